"""Tokenizers for the detokenizer tests: the real SmolLM2 one and tiny hand-built ones."""

from __future__ import annotations

import functools

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from gpu.loading.convert import DEFAULT_MODEL_NAME, cache_dir

EMOJI_CJK = "Hi 🤗🚀 there: 中文测试，世界 done 👍🏽✨ end"


@functools.cache
def _load_smollm2() -> Tokenizer | None:
    path = cache_dir() / "models" / DEFAULT_MODEL_NAME / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def smollm2() -> Tokenizer:
    """The real byte-level BPE tokenizer (made by `python -m gpu.loading.convert`, i.e. `make model`)."""
    tok = _load_smollm2()
    if tok is None:
        pytest.skip("SmolLM2 tokenizer not converted yet (run `make model`)")
    return tok


def metaspace() -> Tokenizer:
    """SentencePiece-style pieces: a token's leading space depends on its context."""
    vocab = {"[UNK]": 0, "▁Hello": 1, "▁world": 2, "s": 3, "▁a": 4, "b": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return tok


def spaced() -> Tokenizer:
    """No decoder: tokens are joined with spaces, special tokens included."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[SEP]", "[CLS]"])  # ids 4, 5
    return tok


class _Shouting:
    """A decoder that is not prefix-stable: more than one token is decoded in upper case."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        text = "".join(tokens)
        return [text.upper() if len(tokens) > 1 else text]


def non_prefix_stable() -> Tokenizer:
    """Makes DecodeStream raise "Invalid prefix encountered" on its second step."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Decoder.custom(_Shouting())
    return tok
