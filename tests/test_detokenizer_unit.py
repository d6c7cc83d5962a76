"""IncrementalDetokenizer: streamed text equals a one-shot decode, for every method and chunking."""

from __future__ import annotations

import logging
import random

import pytest

from actors.detokenizer import incremental
from actors.detokenizer.incremental import METHODS, IncrementalDetokenizer, token_table
from tests.detok_tokenizers import EMOJI_CJK, metaspace, non_prefix_stable, smollm2, spaced

PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=(1,)) -> list[str]:
    """Feed `ids` in chunks of the given sizes (cycled); the pieces, then flush()."""
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = chunk_sizes[k % len(chunk_sizes)]
        pieces.append(detok.step(ids[i : i + n]))
        i, k = i + n, k + 1
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("method", METHODS)
def test_emoji_and_cjk_split_across_tokens_are_emitted_only_once_complete(method):
    tok = smollm2()
    prompt, out = tok.encode(PROMPT).ids, tok.encode(EMOJI_CJK).ids
    pieces = stream(IncrementalDetokenizer(tok, prompt, method=method), out)
    assert "".join(pieces) == tok.decode(out) == EMOJI_CJK
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 5  # the tokens that end inside a character
    assert pieces[2] == "" and pieces[3].endswith("🤗")  # 'ĠðŁ' '¤' 'Ĺ': 🤗 only with its last byte


@pytest.mark.parametrize("method", METHODS)
def test_every_chunking_gives_the_one_shot_decode(method):
    tok = smollm2()
    rng = random.Random(0)
    out = tok.encode(EMOJI_CJK * 3).ids
    for _ in range(5):
        sizes = [rng.randint(1, 4) for _ in range(7)]
        detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, method=method)
        assert "".join(stream(detok, out, sizes)) == EMOJI_CJK * 3


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_bytes_method_equals_tokenizer_decode_on_random_ids(skip_special_tokens):
    tok = smollm2()
    rng = random.Random(1)
    vocab = tok.get_vocab_size()
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))] + [rng.randrange(3)]
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens, method="bytes")
        text = "".join(stream(detok, ids, (1, 3)))
        whole = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert text == whole or (whole == text + "\ufffd" and _ends_mid_character(tok, ids)), (text, whole)


def test_first_token_gets_its_leading_space_from_the_prompt():
    tok = smollm2()
    prompt, out = tok.encode("The capital of France is").ids, tok.encode(" Paris.").ids
    for method in METHODS:
        assert IncrementalDetokenizer(tok, prompt, method=method).step(out[:1]) == " Paris"


@pytest.mark.parametrize("method", ["decode_stream", "offsets"])
def test_metaspace_leading_space_depends_on_context(method):
    tok = metaspace()
    # ▁Hello | ▁world s: " world" (a new word), then "s" (no spurious space)
    detok = IncrementalDetokenizer(tok, [1], method=method)
    assert [detok.step([2]), detok.step([3])] == [" world", "s"]
    assert tok.decode([1, 2, 3]) == "Hello worlds"
    assert tok.decode([2]) == "world"  # decoded alone the space would be lost


@pytest.mark.parametrize("method", METHODS)
def test_prompt_ending_mid_character_does_not_leak_into_the_output(method):
    """vLLM #48853: a token-id prompt that stops inside 🤗 (3 tokens); the character belongs to the prompt."""
    tok = smollm2()
    ids = tok.encode("Hello world 🤗 ok fine").ids
    cut = ids.index(tok.token_to_id("¤"))  # prompt = "Hello world " + 2 of 🤗's 3 tokens
    prompt, out = ids[:cut], ids[cut:]
    assert tok.decode(prompt).endswith("\ufffd")
    pieces = stream(IncrementalDetokenizer(tok, prompt, method=method), out)
    assert "".join(pieces) == " ok fine"
    # finishing before the character completes releases nothing of the prompt either
    assert stream(IncrementalDetokenizer(tok, prompt, method=method), out[:1]) == ["", ""]


def _ends_mid_character(tok, ids: list[int]) -> bool:
    """Whether the text of `ids` ends inside a character: a continuation byte's token (0x80-0xBF, in GPT-2's byte
    alphabet, transformers' own table) completes or extends it without a U+FFFD at the end."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    continuations = [tok.token_to_id(alphabet[b]) for b in range(0x80, 0xC0)]
    return any(not tok.decode([*ids, c]).endswith("\ufffd") for c in continuations if c is not None)


@pytest.mark.parametrize("method", METHODS)
def test_flush_drops_an_incomplete_trailing_character(method):
    """As vLLM, a request cut inside a character ends at the last whole one (no U+FFFD)."""
    tok = smollm2()
    out = tok.encode("ok 🤗").ids[:-1]
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, method=method)
    streamed = detok.step(out)
    assert tok.decode(out) == "ok \ufffd"
    assert streamed + detok.flush() == "ok "
    assert detok.flush() == ""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [49152, 10**7, -1])
def test_out_of_vocabulary_ids_raise_value_error(method, bad):
    tok = smollm2()
    detok = IncrementalDetokenizer(tok, [1, 2], method=method)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.step([905, bad])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok, [1, bad], method=method)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(skip):
    tok = smollm2()
    out = [*tok.encode("Hi").ids, 2]  # <|im_end|>
    for method in METHODS:
        text = "".join(stream(IncrementalDetokenizer(tok, [1], skip, method=method), out))
        assert text == ("Hi" if skip else "Hi<|im_end|>")


@pytest.mark.parametrize("method", ["decode_stream", "offsets"])
def test_spaces_between_special_tokens_as_vllm(method):
    tok = spaced()  # decode joins tokens with " "; [SEP]=4, [CLS]=5
    out = [4, 5, 2]

    def text(spaces: bool) -> str:
        return "".join(stream(IncrementalDetokenizer(tok, [1], False, spaces, method=method), out))

    assert text(True) == " [SEP] [CLS] b"
    assert text(False) == " [SEP][CLS] b"  # only between consecutive special tokens
    assert "".join(stream(IncrementalDetokenizer(tok, [1], True, False, method=method), out)) == " b"


def test_decode_stream_error_falls_back_to_offsets_and_logs_the_request(caplog):
    tok = non_prefix_stable()  # DecodeStream raises "Invalid prefix encountered" on its 2nd step
    detok = IncrementalDetokenizer(tok, [], method="decode_stream", request_id="req-7")
    with caplog.at_level(logging.WARNING, logger=incremental.__name__):
        pieces = [detok.step([1]), detok.step([2]), detok.step([3])]
    assert detok.method == "offsets"
    assert pieces[0] == "a" and all(pieces)
    assert "req-7" in caplog.text and "Invalid prefix" in caplog.text


def test_decode_stream_error_midway_keeps_the_text_exact(caplog):
    """A stream that breaks after buffering half an emoji: the offset fallback resumes at the last emission."""
    tok = smollm2()
    out = tok.encode(EMOJI_CJK).ids
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, method="decode_stream", request_id="r9")

    class Broken:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered while decoding stream")

    pieces = [detok.step(out[:2])]  # "Hi", then the first byte-piece of 🤗 is buffered
    detok._stream = Broken()
    with caplog.at_level(logging.WARNING, logger=incremental.__name__):
        pieces += stream(detok, out[2:])
    assert "".join(pieces) == EMOJI_CJK
    assert "r9" in caplog.text


def test_method_selection(monkeypatch):
    assert IncrementalDetokenizer(smollm2(), [1]).method == "bytes"
    assert IncrementalDetokenizer(metaspace(), [1]).method == "decode_stream"
    with pytest.raises(ValueError, match="not available"):
        IncrementalDetokenizer(metaspace(), [1], method="bytes")
    monkeypatch.setattr(incremental, "HAS_DECODE_STREAM", False)  # tokenizers < 0.22: no prefill
    assert IncrementalDetokenizer(metaspace(), [1]).method == "offsets"


def test_token_table_is_cached_per_tokenizer():
    tok = smollm2()
    assert token_table(tok) is token_table(tok)
    assert token_table(tok).vocab_size == 49152
