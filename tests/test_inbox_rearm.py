"""An inbox re-arms its socket's reader (actors/runtime/mailbox.py): it hears its socket again after someone else
removed its reader, and a healthy one re-arms silently on uvloop as on asyncio's loop."""

from __future__ import annotations

import asyncio

import zmq

from actors.runtime import ActorSystem, mailbox
from actors.runtime.mailbox import Inbox
from messages.codec import Codec
from messages.wire import Msg, Ping
from tests.runtime_actors import ECHO, Sender


async def test_an_inbox_whose_reader_someone_else_removed_hears_its_socket_again(monkeypatch):
    """asyncio keys a reader by fd number, and code sharing the loop may remove one it does not own: a transport closed
    after its socket was (an un-closed openai client that the cyclic GC finalizes resurrects itself in __del__ and
    later aborts the transports whose sockets the GC closed) removes the reader of whatever took that number since.
    Done here by hand to the tester's inbox: it re-arms its reader (mailbox.REARM_S) and hears the reply it missed."""
    monkeypatch.setattr(mailbox, "REARM_S", 0.05)
    tester = Sender()
    async with ActorSystem([ECHO], local=[tester]):
        await tester.ask("echo", Ping(), timeout=10)  # the echo is up and the link connected
        assert asyncio.get_running_loop().remove_reader(tester.inbox._sock.getsockopt(zmq.FD))  # the stale close
        pong = await tester.ask("echo", Ping(payload=b"again"), timeout=10)
        assert pong.payload == b"again" and tester.inbox.rearmed == 1


def test_a_healthy_inbox_re_arms_silently_on_uvloop(caplog):
    """uvloop's remove_reader answers None whether or not a reader was there: no false 'removed by someone else'
    (every actor of a served graph logged it every REARM_S once)."""
    import uvloop

    async def rearm_twice() -> tuple[int, Msg]:
        codec, ctx = Codec(), zmq.Context.instance()
        inbox = Inbox("probe", codec)
        inbox.bind(ctx, "inproc://rearm-probe")
        inbox.rearm()
        inbox.rearm()
        push = ctx.socket(zmq.PUSH)
        push.connect("inproc://rearm-probe")
        push.send(codec.encode(Ping(payload=b"heard")))
        try:
            return inbox.rearmed, await asyncio.wait_for(inbox.get(), 10)
        finally:
            push.close(linger=0)
            inbox.close()

    rearmed, msg = uvloop.run(rearm_twice())
    assert rearmed == 0 and "removed by someone else" not in caplog.text
    assert msg == Ping(payload=b"heard")  # re-armed, it still hears its socket
