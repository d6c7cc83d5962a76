"""The wire types: every message that crosses a mailbox, with who sends it to whom.

All are msgspec Structs tagged with their class name and encoded as msgpack arrays. Messages
that carry device tensors set `local_only = True`: they may only travel in-process.
Queries carry a correlation id and the asker's address; the runtime routes their Reply back.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from messages.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]  # why a request ended: OpenAI's, and vLLM's abort, error
AbortReason = Literal["client", "stop", "error", "shutdown"]  # who ended it early (Abort; Finished.stop_reason)
# why the engine failed a request (with finish_reason "error"), for its client: a field of the request is at fault
# (`error_param` names it; HTTP 400), the server cannot take it now (503), or the engine failed it (500)
ErrorKind = Literal["invalid", "unavailable", "internal"]


class Msg(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    local_only: ClassVar[bool] = False


class Query(Msg, kw_only=True):
    """A message answered by a Reply (`Actor.ask`); the runtime fills both fields."""

    corr_id: int = 0
    reply_to: str = ""


class Reply(Msg, kw_only=True):
    corr_id: int = 0


# ---------------------------------------------------------------- runtime control


class Ready(Msg, kw_only=True):
    """child actor -> supervisor: started, mailbox bound."""

    actor: str
    pid: int


class Shutdown(Msg, kw_only=True):
    """supervisor -> every actor: drain (stop admitting, finish or abort in-flight), then exit."""

    reason: AbortReason = "shutdown"  # of the aborts it causes


class Ping(Query, kw_only=True):
    """anyone -> any actor (the supervisor's heartbeat); answered by the runtime itself."""

    payload: bytes = b""


class Pong(Reply, kw_only=True):
    payload: bytes = b""


class ActorDown(Msg, kw_only=True):
    """supervisor -> the actors that are up: `actor` died (its process exited, hung, or died restarting); a restarted
    actor hears it once Ready of every actor down at that moment."""

    actor: str
    reason: str = ""
    retry_in_s: float = 0.0  # when the supervisor restarts it: 0 at once; past its restart intensity, its back-off
    restarts: int = 0  # the restarts of its group (its engine replica's processes, or its own) so far, this one's too


class ActorUp(Msg, kw_only=True):
    """supervisor -> all actors: `actor` is Ready again; ActorUp(SUPERVISOR): the start has ended (runtime/system.py)."""

    actor: str


class Probe(Msg, kw_only=True):
    """test/benchmark actor -> test/benchmark actor: a numbered payload (ordering, throughput)."""

    seq: int
    payload: bytes = b""


class CheckIdle(Query, kw_only=True):
    """tests/operators -> any request-path actor: report per-request state left over."""


class IdleReport(Reply, kw_only=True):
    actor: str = ""
    idle: bool = True
    details: dict[str, int] = {}


# ---------------------------------------------------------------- request path


class AddRequest(Msg, kw_only=True):
    """HTTP/offline client -> scheduler -> detokenizer, before any output of the request (FIFO registration)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    client: str = "http"  # the actor that receives this request's text
    # A resumed copy (DESIGN I8): the output tokens its client has (the engine recomputes their KV and samples on from
    # seq len(...); None: a new request), and the characters of their text it has (the rest is held back).
    resume_token_ids: list[int] | None = None
    resume_chars: int = 0
    # Which copy this is: 0 as first sent, higher at each re-submission (odd from a client, even from the detokenizer:
    # copies made at once never share a number, actors.protocol.next_attempt). The scheduler runs only the highest it
    # has seen; every output carries it: a party drops the outputs of a copy older than the one it follows.
    attempt: int = 0


class Abort(Msg, kw_only=True):
    """HTTP (client gone, shutdown) or detokenizer (stop string) -> scheduler. Idempotent."""

    request_id: str
    reason: AbortReason = "client"
    attempt: int | None = None  # the copy it ends (the detokenizer's: found in that copy's output); None: any copy


class AbortAck(Msg, kw_only=True):
    """scheduler -> detokenizer (-> HTTP as Finished): terminal message of an aborted request,
    sent after its last output once no in-flight step references its KV blocks."""

    request_id: str
    reason: AbortReason = "client"
    attempt: int = 0  # AddRequest.attempt of the copy it ends: an ack of a replaced copy is stale


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of the sampled tokens of one entry, aligned with `new_token_ids`."""

    sampled: list[float]
    ranks: list[int]
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    @staticmethod
    def join(parts: list[TokenLogprobs]) -> TokenLogprobs:
        """The entries of consecutive parts, in order (a request's deltas, a prompt's chunks)."""
        out = TokenLogprobs(sampled=[], ranks=[], top_ids=[], top_logprobs=[])
        for p in parts:
            out.sampled += p.sampled
            out.ranks += p.ranks
            out.top_ids += p.top_ids
            out.top_logprobs += p.top_logprobs
        return out

    def part(self, start: int, stop: int) -> TokenLogprobs:
        """Entries start..stop-1."""
        return TokenLogprobs(
            self.sampled[start:stop], self.ranks[start:stop], self.top_ids[start:stop], self.top_logprobs[start:stop]
        )


class RequestOutput(msgspec.Struct, array_like=True, kw_only=True):
    """One request's new tokens in one engine step. `seq` = index of its first new token."""

    request_id: str
    seq: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None  # stop | length | error
    stop_reason: int | str | None = None  # the stop token id (or stop string downstream)
    logprobs: TokenLogprobs | None = None
    error: str | None = None
    error_kind: ErrorKind = "internal"  # with an error: whose fault it is
    error_param: str | None = None  # with an "invalid" error: the request field at fault (a SamplingParams name)
    # with the request's first output (seq 0; a resumed request's first seq), for prompt_logprobs: one entry per prompt token after the first (the logits of the token before)
    prompt_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int | None = None  # with the first output: prompt tokens whose KV came from the prefix cache
    attempt: int = 0  # AddRequest.attempt of the copy that produced it
    timings: list[float] | None = None  # with the terminal output: [prefill_s, decode_s] of this copy (vLLM's)


class StepOutputs(Msg, kw_only=True):
    """scheduler -> detokenizer: everything one engine step produced (one message per step)."""

    step: int  # numbered from 0 per engine incarnation (the engine numbers every one; -1: unnumbered)
    outputs: list[RequestOutput]
    recent: list[tuple[int, list[str]]] = []  # the request ids of the numbered ones before (actors.protocol.SentNames)


class TextDelta(msgspec.Struct, array_like=True, kw_only=True):
    """Decoded text released for one request in one step (hold-back already applied)."""

    request_id: str
    seq: int
    text: str
    token_ids: list[int]
    logprobs: TokenLogprobs | None = None
    attempt: int = 0  # RequestOutput.attempt, passed on


class Finished(Msg, kw_only=True):
    """detokenizer -> HTTP (exactly one per request), or HTTP to itself on actor death.
    Carries the request's last text (released hold-back) and its final accounting."""

    request_id: str
    finish_reason: FinishReason
    stop_reason: int | str | None = None  # stop token id / stop string; for an abort, its reason
    text: str = ""
    token_ids: list[int] = []
    logprobs: TokenLogprobs | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    error_kind: ErrorKind = "internal"  # RequestOutput.error_kind, passed on
    error_param: str | None = None  # RequestOutput.error_param, passed on
    prompt_logprobs: TokenLogprobs | None = None  # RequestOutput.prompt_logprobs, passed on
    num_cached_tokens: int = 0  # RequestOutput.num_cached_tokens, passed on
    attempt: int = 0  # AddRequest.attempt of the copy the detokenizer followed
    timings: list[float] | None = None  # RequestOutput.timings, passed on (None: ended before or without them)


class TextOutputs(Msg, kw_only=True):
    """detokenizer -> HTTP (a client): one batched message per engine step, a Finished of its own, or (empty) a
    marker sent on a quiet link after output, so that the loss of a link's last message shows too."""

    step: int  # the engine step it comes from (-1: none)
    deltas: list[TextDelta]
    finished: list[Finished] = []
    number: int = -1  # consecutive per (detokenizer incarnation, client) from 0, as StepOutputs.step; -1: unnumbered
    recent: list[tuple[int, list[str]]] = []  # as StepOutputs.recent
    replica: int = 0  # the engine replica whose detokenizer sent it (a client numbers each replica's link apart)


class EngineStats(Msg, kw_only=True):
    """scheduler -> HTTP, periodically: gauges and counters for /metrics."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    late_aborts_total: int
    discarded_samples_total: int = 0
    num_preemptions_total: int = 0
    worker_resets_total: int = 0  # the worker's state was lost (its death, a lost or failed step): all recomputed
    worker_ranks: int = 1  # the worker's ranks (a tensor-parallel gang's size) ...
    worker_up: bool = True  # ... and whether they serve (False while the worker or its gang restarts)
    queue_times_s: list[float] = []  # arrival -> first scheduled, one per request scheduled since the last EngineStats
    spec_num_drafts: int = 0  # speculative decoding: rows that verified drafts
    spec_num_draft_tokens: int = 0  # draft tokens verified
    spec_num_accepted_tokens: int = 0  # draft tokens accepted
    spec_accepted_per_pos: list[int] = []  # [i]: drafts accepted at position i
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache (at first admission)
    prefix_cache_hits_total: int = 0  # ... and found there
    cache_config: dict[str, str] = {}  # block_size, num_gpu_blocks, enable_prefix_caching (vLLM's cache_config_info)
    replica: int = 0  # the engine replica that reports (--data-parallel-size; vLLM's `engine` label)
    prefix_anchors: list[bytes] = []  # its prefix cache's anchors (actors/prefix_hash.py), for the replica router
    # LoRA: vLLM's lora_requests_info labels (max_lora; running_/waiting_lora_adapters: digests), loads, evictions
    lora_info: dict[str, str] = {}


class DetokStats(Msg, kw_only=True):
    """detokenizer -> HTTP, periodically: the protocol counters seen by the detokenizer."""

    stale_outputs_dropped_total: int
    protocol_violations_total: int
    num_tombstones: int
    repairs_total: int = 0  # requests re-submitted because some output of theirs was lost
    replica: int = 0  # the engine replica whose detokenizer reports
    prompt_tokens_total: int = 0  # vLLM's accounting (actors/detokenizer/token_counts.py)
    generation_tokens_total: int = 0
    iteration_tokens: list[int] = []  # the tokens of each step that gave a request tokens, since the last report


class Opaque(Msg, kw_only=True):
    """Local-only envelope for in-process payloads that must never be serialized (tensors)."""

    local_only: ClassVar[bool] = True
    kind: str
    payload: Any = None


WIRE_TYPES: tuple[type[Msg], ...] = (
    Ready,
    Shutdown,
    Ping,
    Pong,
    ActorDown,
    ActorUp,
    Probe,
    CheckIdle,
    IdleReport,
    AddRequest,
    Abort,
    AbortAck,
    StepOutputs,
    TextOutputs,
    Finished,
    EngineStats,
    DetokStats,
)
