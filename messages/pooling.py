"""Pooling requests (issue 52): the HTTP actor -> a pooling model's engine (actors/pooler) -> the HTTP actor.

A pooling request is one forward over its inputs, no state kept between steps: its copy after an engine death is
the same request sent again (a higher `attempt`); an output of an older copy is stale. Abort (messages/wire.py) ends a
queued one with an AbortAck; one in a step runs to its end and its output is dropped by the client.
"""

from __future__ import annotations

from messages.wire import Msg


class PoolRequest(Msg, kw_only=True):
    """HTTP -> pooler: embed each input (token ids, each within the model's length: the frontend checked); a
    cross-encoder's engine gives each input's logits instead (its activation is the frontend's: per endpoint)."""

    request_id: str
    inputs: list[list[int]]
    token_type_ids: list[list[int]] | None = None  # per input, each token's segment (a pair's second text: 1); None: 0
    normalize: bool | None = None  # None: the model's pooling says; else L2-normalized or not
    dimensions: int | None = None  # matryoshka: the embedding cut to its first this many values (renormalized)
    client: str = "http"
    attempt: int = 0  # the copy: 0 as first sent, one more at each re-send after the engine died


class PoolOutput(Msg, kw_only=True):
    """pooler -> HTTP: the embeddings of a PoolRequest, or why it failed."""

    request_id: str
    attempt: int = 0
    dim: int = 0  # the values per embedding (a cross-encoder's: per input, its labels' logits)
    data: bytes = b""  # len(inputs) x dim float32, little-endian, row-major (the wire carries no per-value framing)
    error: str | None = None


POOL_TYPES: tuple[type[Msg], ...] = (PoolRequest, PoolOutput)
