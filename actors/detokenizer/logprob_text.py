"""Display strings of logprob tokens (not on the wire): a token's text, or its bytes when it holds part of a UTF-8
character (OpenAI's convention), and the text offsets of an entry's tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenizers import Tokenizer

from actors.detokenizer.incremental import token_table

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Tokenizer, token_ids: list[int]) -> list[bytes]:
    """The bytes each token stands for on its own (a piece of a UTF-8 character stays a piece)."""
    table = token_table(tokenizer)
    if table.byte_level:
        return [table.byte_tables[False][0].get(t, b"") for t in token_ids]
    out = []
    for t in token_ids:
        m = _BYTE_FALLBACK.fullmatch(tokenizer.id_to_token(t) or "")
        out.append(bytes([int(m[1], 16)]) if m else tokenizer.decode([t], skip_special_tokens=False).encode())
    return out


def decode_logprob_tokens(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    """Display strings for logprob tokens: the token's text; for a token that is not valid UTF-8 on its
    own (a piece of an emoji or CJK character) "bytes:" + its bytes, the invalid ones as \\xNN escapes
    (OpenAI's convention), e.g. 'bytes: \\xf0\\x9f'. Special tokens show their content."""
    out = []
    for raw in token_bytes(tokenizer, token_ids):
        try:
            out.append(raw.decode())
        except UnicodeDecodeError:
            out.append("bytes:" + raw.decode("utf-8", "backslashreplace"))
    return out


@dataclass(slots=True)
class DecodedLogprobs:
    """Display data for one entry's logprobs (not on the wire), aligned with its new_token_ids."""

    tokens: list[str]  # the sampled tokens, see decode_logprob_tokens
    top_tokens: list[list[str]]
    text_offsets: list[int]  # character offset of each token's text in the generated text
