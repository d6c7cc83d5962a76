"""`sluice generate`: one prompt, offline (frontend/offline.py's AsyncLLM), its text streamed to stdout. Past a
process's restart intensity it stops with exit code 1 (its caller waits at a terminal: no back-off)."""

from __future__ import annotations

import argparse
import functools
import sys

from actors.engine.config import EngineConfig
from frontend import cli_engine
from frontend.cli_args import Help, engine_arguments


def generate(args: argparse.Namespace) -> int:
    import uvloop

    from messages.sampling_params import ParamError, SamplingParams

    model = cli_engine.setup(args, "WARNING")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    )
    try:
        params.verify(model.vocab_size)
    except ParamError as e:
        print(f"sluice generate: --{e.param.replace('_', '-')}: {e}", file=sys.stderr)
        return cli_engine.EXIT_USAGE
    engine = cli_engine.engine_config(args, str(model.path))
    if engine.local_replicas < engine.data_parallel_size:
        raise SystemExit("sluice generate runs every replica itself: --data-parallel-size-local is for a server")
    from frontend.preflight import check_gang

    check_gang(model, engine)
    need = cli_engine.check_memory_of(args, model, engine)
    return uvloop.run(_generate(engine, args.prompt, params, args.chat, need, args))


async def _generate(engine: EngineConfig, prompt: str, params, chat: bool, need, args) -> int:
    from frontend.launch import explain
    from frontend.offline import AsyncLLM
    from messages.wire import Finished

    policy, log_level = cli_engine.restart_policy(args, give_up=True), args.log_level
    llm = AsyncLLM(engine, fault_plan=cli_engine.fault_plan_of(args), policy=policy, log_level=log_level)
    llm.system.explain = functools.partial(
        explain, memory=need.explanation()
    )  # (an engine killed as it starts or restarts: OOM?)
    async with llm:  # (replica 0)
        tokens = prompt
        if chat:
            text = llm.tokenizer.render_chat([{"role": "user", "content": prompt}])
            tokens = llm.tokenizer.encode(text, add_special_tokens=False)
        async for out in llm.stream(tokens, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if isinstance(out, Finished) and out.finish_reason == "error":
                print(f"\nsluice generate: {out.error}", file=sys.stderr)
                return cli_engine.EXIT_FAILED
    print()
    return cli_engine.EXIT_OK


def add_parser(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="generate text offline and stream it to stdout",
        description="Generate text offline.",
        formatter_class=Help,
    )
    engine_arguments(p)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    s.add_argument("--seed", type=int, default=None, help="for reproducible sampling")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.set_defaults(func=generate)
