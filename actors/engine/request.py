"""EngineRequest: the scheduler's per-request state.

A resumed request (DESIGN I8) arrives with the output tokens it already delivered: they are its output from the
start (recomputed like a preempted request's), and its outputs here start at seq `first_seq`.

Token accounting (vLLM v1 style): the request's sequence is `prompt + output + pending`, where
`pending` counts tokens sampled by in-flight steps and not yet known on the host (async
scheduling). `num_computed_tokens` counts tokens whose KV is computed or being computed by a
scheduled step: it advances when a step is scheduled, and drops to 0 on preemption, after which
the request re-prefills prompt + output (recompute) and continues exactly where it was.

A guided request (classifier-free guidance) owns a `Companion`: its unconditional sequence, the negative prompt
followed by the request's own output and pending tokens, with its own KV blocks and slot (actors/engine/guidance.py
schedules the pair).

A beam search's group holds its search as a `Beams`: what a request reads of actors/engine/beams.py's BeamGroup.
beams.py builds on this module; of the engine, this one imports only actors/engine/grammar.py.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from actors.engine.grammar import Matcher
from actors.prefix_hash import root
from gpu.batch import PLACEHOLDER
from messages.sampling_params import BeamSearch, SamplingParams
from messages.wire import AbortReason, AddRequest, FinishReason, TokenLogprobs


class Beams(Protocol):
    """What a request reads of its beam search's group (actors/engine/beams.py's BeamGroup)."""

    spec: BeamSearch  # its width: the slots the group holds
    live: list  # its running beams: each a sequence with its own KV blocks and slot


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV blocks freed
    FINISHED = "finished"
    ABORTED = "aborted"


# (constants for the per-row paths: on Python 3.11 an Enum member's lookup costs ~200 ns, its hash more)
ENDED = (RequestStatus.FINISHED, RequestStatus.ABORTED)
RUNNING = RequestStatus.RUNNING


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0  # sampled by in-flight steps, not yet appended to output_token_ids
    num_inflight_steps: int = 0  # scheduled steps with a row of this request, not yet updated
    block_table: list[int] = field(default_factory=list)
    sent_blocks: int = 0  # the leading blocks of block_table its slot's rows have sent (BlockManager.unsent)
    slot: int = -1  # stable index in [0, max_num_seqs) while admitted; -1 when it holds none
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    prompt_logprobs: TokenLogprobs | None = None  # collected chunk by chunk; sent with the first output
    companion: Companion | None = None  # classifier-free guidance's unconditional sequence
    grammar: Matcher | None = None  # structured outputs: accepts each emitted token (actors/engine/grammar.py)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix caching: its full blocks' chained hashes
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    error: str | None = None  # why the request ended with finish_reason "error"
    abort_reason: AbortReason | None = None  # aborted: its Abort's reason, acked with it; None: silently (no AbortAck)
    first_seq: int = 0  # a resumed request's first output seq here (DESIGN I8): the tokens it arrived with
    attempt: int = 0  # AddRequest.attempt: which copy of the request this is (its outputs carry it)
    queued_at: float = field(default_factory=time.monotonic)  # arrival here (queue time: to scheduled_at)
    scheduled_at: float = 0.0  # when first scheduled (time.monotonic)
    first_token_at: float = 0.0  # when its first output here was appended
    worker_outputs: int = -1  # output tokens the worker holds of it (ExecuteStep deltas); -1: it is new there
    failed_steps: int = 0  # steps of it that never reported (the worker died or lost them): a poison request's count
    beams: Beams | None = None  # a beam search's group: its live beams are its sequences (actors/engine/beams.py)
    search: EngineRequest | None = None  # a beam search's choice: the group that answers it (it holds nothing)
    overtaken: int = 0  # younger requests admitted while its LoRA adapter was over the cap (actors/engine/lora_cap.py)
    reads_until: float = field(init=False)  # params.reads_output_until, read every step (scheduler_actor.py)
    # known + pending tokens at which it ends by length: prompt + max_tokens, or max_model_len less the companion's
    # overhang (set by Scheduler.add_request, which knows max_model_len; read by every row's planning and results)
    length_limit: float = float("inf")

    def __post_init__(self):
        self.reads_until = self.params.reads_output_until

    @property
    def fresh(self) -> bool:
        """No output yet in this engine (and none in flight): prompt logprobs and the cached-token count are due."""
        return self.next_seq == self.first_seq and not self.num_pending_tokens

    @classmethod
    def from_msg(
        cls, msg: AddRequest, bos_token_id: int | None = None, grammar: Matcher | None = None
    ) -> EngineRequest:
        """A guided request gets its companion: the negative prompt, or the BOS token alone."""
        resumed = list(msg.resume_token_ids or [])
        req = cls(msg.request_id, list(msg.prompt_token_ids), msg.params, msg.arrival_time, resumed, grammar=grammar)
        req.first_seq, req.attempt = len(resumed), msg.attempt
        if msg.params.guided:
            req.companion = Companion(req, list(msg.params.negative_prompt_token_ids or [bos_token_id]))
        return req

    def timings(self, first: bool, last: bool) -> list[float] | None:
        """At the first or last output (one of them): stamp the first output's time; with the last,
        [prefill_s, decode_s]: first scheduled -> first token -> now (RequestOutput.timings)."""
        now = time.monotonic()
        self.first_token_at = now if first else self.first_token_at
        return [self.first_token_at - self.scheduled_at, now - self.first_token_at] if last else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def sequences(self) -> tuple:
        """This sequence and its CFG companion's, or a beam group's live beams: each holds KV blocks and a slot."""
        if self.beams is not None:
            return tuple(self.beams.live)
        return (self,) if self.companion is None else (self, self.companion)

    @property
    def decoding(self) -> bool:
        """It feeds its last token next (a beam group: one of its beams does; a CFG companion does not count)."""
        return any(s.num_tokens - s.num_computed_tokens == 1 for s in (self.beams.live if self.beams else (self,)))

    @property
    def num_slots(self) -> int:
        """The slots it holds while admitted (a beam group: one per beam it may have)."""
        return len(self.sequences) if self.beams is None else self.beams.spec.width

    @property
    def overhang(self) -> int:
        """How much longer the CFG companion's sequence is than this one (max_model_len bounds both)."""
        return max(0, len(self.companion.prompt_token_ids) - self.num_prompt_tokens) if self.companion else 0

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known or pending: what max_tokens is checked against when scheduling."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def next_seq(self) -> int:
        """Index of the next output token to report (RequestOutput.seq, DESIGN I6)."""
        return len(self.output_token_ids)

    @property
    def prefix_root(self) -> bytes:
        """The first block's parent in its prefix-cache chain (actors/prefix_hash.py): its salt and adapter."""
        return root(self.params.cache_salt, self.params.lora)

    @property
    def all_token_ids(self) -> list[int]:
        """The known sequence, prompt + output: what a preempted request re-prefills."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in ENDED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the sequence; pending ones (only ever the last) are PLACEHOLDER."""
        return token_range(self.prompt_token_ids, self.output_token_ids, start, end)


@dataclass(eq=False)
class Companion:
    """The unconditional sequence of a guided request: never seen outside the engine, scheduled, preempted and
    freed with its parent (whose in-flight count covers its rows). Duck-types the BlockManager's request."""

    parent: EngineRequest
    prompt_token_ids: list[int]  # the negative prompt
    block_table: list[int] = field(default_factory=list)
    sent_blocks: int = 0
    num_computed_tokens: int = 0
    slot: int = -1
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return f"{self.parent.request_id}/uncond"

    @property
    def prefix_root(self) -> bytes:
        return self.parent.prefix_root

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.parent.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.parent.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.parent.num_output_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        return token_range(self.prompt_token_ids, self.parent.output_token_ids, start, end)


def token_range(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output + pending tokens (PLACEHOLDER: sampled by a step in flight)."""
    p, k = len(prompt), len(prompt) + len(output)
    if start >= k:  # (pending tokens only: a decode row under async scheduling)
        return [PLACEHOLDER] * (end - start)
    ids = prompt[start : min(end, p)] + output[max(start - p, 0) : max(end - p, 0)]
    return ids + [PLACEHOLDER] * (end - max(start, k)) if end > k else ids
