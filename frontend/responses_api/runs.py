"""A response being generated: its chat request in the HTTP actor's RequestTable, its writer, and its readers.

Every run, streamed or not, foreground or background, is driven by one task the HTTP actor owns (`drive`): it
feeds the request's output to the writer until the request ends, then writes the ended response to the store and
only then publishes the last event, so a client that saw `response.completed` finds the response stored. Readers
(the POST's stream, `GET ?stream=true` resumes) follow `published` and wait on `changed` (a fresh event per
publish): no reader ever holds up the run, and a run never waits for a reader.

  how it ends                                    status                  stored
  the engine's Finished: stop / length / abort   completed / incomplete  if store
                                                 / cancelled
  the request failed (req.error)                 failed (error)          if store
  POST /cancel (background): Abort -> AbortAck   cancelled, output kept  if store
  the foreground client went away: Abort         cancelled               no (nobody holds its whole output)
  DELETE while it runs (background): Abort       cancelled               no
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from frontend.request_state import HttpRequest
from frontend.responses_api.request import ResponsesCall
from frontend.responses_api.store import ResponseStore
from frontend.responses_api.writer import ResponseWriter

log = logging.getLogger("sluice.http")

_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


class ResponseRun:
    def __init__(self, call: ResponsesCall, req: HttpRequest, writer: ResponseWriter):
        self.call = call
        self.req = req
        self.writer = writer
        self.published = 0  # events readers may see
        self.changed = asyncio.Event()  # set (and replaced) at each publish
        self.ended = asyncio.Event()  # the run ended, and its response was stored if it is to be
        self.cancelled = False  # POST /cancel or DELETE
        self.keep = call.store  # stored once it ends (not when its foreground client went away, or deleted)

    @property
    def id(self) -> str:
        return self.writer.id

    @property
    def conversation(self) -> list[dict]:
        return self.call.history + self.call.input

    def publish(self) -> None:
        self.published = len(self.writer.events)
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def events(self, after: int) -> AsyncIterator[bytes]:
        """The events after sequence number `after`, as they are published, to the last."""
        i = after + 1
        while True:
            changed = self.changed
            if i < self.published:
                chunk, i = b"".join(self.writer.events[i : self.published]), self.published
                yield chunk
            elif self.ended.is_set():
                return
            else:
                await changed.wait()


async def drive(run: ResponseRun, store: ResponseStore) -> None:
    """Feed the run's output to its writer until it ends; store it; publish the end (module docstring)."""
    req, writer = run.req, run.writer
    choice = req.choices[0]
    writer.start()
    run.publish()
    while True:
        done = req.done
        text, ids, lps = choice.take()
        if text or ids:
            writer.feed(text, ids, lps)
            run.publish()
        if done:
            break
        await req.wake.wait()
        req.wake.clear()
    status, error = _outcome(run)
    usage = {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": choice.num_output_tokens,
             "total_tokens": req.num_prompt_tokens + choice.num_output_tokens,
             "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens}}  # fmt: skip
    writer.finish(status, usage, error)
    try:
        if run.keep:
            events = writer.events if run.call.background else None
            await store.put(run.id, writer.response(), run.conversation, events)
    except Exception:
        log.exception("[%s] the response could not be stored", run.id)
    finally:
        run.publish()
        run.ended.set()
    log.info("[%s] response %s", run.id, status)


def _outcome(run: ResponseRun) -> tuple[str, dict | None]:
    req = run.req
    if req.error is not None:
        e = req.error
        return "failed", {"code": "server_error" if e.status >= 500 else "invalid_prompt", "message": e.message}
    fin = req.choices[0].finished
    if run.cancelled or fin is None:
        return "cancelled", None
    return _STATUS.get(fin.finish_reason, "completed"), None
