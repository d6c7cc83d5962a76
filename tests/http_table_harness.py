"""Helpers for the tests of the HTTP actor's request table (tests/test_http_requests.py, tests/test_client_ledger.py):
a parsed request, a table whose sent messages are recorded, and readers of what it sent and rendered."""

from __future__ import annotations

import json

from actors.routing import Replicas
from frontend.metrics import Metrics
from frontend.protocol import ParsedRequest, PromptInput
from frontend.requests import RequestTable
from messages.sampling_params import SamplingParams
from messages.wire import Abort, TextDelta, TextOutputs


class Vocab:
    def token_str(self, token_id: int) -> str:
        return f"<{token_id}>"

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_str(token_id).encode()


VOCAB = Vocab()


def parsed(
    n=1, prompts=((1, 2, 3),), kind="completion", seed=None, logprobs=None, echo=False, rid="cmpl-abc"
) -> ParsedRequest:
    params = SamplingParams(n=n, seed=seed, max_tokens=8, logprobs=logprobs)
    inputs = [PromptInput("hi", list(p), params) for p in prompts]
    return ParsedRequest(kind, rid, "m", 0, inputs, True, True, echo)


def make_table(abort_timeout_s=1.0, replicas=1, policy="cache_aware", stream_interval=1):
    sent = []
    metrics = Metrics(replicas=Replicas(replicas, policy))
    table = RequestTable(lambda dst, msg: sent.append(msg), metrics, abort_timeout_s, max_abort_tries=3,
                         stream_interval=stream_interval)  # fmt: skip
    return table, metrics, sent


def delta(rid: str, seq: int, text: str, ids=None) -> TextOutputs:
    ids = [seq] if ids is None else ids
    return TextOutputs(step=seq, deltas=[TextDelta(request_id=rid, seq=seq, text=text, token_ids=ids)])


def events(data: bytes) -> list[dict]:
    assert data.endswith(b"\n\n")
    return [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n")[:-1] if e != b"data: [DONE]"]


def aborts(sent) -> list[tuple[str, str]]:
    return [(m.request_id, m.reason) for m in sent if isinstance(m, Abort)]


def resumed(sent) -> list[tuple[str, int, list[int], int]]:
    return [
        (m.request_id, m.attempt, m.resume_token_ids, m.resume_chars)
        for m in sent
        if getattr(m, "resume_token_ids", None) is not None
    ]
