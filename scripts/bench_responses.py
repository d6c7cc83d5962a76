"""The Responses API's cost: its per-request latency against chat completions' for the same conversation and
parameters, in one server in the same run (rounds alternate the endpoints, so drift hits both alike), stored and not;
and the store's write and read cost per response, measured on the store alone.

    python scripts/bench_responses.py [--model DIR] [--requests 200] [--concurrency 1 8] [--max-tokens 8]

Greedy, short outputs (the overhead is per request, not per token); the median and p90 latency of each endpoint
at each concurrency, and the ratio of medians against chat's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import openai

from actors.engine.config import EngineConfig
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from frontend.preflight import resolve_model
from frontend.responses_api.store import ResponseStore

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers of Europe."}]


async def timed(call) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


async def endpoints(client: openai.AsyncOpenAI, max_tokens: int) -> dict:
    return {
        "chat": lambda: client.chat.completions.create(
            model="", messages=CONVO, temperature=0, max_completion_tokens=max_tokens
        ),
        "responses": lambda: client.responses.create(
            model="", input=CONVO, temperature=0, max_output_tokens=max_tokens
        ),
        "responses, store=false": lambda: client.responses.create(
            model="", input=CONVO, temperature=0, max_output_tokens=max_tokens, store=False
        ),
    }


async def serving(args: argparse.Namespace, db: Path) -> None:
    model = resolve_model(args.model)
    engine = EngineConfig(model=str(model.path), max_model_len=1024, max_num_seqs=max(args.concurrency))
    server = await start_server(engine, HttpConfig(port=0, responses_db=str(db)), log_level="WARNING")
    try:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
            calls = await endpoints(client, args.max_tokens)
            for call in calls.values():  # warm up
                await call()
            for concurrency in args.concurrency:
                times: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(args.requests // concurrency):
                    for name, call in calls.items():
                        times[name] += await asyncio.gather(*(timed(call) for _ in range(concurrency)))
                base = statistics.median(times["chat"])
                print(f"\nconcurrency {concurrency}, {args.requests} requests each, {args.max_tokens} output tokens")
                for name, ts in times.items():
                    med, p90 = statistics.median(ts), statistics.quantiles(ts, n=10)[-1]
                    print(f"  {name:24s} median {med * 1e3:7.2f} ms  p90 {p90 * 1e3:7.2f} ms  ({med / base:.3f}x chat)")
    finally:
        await server.stop()


async def store_cost(db: Path, writes: int) -> None:
    store = ResponseStore(db, max_stored=writes // 2, max_age_s=3600)
    await store.open()
    item = {"type": "message", "id": "msg_x", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "word " * 100, "annotations": [], "logprobs": []}]}  # fmt: skip
    response = {"id": "", "object": "response", "status": "completed", "output": [item]}
    conversation = [{"type": "message", "id": "msg_y", "role": "user", "content": [{"type": "input_text",
                     "text": "word " * 200}]}]  # fmt: skip
    start = time.perf_counter()
    for i in range(writes):
        await store.put(f"resp_{i}", response | {"id": f"resp_{i}"}, conversation)
    write = (time.perf_counter() - start) / writes
    start = time.perf_counter()
    for i in range(writes // 2, writes):
        assert await store.conversation(f"resp_{i}", with_output=True) is not None
    read = (time.perf_counter() - start) / (writes - writes // 2)
    await store.close()
    print(f"\nstore: {write * 1e6:.0f} us per write (a ~3 KB response, evicting past {writes // 2} rows), "
          f"{read * 1e6:.0f} us per read, awaited from the event loop")  # fmt: skip


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--store-writes", type=int, default=2000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        await serving(args, Path(tmp) / "serving.sqlite3")
        await store_cost(Path(tmp) / "store.sqlite3", args.store_writes)


if __name__ == "__main__":
    asyncio.run(main())
