"""Detokenizer cost per token: DetokRequestState.process (seq check, decoding, 2 stop strings with
hold-back, the TextDelta) vs a bare `DecodeStream.step` per token on the same token stream, same run,
same loop shape. Every decoding method is measured; the budget applies to the tokenizer's default one.

Budget (DESIGN §9): process <= 1.2x the raw DecodeStream cost per token.
Usage: python scripts/bench_detok.py [--tokens 3000] [--repeats 5] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from actors.detokenizer.incremental import METHODS, IncrementalDetokenizer
from actors.detokenizer.request_state import DetokRequestState
from gpu.loading.convert import DEFAULT_MODEL_NAME, cache_dir
from messages.sampling_params import SamplingParams
from messages.wire import AddRequest, RequestOutput

BUDGET = 1.2
PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog, and then it writes a short report about the weather. ",
    "Streaming text must never split a character: 🤗🚀 emoji, 中文测试，世界你好 and 日本語のテキスト. ",
    "Numbers like 3.14159 and 2025-11-21 are tokenized one digit at a time; punctuation (!?) too. ",
    "Les élèves étudient la physique — naïve café déjà vu. Ελληνικά και русский текст тоже. 👍🏽✨\n",
]


def default_tokenizer_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME / "tokenizer.json"


def token_stream(tok: Tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode("".join(PARAGRAPHS)).ids
    return ids[:n]


def run_raw(tok: Tokenizer, prompt: list[int], ids: list[int], batch: int) -> float:
    streams = [DecodeStream(ids=prompt, skip_special_tokens=True) for _ in range(batch)]
    steps = [[(s, tid) for s in streams] for tid in ids]
    t0 = time.perf_counter()
    for pairs in steps:  # the same loop shape as run_process, a direct C call per token
        for s, tid in pairs:
            s.step(tok, tid)
    return time.perf_counter() - t0


def run_process(tok: Tokenizer, prompt: list[int], ids: list[int], batch: int, method: str) -> float:
    params = SamplingParams(max_tokens=len(ids), stop=["\n\nUser:", "###"])
    states = [
        DetokRequestState(AddRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params), tok, method=method)
        for i in range(batch)
    ]
    last = len(ids) - 1
    steps = [
        [
            (st, RequestOutput(request_id=st.request_id, seq=k, new_token_ids=[tid], finish_reason=None))
            if k < last
            else (st, RequestOutput(request_id=st.request_id, seq=k, new_token_ids=[tid], finish_reason="length"))
            for st in states
        ]
        for k, tid in enumerate(ids)
    ]
    t0 = time.perf_counter()
    for pairs in steps:
        for st, out in pairs:
            st.process(out)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", type=Path, default=default_tokenizer_path())
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer))
    prompt = tok.encode("<|im_start|>user\nWrite a long multilingual story.<|im_end|>\n<|im_start|>assistant\n").ids
    ids = token_stream(tok, args.tokens)
    default = IncrementalDetokenizer(tok, prompt).method
    print(f"{len(ids)} tokens of mixed English/emoji/CJK text, prompt {len(prompt)} tokens, min of {args.repeats} runs")
    worst = 0.0
    for batch in (1, 64):
        tokens = len(ids) * batch
        best = dict.fromkeys(("raw", *METHODS), float("inf"))
        for _ in range(args.repeats):  # interleaved, so that machine load hits all alike
            gc.collect()
            best["raw"] = min(best["raw"], run_raw(tok, prompt, ids, batch) / tokens)
            for method in METHODS:
                gc.collect()
                best[method] = min(best[method], run_process(tok, prompt, ids, batch, method) / tokens)
        raw = best["raw"]
        print(f"batch {batch:>3}: raw DecodeStream.step {raw * 1e6:6.2f} us/token")
        for method in METHODS:
            ratio = best[method] / raw
            print(f"    process, method={method:<13} {best[method] * 1e6:6.2f} us/token  ratio {ratio:5.2f}x")
        worst = max(worst, best[default] / raw)
    verdict = "OK" if worst <= BUDGET else "OVER"
    print(f"default method for this tokenizer ({default}): budget <= {BUDGET}x {verdict} (worst {worst:.2f}x)")


if __name__ == "__main__":
    main()
