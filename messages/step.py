"""The scheduler <-> worker link (issue 17): one ExecuteStep out and one StepResult back per step.

The worker (actors/engine/worker.py: the model runner and the sampler) keeps a persistent batch: each live
request's sampling state (prompt ids, params, output ids). An ExecuteStep carries the full state of the requests
new to the worker and per-step deltas for the rest (the output tokens the scheduler appended since it last sent
the request); the sampled ids themselves stay on the device between steps (the runner's relay buffer), so async
scheduling keeps its one-step-ahead overlap across the process boundary.

Numbering: `epoch` names one run of the worker's state (a restarted worker, or a reset after a lost message,
starts a new one: every request is new again); `seq` counts ExecuteSteps within an epoch. The worker runs
ExecuteSteps in seq order and answers each with a StepResult of the same (epoch, seq); a gap in either
direction means the worker's state can no longer be trusted, and the scheduler resets it (a new epoch, every
running request recomputed).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gpu.batch import BatchSpec
from messages.sampling_params import SamplingParams
from messages.wire import Msg, TokenLogprobs

# Why a step did not run: "gap" (the worker refused it: an ExecuteStep before it was lost), "raised" (it raised in
# the worker), "lost" (its StepResult was lost or late), "died" (the worker died with it in flight). The steps that
# "raised" or "died" blame their requests (one may be a poison request); a lost message blames nobody.
StepFailure = Literal["gap", "raised", "lost", "died"]
BLAMING_FAILURES: tuple[StepFailure, ...] = ("raised", "died")


class WorkerRequest(msgspec.Struct, array_like=True):
    """A request new to the worker (in this epoch): what its sampling reads."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the output the scheduler knows so far (a preempted or resumed request's)
    params: SamplingParams


class GrammarMasks(msgspec.Struct, array_like=True):
    """The constrained positions of one step: int32 bitmask rows over the vocabulary (bit set: allowed)."""

    positions: list[int]  # indices among the step's sampled positions, one bitmask row each, in `bitmask`
    bitmask: bytes  # int32 [len(positions), ceil(V / 32)], native byte order
    deferred: list[int] = []  # positions whose rows come later in FillMasks (their previous token is in flight)


class ExecuteStep(Msg, kw_only=True):
    """scheduler -> worker: run one step (forward, CFG, grammar masks, sampling, draft verification)."""

    epoch: int  # the worker state the scheduler addresses: a new epoch resets it (every request is new again)
    seq: int  # the ExecuteStep's number within the epoch: 0, 1, 2, ...
    batch: BatchSpec
    new: list[WorkerRequest] = []  # requests of the batch the worker does not hold: their full state
    appended: dict[str, list[int]] = {}  # request id -> output tokens the scheduler appended since it last sent it
    freed: list[str] = []  # requests that ended since the last ExecuteStep: forgotten first (before `new`)
    num_prompt_logprobs: int = 0  # the top-N of the prompt logprobs (the largest any row with targets asked for)
    masks: GrammarMasks | None = None  # structured outputs: the constrained positions' masks


class FillMasks(Msg, kw_only=True):
    """scheduler -> worker: the deferred grammar masks of ExecuteStep (epoch, seq), once the tokens they depend on
    are accepted by the matchers (its sampler waits for this, with a deadline)."""

    epoch: int
    seq: int
    masks: GrammarMasks  # `positions`: exactly that step's `deferred`


class StepResult(Msg, kw_only=True):
    """worker -> scheduler: what a step sampled (host lists), or that it could not run it."""

    epoch: int
    seq: int
    step: int  # BatchSpec.step of the ExecuteStep
    sampled: list[int] = []  # the token at each sampled position (1 + K for a row verifying K drafts)
    num_emitted: list[int] | None = None  # per sampling row: leading positions it emits (None: one each)
    logprobs: TokenLogprobs | None = None  # per sampled position, top-N at the largest N asked (rows cut theirs)
    prompt_logprobs: TokenLogprobs | None = None  # per prompt target, rows in batch order
    failure: StepFailure | None = None  # set when the step did not run (the scheduler resets the worker)
    error: str | None = None  # ... and what happened, for the log


STEP_TYPES: tuple[type[Msg], ...] = (ExecuteStep, FillMasks, StepResult)
