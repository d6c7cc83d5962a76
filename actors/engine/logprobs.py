"""Host-side logprobs: a step's lists from the worker (StepResult.logprobs) cut into each request's TokenLogprobs."""

from __future__ import annotations

from actors.engine.request import EngineRequest
from gpu.batch import BatchSpec
from messages.wire import TokenLogprobs


def entries(lists: TokenLogprobs, start: int, stop: int, n: int) -> TokenLogprobs:
    """Entries start..stop-1 of a step's logprob lists, each top-N cut to the request's n."""
    part = lists.part(start, stop)
    part.top_ids, part.top_logprobs = [ids[:n] for ids in part.top_ids], [lps[:n] for lps in part.top_logprobs]
    return part


def wanted_logprobs(batch: BatchSpec, requests: dict[str, EngineRequest]) -> dict[str, tuple[int, int]]:
    """Request id -> (its first sampled position in the step's lists, its top-N), for the rows whose request
    asked; the entries of the tokens it emits follow from there."""
    want, pos = {}, 0
    for row in batch.rows:
        req = requests[row.request_id]
        if row.num_samples and req.params.logprobs is not None:
            want[req.request_id] = (pos, req.params.logprobs)
        pos += row.num_samples
    return want


def collect_prompt_logprobs(batch: BatchSpec, lists: TokenLogprobs, requests: dict[str, EngineRequest]) -> None:
    """Append each row's prompt logprobs to its request (a row from position 0 starts them afresh: a request
    preempted before its first output computes its prompt again)."""
    k = 0
    for row in batch.rows:
        if not row.prompt_targets:
            continue
        req = requests[row.request_id]
        more = entries(lists, k, k + len(row.prompt_targets), req.params.prompt_logprobs)
        k += len(row.prompt_targets)
        old = req.prompt_logprobs
        req.prompt_logprobs = TokenLogprobs.join([old, more]) if row.num_computed and old is not None else more


def take_prompt_logprobs(req: EngineRequest) -> TokenLogprobs | None:
    """The prompt logprobs, for the request's first output only (a one-token prompt has none: an empty list)."""
    if req.params.prompt_logprobs is None:
        return None
    lp, req.prompt_logprobs = req.prompt_logprobs, None
    return lp or TokenLogprobs(sampled=[], ranks=[])
