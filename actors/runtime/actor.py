"""Actor: owns its state, handles one message at a time through a type -> handler table.

Every task an actor starts (`self.spawn`) is owned by the actor's TaskGroup and cancelled when
the actor stops: nothing runs unowned. A handler exception is logged with the message and the
actor carries on, unless it is a `FatalError`, which stops the process so the supervisor
restarts it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from actors.runtime.mailbox import Inbox
from actors.runtime.router import Router
from messages.wire import ActorDown, ActorUp, Msg, Ping, Pong, Query, Reply, Shutdown

log = logging.getLogger("sluice.actor")

Handler = Callable[[Any], Awaitable[Any] | Any]


class FatalError(Exception):
    """Raised by a handler when the actor cannot go on: its process exits, the supervisor restarts it."""


class AskTimeout(TimeoutError):
    pass


class Actor:
    name: str = "actor"

    def __init__(self, name: str | None = None):
        if name:
            self.name = name
        self.router: Router | None = None
        self.inbox: Inbox | None = None
        self.handled = 0
        self.handler_errors = 0
        self.unexpected = 0
        self.late_replies = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._corr = itertools.count(1)
        self._tasks: asyncio.TaskGroup | None = None
        self._owned: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()
        self.started = asyncio.Event()  # set once on_start returned: the actor is Ready
        self._moved = asyncio.Event()  # set as its state may have changed: a message handled, or `moved()`
        self._draining: asyncio.Task | None = None
        self._handlers: dict[type, Handler] = {}

    # ------------------------------------------------------------ to override

    def handlers(self) -> dict[type, Handler]:
        """The type -> handler table. Ping, replies to asks and Shutdown are handled by the runtime."""
        return {}

    async def on_start(self) -> None:
        """Called once the inbox is bound, before the first message."""

    async def on_shutdown(self, reason: str) -> None:
        """Drain: stop admitting, finish or abort in-flight work. Then the actor stops."""

    async def on_processes_exited(self, timeout_s: float) -> None:
        """A launcher's actor, as the system stops: its processes have exited (or were killed past the deadline),
        and what they sent last may still be on its way here; an actor that waits for it (the offline client: its
        streams' Finished) waits, at most `timeout_s` (0 or less: only what is handled meanwhile), before it is
        stopped."""

    def on_stop(self) -> None:
        """Release what the actor holds (sockets, contexts) once it has ended, however it ended (drained, stopped,
        failed; after on_start, even one that failed): never left to the garbage collector."""

    # ------------------------------------------------------------ messaging

    def tell(self, dst: str, msg: Msg) -> None:
        """Fire and forget; never blocks."""
        self.router.send(self.name, dst, msg)

    async def ask(self, dst: str, query: Query, timeout: float = 5.0) -> Reply:
        corr = next(self._corr)
        query.corr_id, query.reply_to = corr, self.name
        fut = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        try:
            self.tell(dst, query)
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise AskTimeout(f"{self.name}: no reply from {dst} to {type(query).__name__} within {timeout}s") from None
        finally:
            self._pending.pop(corr, None)  # a late reply finds nothing and is dropped (counted)

    def spawn(self, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        """Start a task owned by this actor: it is cancelled when the actor stops."""
        task = self._tasks.create_task(coro, name=name or f"{self.name}:{coro.__name__}")
        self._owned.add(task)
        task.add_done_callback(self._owned.discard)
        return task

    def stop(self) -> None:
        self._stopped.set()

    def drain(self, reason: str) -> None:
        """Shutdown (the supervisor's message, or a signal): `on_shutdown` runs once, in a task of its own, so the
        actor goes on handling the messages it drains for; then the actor stops."""
        if self._draining is None:
            self._draining = self.spawn(self._shutdown(reason))

    def moved(self) -> None:
        """Wake `until` (a task of the actor changed its state outside a handler)."""
        self._moved.set()

    async def until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `done()` holds, checked each time the actor's state may have changed (after every message
        handled, and at `moved()`); False if it still does not after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while not done():
                    self._moved.clear()
                    await self._moved.wait()
        except TimeoutError:
            return False
        return True

    @property
    def pending_asks(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------ the loop

    async def run(self, router: Router) -> None:
        """Bind the inbox, then handle messages until stopped. Returns when the actor is done."""
        self.router = router
        self.inbox = router.open_inbox(self.name)
        self._handlers = self.handlers()
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                await self.on_start()
                self.started.set()
                self.spawn(self._receive())
                await self._stopped.wait()
                for task in list(self._owned):
                    task.cancel()
        finally:
            self.on_stop()

    async def _receive(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                pending = self.dispatch(msg)
                if pending is not None:
                    await pending
            except FatalError:
                raise
            except Exception:
                self.handler_errors += 1
                log.exception("%s: handler failed on %s", self.name, _short(msg))
            self._moved.set()

    def dispatch(self, msg: Msg) -> Awaitable | None:
        """Handle `msg`; returns an awaitable only when there is something to await (the hot path is sync)."""
        self.handled += 1
        handler = self._handlers.get(type(msg))
        if handler is None or isinstance(msg, Reply | ActorDown):
            return self._runtime(msg, handler)
        result = handler(msg)
        if result is None:
            return None
        if inspect.isawaitable(result):
            return self._answer_later(msg, result)
        self._answer(msg, result)
        return None

    def _runtime(self, msg: Msg, handler: Handler | None) -> Awaitable | None:
        """What the runtime handles itself: replies to asks, Ping, Shutdown, ActorDown bookkeeping."""
        if isinstance(msg, Reply):
            fut = self._pending.get(msg.corr_id)
            if fut is None or fut.done():
                self.late_replies += 1
            else:
                fut.set_result(msg)
            return None
        if isinstance(msg, ActorDown):
            self.router.forget(msg.actor)
            if handler is not None:
                result = handler(msg)
                return result if inspect.isawaitable(result) else None
        elif isinstance(msg, Ping):
            self.tell(msg.reply_to, Pong(corr_id=msg.corr_id, payload=msg.payload))
        elif isinstance(msg, Shutdown):
            self.drain(msg.reason)
        elif not isinstance(msg, ActorUp):
            self.unexpected += 1
            log.warning("%s: no handler for %s, dropped", self.name, type(msg).__name__)
        return None

    async def _answer_later(self, msg: Msg, result: Awaitable) -> None:
        self._answer(msg, await result)

    def _answer(self, msg: Msg, result: Any) -> None:
        if isinstance(msg, Query) and isinstance(result, Reply):
            result.corr_id = msg.corr_id
            self.tell(msg.reply_to, result)

    async def _shutdown(self, reason: str) -> None:
        await self.on_shutdown(reason)
        self.stop()


def _short(msg: Msg, limit: int = 300) -> str:
    text = repr(msg)
    return text if len(text) <= limit else text[:limit] + "..."
