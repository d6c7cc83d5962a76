"""Codecs: msgpack via msgspec, validated against the message types a link may carry."""

from __future__ import annotations

from typing import Union

import msgspec

from messages.lora import LORA_TYPES
from messages.pooling import POOL_TYPES
from messages.servers import SERVER_TYPES
from messages.step import STEP_TYPES
from messages.wire import WIRE_TYPES, Msg


class BadFrame(Exception):
    """A frame that does not decode to one of the link's message types."""


class LocalOnlyError(TypeError):
    """A local-only message (it carries device tensors) was sent over a process link."""


class Codec:
    """Encoder + validating decoder for one link; `types` is what the receiver accepts."""

    def __init__(self, types: tuple[type[Msg], ...] = WIRE_TYPES + STEP_TYPES + LORA_TYPES + POOL_TYPES + SERVER_TYPES):
        self.types = types
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Union[types])  # noqa: UP007 (runtime union)

    def encode(self, msg: Msg) -> bytes:
        if msg.local_only:
            raise LocalOnlyError(
                f"{type(msg).__name__} is local-only (it carries device tensors) and cannot cross a process link"
            )
        return self._encoder.encode(msg)

    def decode(self, frame: bytes) -> Msg:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadFrame(f"{e} (frame of {len(frame)} bytes)") from e
