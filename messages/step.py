"""The scheduler <-> worker link (issue 17): one ExecuteStep out and one StepResult back per step.

The worker (actors/engine/worker.py: the model runner and the sampler) keeps a persistent batch: each live
request's sampling state (prompt ids, params, output ids). An ExecuteStep carries the full state of the requests
new to the worker and per-step deltas for the rest (the output tokens the scheduler appended since it last sent
the request, while its sampling reads them); the sampled ids themselves stay on the device between steps (the
runner's relay buffer), so async scheduling keeps its one-step-ahead overlap across the process boundary.

Numbering: `epoch` names one run of the worker's state (a restarted worker, or a reset after a lost message,
starts a new one: every request is new again); `seq` counts ExecuteSteps within an epoch. The worker runs
ExecuteSteps in seq order and answers each with a StepResult of the same (epoch, seq); a gap in either
direction means the worker's state can no longer be trusted, and the scheduler resets it (a new epoch, every
running request recomputed).

Slow is not hung: while a step is on the worker, the worker's event loop sends a StepProgress every
step_timeout_s / 5 with a counter its device thread advances as it computes (phases, layers of the forward). The
scheduler waits for a StepResult until step_timeout_s passes with no progress: then heartbeats that kept coming
without progress mean a hung step (it tells the worker StepHung: the process exits, the supervisor restarts it),
silence means a lost message.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gpu.batch import BatchSpec
from messages.sampling_params import SamplingParams
from messages.wire import Msg, TokenLogprobs

# Why a step did not run: "gap" (the worker refused it: an ExecuteStep before it was lost, or rows that do not fit
# the block tables its runner keeps, gpu/runner/slot_tables.py), "raised" (it raised in
# the worker), "lost" (its StepResult was lost or late: nothing was heard of it for step_timeout_s), "died" (the
# worker died with it in flight), "hung" (the worker's heartbeats showed its device thread making no progress for
# step_timeout_s: the worker is made to exit). The steps that "raised", "died" or "hung" blame their requests (one may
# be a poison request); a lost message blames nobody.
StepFailure = Literal["gap", "raised", "lost", "died", "hung"]
BLAMING_FAILURES: tuple[StepFailure, ...] = ("raised", "died", "hung")


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
    # request id -> output tokens the scheduler appended since it last sent it, while the worker's copy is shorter
    # than what its sampling reads (SamplingParams.reads_output_until: every token with penalties or bad words, up to
    # min_tokens otherwise); past that its copy stays as it is (no sampling decision depends on it any more)
    appended: dict[str, list[int]] = {}
    freed: list[str] = []  # requests that ended since the last ExecuteStep: forgotten first (before `new`)
    num_prompt_logprobs: int = 0  # the top-N of the prompt logprobs (the largest any row with targets asked for)
    masks: GrammarMasks | None = None  # structured outputs: the constrained positions' masks
    # LoRA: the adapters the worker is to hold from this step on (digest -> directory), when that changed (None: as
    # before); it reads new ones off the step loop, and loads a row's adapter it lacks before the step
    loras: dict[str, str] | None = None


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
    loras: list[str] | None = None  # LoRA: the adapters the worker holds after this step, when that changed
    lora_errors: dict[str, str] = {}  # ... and those it could not load (digest -> why)
    failure: StepFailure | None = None  # set when the step did not run (the scheduler resets the worker)
    error: str | None = None  # ... and what happened, for the log


class StepProgress(Msg, kw_only=True):
    """worker -> scheduler, every step_timeout_s / 5 while it holds a step: what its device thread is doing."""

    epoch: int
    seq: int  # the step on the device thread (the last one it ran, when `waiting` for nothing but host copies)
    progress: int  # a counter the device thread advances as it computes (per worker process: 0 when it starts)
    waiting: bool = False  # the device thread is not computing: it waits for the scheduler (deferred grammar masks)
    # or is idle (the steps wait for their host copies): a stall then is nobody's fault


class StepHung(Msg, kw_only=True):
    """scheduler -> worker: a step of `epoch` (or before) made no progress for step_timeout_s. The worker process
    exits (nothing else stops a stuck device thread) and the supervisor restarts it; an incarnation that has run no
    step yet, or one of a later epoch, ignores it (a late or repeated ask)."""

    epoch: int


STEP_TYPES: tuple[type[Msg], ...] = (ExecuteStep, FillMasks, StepResult, StepProgress, StepHung)


# A tensor-parallel gang across nodes (actors/engine/gang_nodes.py): its leader's door <-> each other node's headless
# launcher, over an authenticated TCP link (actors/runtime/curve.py). A gang is named by an id per incarnation.


class NodeHello(Msg, kw_only=True):
    """headless node -> door, every second: it is there, and which gang its ranks belong to."""

    node_rank: int
    gang: str = ""  # the gang its ranks run in ("": none)


class SpawnRanks(Msg, kw_only=True):
    """door -> headless node: (re)start this node's ranks in a new gang (its old ranks are killed first)."""

    gang: str
    store: str  # the group's rendezvous (tcp://host:port/<gang>: gpu/distributed/group.py)
    engine: dict  # the leader's EngineConfig (the node serves its own copy of the model: `model` is replaced)
    num_blocks: int  # KV blocks per rank
    log_level: str


class RankExited(Msg, kw_only=True):
    """headless node -> door: one of its ranks of `gang` exited (the gang is over)."""

    gang: str
    rank: int
    code: int | None  # its exit code (negative: the signal that killed it)


NODE_TYPES: tuple[type[Msg], ...] = (NodeHello, SpawnRanks, RankExited)


# Engine replicas on other nodes (actors/replica_link.py): the front node's door <-> each headless replica's node, over
# an authenticated TCP link (actors/runtime/curve.py). The link's epoch numbers its admissions of a node.


class ReplicaHello(Msg, kw_only=True):
    """headless replica's node -> the front's door, every second: it serves replica `replica`, in the link's
    epoch it last adopted (0: none yet)."""

    replica: int
    epoch: int = 0


class Welcome(Msg, kw_only=True):
    """door -> node, answering each hello: the link's epoch. A node adopting a new one first drops every request the
    front sent it before (they were re-submitted elsewhere when the door lost it)."""

    replica: int
    epoch: int
    sent: int = 0  # the relays sent in the epoch before it (a node that received fewer lost one: it leaves the epoch)


class Relay(Msg, kw_only=True):
    """door <-> node: a message for actor `dst` on the other side (a front proxy's or the node's client proxy's),
    encoded as on any process link (decoded and validated there)."""

    dst: str
    frame: bytes
    seq: int = 0  # door -> node: consecutive from 1 in each epoch (a node that finds a gap leaves the epoch)


REPLICA_TYPES: tuple[type[Msg], ...] = (ReplicaHello, Welcome, Relay)
