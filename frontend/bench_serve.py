"""Load generator for any OpenAI-compatible server (`sluice bench serve`), metrics as in `vllm bench serve`.

TTFT: send -> first chunk carrying text. ITL: every later gap between chunks with choices, pooled over
requests. E2E: send -> last chunk with choices. TPOT per request: (E2E - TTFT) / (output_tokens - 1).
With --server-pid (a server on this machine): the CPU its process tree spent during the timed run, per process
title, in cores and microseconds per output token (frontend/process_cpu.py).
"""

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec
import numpy as np
import uvloop

from frontend.process_cpu import cpu_report, tree_cpu

# Each word is one token after a space in common BPE vocabularies (checked on SmolLM2), so N words ~ N tokens.
WORDS = (  # noqa: SIM905
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water "
    "room mother area money story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community name president team "
    "minute idea kid body information back parent face others level office door health person art war history "
    "party result change morning reason research girl guy moment air teacher force education"
).split()
PERCENTILES = (50, 90, 99)
STAT_LABELS = {"mean": "Mean", "p50": "Median", "p90": "P90", "p99": "P99"}


@dataclass
class RequestOutput:
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def random_prompts(num: int, input_len: int, seed: int) -> list[str]:
    rng = np.random.default_rng([seed, 0])
    return [" ".join(WORDS[i] for i in rng.integers(len(WORDS), size=input_len)) for _ in range(num)]


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send offsets in seconds: Gamma(shape=burstiness) gaps (Poisson at 1), rescaled to span num/rate exactly."""
    if math.isinf(rate):
        return np.zeros(num)
    rng = np.random.default_rng([seed, 1])
    offsets = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num))
    return offsets * (num / rate / offsets[-1])


def _error_message(error) -> str:
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


async def sse_data(content: aiohttp.StreamReader):
    """Yield (arrival time, payload) for each `data:` line; one await per network read, not per line."""
    tail = b""
    async for block in content.iter_any():
        now = time.perf_counter()
        *lines, tail = (tail + block).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):  # skips blank separators, SSE comments and other fields
                yield now, line[5:].strip()


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, chat: bool) -> RequestOutput:
    out = RequestOutput()
    text_chunks, done = 0, False
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for now, data in sse_data(resp.content):
                if done := data == b"[DONE]":
                    break
                chunk = msgspec.json.decode(data)
                if error := chunk.get("error"):
                    out.error = _error_message(error)
                    return out
                if usage := chunk.get("usage"):
                    out.prompt_tokens = usage.get("prompt_tokens") or 0
                    out.output_tokens = usage.get("completion_tokens") or 0
                if choices := chunk.get("choices"):
                    text = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
                    if out.ttft:
                        out.itl.append(now - last)
                    elif text:
                        out.ttft = now - start
                    else:  # e.g. a role-only chat chunk before the first token
                        continue
                    last = now
                    text_chunks += bool(text)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if not (done and out.ttft):
        out.error = "stream ended before [DONE]" if out.ttft else "stream ended without any output text"
        return out
    out.success = True
    out.latency = last - start
    out.output_tokens = out.output_tokens or text_chunks  # servers that omit the usage chunk
    return out


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    arr = np.asarray(values or [0.0]) * scale
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(outputs: list[RequestOutput], duration: float, input_len: int) -> dict:
    ok = [o for o in outputs if o.success]
    errors = list(dict.fromkeys(o.error for o in outputs if not o.success))
    input_tokens = sum(o.prompt_tokens or input_len for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    return {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats([o.ttft for o in ok]),
        "tpot_ms": _stats([(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]),
        "itl_ms": _stats([gap for o in ok for gap in o.itl]),
        "e2el_ms": _stats([o.latency for o in ok]),
    }


def format_table(result: dict) -> str:
    def row(name, value):
        return f"{name:<40} {value:.2f}" if isinstance(value, float) else f"{name:<40} {value}"

    cfg = result["config"]
    lines = [
        f"{' Serving Benchmark Result ':=^50}",
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
        *(f"  error: {e}" for e in result["errors"]),
        row("Request rate (req/s):", cfg["request_rate"]),
        row("Maximum request concurrency:", cfg["concurrency"]),
        row("Peak concurrent requests:", result["peak_concurrency"]),
        row("Benchmark duration (s):", result["duration_s"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
        row("Output token throughput (tok/s):", result["output_throughput"]),
        row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for key, short, title in (
        ("ttft_ms", "TTFT", "Time to First Token"),
        ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "ITL", "Inter-token Latency"),
        ("e2el_ms", "E2EL", "End-to-end Latency"),
    ):
        lines.append(f"{title:-^50}")
        lines += [row(f"{STAT_LABELS[name]} {short} (ms):", v) for name, v in result[key].items()]
    if "server_cpu" in result:
        lines.append(f"{'Server CPU (cores, us per output token)':-^50}")
        lines += [f"{t:<30} {s['cores']:>6.2f} {s['us_per_token']:>12.1f}" for t, s in result["server_cpu"].items()]
    lines.append("=" * 50)
    return "\n".join(lines)


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by `args` (see add_arguments), print the table and return the result."""
    base_url = args.base_url.rstrip("/")
    chat = args.endpoint.endswith("chat/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # The semaphore is the only cap on in-flight requests: aiohttp's default pool stops at 100 connections.
    session = aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=6 * 3600)
    )
    async with session:
        model = args.model or await first_model(session, base_url)
        limit = asyncio.Semaphore(args.concurrency or args.num_prompts + args.warmup)
        in_flight = peak = 0

        async def limited(prompt: str) -> RequestOutput:
            nonlocal in_flight, peak
            body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
            body |= {
                "model": model,
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with limit:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await send_request(session, base_url + args.endpoint, body, chat)
                finally:
                    in_flight -= 1

        prompts = random_prompts(args.warmup + args.num_prompts, args.input_len, args.seed)
        warm = await asyncio.gather(*(limited(p) for p in prompts[: args.warmup]))
        if failed := [o.error for o in warm if not o.success]:
            raise RuntimeError(f"warmup request failed: {failed[0]}")
        peak = 0

        offsets = arrival_times(args.num_prompts, args.request_rate, args.burstiness, args.seed)
        tasks = []
        cpu = tree_cpu(args.server_pid) if args.server_pid else None
        start = time.perf_counter()
        for prompt, offset in zip(prompts[args.warmup :], offsets, strict=True):
            if (delay := start + offset - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(prompt)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu_after = tree_cpu(args.server_pid) if args.server_pid else None

    result = summarize(outputs, duration, args.input_len)
    result["peak_concurrency"] = peak
    if cpu is not None:
        result["server_cpu"] = cpu_report(cpu, cpu_after, duration, result["total_output_tokens"])
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    echoed = ("endpoint", "concurrency", "burstiness", "num_prompts", "input_len", "output_len", "seed", "warmup")
    result["config"] = {"base_url": base_url, "model": model, "request_rate": rate}
    result["config"] |= {k: getattr(args, k) for k in echoed}
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    parser.add_argument("--concurrency", type=int, default=None, help="max in-flight requests (default: unlimited)")
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals; inf = all at t=0"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrival gaps; 1 = Poisson")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens, with ignore_eos")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--warmup", type=int, default=0, help="untimed requests sent before the benchmark")
    parser.add_argument("--server-pid", type=int, default=None, help="a local server's pid: report its CPU")
    parser.add_argument("--json", default=None, metavar="FILE", help="save the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = add_arguments(argparse.ArgumentParser(description=__doc__)).parse_args(argv)
    return uvloop.run(run(args))
