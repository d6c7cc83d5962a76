"""The offline API's client actor: hosted in the caller's process, it routes each request's TextOutputs and Finished
to one queue per stream, checks them (DESIGN I6) and resumes its streams after a loss or a death (I8)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from actors.protocol import MAX_ATTEMPTS, RecentIds, RequestRecord, StepNumbers, lost_suspects
from actors.runtime import Actor
from messages.names import CLIENT, DETOKENIZER, SCHEDULER
from messages.wire import (
    Abort,
    ActorDown,
    ActorUp,
    AddRequest,
    DetokStats,
    EngineStats,
    Finished,
    TextOutputs,
)

log = logging.getLogger("sluice.offline")


@dataclass
class Stream:
    record: RequestRecord  # what was sent, what arrived (DESIGN I6, I8)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class ClientActor(Actor):
    """Routes TextOutputs / Finished to one queue per request, checking each stream's seq (DESIGN I6).

    A duplicate delta is dropped, so is an older copy's (stale); a gap (a lost or reordered TextOutputs, or a
    Finished that reports more tokens than arrived) re-submits the request from what the stream has, as does an
    engine-side death once the request path is whole again (DESIGN I8; a stream live at more than `max_resumes`
    deaths, or one that had MAX_ATTEMPTS copies, ends with an error). Output for a stream that has ended is
    counted: `outputs_after_finished` when it brings tokens past the count its Finished reported (a protocol
    bug), `late_outputs` otherwise (a duplicate, a message the link reordered behind the Finished, or a stream
    ended here)."""

    name = CLIENT

    def __init__(self, max_resumes: int = 2):
        super().__init__()
        self.max_resumes = max_resumes
        self.streams: dict[str, Stream] = {}
        self.ended = RecentIds()  # request id -> the tokens its Finished accounts for
        self.down: set[str] = set()  # actors of the request path that are down
        self.link = StepNumbers()  # the numbering of the detokenizer's TextOutputs
        self.engine_stats: EngineStats | None = None
        self.detok_stats: DetokStats | None = None
        self.duplicates = self.gaps = self.stale = self.resumes = self.late_outputs = self.outputs_after_finished = 0

    def handlers(self):
        return {
            TextOutputs: self.on_text,
            Finished: self.on_finished,
            EngineStats: lambda m: setattr(self, "engine_stats", m),
            DetokStats: lambda m: setattr(self, "detok_stats", m),
            ActorDown: self.on_down,
            ActorUp: self.on_up,
        }

    async def on_start(self) -> None:
        self.spawn(self._find_lost_on_a_quiet_link())

    def add(self, msg: AddRequest) -> Stream:
        stream = self.streams[msg.request_id] = Stream(RequestRecord(msg, self.link.last))
        if self.stopped:  # the system is gone: the stream ends at once
            self._fail(msg.request_id, "the system stopped")
        else:
            self.tell(SCHEDULER, msg)
        return stream

    def on_text(self, msg: TextOutputs) -> None:
        if msg.number >= 0 and not self.link.accept(msg.number, msg.recent):
            self.duplicates += 1  # the whole message again
            return
        for delta in msg.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                self._late(delta.request_id, delta.seq + len(delta.token_ids))
                continue
            match stream.record.check(delta.seq, len(delta.token_ids), delta.attempt):
                case "ok":  # (only output taken: a lost message before a stale or duplicate one may hold its next)
                    stream.record.heard = max(stream.record.heard, msg.number)
                    stream.record.received(delta.text, delta.token_ids)
                    stream.queue.put_nowait(delta)
                case "stale":
                    self.stale += 1
                case "duplicate":
                    self.duplicates += 1
                case "gap":
                    self._gap(delta.request_id, f"delta seq {delta.seq}, expected {stream.record.num_tokens}")
        for fin in msg.finished:
            self.on_finished(fin)
        self._find_lost()

    def _find_lost(self) -> None:
        if lost := self.link.lost():
            for rid in lost_suspects(self.link, lost, ((rid, s.record) for rid, s in self.streams.items())):
                self._gap(rid, "a TextOutputs it may have been in was lost")

    async def _find_lost_on_a_quiet_link(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self._find_lost()

    def on_finished(self, msg: Finished) -> None:
        rid = msg.request_id
        stream = self.streams.get(rid)
        if stream is None:
            self._late(rid, msg.num_output_tokens)
            return
        if not stream.record.follows(msg.attempt):  # an older copy's
            self.stale += 1
            return
        if msg.finish_reason != "error" and stream.record.num_tokens < msg.num_output_tokens - len(msg.token_ids):
            self._gap(rid, f"Finished after {msg.num_output_tokens} tokens, {stream.record.num_tokens} received")
        else:
            self._end(rid, msg)
            self.ended.remember(rid, max(stream.record.num_tokens + len(msg.token_ids), msg.num_output_tokens))

    def on_down(self, msg: ActorDown) -> None:
        if msg.actor in (SCHEDULER, DETOKENIZER):
            self.down.add(msg.actor)  # the streams wait: the engine side forgets every request
        if msg.actor == DETOKENIZER:
            self.link.reset()  # its next incarnation numbers from 0

    def on_up(self, msg: ActorUp) -> None:
        if msg.actor not in self.down:
            return  # (a worker's restart is the engine's business)
        self.down.discard(msg.actor)
        if self.down:
            return
        for rid, stream in list(self.streams.items()):
            stream.record.deaths += 1
            if stream.record.deaths > self.max_resumes:
                self._fail(rid, f"failed after {self.max_resumes} restarts of the engine side while it ran")
            else:
                self._resume(rid, "death")

    def fail_all(self, error: str) -> None:
        for rid in list(self.streams):
            self._fail(rid, error)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """The system stopped (also when it gave up restarting a process): no stream waits on."""
        self.fail_all("the system stopped")
        super().stop()

    def _end(self, rid: str, msg: Finished) -> None:
        self.streams.pop(rid).queue.put_nowait(msg)

    def _gap(self, rid: str, what: str) -> None:
        self.gaps += 1
        self._resume(rid, f"lost output: {what}")

    def _resume(self, rid: str, why: str) -> None:
        """Re-submit the request from what its stream has; one that had MAX_ATTEMPTS copies fails."""
        msg = self.streams[rid].record.resume()
        if msg is None:
            self._fail(rid, f"{why}; failed after {MAX_ATTEMPTS} resumptions", abort=True)
            return
        self.resumes += 1
        log.info("[%s] resumed after %d tokens (%s)", rid, len(msg.resume_token_ids), why)
        self.tell(SCHEDULER, msg)

    def _fail(self, rid: str, error: str, abort: bool = False) -> None:
        received = self.streams[rid].record.num_tokens
        self._end(rid, Finished(request_id=rid, finish_reason="error", error=error, num_output_tokens=received))
        if abort:  # the engine may still run it
            self.tell(SCHEDULER, Abort(request_id=rid, reason="error"))

    def _late(self, rid: str, end: int) -> None:
        final = self.ended.get(rid)
        if final is not None and end > final:
            self.outputs_after_finished += 1
            log.error("[%s] output after its Finished (%d tokens past %d)", rid, end, final)
        else:
            self.late_outputs += 1
