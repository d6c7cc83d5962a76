"""Prefix caching over HTTP against vLLM's CPU build: the same chat workloads, the same client, one run.

    python scripts/bench_prefix_peers.py [--vllm ~/peers/vllm/bin/vllm] [--no-vllm-off]

Servers, each started alone (they would share these few cores): Sluice with caching on and off, vLLM with its
prefix caching on and off. Every request is a streaming chat completion (greedy, ignore_eos) whose prompt the
server renders with the model's chat template, as a chat client sends it:

1. A cached prefix: a `--prefix-words`-word system prompt asked one question, then another: the second's time to
   first token (three fresh system prompts, median).
2. A shared system prompt: `--users` different questions on one `--prefix-words`-word system prompt, `--concurrency`
   at a time: mean TTFT and output tok/s.
3. Multi-turn chats: `--chats` conversations at once, `--turns` turns each, every turn re-sending the whole
   conversation (a 200-word system prompt, the questions and the answers so far): mean TTFT and output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend.bench_serve import first_model, random_prompts, sse_data
from gpu.loading.convert import default_model_dir
from scripts.bench_peers import NO_VLLM, machine, server_arguments, serving, sluice_command, vllm_command

ROWS = (  # (label, result key)
    ("cached prefix: TTFT s (median of 3)", "prefix_ttft"),
    ("shared system prompt: mean TTFT s", "shared_ttft"),
    ("shared system prompt: output tok/s", "shared_tps"),
    ("multi-turn chats: mean TTFT s", "chat_ttft"),
    ("multi-turn chats: output tok/s", "chat_tps"),
)


class Client:
    """One server's chat endpoint: each call streams one greedy answer and returns (TTFT s, answer text)."""

    def __init__(self, session: aiohttp.ClientSession, port: int, model: str, max_tokens: int) -> None:
        self.session, self.url, self.max_tokens = session, f"http://127.0.0.1:{port}/v1/chat/completions", max_tokens
        self.model, self.seed = model, 0

    def words(self, n: int) -> str:
        self.seed += 1
        return random_prompts(1, n, self.seed)[0]

    async def ask(self, messages: list[dict], max_tokens: int | None = None) -> tuple[float, str]:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens or self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        start, first, text = time.perf_counter(), None, []
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for now, data in sse_data(resp.content):
                if data == b"[DONE]":
                    break
                for choice in msgspec.json.decode(data).get("choices", []):
                    if piece := choice["delta"].get("content"):
                        first = first or now - start
                        text.append(piece)
        return first, "".join(text)


async def cached_prefix(c: Client, words: int) -> float:
    times = []
    for _ in range(3):
        system = {"role": "system", "content": c.words(words)}
        await c.ask([system, {"role": "user", "content": c.words(16)}], max_tokens=1)
        times.append((await c.ask([system, {"role": "user", "content": c.words(16)}], max_tokens=1))[0])
    return statistics.median(times)


async def shared_system(c: Client, words: int, users: int, concurrency: int) -> tuple[float, float]:
    system, limit = {"role": "system", "content": c.words(words)}, asyncio.Semaphore(concurrency)
    questions = [c.words(32) for _ in range(users)]

    async def user(question: str) -> tuple[float, str]:
        async with limit:
            return await c.ask([system, {"role": "user", "content": question}])

    start = time.perf_counter()
    answers = await asyncio.gather(*(user(q) for q in questions))
    return statistics.mean(t for t, _ in answers), users * c.max_tokens / (time.perf_counter() - start)


async def chats(c: Client, n: int, turns: int) -> tuple[float, float]:
    system, firsts = c.words(200), []

    async def chat() -> None:
        history = [{"role": "system", "content": system}]
        for _ in range(turns):
            history.append({"role": "user", "content": c.words(30)})
            first, answer = await c.ask(history)
            firsts.append(first)
            history.append({"role": "assistant", "content": answer})

    start = time.perf_counter()
    await asyncio.gather(*(chat() for _ in range(n)))
    return statistics.mean(firsts), n * turns * c.max_tokens / (time.perf_counter() - start)


async def workload(args) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        base = f"http://127.0.0.1:{args.port}"
        c = Client(session, args.port, await first_model(session, base), args.max_tokens)
        await c.ask([{"role": "user", "content": c.words(16)}], max_tokens=2)  # warm-up
        result = {"prefix_ttft": await cached_prefix(c, args.prefix_words)}
        result["shared_ttft"], result["shared_tps"] = await shared_system(
            c, args.prefix_words, args.users, args.concurrency
        )
        result["chat_ttft"], result["chat_tps"] = await chats(c, args.chats, args.turns)
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_arguments(ap)
    ap.add_argument("--no-vllm-off", action="store_true", help="skip vLLM with its caching off (saves a startup)")
    ap.add_argument("--prefix-words", type=int, default=1000, help="~ tokens of the shared system prompt")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    model_dir = default_model_dir()
    print(f"# bench_prefix_peers {machine()}: {model_dir.name} fp32, chat endpoint, greedy, {args.max_tokens} out")
    sluice = sluice_command(args)
    servers = {"sluice on": (sluice, {}), "sluice off": ([*sluice, "--no-enable-prefix-caching"], {})}
    for on in (True, False) if not args.no_vllm_off else (True,):
        if vllm := vllm_command(args, model_dir, prefix_caching=on):
            servers[f"vllm {'on' if on else 'off'}"] = vllm
    if "vllm on" not in servers:
        print(NO_VLLM.format(args.vllm))
    results = {}
    for name, (cmd, env) in servers.items():
        with serving(name.replace(" ", "-"), cmd, env, args):
            results[name] = asyncio.run(workload(args))
        print(f"# {name}: {results[name]}", flush=True)
    names = list(results)
    pairs = [(a, b) for a, b in (("sluice on", "sluice off"), ("vllm on", "vllm off"), ("sluice on", "vllm on"))
             if a in results and b in results]  # fmt: skip
    print(f"\n{'':38s}" + "".join(f"{n:>12s}" for n in names) + "".join(f"{f'{a}/{b}':>22s}" for a, b in pairs))
    for label, key in ROWS:
        vals = "".join(f"{results[n][key]:12.3f}" for n in names)
        print(f"{label:38s}" + vals + "".join(f"{results[a][key] / results[b][key]:21.2f}x" for a, b in pairs))


if __name__ == "__main__":
    main()
