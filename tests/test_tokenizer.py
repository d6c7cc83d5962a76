"""frontend.tokenizer: encoding, token strings/bytes, bad words, and chat templates rendered exactly
as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from frontend.tokenizer import Tokenizer, chat_message
from messages.sampling_params import ParamError

SMOL_DIR = Path(os.environ.get("SLUICE_CACHE_DIR", "~/.cache/sluice")).expanduser() / "models" / "SmolLM2-135M-Instruct"
needs_smol = pytest.mark.skipif(
    not (SMOL_DIR / "tokenizer.json").is_file(), reason="converted SmolLM2 not in the cache"
)

TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}{{ ' ' + m['name'] if m['name'] else '' }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Say 🤗 in 中文"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "again"}, {"type": "text", "text": "please"}]},
    ],
]


def write_tiny_model_dir(path: Path, template: str | None = TINY_TEMPLATE) -> Path:
    """A byte-level BPE tokenizer (ChatML specials 0..3) with its configs and an optional template."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    path.mkdir(parents=True, exist_ok=True)
    hf.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|pad|>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_dir)


def test_vocab_eos_and_special_tokens(tiny):
    assert tiny.vocab_size == tiny.hf.get_vocab_size(with_added_tokens=True) > 256 + 4
    assert tiny.eos_token_ids == [2, 0]  # tokenizer eos first, then generation_config's
    assert tiny.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}


def test_encode_adds_no_special_tokens_and_round_trips(tiny):
    ids = tiny.encode("hello world")
    assert ids and all(i > 3 for i in ids)
    assert tiny.decode(ids) == "hello world"
    assert tiny.encode("<|im_end|>") == [2]  # special tokens in text are parsed, as in vLLM


def test_token_str_and_bytes_rebuild_split_characters(tiny):
    ids = tiny.encode(" 🤗中")
    assert len(ids) > 2  # the characters are split across byte tokens
    assert b"".join(tiny.token_bytes(i) for i in ids).decode("utf-8") == " 🤗中"
    assert "\ufffd" in "".join(tiny.token_str(i) for i in ids)  # a lone token shows a partial char as U+FFFD
    assert tiny.token_str(2) == "<|im_end|>"
    assert tiny.token_bytes(2) == b"<|im_end|>"


def test_bad_words_with_and_without_leading_space(tiny):
    out = tiny.bad_words_token_ids(["fox", " lazy dog"])
    assert out == [tiny.encode("fox"), tiny.encode(" fox"), tiny.encode("lazy dog"), tiny.encode(" lazy dog")]
    with pytest.raises(ParamError) as e:
        tiny.bad_words_token_ids(["ok", "  "])
    assert e.value.param == "bad_words"


def test_render_chat_string_and_text_parts(tiny):
    text = tiny.render_chat(CONVERSATIONS[2])
    assert text == (
        "<|im_start|><|im_start|>user\nSay 🤗 in 中文<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
        "<|im_start|>user\nagain\nplease<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tiny.render_chat(CONVERSATIONS[0], add_generation_prompt=False).endswith("assistant\n")


def test_render_chat_roles_names_function_calls_and_continuing_the_last_message(tiny, tmp_path):
    """Any role the template renders (the deprecated `function`, a custom one) with its `name`; a deprecated
    function_call becomes a tool call; continue_final leaves the last message open right after its content, its
    trailing whitespace kept; a template that drops that content makes it a ParamError."""
    chat = [
        {"role": "function", "name": "get_time", "content": "12:00"},
        {"role": "narrator", "content": "Later."},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"x": 1}'}},
        {"role": "assistant", "content": "It is "},
    ]
    text = tiny.render_chat(chat, add_generation_prompt=False, continue_final=True)
    assert text == (
        "<|im_start|><|im_start|>function get_time\n12:00<|im_end|>\n<|im_start|>narrator\nLater.<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\nIt is "
    )
    calls = chat_message(2, chat[2])["tool_calls"]
    assert calls == [{"id": "call_2", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    blind = write_tiny_model_dir(tmp_path / "m", template="{{ messages | length }}")
    with pytest.raises(ParamError) as e:
        Tokenizer.from_model_dir(blind).render_chat(chat, continue_final=True)
    assert e.value.param == "continue_final_message"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "user", "content": "a"}, "b"], "messages[1]"),
        ([{"role": "", "content": "a"}], "messages[0].role"),
        ([{"role": 5, "content": "a"}], "messages[0].role"),
        ([{"content": "a"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0]"),
        ([{"role": "tool", "content": "x"}], "messages"),  # the template's raise_exception
    ],
)
def test_render_chat_rejects(tiny, messages, param):
    with pytest.raises(ParamError) as e:
        tiny.render_chat(messages)
    assert e.value.param == param


def test_template_from_tokenizer_config_and_missing_template(tmp_path):
    d = write_tiny_model_dir(tmp_path / "a", template=None)
    assert Tokenizer.from_model_dir(d).chat_template is None
    with pytest.raises(ParamError, match="no chat template"):
        Tokenizer.from_model_dir(d).render_chat(CONVERSATIONS[0])
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TINY_TEMPLATE}))
    assert Tokenizer.from_model_dir(d).render_chat(CONVERSATIONS[0]) == (
        "<|im_start|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@needs_smol
def test_smollm2_chatml_render():
    tok = Tokenizer.from_model_dir(SMOL_DIR)
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [2]
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.render_chat(CONVERSATIONS[0]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.render_chat(CONVERSATIONS[1]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_renders_match_transformers_apply_chat_template(tiny_dir):
    transformers = pytest.importorskip("transformers")
    dirs = [tiny_dir] + ([SMOL_DIR] if (SMOL_DIR / "tokenizer.json").is_file() else [])
    for d in dirs:
        ours = Tokenizer.from_model_dir(d)
        theirs = transformers.AutoTokenizer.from_pretrained(str(d))
        for conv in CONVERSATIONS[:2]:
            text = theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            assert ours.render_chat(conv) == text
            ids = theirs.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
            assert ours.encode(text, add_special_tokens=False) == list(ids)
