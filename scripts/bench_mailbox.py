"""Mailbox throughput and latency: an actor pair in two processes vs raw pyzmq in the same run.

    python scripts/bench_mailbox.py [--quick] [--repeats 3]

Throughput: a one-way stream of n messages from an actor in process A to an actor in process B
(timed from the first send to the last message handled) vs two blocking pyzmq processes, PUSH ->
PULL, sending the same encoded bytes ("raw") and encoding + decoding every message
("raw+msgspec", so the serialization share is visible). Latency: `Actor.ask(Ping)` round trips vs
a raw ping-pong over a PUSH/PULL pair each way. Payloads: a Probe with 16 bytes and StepOutputs
with 64 and 256 one-token entries (a Ping carries the step message's encoded size in bytes).
Repeats are interleaved; each figure is the best of the repeats (the machine is shared).
Budget (DESIGN §9): actor throughput >= 0.7x raw pyzmq.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

import msgspec
import uvloop
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_actors import make_message, raw_worker  # scripts/ is sys.path[0] when run as a script

from actors.runtime import Actor, ActorSpec, ActorSystem, ProcessSpec, RestartPolicy
from actors.runtime.router import make_rundir, remove_rundir
from messages.codec import Codec
from messages.wire import CheckIdle, Probe

BUDGET = 0.7
KINDS = ("small", "step64", "step256")
STREAM_N = {"small": 40_000, "step64": 6_000, "step256": 2_000}
PING_N = 2_000
VARIANTS = ("actor", "raw", "raw+msgspec")
ACTORS = [
    ProcessSpec(
        name="bench-a", actors=[ActorSpec(name="driver", factory="bench_actors:Driver", kwargs={"target": "sink"})]
    ),
    ProcessSpec(name="bench-b", actors=[ActorSpec(name="sink", factory="bench_actors:Sink")]),
]
QUIET = RestartPolicy(heartbeat_s=3600)  # no heartbeat Pings in the measurements
TIMEOUT = 120.0


class RawPair:
    """Two raw_worker processes, A and B, each with a PULL socket and a PUSH to the other."""

    def __init__(self):
        self.rundir = make_rundir()
        ctx = multiprocessing.get_context("spawn")
        a, b = f"ipc://{self.rundir}/a", f"ipc://{self.rundir}/b"
        self.conns, self.procs = [], []
        for bind, connect in ((a, b), (b, a)):
            parent, child = ctx.Pipe()
            self.procs.append(ctx.Process(target=raw_worker, args=(child, bind, connect), daemon=True))
            self.procs[-1].start()
            self.conns.append(parent)
        assert [c.recv() for c in self.conns] == ["ready", "ready"]

    def run(self, op_a: str, op_b: str, kind: str, n: int, serialize: bool) -> tuple[dict, dict]:
        conn_a, conn_b = self.conns
        conn_b.send((op_b, kind, n, serialize))  # the receiver is waiting before the sender starts
        conn_a.send((op_a, kind, n, serialize))
        return conn_a.recv(), conn_b.recv()

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            conn.send(None)
            proc.join(5)
        remove_rundir(self.rundir)


async def actor_run(ctl: Actor, op: str, kind: str, n: int) -> tuple[dict, dict]:
    """Start `op` on the driver; the driver's and the sink's reports arrive once it is done."""
    ctl.tell("driver", Probe(seq=n, payload=f"{op} {kind}".encode()))
    driver = asyncio.ensure_future(ctl.ask("driver", CheckIdle(), timeout=TIMEOUT))
    sink = asyncio.ensure_future(ctl.ask("sink", CheckIdle(), timeout=TIMEOUT)) if op == "stream" else None
    return (await driver).details, (await sink).details if sink else {}


def rate(n: int, sent: dict, received: dict) -> float:
    return n / ((received["t_last"] - sent["t0"]) / 1e9)


async def measure(args) -> tuple[dict, dict]:
    """Best-of-repeats {(kind, variant): msgs/s} and {(kind, variant): {"p50", "p99"} in µs}."""
    scale = 0.25 if args.quick else 1.0
    tput: dict[tuple[str, str], float] = {}
    rtt: dict[tuple[str, str], dict[str, float]] = {}
    raw, ctl = RawPair(), Actor("bench")
    try:
        async with ActorSystem(ACTORS, local=[ctl], policy=QUIET, log_level="WARNING"):
            for _ in range(args.repeats):
                for kind in KINDS:
                    n = int(STREAM_N[kind] * scale)
                    driver, sink = await actor_run(ctl, "stream", kind, n)
                    assert sink["count"] == n, f"sink got {sink['count']} of {n}"
                    got = {"actor": rate(n, driver, sink)}
                    for variant in VARIANTS[1:]:
                        got[variant] = rate(n, *raw.run("send", "recv", kind, n, variant == "raw+msgspec"))
                    for variant, value in got.items():
                        tput[kind, variant] = max(value, tput.get((kind, variant), 0.0))
                for kind in ("small", "step256"):
                    n = int(PING_N * scale)
                    got = {"actor": (await actor_run(ctl, "ping", kind, n))[0]}
                    for variant in VARIANTS[1:]:
                        got[variant] = raw.run("ping", "pong", kind, n, variant == "raw+msgspec")[0]
                    for variant, stats in got.items():
                        best = rtt.setdefault((kind, variant), {"p50": float("inf"), "p99": float("inf")})
                        for q in best:
                            best[q] = min(best[q], stats[q] / 1e3)
    finally:
        raw.close()
    return tput, rtt


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cpus"


def report(tput: dict, rtt: dict, args, load: float, seconds: float) -> None:
    size = {kind: len(Codec().encode(make_message(kind))) for kind in KINDS}
    print(
        f"# bench_mailbox {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, load {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(
        f"# best of {args.repeats} interleaved repeats, {seconds:.0f} s; python {platform.python_version()}, ", end=""
    )
    print(
        f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), msgspec {msgspec.__version__}, uvloop {uvloop.__version__}"
    )
    print("\nthroughput, one-way over ipc://, messages/s")
    print(
        f"{'payload':8} {'bytes':>6} {'actor':>9} {'raw':>9} {'raw+msgspec':>12} {'actor/raw':>10} {'actor/raw+msgspec':>18}"
    )
    for kind in KINDS:
        actor, raw, ser = (tput[kind, v] for v in VARIANTS)
        print(
            f"{kind:8} {size[kind]:6d} {actor:9,.0f} {raw:9,.0f} {ser:12,.0f} {actor / raw:10.2f} {actor / ser:18.2f}"
        )
    print("\nround trip (ping-pong), µs p50 / p99")
    print(f"{'payload':8} {'bytes':>6} {'actor':>13} {'raw':>13} {'raw+msgspec':>13} {'actor/raw p50':>14}")
    for kind in ("small", "step256"):
        cells = [f"{rtt[kind, v]['p50']:5.0f} / {rtt[kind, v]['p99']:5.0f}" for v in VARIANTS]
        ratio = rtt[kind, "actor"]["p50"] / rtt[kind, "raw"]["p50"]
        print(f"{kind:8} {size[kind]:6d} {cells[0]:>13} {cells[1]:>13} {cells[2]:>13} {ratio:14.2f}")
    for baseline in VARIANTS[1:]:
        missed = [kind for kind in KINDS if tput[kind, "actor"] < BUDGET * tput[kind, baseline]]
        verdict = f"MISSED by {', '.join(missed)}" if missed else "met"
        print(f"\nbudget: actor throughput >= {BUDGET}x {baseline}: {verdict}", end="")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a quarter of the messages (about 20 s)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load, start = os.getloadavg()[0], time.monotonic()
    tput, rtt = asyncio.run(measure(args))
    report(tput, rtt, args, load, time.monotonic() - start)


if __name__ == "__main__":
    main()
