"""Per-step sampler time vs plain argmax (the floor) and a sort-based reference, measured in the same run.

    python scripts/bench_sampler.py [--quick] [--threads 1] [--logits peaked|flat] [--device cpu] [--unseeded]

Rows cycle through a mix of request parameters (greedy, top-p, top-k + top-p, temperature only, min-p,
penalties + bias, seeded). B = 1 is timed per kind of row instead, each labelled: a greedy row (the sampler's
all-greedy batch: an argmax and a return), a top-p row (T 0.8, top_p 0.95) and a temperature-only row (T 1.0,
untruncated: drawn over the whole vocabulary). "peaked" logits imitate a language model (Zipf-like ranks; nucleus sizes close to SmolLM2's: at T = 1, top_p = 0.95 median 12 / p90 400 tokens, 15 % of rows wider than 256); "flat" is N(0, 3^2), where T = 1 nuclei are thousands wide.
The reference is the textbook path: sort -> softmax -> cumsum -> mask -> torch.multinomial.
On CUDA with FlashInfer installed, unseeded batches (--unseeded drops the seeded row from the mix) are drawn by
FlashInfer's kernel; the `torch` column then times the same batch through the torch path.
The `sampler` column is the window path (sort_free="off"); `sort-free` times the sampler with the threshold-search
draw (gpu/sampling/threshold.py) instead, and `draw` that draw alone (row maxima included, uniforms given): its Triton
kernel on CUDA, its torch form elsewhere (`--sort-free torch|triton` picks; triton on CPU needs TRITON_INTERPRET=1: no
speed claims). On CUDA `fused` times the default sampler there (gpu/sampling/fused_triton.py: every processor, the
draw and the logprobs in a few launches), its metadata built with the edits table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.sampling import Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.topk_topp import flashinfer_available, uniforms
from messages.sampling_params import SamplingParams as SP

MIX = [
    SP(temperature=0.0),
    SP(temperature=0.7, top_p=0.9),
    SP(temperature=0.8, top_k=50, top_p=0.95),
    SP(temperature=1.0),
    SP(temperature=0.7, min_p=0.05),
    SP(temperature=0.9, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2),
    SP(temperature=0.0, logit_bias={11: 5.0, 12: -100.0}, frequency_penalty=0.5),
    SP(temperature=0.7, top_k=40, seed=7),
]


SINGLE = {"greedy": MIX[0], "top-p": SP(temperature=0.8, top_p=0.95), "T only": SP(temperature=1.0)}  # B = 1


def make_rows(b: int, device, unseeded: bool = False) -> list[SamplingRow]:
    mix = [p for p in MIX if not (unseeded and p.seed is not None)]
    return [row(mix[i % len(mix)]) for i in range(b)]


def row(params: SP) -> SamplingRow:
    return SamplingRow(params, list(range(100, 400)), list(range(500, 564)), eos_token_ids=[2])


def cases(b: int, device, unseeded: bool) -> list[tuple[str, list[SamplingRow]]]:
    """(label, rows) timed at batch size b: each kind of row alone at B = 1, the mix above."""
    if b == 1:
        return [(label, [row(params)]) for label, params in SINGLE.items()]
    return [("mix", make_rows(b, device, unseeded))]


def make_logits(b: int, v: int, kind: str, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return (3.0 * torch.randn(b, v, generator=g)).to(device)
    # Zipf-like: the logit of the rank-r token falls like -a log r (SmolLM2's do, with a ~ 1.7), some rows boost
    # their top token; token ids are a random permutation of the ranks.
    rank = torch.arange(1, v + 1, dtype=torch.float32)
    a = 1.25 + 1.0 * torch.rand(b, 1, generator=g)
    x = -a * rank.log() - 20.0 * (rank / v) ** 4 + 0.3 * torch.randn(b, v, generator=g)
    x[:, 0] += 4.0 * torch.empty(b).exponential_(generator=g) * (torch.rand(b, generator=g) < 0.55)
    perm = torch.randperm(v, generator=g)
    shifts = torch.randint(0, v, (b, 1), generator=g)
    return (x.gather(1, (perm + shifts) % v) + 20.0).to(device)


def reference(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sort -> softmax -> cumsum -> mask -> multinomial over the whole batch (penalties etc. left out)."""
    t = torch.tensor([r.params.temperature or 1.0 for r in rows], device=x.device)[:, None]
    k = torch.tensor([r.params.top_k if r.params.top_k > 0 else x.shape[1] for r in rows], device=x.device)
    p = torch.tensor([r.params.top_p for r in rows], device=x.device)[:, None]
    values, ids = (x / t).sort(-1, descending=True)
    probs = values.softmax(-1)
    cum = probs.cumsum(-1)
    keep = (cum - probs < p) & (torch.arange(x.shape[1], device=x.device) < k[:, None])
    choice = torch.multinomial(probs * keep, 1)
    return ids.gather(1, choice).squeeze(1)


def timed(fns: dict, base: torch.Tensor, reps: int, stat=statistics.median) -> dict[str, float]:
    """Seconds of each fn(logits) (median, or `stat`), interleaved so that load on a shared machine hits them
    alike; each call gets a fresh copy of the logits (the sampler works in place)."""
    x = base.clone()
    times = {name: [] for name in fns}
    for _ in range(reps + 1):
        for name, fn in fns.items():
            x.copy_(base)
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {name: stat(t[1:]) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B in {1, 32}, V = 128256, fewer repetitions")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--logits", choices=["peaked", "flat"], default="peaked")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) sort-based reference")
    ap.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    ap.add_argument("--vocabs", type=int, nargs="*", help="override the vocabulary sizes")
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="min: best of the repetitions")
    ap.add_argument("--unseeded", action="store_true", help="leave the seeded row out of the mix")
    ap.add_argument("--sort-free", choices=["torch", "triton"], help="the sort-free draw timed (default: by device)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches, vocabs = ([1, 32], [128256]) if args.quick else ([1, 8, 32, 128, 256], [49152, 128256, 151936])
    batches, vocabs = args.batches or batches, args.vocabs or vocabs
    sort_free_kind = args.sort_free or ("triton" if args.device.startswith("cuda") else "torch")
    sampler, torch_sampler = (
        Sampler(sort_free="off", fused=False),
        Sampler(flashinfer=False, sort_free="off", fused=False),
    )
    sort_free, fused = Sampler(flashinfer=False, sort_free=sort_free_kind, fused=False), Sampler(fused=True)
    on_cuda = args.device.startswith("cuda")
    stat = min if args.stat == "min" else statistics.median
    flashinfer = flashinfer_available(torch.empty(0, device=args.device))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"device={args.device} ({where}) threads={args.threads} logits={args.logits} flashinfer={flashinfer} "
          f"sort-free={sort_free_kind}; ms per step ({args.stat})")  # fmt: skip
    print(
        f"{'B':>4} {'rows':>7} {'V':>7} {'argmax':>9} {'sampler':>9} {'ratio':>6} {'sort-free':>9} {'ratio':>6}"
        f" {'draw':>9} {'ratio':>6} {'reference':>10} {'ref/argmax':>10} {'build':>7}"
        + (f" {'torch':>9} {'torch/argmax':>12}" if flashinfer else "")
        + (f" {'fused':>9} {'ratio':>6}" if on_cuda else "")
    )
    for v, b in ((v, b) for v in vocabs for b in batches):
        for label, rows in cases(b, args.device, args.unseeded):
            reps = 5 if args.quick or b * v > 8_000_000 else 11
            base = make_logits(b, v, args.logits, args.device)
            t0 = time.perf_counter()
            meta = SamplingMetadata.build(rows, v, args.device)
            build = time.perf_counter() - t0
            u = uniforms(b, meta.seeded_rows, meta.seeds, meta.positions)
            cols = torch.cat([meta.params, u[:, None], torch.zeros_like(u)[:, None]], 1)
            draw = sort_free.sort_free_draw(base)
            fns = {
                "argmax": lambda x: x.argmax(-1),
                "sampler": lambda x, m=meta: sampler(x, m),
                "sort-free": lambda x, m=meta: sort_free(x, m),
                "draw": lambda x, m=meta, c=cols, d=draw: d(x, x.amax(-1), c, m),
            }
            if flashinfer:
                fns["torch"] = lambda x, m=meta: torch_sampler(x, m)
            if on_cuda:
                fns["fused"] = lambda x, m=SamplingMetadata.build(rows, v, args.device, edits=True): fused(x, m)
            t = timed(fns, base, reps, stat)
            t_argmax, t_sampler, t_free, t_draw = t["argmax"], t["sampler"], t["sort-free"], t["draw"]
            ref_fn = {"ref": lambda x, r=rows: reference(x, r)}
            ref = "-" if args.no_reference else timed(ref_fn, base, min(reps, 3), stat)["ref"] * 1e3
            ref_ratio = "-" if args.no_reference else f"{ref / (t_argmax * 1e3):.0f}x"
            ref = ref if isinstance(ref, str) else f"{ref:.2f}"
            print(
                f"{b:>4} {label:>7} {v:>7} {t_argmax * 1e3:>9.3f} {t_sampler * 1e3:>9.3f} {t_sampler / t_argmax:>5.2f}x"
                f" {t_free * 1e3:>9.3f} {t_free / t_argmax:>5.2f}x {t_draw * 1e3:>9.3f} {t_draw / t_argmax:>5.2f}x {ref:>10} {ref_ratio:>10} {build * 1e3:>7.2f}"
                + (f" {t['torch'] * 1e3:>9.3f} {t['torch'] / t_argmax:>11.2f}x" if flashinfer else "")
                + (f" {t['fused'] * 1e3:>9.3f} {t['fused'] / t_argmax:>5.2f}x" if on_cuda else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
