"""Incremental detokenization of one request: token ids in, newly complete text out.

Three methods, same output (the text `tokenizer.decode` gives for prompt + output, minus the prompt's):
- "bytes" (the default for byte-level BPE, GPT-2 style, e.g. SmolLM2): such a decoder turns each
  token into fixed bytes, whatever its context, so a per-tokenizer id -> bytes table plus an
  incremental UTF-8 decode is exact, and several times cheaper than a DecodeStream step; that is what
  keeps the whole per-token path within the detokenizer's CPU budget (DESIGN §9).
- "decode_stream": one `tokenizers.decoders.DecodeStream` primed with the prompt ids, so the first
  generated token gets its leading space (or none) from its real context (Metaspace / SentencePiece).
- "offsets": the classic two-decode prefix_offset/read_offset algorithm (TGI, vLLM's slow path). Used
  when DecodeStream cannot be primed (tokenizers < 0.22), when the prompt ends inside a UTF-8
  character (DecodeStream would re-emit the whole prompt, vLLM #48853), and for the rest of a request
  whose stream raised.
Text is emitted only once every multi-byte character is complete; `flush()` releases the rest but an incomplete last
character (vLLM's text ends at the last whole one). A
character that starts in the prompt and ends in the output belongs to the prompt: it is not emitted.
"""

from __future__ import annotations

import logging
import weakref
from codecs import utf_8_decode

from tokenizers import Tokenizer, decoders

log = logging.getLogger(__name__)

METHODS = ("bytes", "decode_stream", "offsets")
CONTEXT_TOKENS = 5  # left context of the two-decode algorithm (as vLLM)
_FFFD = "\ufffd"


def _decode_stream_supports_prefill() -> bool:
    try:
        decoders.DecodeStream(ids=[], skip_special_tokens=True)
    except (AttributeError, TypeError):
        return False
    return True


HAS_DECODE_STREAM = _decode_stream_supports_prefill()


def _byte_level_translation() -> dict[int, int]:
    """GPT-2's bytes_to_unicode, inverted for str.translate: alphabet char -> the byte it stands for
    (as a latin-1 code point); the other chars below 256 -> U+FFFF, which latin-1 cannot encode."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: b for b in printable} | {256 + n: b for n, b in enumerate(others)}
    return table | {b: 0xFFFF for b in others}


_UNBYTE = _byte_level_translation()


def byte_level_bytes(piece: str) -> bytes:
    """What the ByteLevel decoder makes of one token: its alphabet bytes, or (any char outside the
    alphabet, e.g. in an added token) the token's own UTF-8."""
    try:
        return piece.translate(_UNBYTE).encode("latin-1")
    except UnicodeEncodeError:
        return piece.encode()


def _utf8_or_none(raw: bytes) -> str | None:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


class TokenTable:
    """Per-tokenizer facts, computed once (call `token_table(tok)` at startup: ~0.3 s for a 49k vocab)."""

    def __init__(self, tokenizer: Tokenizer):
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        self.added = {i: t.content for i, t in added.items()}
        self.special = {i for i, t in added.items() if t.special}
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        # Byte-level tokenizers, per skip_special_tokens: id -> bytes, and id -> text for tokens that
        # are whole UTF-8 on their own (None for a piece of a character).
        self.byte_tables: dict[bool, tuple[dict[int, bytes], dict[int, str | None]]] = {}
        if self.byte_level:
            raw = {i: byte_level_bytes(piece) for piece, i in tokenizer.get_vocab(with_added_tokens=True).items()}
            texts = {i: _utf8_or_none(b) for i, b in raw.items()}
            skipped = (raw | dict.fromkeys(self.special, b""), texts | dict.fromkeys(self.special, ""))
            self.byte_tables = {False: (raw, texts), True: skipped}


_tables: weakref.WeakKeyDictionary[Tokenizer, TokenTable] = weakref.WeakKeyDictionary()


def token_table(tokenizer: Tokenizer) -> TokenTable:
    table = _tables.get(tokenizer)
    if table is None:
        table = _tables[tokenizer] = TokenTable(tokenizer)
    return table


def check_token_ids(tokenizer: Tokenizer, token_ids: list[int], vocab_size: int) -> None:
    """Raise ValueError for an id the tokenizer does not know (tokenizers would decode it to '')."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        for t in token_ids:
            if t < 0 or (t >= vocab_size and tokenizer.id_to_token(t) is None):
                raise ValueError(f"token id {t} is outside the vocabulary [0, {vocab_size})")


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens; `step` returns only newly complete text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        *,
        method: str | None = None,
        request_id: str = "",
    ):
        table = token_table(tokenizer)
        check_token_ids(tokenizer, prompt_token_ids, table.vocab_size)
        if method is None:
            method = "bytes" if table.byte_level else "decode_stream" if HAS_DECODE_STREAM else "offsets"
        if method not in METHODS or (method == "bytes" and not table.byte_level):
            raise ValueError(f"detokenization method {method!r} is not available for this tokenizer")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.request_id = request_id
        self._vocab_size = table.vocab_size
        # vLLM semantics: two consecutive kept special tokens lose the separator the decoder put between them.
        keep_separator = skip_special_tokens or spaces_between_special_tokens or table.byte_level
        self._added = None if keep_separator or not table.added else table.added
        self._last_added = False
        self._ids = list(prompt_token_ids)  # context of the two-decode algorithm
        self._read_offset = len(self._ids)  # the text of ids[:read_offset] has been emitted
        self._stream = self._bytes = self._texts = None
        if method == "bytes":
            self._bytes, self._texts = table.byte_tables[skip_special_tokens]
            tail = b"".join([self._bytes.get(t, b"") for t in prompt_token_ids[-2 * CONTEXT_TOKENS :]])
            self._buf = tail[utf_8_decode(tail, "replace", False)[1] :]  # an unfinished prompt character
            self._drop_first = bool(self._buf)
        elif method == "decode_stream" and not self._prompt_ends_mid_char():
            self._stream = decoders.DecodeStream(ids=self._ids, skip_special_tokens=skip_special_tokens)
        else:
            self._start_offsets()

    @property
    def method(self) -> str:
        return "bytes" if self._bytes is not None else "decode_stream" if self._stream is not None else "offsets"

    def step(self, new_token_ids: list[int]) -> str:
        """Append output tokens; return the text they complete (possibly ''). ValueError: unknown id."""
        if self._bytes is not None:
            if len(new_token_ids) == 1 and not self._buf:  # the hot path: a whole character or more
                text = self._texts.get(new_token_ids[0])
                if text is not None:
                    return text
            return self._bytes_step(new_token_ids)
        check_token_ids(self.tokenizer, new_token_ids, self._vocab_size)
        pieces = []
        for t in new_token_ids:
            self._ids.append(t)
            piece = self._offset_step() if self._stream is None else self._stream_step(t)
            pieces.append(piece if self._added is None else self._join_special(t, piece))
        return "".join(pieces)

    def flush(self) -> str:
        """At finish: release text still buffered but an incomplete trailing character (as vLLM: the text ends at
        the last whole character; the token ids still say every byte)."""
        if self._bytes is not None:
            self._buf = b""  # (only ever an incomplete character: `step` decoded everything before it)
            return ""
        if self._read_offset == len(self._ids):
            return ""
        if self._stream is not None:
            self._stream = None
            self._start_offsets()
        text = self._decode(self._prefix_offset, len(self._ids))[len(self._prefix_text) :]
        self._read_offset = len(self._ids)
        self._start_offsets()  # steps after a flush go on from a clean state
        return text.removesuffix(_FFFD)  # (held back: the incomplete character; also, unlike "bytes", a lone
        # invalid byte at the very end: these methods see text, not bytes)

    # ------------------------------------------------------------------ internals

    def _bytes_step(self, ids: list[int]) -> str:
        try:
            data = self._buf + (self._bytes[ids[0]] if len(ids) == 1 else b"".join([self._bytes[t] for t in ids]))
        except KeyError:
            check_token_ids(self.tokenizer, ids, self._vocab_size)
            raise ValueError(f"token ids {ids} are not all in the tokenizer's table") from None
        text, used = utf_8_decode(data, "replace", False)
        self._buf = data[used:]
        return self._drop_prompt_char(text) if self._drop_first else text

    def _drop_prompt_char(self, text: str) -> str:
        if self._drop_first and text:
            self._drop_first = False
            return text[1:]
        return text

    def _stream_step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self.tokenizer, token_id)
        except Exception as e:  # tokenizers raises a bare Exception ("Invalid prefix encountered")
            log.warning("request %s: DecodeStream failed (%s); continuing with offset decoding", self.request_id, e)
            self._stream = None
            self._start_offsets()
            return self._offset_step()
        if piece is None:
            return ""
        self._read_offset = len(self._ids)
        return piece

    def _start_offsets(self) -> None:
        """(Re)start the two-decode algorithm at the read offset."""
        self._prefix_offset = max(self._read_offset - CONTEXT_TOKENS, 0)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    def _offset_step(self) -> str:
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_FFFD):
            return ""  # an incomplete character (or nothing new) so far
        piece = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return piece

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _prompt_ends_mid_char(self) -> bool:
        return self._decode(max(len(self._ids) - 2 * CONTEXT_TOKENS, 0), len(self._ids)).endswith(_FFFD)

    def _join_special(self, token_id: int, piece: str) -> str:
        content = self._added.get(token_id)
        if content is not None and self._last_added and piece:
            piece = content
        self._last_added = content is not None
        return piece
