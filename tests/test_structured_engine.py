"""Structured outputs through the real engine (tiny model, fp32): every constrained greedy token is HF's argmax
under the grammar's mask (computed plainly, step by step), in sync and async scheduling and with speculation;
unconstrained requests beside constrained ones are unchanged; seeded draws follow the masked distribution; aborts
(also while the grammar compiles) leave nothing behind; xgrammar failing in one request's matcher fails that one
alone."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import xgrammar as xgr
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from actors.engine.config import SpeculativeConfig
from actors.engine.grammar import GrammarError, Grammars, grammars
from actors.engine.scheduler_actor import SchedulerActor
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams, StructuredOutput
from tests.cancel_harness import assert_idle, engine_config, gate, model_dir, start_held, wait_state  # noqa: F401

EOS, VOCAB = 2, 49152  # the tiny model's
ALPHA = 0.001  # significance level of the chi-square test
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "n"],
}
SPECS = {
    "regex": StructuredOutput(kind="regex", spec=r"[a-z]{2,5}-\d{2}"),
    "choice": StructuredOutput(kind="choice", spec='["alpha", "beta", "gamma delta"]'),
    "json": StructuredOutput(kind="json", spec=json.dumps(SCHEMA)),
    "grammar": StructuredOutput(kind="grammar", spec='root ::= "(" num ("+" num)? ")"\nnum ::= [0-9] [0-9]?'),
}


def valid(name: str, text: str) -> bool:
    if name == "regex":
        return re.fullmatch(r"[a-z]{2,5}-\d{2}", text) is not None
    if name == "choice":
        return text in ("alpha", "beta", "gamma delta")
    if name == "grammar":
        return re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})?\)", text) is not None
    value = json.loads(text)
    return set(value) == {"color", "n"} and value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 99


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def compiler(model_dir):  # noqa: F811
    return grammars(str(model_dir), VOCAB, (EOS,))


def masked_reference(hf, model_dir, spec: StructuredOutput, prompt: list[int], steps: int) -> list[int]:  # noqa: F811
    """Greedy tokens under the grammar, computed plainly: HF's logits, xgrammar's mask, argmax, accept."""
    matcher, bitmask, out = compiler(model_dir).matcher(spec), xgr.allocate_token_bitmask(1, VOCAB), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1:].clone()
            matcher.fill(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            out.append(int(logits.argmax()))
            assert matcher.accept(out[-1])
            if matcher.terminated:
                break
    return out


@pytest.mark.parametrize(
    "variant", ["async", "sync", "ngram", "draft_model"], ids=["async", "sync", "ngram", "draft_model"]
)
async def test_constrained_greedy_is_the_masked_argmax_and_neighbours_are_unchanged(model_dir, hf, variant):  # noqa: F811
    """Four constrained requests (regex, choice, JSON schema, EBNF) beside two unconstrained ones: each constrained
    output is HF's masked greedy one, valid and ended by the grammar ("stop"); the unconstrained ones equal their
    output alone; speculation accepts drafts and changes nothing."""
    spec = None
    if variant in ("ngram", "draft_model"):
        spec = SpeculativeConfig(method=variant, num_speculative_tokens=3, prompt_lookup_min=1)
        spec.model = str(model_dir) if variant == "draft_model" else None
    config = engine_config(model_dir, async_scheduling=variant != "sync", speculative=spec, max_num_batched_tokens=64)
    prompt = [1, *range(300, 310)] * 2
    constrained = [SamplingParams(temperature=0, max_tokens=40, structured=s) for s in SPECS.values()]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    async with AsyncLLM(config) as llm:
        alone = await llm.generate([prompt, prompt[3:]], free)
        outs = await llm.generate([prompt] * 4 + [prompt, prompt[3:]], [*constrained, free, free])
        stats, _ = await llm.fresh_stats()
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)
    for (name, s), out in zip(SPECS.items(), outs, strict=False):
        assert out.finish_reason == "stop" and valid(name, llm.tokenizer.decode(out.token_ids[:-1])), (name, out)
        assert out.token_ids == masked_reference(hf, model_dir, s, prompt, 40), name
    assert [o.token_ids for o in outs[4:]] == [o.token_ids for o in alone]
    if spec is not None:
        assert stats.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["plain", "guided"])
async def test_seeded_draws_follow_the_masked_distribution(model_dir, hf, scale):  # noqa: F811
    """Chi-square at significance level 0.001 over 1,000 seeded first tokens at temperature 1 under the regex
    [a-e]x (its first token is one of a..e or a token ax..ex) with a logit bias that favours some of them and a
    +10 on a token outside the grammar (the tiny model's own logits are nearly flat): the draws follow HF's
    softmax of logits + bias renormalised over the allowed tokens (with CFG: of l_u + s (l_c - l_u) + bias), never
    the biased outsider, and the same counts reject a sampler that masked after temperature 2 (the wrong order)."""
    prompt, n = [1, *range(500, 512)], 1000
    spec = StructuredOutput(kind="regex", spec="[a-e]x")
    bitmask, mask = xgr.allocate_token_bitmask(1, VOCAB), torch.zeros(1, VOCAB)
    compiler(model_dir).matcher(spec).fill(bitmask, 0)
    xgr.apply_token_bitmask_inplace(mask, bitmask)
    allowed = mask[0].isfinite().nonzero()[:, 0].tolist()  # a .. e, and those of "ax" .. "ex" that are tokens
    assert len(allowed) > 5
    bias = {allowed[0]: 3.0, allowed[1]: 1.5, allowed[2]: -2.0, 300: 10.0}
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=1, structured=spec, guidance_scale=scale, logit_bias=bias)
        for i in range(n)
    ]
    config = engine_config(model_dir, max_num_seqs=64, num_kv_blocks=256, max_num_batched_tokens=512)
    async with AsyncLLM(config) as llm:
        outs = await llm.generate([prompt] * n, params)
    with torch.inference_mode():
        cond = hf(torch.tensor([prompt])).logits[0, -1]
        uncond = hf(torch.tensor([[1]])).logits[0, -1]
    logits = (uncond + scale * (cond - uncond))[allowed].double()
    logits += torch.tensor([bias.get(t, 0.0) for t in allowed], dtype=torch.float64)
    observed = [sum(o.token_ids[0] == t for o in outs) for t in allowed]
    assert sum(observed) == n  # every draw is one of the allowed tokens
    assert chisquare(observed, logits.softmax(-1).numpy() * n).pvalue > ALPHA
    assert chisquare(observed, (logits / 2).softmax(-1).numpy() * n).pvalue < ALPHA


def engine_with_a_held_compile(config: dict, held: str, fifo: str) -> SchedulerActor:
    """The engine actor (an ActorSpec factory), whose compile of the spec `held` waits until a byte is written to
    the FIFO `fifo` (a gate across processes)."""
    make = Grammars.matcher

    def matcher(self, spec: StructuredOutput, accepted=()):
        if spec.spec == held:
            with open(fifo, "rb") as gate:
                gate.read(1)
        return make(self, spec, accepted)

    Grammars.matcher = matcher
    return SchedulerActor(config)


async def test_aborts_free_matchers_also_while_compiling(model_dir, tmp_path):  # noqa: F811
    """A request aborted while its grammar compiles (held compiling) is acked and never runs; one aborted with a
    step of it in flight (held at the step gate) after three steps ends "abort" too; the engine is idle after
    both, every grammar matcher released (`matchers`)."""
    held = StructuredOutput(kind="regex", spec="[a-z]{5}")
    long = StructuredOutput(kind="regex", spec="[a-z]{80}")  # (3 tokens cannot complete it)
    fifo = tmp_path / "compile-gate"
    os.mkfifo(fifo)
    llm = AsyncLLM(engine_config(model_dir))
    engine = llm.system.specs["engine"].actors[0]
    engine.factory = "tests.test_structured_engine:engine_with_a_held_compile"
    engine.kwargs |= {"held": held.spec, "fifo": str(fifo)}
    async with llm:
        rid = llm.new_id()
        task = asyncio.ensure_future(llm.generate_one([1, 5, 6], SamplingParams(max_tokens=5, structured=held), rid))
        await wait_state(llm, compiling=1)
        llm.abort(rid)
        assert (await task).finish_reason == "abort"
        await asyncio.get_running_loop().run_in_executor(None, fifo.write_bytes, b"x")  # the compile ends, unused
        run = await start_held(
            llm, [1, 7, 8, 9], SamplingParams(temperature=1.0, seed=0, max_tokens=90, structured=long)
        )
        gate(llm, 3)
        assert (await wait_state(llm, gate_permits=0, held_steps=1))["matchers"] == 1
        llm.abort(run.request_id)
        gate(llm, None)
        assert (await run.done()).finish_reason == "abort" and len(run.token_ids) == 3
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)


class FailingMatcher:
    """xgrammar's matcher, whose `method` raises RuntimeError once `after` tokens were accepted (else as `inner`)."""

    def __init__(self, inner, method: str, after: int):
        self.inner, self.method, self.after, self.accepted = inner, method, after, 0

    def __getattr__(self, name):  # fill_next_token_bitmask, is_terminated, ...
        self._fail_if_due(name)
        return getattr(self.inner, name)

    def accept_token(self, token: int) -> bool:
        self._fail_if_due("accept_token")
        self.accepted += (accepted := self.inner.accept_token(token))
        return accepted

    def _fail_if_due(self, name: str) -> None:
        if name == self.method and self.accepted >= self.after:
            raise RuntimeError(f"injected {name} failure")


def engine_with_failing_matchers(config: dict, failures: dict[str, list]) -> SchedulerActor:
    """The engine actor (an ActorSpec factory: it runs in the engine process), where the matchers of the regexes in
    `failures` ({regex: [xgrammar method, after]}) fail like FailingMatcher."""
    make = Grammars.matcher

    def matcher(self, spec: StructuredOutput, accepted=()):
        m = make(self, spec, accepted)
        if spec.spec in failures:
            m._m = FailingMatcher(m._m, *failures[spec.spec])
        return m

    Grammars.matcher = matcher
    return SchedulerActor(config)


async def test_a_failing_matcher_ends_its_request_alone(model_dir):  # noqa: F811
    """xgrammar raising in one request's mask fill (its first, filled as its step is planned; its third, which async
    scheduling fills once the step before is postprocessed) or token accept ends that request alone with
    finish_reason "error" after the tokens accepted before (never a token its grammar did not check); the requests
    beside it, constrained or not, produce what they produce alone; the engine serves on (no restart), idle after,
    every matcher released."""
    failures = {"[a-z]{40}": ["fill_next_token_bitmask", 0], "[b-z]{40}": ["fill_next_token_bitmask", 2],
                "[c-z]{40}": ["accept_token", 2]}  # fmt: skip
    failing = [SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutput(kind="regex", spec=r))
               for r in failures]  # fmt: skip
    prompt = [1, *range(300, 310)]
    neighbours = [SamplingParams(temperature=0, max_tokens=40, structured=SPECS["json"]),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)]  # fmt: skip
    llm = AsyncLLM(engine_config(model_dir))
    engine = llm.system.specs["engine"].actors[0]
    engine.factory, engine.kwargs["failures"] = "tests.test_structured_engine:engine_with_failing_matchers", failures
    async with llm:
        alone = await llm.generate([prompt] * 2, neighbours)
        outs = await asyncio.wait_for(llm.generate([prompt] * 5, [*failing, *neighbours]), 60)
        assert [(o.finish_reason, o.token_ids) for o in outs[3:]] == [(o.finish_reason, o.token_ids) for o in alone]
        for out, (_, after) in zip(outs, failures.values(), strict=False):
            assert out.finish_reason == "error" and "RuntimeError: injected" in out.error, out
            assert len(out.token_ids) == after and re.fullmatch("[a-z]*", out.text), out
        assert (await llm.generate_one(prompt, failing[0])).finish_reason == "error"  # (served: the engine is up)
        assert not llm.system.num_restarts
        await assert_idle(llm)  # (a request that failed is freed once its step in flight is postprocessed)


async def test_an_invalid_spec_reaching_the_engine_fails_that_request_only(model_dir):  # noqa: F811
    """The offline API has no frontend check: the engine's compile error ends that request with an error naming
    the problem; a request beside it is served."""
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput(kind="regex", spec="(a"))
    async with AsyncLLM(engine_config(model_dir)) as llm:
        failed, served = await llm.generate([[1, 5], [1, 6]], [bad, SamplingParams(max_tokens=4, ignore_eos=True)])
        assert failed.finish_reason == "error" and "invalid structured output" in failed.error
        assert served.finish_reason == "length" and len(served.token_ids) == 4
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)


def test_compile_errors_name_the_problem(model_dir):  # noqa: F811
    """Bad specs raise GrammarError with xgrammar's message (no C++ location). (check()'s deadlines:
    tests/test_grammar_check.py.)"""
    g = compiler(model_dir)
    for spec, words in [
        (StructuredOutput(kind="json", spec='{"type": "nonsense"}'), "nonsense"),
        (StructuredOutput(kind="regex", spec="(a"), "parenthesis"),
        (StructuredOutput(kind="grammar", spec="root ::= "), "EBNF"),
        (StructuredOutput(kind="choice", spec="[]"), "non-empty"),
        (StructuredOutput(kind="json", spec="[1]"), "object"),
    ]:
        with pytest.raises(GrammarError, match=words) as e:
            g.compile(spec)
        assert ".cc:" not in str(e.value)


def test_a_process_exiting_during_the_warm_up_waits_for_it(model_dir):  # noqa: F811
    """CI once saw the engine exit with SIGABRT on a fast shutdown: its interpreter finalized while the warm-up
    thread was inside xgrammar's C++. A process that exits right after warm() must let the warm-up finish first:
    its atexit handlers (which run after the interpreter has joined its threads) see the built instance."""
    script = (
        "import atexit, sys\n"
        "from actors.engine.grammar import _build, warm\n"
        "atexit.register(lambda: print('built', _build.cache_info().currsize, flush=True))\n"
        f"warm({str(model_dir)!r}, {VOCAB}, ({EOS},))\n"
        "sys.exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "built 1"), done.stderr[-2000:]
