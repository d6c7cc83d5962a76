"""What a chaos run (scripts/chaos.py) is checked against: each job's outcome, the fault-free run's, and the tokens
the engine recorded as sent (EngineConfig.record_outputs); the report of what differed. The rules, and why tokens
may legitimately diverge from the fault-free run, are in scripts/chaos.py's docstring."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from messages.sampling_params import SamplingParams
from messages.wire import Finished, TextDelta


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


def compare(jobs: list[Job], reference: list[Outcome], chaos: list[Outcome], sent: dict[str, list[int]]) -> Report:
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
        if ref.reason not in ("length", "stop"):
            report.problems.append(f"job {job.index}: the fault-free run ended with {ref.finished}")
        elif got.token_ids != ref.token_ids[: len(got.token_ids)]:
            report.counts["diverged"] += 1  # numerics (see the module docstring): the engine's tokens are checked
        elif natural and (got.token_ids, got.text, got.reason) != (ref.token_ids, ref.text, ref.reason):
            report.problems.append(f"job {job.index}: {got.reason} output differs from the fault-free run {ref}")
        elif not natural and not ref.text.startswith(got.text):
            report.problems.append(f"job {job.index}: {got.reason} text is not a prefix of the fault-free run's")
        if got.reason == "abort" and job.abort_after_tokens is None and job.abort_after_s is None:
            report.problems.append(f"job {job.index}: aborted without an abort ({got.finished.stop_reason})")
    if report.counts["diverged"] > max(2, len(jobs) // 500):
        report.problems.append(f"{report.counts['diverged']} requests diverged: more than last-bit numerics explain")
    return report
