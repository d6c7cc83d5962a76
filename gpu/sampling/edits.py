"""The logit processors' ids per row, and a step's edits as one table for the fused sampler (fused_triton.py).

`row_ids(row)` is what each processor touches in one row (allowed ids, bans, the clamped bias): the torch path's
entries (metadata.py) and the fused table are both built from it. `build_edits(rows, device)` lays the table out:
per row its allowed ids, banned ids, biased ids and penalised ids, in the sampler's order (DESIGN 5), so that one
launch applies every processor to every row. Its size follows the ids the requests name, never the vocabulary. A
penalised id appears once per row, with its count in the row's output, so no two writes of a segment collide.
Imports numpy, torch, messages/sampling_params.py and nothing of its package: metadata.py builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from messages.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the edits read of a row (metadata.SamplingRow)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: list[int]


ALLOWED, BAN, BIAS, PENALTY = range(4)  # a row's segments of entries, applied in this order


@dataclass
class Edits:
    starts: torch.Tensor  # [B, 5] int64: row i's entries of kind k are tokens[starts[i, k] : starts[i, k + 1]]
    tokens: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32: the bias (BIAS entries), the id's count in the output (PENALTY), else 0
    penalties: torch.Tensor  # [B, 3] float32: repetition, presence, frequency (1, 0, 0: none)


def row_ids(row: SamplingRow) -> tuple[list[int], list[int], list[int], dict[int, float]]:
    """(allowed ids, bad words' banned ids, ids banned before min_tokens, the clamped logit bias) of one row."""
    p = row.params
    bad = bad_word_bans(p.bad_words_token_ids, row.output_token_ids) if p.bad_words_token_ids else []
    early = len(row.output_token_ids) < p.min_tokens
    stops = [*p.stop_token_ids, *([] if p.ignore_eos else row.eos_token_ids)] if early else []
    return list(p.allowed_token_ids or ()), bad, stops, p.clamped_logit_bias() if p.logit_bias else {}


def bad_word_bans(bad_words_token_ids: list[list[int]], output: list[int]) -> list[int]:
    """Last tokens of the bad-word sequences whose prefix the output ends with (vLLM semantics: output only)."""
    banned = []
    for seq in bad_words_token_ids:
        n = len(seq) - 1
        if seq and n <= len(output) and (n == 0 or output[-n:] == seq[:-1]):
            banned.append(seq[-1])
    return banned


def penalty_ids(row: SamplingRow) -> np.ndarray | None:
    """The ids a row's penalties touch, in order and repeated: its prompt's (only with the repetition penalty on)
    then its output's; None without penalties. (np.asarray is free where the caller keeps the prompt as an int64
    array.)"""
    p = row.params
    if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return None
    prompt = np.asarray(row.prompt_token_ids if p.repetition_penalty != 1.0 else (), np.int64)
    return np.concatenate([prompt, np.asarray(row.output_token_ids, np.int64)])


def penalised(row: SamplingRow) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids of `penalty_ids` and each one's count in the output; empty without penalties."""
    seq = penalty_ids(row)
    if seq is None:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    output = np.asarray(row.output_token_ids, np.int64)
    ids = np.unique(seq)
    seen, counts = np.unique(output, return_counts=True)
    count = np.zeros(len(ids), np.float32)
    count[np.searchsorted(ids, seen)] = counts
    return ids, count


def build_edits(rows: list[SamplingRow], device: torch.device | str) -> Edits | None:
    """The step's edits table (module docstring), or None where no row edits its logits."""
    starts = np.zeros((len(rows), 5), np.int64)
    penalties = np.tile(np.float32([1.0, 0.0, 0.0]), (len(rows), 1))
    tokens, values, n = [], [], 0
    for i, row in enumerate(rows):
        allowed, bad, stops, bias = row_ids(row)
        ids, count = penalised(row)
        if len(ids):
            p = row.params
            penalties[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        segments = [(allowed, None), ([*bad, *stops], None), (list(bias), list(bias.values())), (ids, count)]
        for k, (ids_k, values_k) in enumerate(segments):
            starts[i, k] = n
            tokens.append(np.asarray(ids_k, np.int64))
            values.append(np.zeros(len(ids_k), np.float32) if values_k is None else np.asarray(values_k, np.float32))
            n += len(ids_k)
        starts[i, 4] = n
    if not n:
        return None
    move = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    return Edits(move(starts), move(np.concatenate(tokens)), move(np.concatenate(values)), move(penalties))
