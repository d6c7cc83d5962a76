"""Whether a chaos stream that left the fault-free run's tokens did so at a near-tie: a reference sampler over HF
transformers' logits (independent of the engine's forward and sampler), for scripts/chaos_check.py.

A greedy or seeded token is a function of its logits (and, seeded, of the uniform keyed by (seed, output position):
gpu/sampling/topk_topp.counter_uniforms, the key's definition). The fault-free and the faulty run compute a row's
logits in other batches (and after a preemption, kill or lost step, by a recompute; with speculation, in a
verification step): CPU matmuls are not batch-invariant, so the logits differ in their last bits (~5e-7 on the tiny
model). That moves a token only at a near-tie of the processed logits x (CFG combined: l_u + s (l_c - l_u)), with
every x free to move by up to a tolerance t:

| row     | near-tie: either token may be drawn                                                          |
|---------|----------------------------------------------------------------------------------------------|
| greedy  | x within t of the largest                                                                    |
| sampled | the k-th and (k+1)-th largest x within 2 t (which token top-k keeps), or u * total within    |
|         | 2 t / T * total of a boundary of the kept set's CDF (id order: DESIGN section 5)             |

t = TOL times the row's largest |x| (at least 1), times |1 - s| + s for a guided row. It bounds the batch numerics
(4.8e-7 at most on the tiny model: docs/performance-history.md, "Seeded draws and batch numerics") and the difference of
the engine's logits and HF's (fp32: on the tiny model this reference at 1e-7 allows exactly the token the engine drew at
each of the 5,505 positions of the test's fault-free run); at TOL = 1e-5 about 0.2 % of the seeded draws there allow two
tokens. `Reference.explain` checks a diverged stream from the first token it differs at: there both the fault-free run's
token and the stream's must be allowed (a near-tie), and every later token of the stream must be one the reference
allows after the stream's own prefix. Supported: what the chaos workload sends (temperature, top_k, seed,
guidance_scale; no top-p, min-p, penalties or constraints).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from gpu.sampling.topk_topp import counter_uniforms
from messages.sampling_params import SamplingParams

TOL = 1e-5
MAX_KEPT_SETS = 64  # kept sets tried when a tie at the top-k boundary leaves the kept set open


def allowed(x: np.ndarray, params: SamplingParams, u: float | None, tol: float) -> set[int]:
    """The tokens a row with processed logits x (float64) may draw when x moves by up to `tol` per entry; u: its
    uniform (None for a greedy row)."""
    if params.greedy:
        return set(np.flatnonzero(x >= x.max() - tol).tolist())
    k = params.top_k if 0 < params.top_k < len(x) else len(x)
    kth = np.partition(x, len(x) - k)[len(x) - k]
    sure = np.flatnonzero(x > kth + 2 * tol)
    near = np.flatnonzero(np.abs(x - kth) <= 2 * tol)  # kept or not, as the last bits fall
    if math.comb(len(near), k - len(sure)) > MAX_KEPT_SETS:  # a wide tie (flat logits): any of them, conservatively
        return set(sure.tolist()) | set(near.tolist())
    out: set[int] = set()
    for chosen in itertools.combinations(near.tolist(), k - len(sure)):
        kept = np.sort(np.concatenate([sure, chosen]).astype(np.int64))
        w = np.exp((x[kept] - x[kept].max()) / params.temperature)
        c = np.cumsum(w)
        reach = 2 * tol / params.temperature * c[-1]  # how far u * total and the boundaries may move apart
        lo, hi = np.searchsorted(c, u * c[-1] - reach, "right"), np.searchsorted(c, u * c[-1] + reach, "right")
        out.update(kept[lo : min(hi, len(kept) - 1) + 1].tolist())
    return out


def supported(p: SamplingParams) -> bool:
    """Whether the reference sampler draws as the engine would for `p`: greedy or seeded, temperature, top-k, CFG."""
    plain = (p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_tokens)
    constrained = p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids or p.structured
    return plain == (1.0, 0.0, 1.0, 0.0, 0.0, 0) and not constrained and (p.greedy or p.seed is not None)


class Reference:
    """The model in HF transformers (float32, loaded at the first use) and the chaos workload's sampler."""

    def __init__(self, model_dir: str, tol: float = TOL):
        self.model_dir, self.tol, self._model = model_dir, tol, None

    def logits(self, prefix: list[int], tokens: list[int]) -> np.ndarray:
        """[len(tokens), V] float64: the logits that sample each of `tokens` after `prefix` and the tokens before it."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(self.model_dir, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            out = self._model(torch.tensor([prefix + tokens[:-1]])).logits[0, len(prefix) - 1 :]
        return out.double().numpy()

    def processed(self, prompt: list[int], tokens: list[int], params: SamplingParams) -> np.ndarray:
        x = self.logits(prompt, tokens)
        if params.guidance_scale != 1.0:
            negative = params.negative_prompt_token_ids or [self._model.config.bos_token_id]
            u = self.logits(negative, tokens)
            x = u + params.guidance_scale * (x - u)
        return x

    def explain(self, prompt: list[int], params: SamplingParams, ref: list[int], got: list[int]) -> str | None:
        """None if `got`, which parts from `ref` (the fault-free run's tokens), does so at a near-tie and follows the
        reference sampler after it; else what it does instead."""
        j = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
        if j is None:
            return f"{got} is a prefix of the fault-free run's {ref}: nothing diverged"
        if not supported(params):
            raise NotImplementedError(f"the reference sampler does not support {params}")
        x = self.processed(prompt, got, params)
        for i in range(j, len(got)):
            tol = self.tol * max(1.0, np.abs(x[i]).max()) * (abs(1 - params.guidance_scale) + params.guidance_scale)
            u = None
            if not params.greedy:
                u = counter_uniforms(torch.tensor([params.seed]), torch.tensor([i])).item()
            ok = allowed(x[i], params, u, tol)
            if got[i] not in ok or (i == j and ref[j] not in ok):
                theirs = f", the fault-free run's {ref[j]}" if i == j else ""
                return f"output {i} is {got[i]}{theirs}; the reference allows {sorted(ok)}"
        return None
