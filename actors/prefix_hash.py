"""The prefix cache's block identity, shared by the engine's BlockManager and the HTTP side's replica router
(actors/routing.py), so both name a prompt's blocks alike. Pure Python: the HTTP process imports it.

A block's hash is chained over its tokens (int64, in the machine's byte order) and its parent's hash (blake2b, 16 bytes); the
first block's parent is nothing, or the hash of the request's cache salt and LoRA adapter (its weights' digest,
not its name: an adapter reloaded with other weights under the same name shares nothing with the old one). An engine tells its client which prefixes it holds by
the first ANCHOR_BYTES of the hashes of its cached blocks at depths 0, 1, 3, 7, ... (2^i - 1): a few per cached
prompt, so a report stays small, and a prompt's deepest anchor found in a replica's report bounds what that replica
would find within a factor of two."""

from __future__ import annotations

import hashlib
from array import array

ANCHOR_BYTES = 8


def root(salt: str | None, lora: str | None = None) -> bytes:
    """The first block's parent: nothing, or the hash of the salt and the adapter's digest (16 bytes, like every
    parent's)."""
    if salt is None and lora is None:
        return b""
    key = b"cache_salt:" + salt.encode() if salt is not None else b""
    if lora is not None:  # (a digest's hex: no colon or NUL in it)
        key = b"lora:" + lora.encode() + b"\0" + key
    return hashlib.blake2b(key, digest_size=16).digest()


def extend(hashes: list[bytes], tokens: list[int], block_size: int, n: int, first: bytes) -> list[bytes]:
    """Append to `hashes` (the chain of the sequence's first blocks, computed so far) up to its first n full blocks
    of `tokens`, the first block's parent `first` (`root`); returns the first n."""
    while len(hashes) < n:
        i = len(hashes)
        h = hashlib.blake2b(hashes[-1] if hashes else first, digest_size=16)
        h.update(array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes())
        hashes.append(h.digest())
    return hashes[:n]


def is_anchor(depth: int) -> bool:
    """Whether the block at this depth of its chain (0: the first) is reported: 0, 1, 3, 7, ..."""
    return not (depth + 1) & depth


def anchors(
    tokens: list[int], block_size: int, salt: str | None, lora: str | None = None, max_blocks: int = 256
) -> list[bytes]:
    """A prompt's anchors, shallowest first, over the blocks a cache hit may cover (its last token is always
    computed), up to `max_blocks` deep (a bound on the work: a router needs no more)."""
    n = min(max_blocks, (len(tokens) - 1) // block_size)
    chain = extend([], tokens, block_size, n, root(salt, lora))
    return [h[:ANCHOR_BYTES] for depth, h in enumerate(chain) if is_anchor(depth)]
