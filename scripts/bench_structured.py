"""Structured outputs' cost: output tokens/s of a batch of `--batch` requests of which 0, 1, 8, ... are constrained by a
JSON schema, against the same batch all unconstrained, measured in one engine in the same run; and the grammar
compile time of the test schemas (first and cached).

    python scripts/bench_structured.py [--model DIR] [--batch 16] [--constrained 0 1 8 16] [--max-tokens 64]

The constrained rows follow a schema no output can complete within max_tokens (an array of at least 1,000
{"name": string, "age": integer} objects), so every row decodes for all max_tokens steps and the batch keeps its
shape: the difference is the masks (filled on the event loop, applied on the device thread) and nothing else.
Greedy, random-token prompts, async scheduling (the engine's default), best of two runs each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from actors.engine.config import EngineConfig
from actors.engine.grammar import Grammars
from frontend.offline import AsyncLLM
from frontend.preflight import resolve_model
from gpu.loading.config import ModelConfig
from messages.sampling_params import SamplingParams, StructuredOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_structured_schemas import ARITHMETIC, SCHEMAS  # the test schemas (needs the test extra)

ITEMS = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
LONG = StructuredOutput(kind="json", spec=json.dumps({"type": "array", "items": ITEMS, "minItems": 1000}))
COMPILED = {
    "json_object": StructuredOutput(kind="json_object"),
    "small schema": StructuredOutput(kind="json", spec=json.dumps(ITEMS)),
    "array schema": LONG,
    "regex": StructuredOutput(kind="regex", spec=r"\d{3}-\d{4}"),
    "choice": StructuredOutput(kind="choice", spec='["yes", "no", "maybe"]'),
    "tool call": StructuredOutput(
        kind="structural_tag",
        spec=json.dumps(
            {
                "type": "structural_tag",
                "format": {
                    "type": "tag",
                    "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
                    "content": {"type": "json_schema", "json_schema": ITEMS},
                    "end": "}\n</tool_call>",
                },
            }
        ),
    ),
    **{name: StructuredOutput(kind="json", spec=json.dumps(schema)) for name, schema in SCHEMAS.items()},
    "arithmetic EBNF": StructuredOutput(kind="grammar", spec=ARITHMETIC),
}


async def tokens_per_s(llm: AsyncLLM, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    outs = await llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def compile_times(model_dir: str) -> None:
    model = ModelConfig.from_path(model_dir)
    start = time.perf_counter()
    grammars = Grammars(model_dir, model.vocab_size, model.eos_token_ids)
    print(f"xgrammar import + tokenizer info: {1e3 * (time.perf_counter() - start):.0f} ms")
    print(f"{'spec':>16} {'first ms':>9} {'cached ms':>10}")
    for name, spec in COMPILED.items():
        times = []
        for _ in range(2):
            start = time.perf_counter()
            grammars.matcher(spec)
            times.append(1e3 * (time.perf_counter() - start))
        print(f"{name:>16} {times[0]:>9.2f} {times[1]:>10.3f}")


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    compile_times(str(model.path))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, structured=LONG)
    async with AsyncLLM(EngineConfig(model=str(model.path), max_num_seqs=args.batch)) as llm:
        await tokens_per_s(llm, prompts[:1], [constrained])  # warm-up (and the engine's compile)
        best = dict.fromkeys(args.constrained, 0.0)
        for _ in range(2):
            for k in args.constrained:
                params = [constrained] * k + [plain] * (args.batch - k)
                best[k] = max(best[k], await tokens_per_s(llm, prompts, params))
    base = best.get(0)
    print(f"{'constrained':>11} {'tok/s':>7} {'vs none':>8} {'per constrained row':>20}")
    for k, tps in best.items():
        if base is None or k == 0:
            print(f"{k:>11} {tps:>7.1f}")
            continue
        slower = base / tps - 1  # the step's extra time, as a fraction of an unconstrained step
        print(f"{k:>11} {tps:>7.1f} {tps / base:>7.3f}x {100 * slower / k:>18.2f} %")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--constrained", type=int, nargs="+", default=[0, 1, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
