"""Structured outputs of the real engine (tiny random-weight model, offline) against their specs: for bounded JSON
schemas (nested objects, arrays with minItems/maxItems, enums, bounded integers and numbers, anyOf, string
patterns), regexes and choices, greedy and seeded temperature-1 outputs all end with "stop" and validate (the
`jsonschema` package) or fully match; a recursive arithmetic EBNF's finished outputs are Python expressions and its
outputs cut by max_tokens are prefixes the grammar accepts; max_tokens ("length") and stop strings ("stop", the text
before the stop string) end a constrained request early. The engine is idle after each test, no matcher left.

The tiny model's logits are nearly flat, so at temperature 1 its outputs wander through the grammar: every schema
is bounded (maxLength, maxItems, closed objects) so that each completes within max_tokens.
"""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from actors.engine.config import SpeculativeConfig
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams, StructuredOutput
from tests.cancel_harness import assert_idle, engine_config, model_dir  # noqa: F401 (fixture)
from tests.test_structured_engine import compiler

SEEDS = range(8)
WORD = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "owner": {
                "type": "object",
                "properties": {"name": WORD, "team": {"type": "object", "properties": {"code": WORD}}},
                "required": ["name", "team"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "owner"],
        "additionalProperties": False,
    },
    "bounded arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": WORD, "minItems": 2, "maxItems": 3},
            "grid": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["tags", "grid"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "array",
        "items": {"enum": ["red", "green", 7, None, 'a "quoted" one']},
        "minItems": 1,
        "maxItems": 4,
    },
    "bounded numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -20, "maximum": 300},
            "ratio": {"type": "number", "minimum": -1.5, "maximum": 2.25},
        },
        "required": ["count", "ratio"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "array",
        "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, WORD, {"const": "none"}]},
        "minItems": 2,
        "maxItems": 3,
    },
    "patterns": {
        "type": "object",
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "day": {"enum": ["mon", "tue"]}},
        "required": ["sku", "day"],
        "additionalProperties": False,
    },
}
MATCHES = {
    "regex": (r"[a-z]{1,6}(-[0-9]{2})?", lambda text: re.fullmatch(r"[a-z]{1,6}(-[0-9]{2})?", text)),
    "choice": ('["alpha", "beta", "gamma delta"]', lambda text: text in ("alpha", "beta", "gamma delta")),
}
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]? | "0"
"""
PROMPT = [1, *range(400, 412)]


@pytest.fixture(scope="module")
async def llm(model_dir):  # noqa: F811
    config = engine_config(model_dir, max_num_seqs=20, num_kv_blocks=256, max_num_batched_tokens=256)
    async with AsyncLLM(config) as llm:
        yield llm


def greedy_and_seeded(spec: StructuredOutput, max_tokens: int, **extra) -> list[SamplingParams]:
    """The greedy request and the seeded temperature-1 ones (SEEDS) of a spec."""
    return [SamplingParams(temperature=0, max_tokens=max_tokens, structured=spec, **extra)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured=spec, **extra) for s in SEEDS
    ]


async def decode(llm: AsyncLLM, params: list[SamplingParams]):
    return await llm.generate([PROMPT] * len(params), params)


@pytest.mark.parametrize("name", SCHEMAS)
async def test_every_output_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    outs = await decode(llm, greedy_and_seeded(StructuredOutput(kind="json", spec=json.dumps(schema)), 120))
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
    assert len({out.text for out in outs}) > 1  # (the seeds explore the schema)
    await assert_idle(llm)


@pytest.mark.parametrize("kind", MATCHES)
async def test_regex_and_choice_outputs_match_fully(llm, kind):
    spec, matches = MATCHES[kind]
    for out in await decode(llm, greedy_and_seeded(StructuredOutput(kind=kind, spec=spec), 24)):
        assert out.finish_reason == "stop" and matches(out.text), out
    await assert_idle(llm)


async def test_arithmetic_grammar_outputs_are_expressions_or_accepted_prefixes(llm, model_dir):  # noqa: F811
    """Finished outputs of the recursive grammar parse as Python expressions of the grammar's characters; outputs
    cut by max_tokens (a short budget, and an ample one: the recursion is unbounded) are prefixes its matcher
    accepts, not yet complete. The fixed seeds give both kinds."""
    spec = StructuredOutput(kind="grammar", spec=ARITHMETIC)
    outs = await decode(llm, greedy_and_seeded(spec, 4) + greedy_and_seeded(spec, 32))
    for out in outs:
        if out.finish_reason == "stop":
            assert re.fullmatch(r"[0-9+\-*/()]+", out.text), out
            ast.parse(out.text, mode="eval")
        else:
            assert out.finish_reason == "length" and len(out.token_ids) in (4, 32), out
            matcher = compiler(model_dir).matcher(spec, out.token_ids)  # (GrammarError if it rejects one)
            assert not matcher.terminated
    assert {out.finish_reason for out in outs} == {"stop", "length"}
    await assert_idle(llm)


async def test_max_tokens_and_stop_strings_end_a_constrained_request_early(llm, model_dir):  # noqa: F811
    """A constrained request cut by max_tokens ends "length" with a prefix its grammar accepts; one with a stop
    string found inside its output ends "stop" with the text before the stop string."""
    spec = StructuredOutput(kind="json", spec=json.dumps(SCHEMAS["nested objects"]))
    (full,) = await decode(llm, [SamplingParams(temperature=0, max_tokens=120, structured=spec)])
    stop = full.text[len(full.text) // 2 :][:2]
    cut, stopped = await decode(llm, [SamplingParams(temperature=0, max_tokens=5, structured=spec),
                                      SamplingParams(temperature=0, max_tokens=120, structured=spec, stop=[stop])])  # fmt: skip
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:5]
    compiler(model_dir).matcher(spec, cut.token_ids)  # (GrammarError if it rejects one)
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.index(stop)]
    await assert_idle(llm)


async def test_sampled_speculation_keeps_every_output_valid(model_dir):  # noqa: F811
    """With n-gram speculation (drafts checked against the grammar, the bonus and resampled tokens drawn from the
    masked distribution), greedy and seeded temperature-1 outputs of every schema still validate; drafts were
    verified and some accepted, so the check had drafts to refuse."""
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    config = engine_config(model_dir, max_num_seqs=64, num_kv_blocks=512, max_num_batched_tokens=512,
                           speculative=speculative)  # fmt: skip
    specs = [StructuredOutput(kind="json", spec=json.dumps(schema)) for schema in SCHEMAS.values()]
    params = [p for spec in specs for p in greedy_and_seeded(spec, 120)]
    async with AsyncLLM(config) as llm:
        outs = await decode(llm, params)
        stats, _ = await llm.fresh_stats()
        await assert_idle(llm)
    for out, p in zip(outs, params, strict=True):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), json.loads(p.structured.spec))
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats
