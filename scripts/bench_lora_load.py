"""Loading a LoRA adapter while serving (issue 51's targets: <= 50 ms for SmolLM2's rank-16 adapter, and no stream's
inter-token gap grows by more than one step during a load). The whole server on SmolLM2-135M with
--enable-lora-runtime-updates and --max-cpu-loras 2; 8 greedy streams of the base model run throughout; meanwhile
a rank-16 adapter on all seven projections is loaded (`POST /v1/load_lora_adapter`: every replica checks it) and a
request of it sent, then `--loads` - 1 more the same way (the oldest's slot taken: --max-cpu-loras). Printed: the
load call's latency, the adapter's first request's time to its first token (the worker reads the adapter from disk
on a thread of its own, then installs it between steps) against a held adapter's, and the streams' inter-token gaps
while loading against their median.

    python scripts/bench_lora_load.py [--streams 8] [--threads 2] [--loads 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.config import EngineConfig, LoraConfig
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from gpu.loading.config import ModelConfig
from gpu.loading.convert import default_model_dir
from scripts.bench_lora import make_adapters

KEY = "bench-key"


async def stream(client, gaps: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """A base-model stream until `stop`: (time, gap since its previous token) for each token."""
    while not stop.is_set():
        out = await client.completions.create(model="base", prompt="Once upon a time", max_tokens=200, stream=True,
                                              temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
        last = None
        async for _ in out:
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            last = now


async def first_token_s(client, model: str) -> float:
    start = time.perf_counter()
    out = await client.completions.create(model=model, prompt="Hello", max_tokens=2, stream=True, temperature=0.0)
    async for _ in out:
        return time.perf_counter() - start
    return float("nan")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--loads", type=int, default=6, help="adapters loaded in turn (medians printed at the end)")
    args = p.parse_args()
    model = ModelConfig.from_path(default_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        made = make_adapters(model.path, Path(tmp), 16, args.loads + 1)
        lora = LoraConfig(modules=[made[0]], max_loras=2, max_cpu_loras=2)
        engine = EngineConfig(model=str(model.path), max_num_seqs=16, max_model_len=512, num_kv_blocks=512,
                              engine_threads=args.threads, lora=lora)  # fmt: skip
        http = HttpConfig(port=0, served_model_name=["base"], api_key=KEY, lora_runtime_updates=True)
        srv = await start_server(engine, http, log_level="WARNING")
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY)
        gaps, stop, rows = [], asyncio.Event(), []
        streams = [asyncio.create_task(stream(client, gaps, stop)) for _ in range(args.streams)]
        try:
            await asyncio.sleep(3.0)  # (the streams settle)
            held = statistics.median([await first_token_s(client, made[0].name) for _ in range(3)])
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
                for module in made[1:]:
                    start = time.perf_counter()
                    body = {"lora_name": module.name, "lora_path": module.path}
                    async with session.post(f"{srv.url}/v1/load_lora_adapter", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                    loaded = time.perf_counter()
                    ttft = await first_token_s(client, module.name)
                    end = time.perf_counter()
                    window = [g for t, g in gaps if start <= t <= end]
                    typical = statistics.median(g for t, g in gaps if t < start)
                    rows.append((loaded - start, ttft, max(window) - typical))
                    print(f"{module.name}: load call {1000 * (loaded - start):.1f} ms; its first request's first "
                          f"token {1000 * ttft:.1f} ms (a held adapter's: {1000 * held:.1f} ms); streams' gaps while "
                          f"loading: max {1000 * max(window):.1f} ms, median before {1000 * typical:.1f} ms")  # fmt: skip
                    await asyncio.sleep(2.0)
            calls, ttfts, growths = ([1000 * x for x in col] for col in zip(*rows, strict=True))
            print(f"median of {len(rows)} loads (the first's apart: {calls[0]:.1f} ms): load call "
                  f"{statistics.median(calls[1:] or calls):.1f} ms, first token {statistics.median(ttfts):.1f} ms, "
                  f"largest gap's growth {statistics.median(growths):.1f} ms")  # fmt: skip
        finally:
            stop.set()
            await asyncio.gather(*streams, return_exceptions=True)
            await client.close()
            await srv.stop()


if __name__ == "__main__":
    asyncio.run(main())
