"""What a chaos run (scripts/chaos.py) is checked against: each job's outcome, the fault-free run's, the tokens the
engine recorded as sent (EngineConfig.record_outputs) and a reference for what diverged; the report of what differed.

Per stream (natural: ended by length or stop; otherwise by an abort or an error):

| check                   | natural                                         | otherwise                              |
|-------------------------|-------------------------------------------------|----------------------------------------|
| tokens vs the engine's  | all it sent (length) / a prefix of them (stop)  | a prefix of what it sent               |
| text vs its own tokens  | equal to their fault-free text                  | a prefix of their fault-free text      |
| tokens vs the fault-free| equal, with the same end                        | a prefix                               |
| run, else (diverged)    | the reference explains it (below), or a problem | the same                               |

"Fault-free text": what a fresh detokenizer state (actors/detokenizer/request_state.py, whose text tests/test_detok*
check against `tokenizer.decode`) makes of the stream's own tokens fed in one entry with the stream's end (the
engine's: length, EOS or a stop token; or none, for a stop string to end it); a stream that did not end naturally
is flushed as if by length, its text a prefix of that. So a corrupted text fails whether its tokens diverged or not.

Diverged: the tokens part from the fault-free run's. CPU matmuls are not batch-invariant, so the two runs' logits
differ in their last bits and a near-tie may draw another token (scripts/chaos_reference.py); a diverged stream is
a problem unless `explain` (a Reference) shows its first differing token is at such a near-tie and each later one is
what the reference sampler draws after the stream's own prefix (or a near-tie allows). None are allowed unexplained.
Explained ones stay allowed because no setting of this engine on CPU rules them out: a row's logits depend on the
batch around it (the batch invariance DESIGN section 10 asks for is not there on CPU), and any draw may fall at a
near-tie of the model's own logits (a seeded one also with its uniform at a CDF boundary). They are rare: the
test's 300-request runs and two 3,000-request runs on 2026-11-25 had none, earlier 3,000-request runs 0 to 3.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from tokenizers import Tokenizer

from actors.detokenizer.request_state import DetokRequestState
from messages.sampling_params import SamplingParams
from messages.wire import AddRequest, Finished, RequestOutput, TextDelta


@dataclass(frozen=True)
class Job:
    index: int
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    abort_after_tokens: int | None = None
    abort_after_s: float | None = None


@dataclass
class Outcome:
    """What a request's stream delivered."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: Finished | None = None

    def add(self, item: TextDelta | Finished) -> None:
        self.token_ids += item.token_ids
        self.text += item.text
        if isinstance(item, Finished):
            self.finished = item

    @property
    def reason(self) -> str | None:
        return self.finished and self.finished.finish_reason


@dataclass
class Report:
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # the failed requests' errors

    def __str__(self) -> str:
        lines = [" ".join(f"{k}={v}" for k, v in self.counts.items())]
        lines += [f"failed {n}x: {error}" for error, n in self.errors.most_common(5)]
        return "\n".join(lines + [f"PROBLEM: {p}" for p in self.problems[:20]])


def sent_tokens(path: str) -> dict[str, list[int]]:
    """The tokens the engine sent per request (EngineConfig.record_outputs): a resumed copy's (DESIGN I8) replace
    what an earlier copy sent from the position it went on at."""
    sent: dict[str, list[int]] = {}
    for line in Path(path).read_bytes().splitlines():
        for rid, seq, token_ids in msgspec.json.decode(line):
            tokens = sent.setdefault(rid, [])
            if seq > len(tokens):  # (the engine records an entry before it sends it: a gap here is a bug)
                raise ValueError(f"{rid}: the record has no entry for seq {len(tokens)}..{seq - 1}")
            del tokens[seq:]
            tokens.extend(token_ids)
    return sent


def fault_free_text(tokenizer: Tokenizer, job: Job, got: Outcome) -> str:
    """The text a fault-free detokenizer makes of the stream's tokens (the module docstring)."""
    add = AddRequest(request_id=got.request_id, prompt_token_ids=job.prompt, params=job.params)
    state = DetokRequestState(add, tokenizer)
    end = got.finished
    by_stop_string = got.reason == "stop" and isinstance(end.stop_reason, str)
    finish = None if by_stop_string else got.reason if got.reason in ("length", "stop") else "length"
    out = RequestOutput(
        request_id=got.request_id, seq=0, new_token_ids=got.token_ids, finish_reason=finish,
        stop_reason=end.stop_reason if finish == "stop" else None,
    )  # fmt: skip
    delta, finished = state.process(out)
    return (finished or delta).text


def compare(
    jobs: list[Job],
    reference: list[Outcome],
    chaos: list[Outcome],
    sent: dict[str, list[int]],
    tokenizer: Tokenizer,
    explain: Callable[[list[int], SamplingParams, list[int], list[int]], str | None] | None = None,
) -> Report:
    """`explain(prompt, params, ref_tokens, got_tokens)`: why a divergence is a near-tie (None) or not (a string;
    scripts/chaos_reference.Reference.explain); without it every divergence is a problem."""
    report = Report(counts={"natural": 0, "aborted": 0, "failed": 0, "diverged": 0})
    for job, ref, got in zip(jobs, reference, chaos, strict=True):
        natural = got.reason in ("length", "stop")
        report.counts["natural" if natural else "aborted" if got.reason == "abort" else "failed"] += 1
        if got.reason == "error":  # (ids and counts blanked: one line per kind of failure)
            report.errors[re.sub(r"\d+", "N", re.sub(r"\S*-\d+", "ID", got.finished.error or ""))] += 1
        engine = sent.get(got.request_id, [])
        if got.token_ids != (engine if got.reason == "length" else engine[: len(got.token_ids)]):
            report.problems.append(
                f"job {job.index}: {got.reason} stream holds {got.token_ids}, the engine sent {engine}"
            )
        text = fault_free_text(tokenizer, job, got)
        if got.text != text if natural else not text.startswith(got.text):
            report.problems.append(f"job {job.index}: {got.reason} text {got.text!r}, its tokens make {text!r}")
        if ref.reason not in ("length", "stop"):
            report.problems.append(f"job {job.index}: the fault-free run ended with {ref.finished}")
        elif got.token_ids != ref.token_ids[: len(got.token_ids)]:
            report.counts["diverged"] += 1
            why = explain(job.prompt, job.params, ref.token_ids, got.token_ids) if explain else "no reference"
            if why is not None:
                report.problems.append(f"job {job.index}: diverged from the fault-free run: {why}")
        elif natural and (got.token_ids, got.text, got.reason) != (ref.token_ids, ref.text, ref.reason):
            report.problems.append(f"job {job.index}: {got.reason} output differs from the fault-free run {ref}")
        if got.reason == "abort" and job.abort_after_tokens is None and job.abort_after_s is None:
            report.problems.append(f"job {job.index}: aborted without an abort ({got.finished.stop_reason})")
    return report
