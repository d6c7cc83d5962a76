"""The chaos checker itself (scripts/chaos_check.py, scripts/chaos_reference.py).

On crafted streams: a lost, duplicated or foreign token is a problem; a text that is not what the stream's tokens
decode to is a problem whether its tokens diverged from the fault-free run or not (before, a diverged stream's text
was not checked at all: the old checker passes " time, in a lamb" for the tokens of " time, in a land"); a diverged
stream counts as diverged when the reference explains it, and is a problem otherwise. The reference's near-tie rule
on crafted logits. Against the engine: the reference sampler (HF's logits) allows, at a tolerance of 1e-7, exactly
the token the fault-free engine drew at every position of 40 jobs of the chaos workload (greedy, seeded, guided),
so it is a sound reference; it explains a stream that took the other token of a real near-tie of those runs and
then went on as the reference draws, when the tie is within its tolerance, and nothing else: not that tie at a
lower tolerance, not a later token that is not the draw, not a seed mix-up (the same request drawn with the next
seed), not a greedy token replaced.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from tokenizers import Tokenizer

from messages.sampling_params import SamplingParams
from messages.wire import Finished
from scripts.chaos import run, workload
from scripts.chaos_check import Job, Outcome, compare, fault_free_text
from scripts.chaos_reference import Reference, allowed, counter_uniforms
from tests.cancel_harness import clean_llm, model_dir  # noqa: F401 (fixtures)

PROMPT = [6403, 1980, 253]  # "Once upon a"
KING = [655, 665, 436, 253, 4197]  # " time there was a king"
LAND = [655, 28, 281, 253, 1666]  # " time, in a land"
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_compare_checks_tokens_and_text_of_every_stream(model_dir):  # noqa: F811
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    jobs = [Job(0, PROMPT, GREEDY, 0.0), Job(1, PROMPT, GREEDY, 0.0)]

    def outcome(rid: str, tokens: list[int], text: str | None = None, reason: str = "length") -> Outcome:
        text = tokenizer.decode(tokens) if text is None else text
        return Outcome(rid, tokens, text, Finished(request_id=rid, finish_reason=reason))

    def problems(got: Outcome, sent: list[int], counts: dict | None = None, explain=None) -> list[str]:
        ref = [outcome("r0", KING), outcome("r1", KING)]
        report = compare(jobs, ref, [outcome("c0", KING), got], {"c0": KING, "c1": sent}, tokenizer, explain)
        assert counts is None or counts.items() <= report.counts.items(), report.counts
        return report.problems

    def near_tie(prompt, params, ref, got) -> None:
        assert (prompt, params, ref, got) == (PROMPT, GREEDY, KING, LAND)

    assert problems(outcome("c1", KING), KING, {"natural": 2, "diverged": 0}) == []
    assert problems(outcome("c1", KING[:4]), KING)  # a lost token
    assert problems(outcome("c1", [*KING, 4197]), KING)  # a duplicated one
    assert problems(outcome("c1", [655, 665, 436, 253, 2644]), KING)  # another request's
    assert problems(outcome("c1", KING, " time there was a kink"), KING)  # corrupted text
    assert problems(outcome("c1", KING[:3], reason="stop"), KING)  # stopped early: differs from the reference
    assert problems(outcome("c1", KING[:3], reason="error"), KING, {"failed": 1}) == []  # a prefix
    assert problems(outcome("c1", KING[:3], " time there", "error"), KING) == []  # (text held back: a prefix too)
    assert problems(outcome("c1", KING[:3], " time where", "error"), KING)  # ... of the tokens' text, not another
    assert problems(outcome("c1", KING[:3], reason="abort"), KING) == [
        "job 1: aborted without an abort (None)"  # (its reason, from stop_reason)
    ]
    # diverged from the fault-free run: what the engine sent, at a near-tie (as `explain` says) ...
    assert problems(outcome("c1", LAND), LAND, {"diverged": 1}, near_tie) == []
    assert problems(outcome("c1", LAND), LAND, {"diverged": 1})  # ... a problem when nothing explains it,
    assert problems(outcome("c1", LAND), LAND, explain=lambda *_: "not a near-tie")  # or the reference does not,
    assert problems(outcome("c1", LAND, " time, in a lamb"), LAND, {"diverged": 1}, near_tie) == [  # or its text
        "job 1: length text ' time, in a lamb', its tokens make ' time, in a land'"  # is not its tokens'
    ]


def test_fault_free_text_ends_as_the_stream_did(model_dir):  # noqa: F811
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def text(tokens: list[int], reason: str, stop_reason=None, stop=()) -> str:
        job = Job(0, PROMPT, msgspec.structs.replace(GREEDY, stop=list(stop)), 0.0)
        end = Finished(request_id="c", finish_reason=reason, stop_reason=stop_reason)
        return fault_free_text(tokenizer, job, Outcome("c", tokens, "", end))

    assert text(KING, "length") == " time there was a king"
    assert text(KING[:4], "stop", " a", [" a"]) == " time there was"  # a stop string: the text ends before it
    assert text([*KING[:2], 2], "stop") == " time there"  # EOS (token 2): not in the text
    assert text(KING[:2], "abort", "abort", [" was"]) == " time there"  # flushed: what a prefix must be part of


def test_allowed_tokens_are_the_draw_and_what_a_near_tie_lets_through():
    greedy, top2 = GREEDY, SamplingParams(temperature=1.0, top_k=2, seed=0)
    assert allowed(np.array([0.0, 1.0, 1 - 5e-6, 0.5]), greedy, None, 1e-5) == {1, 2}
    assert allowed(np.array([0.0, 1.0, 1 - 5e-6, 0.5]), greedy, None, 1e-6) == {1}
    # top-2 keeps {0, 1} or, at a tie of the 2nd and 3rd, {0, 2}; u = 0.99 draws the kept set's last token (id order)
    assert allowed(np.array([3.0, 1.0, 1 - 1e-6, 0.0]), top2, 0.99, 1e-5) == {1, 2}
    assert allowed(np.array([3.0, 1.0, 0.9, 0.0]), top2, 0.99, 1e-5) == {1}
    assert allowed(np.array([3.0, 1.0, 0.9, 0.0]), top2, 0.01, 1e-5) == {0}
    # two equal tokens kept: u at their CDF boundary may draw either
    untruncated = SamplingParams(temperature=1.0, seed=0)
    assert allowed(np.array([0.0, 0.0]), untruncated, 0.5 + 1e-7, 1e-5) == {0, 1}
    assert allowed(np.array([0.0, 0.0]), untruncated, 0.3, 1e-5) == {0}


async def test_the_reference_draws_what_the_engine_draws_and_explains_only_near_ties(clean_llm, model_dir):  # noqa: F811
    jobs = workload(7, 40)
    outs = await run(clean_llm, jobs, aborts=False)
    reference, kinds, ties = Reference(str(model_dir)), set(), []
    for job, out in zip(jobs, outs, strict=True):
        p = job.params
        x = reference.processed(job.prompt, out.token_ids, p)
        for i, token in enumerate(out.token_ids):
            u = None if p.greedy else counter_uniforms(torch.tensor([p.seed]), torch.tensor([i])).item()
            assert allowed(x[i], p, u, 1e-7) == {token}, (job, i)
            near = allowed(x[i], p, u, 1e-3) - allowed(x[i], p, u, 1e-4)  # tied within 1e-3 only
            ties += [(job, out.token_ids, i, other) for other in near]
        kinds.add((p.greedy, p.guided))
    assert kinds == {(True, False), (False, False), (True, True), (False, True)}
    # a stream that took the other token of a near-tie, then went on as the reference draws: explained when the tie
    # is within the reference's tolerance; one more token that is not the draw, or the tie at a lower tolerance, not
    job, tokens, i, other = ties[0]
    wide, took_other = Reference(str(model_dir), tol=1e-3), [*tokens[:i], other]
    for n in range(i + 1, i + 4):
        x = reference.processed(job.prompt, [*took_other, 0], job.params)[n]  # (the last token is not read)
        u = None if job.params.greedy else counter_uniforms(torch.tensor([job.params.seed]), torch.tensor([n])).item()
        (drawn,) = allowed(x, job.params, u, 0.0)
        took_other.append(drawn)
    assert wide.explain(job.prompt, job.params, tokens, took_other) is None
    assert f"output {i} is {other}" in reference.explain(job.prompt, job.params, tokens, took_other)
    last = [*took_other[:-1], (took_other[-1] + 1) % 49152]
    assert f"output {i + 3} is" in wide.explain(job.prompt, job.params, tokens, last)
    long = [(job, out.token_ids) for job, out in zip(jobs, outs, strict=True) if len(out.token_ids) >= 4]
    seeded = [(job, tokens) for job, tokens in long if not job.params.greedy][:3]
    for job, tokens in seeded:  # a seed mix-up: the same request drawn with the next seed
        other = await clean_llm.generate_one(job.prompt, msgspec.structs.replace(job.params, seed=job.params.seed + 1))
        assert reference.explain(job.prompt, job.params, tokens, other.token_ids) is not None
    job, tokens = next((job, tokens) for job, tokens in long if job.params.greedy)
    replaced = [*tokens[:3], (tokens[3] + 1) % 49152]  # a greedy token replaced
    assert "output 3 is" in reference.explain(job.prompt, job.params, tokens, replaced)
