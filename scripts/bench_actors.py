"""The two sides of scripts/bench_mailbox.py: an actor pair, and the raw pyzmq pair it is measured against.

Both sides send the same messages (`make_message`) and report the same statistics (`summarize`).
Actors are spawned as "bench_actors:Driver" / "bench_actors:Sink" (the launcher's sys.path, which
holds scripts/, is handed to spawned children).
"""

from __future__ import annotations

import time

import zmq

from actors.runtime import Actor
from messages.codec import Codec
from messages.wire import CheckIdle, IdleReport, Msg, Ping, Pong, Probe, RequestOutput, StepOutputs

END = -1  # Probe.seq of the marker closing a stream: it travels on the same link, so it arrives last
WARMUP = 200  # ping-pongs discarded before the timed ones


def make_message(kind: str) -> Msg:
    """kind "small": a Probe with 16 payload bytes; "stepN": a StepOutputs with N one-token RequestOutputs."""
    if kind == "small":
        return Probe(seq=1, payload=b"x" * 16)
    outputs = [
        RequestOutput(request_id=f"cmpl-{i:032x}", seq=100 + i, new_token_ids=[1000 + i])
        for i in range(int(kind.removeprefix("step")))
    ]
    return StepOutputs(step=1, outputs=outputs)


def ping_payload(kind: str) -> bytes:
    """A Ping carries bytes: the small probe's 16 bytes, or a step message's encoded size."""
    return b"x" * 16 if kind == "small" else Codec().encode(make_message(kind))


def summarize(rtts_ns: list[int]) -> dict[str, int]:
    rtts = sorted(rtts_ns)
    return {
        "n": len(rtts),
        "p50": rtts[len(rtts) // 2],
        "p99": rtts[len(rtts) * 99 // 100],
        "mean": sum(rtts) // len(rtts),
    }


class Reporter(Actor):
    """Answers a CheckIdle with its next result, whichever of the two comes first."""

    def __init__(self, target: str = ""):
        super().__init__()
        self.target = target
        self._asker: CheckIdle | None = None
        self._result: dict[str, int] | None = None

    def on_check(self, msg: CheckIdle) -> None:
        self._asker = msg
        self._flush()

    def report(self, result: dict[str, int]) -> None:
        self._result = result
        self._flush()

    def _flush(self) -> None:
        if self._asker is not None and self._result is not None:
            reply = IdleReport(corr_id=self._asker.corr_id, actor=self.name, details=self._result)
            self.tell(self._asker.reply_to, reply)
            self._asker = self._result = None


class Driver(Reporter):
    """On Probe(seq=n, payload=b"stream KIND" | b"ping KIND"): streams n messages to `target`,
    or runs n timed `ask(Ping)` round trips; reports {"t0"} or the RTT summary (ns)."""

    def handlers(self):
        return {Probe: self.on_command, CheckIdle: self.on_check}

    def on_command(self, msg: Probe) -> None:
        op, kind = msg.payload.decode().split()
        if op == "stream":
            self.report(self.stream(make_message(kind), msg.seq))
        else:
            self.spawn(self.ping_pong(ping_payload(kind), msg.seq))

    def stream(self, msg: Msg, n: int) -> dict[str, int]:
        t0 = time.monotonic_ns()
        for _ in range(n):
            self.tell(self.target, msg)
        self.tell(self.target, Probe(seq=END))
        return {"t0": t0}

    async def ping_pong(self, payload: bytes, n: int) -> None:
        rtts = []
        for _ in range(WARMUP + n):
            t0 = time.monotonic_ns()
            await self.ask(self.target, Ping(payload=payload))
            rtts.append(time.monotonic_ns() - t0)
        self.report(summarize(rtts[WARMUP:]))


class Sink(Reporter):
    """Counts streamed messages; at the END marker reports {"count", "t_last"} and starts over."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def handlers(self):
        return {Probe: self.on_probe, StepOutputs: self.on_step, CheckIdle: self.on_check}

    def on_step(self, msg: StepOutputs) -> None:
        self.count += 1

    def on_probe(self, msg: Probe) -> None:
        if msg.seq != END:
            self.count += 1
            return
        self.report({"count": self.count, "t_last": time.monotonic_ns()})
        self.count = 0


def raw_worker(conn, bind: str, connect: str) -> None:
    """One side of the raw baseline: blocking PULL at `bind`, PUSH to `connect`, the same socket
    options as the runtime. Commands (op, kind, n, serialize) arrive on the pipe `conn`; None stops.
    serialize=False sends pre-encoded bytes and never decodes; True encodes and decodes every message."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.setsockopt(zmq.RCVHWM, 0)
    push.setsockopt(zmq.SNDHWM, 0)
    pull.bind(bind)
    push.connect(connect)
    codec = Codec()
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        op, kind, n, serialize = cmd
        if op == "send":
            msg = make_message(kind)
            frame = codec.encode(msg)
            t0 = time.monotonic_ns()
            for _ in range(n):
                push.send(codec.encode(msg) if serialize else frame)
            conn.send({"t0": t0})
        elif op == "recv":
            for _ in range(n):
                frame = pull.recv()
                if serialize:
                    codec.decode(frame)
            conn.send({"t_last": time.monotonic_ns()})
        elif op == "ping":
            ping = Ping(corr_id=1, reply_to="driver", payload=ping_payload(kind))
            frame, rtts = codec.encode(ping), []
            for _ in range(WARMUP + n):
                t0 = time.monotonic_ns()
                push.send(codec.encode(ping) if serialize else frame)
                reply = pull.recv()
                if serialize:
                    codec.decode(reply)
                rtts.append(time.monotonic_ns() - t0)
            conn.send(summarize(rtts[WARMUP:]))
        else:  # pong
            frame = codec.encode(Pong(corr_id=1, payload=ping_payload(kind)))
            for _ in range(WARMUP + n):
                ping = pull.recv()
                if serialize:
                    ping = codec.decode(ping)
                    frame = codec.encode(Pong(corr_id=ping.corr_id, payload=ping.payload))
                push.send(frame)
            conn.send({})
    ctx.destroy(linger=0)
