"""The frontend's tokenizer: `tokenizers.Tokenizer` (tokenizer.json) plus the model's chat template.

The template is rendered with a jinja2 ImmutableSandboxedEnvironment configured like transformers'
`apply_chat_template` (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, a non-escaping
`tojson`, `strftime_now`, the special tokens as variables, and a request's `chat_template_kwargs` beside them);
the tests pin byte-identical renders.
This avoids importing transformers (seconds) in the server process. Every method is pure and
thread-safe, so long prompts can be tokenized in an executor; `encode` and `encode_batch` release
the GIL while the Rust tokenizer runs (`Tokenizer.encode` would hold it: 1.7 s for 3 MB, measured),
so a worker thread tokenizing a long prompt never stalls the event loop.

`max_token_chars` bounds how few tokens a string can be: no token covers more characters of the
input than its longest vocabulary entry, so a prompt of C characters has at least
ceil(C / max_token_chars) tokens, known before tokenizing it. It is None when a normalizer could
shrink the text (then no such bound holds).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from frontend.body import MAX_JSON_DEPTH, strict_json
from messages.sampling_params import ParamError

_CONTINUE = "\ue000sluice-continue\ue000"  # continue_final_message: where the last message's content ends
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE token characters -> raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_BYTE_DECODER = _byte_decoder()
# what a template is given (as transformers gives it), which chat_template_kwargs may not replace
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", *_SPECIAL_TOKEN_KEYS, *_template_env().globals}
)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _keeps_length(normalizer: dict) -> bool:
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(map(_keeps_length, normalizer["normalizers"]))
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        return pattern is not None and len(normalizer.get("content", "")) >= len(pattern)
    return kind == "Prepend"


def _max_token_chars(hf: HFTokenizer) -> int | None:
    normalizer = json.loads(hf.to_str()).get("normalizer")
    if normalizer and not _keeps_length(normalizer):
        return None
    return max(map(len, hf.get_vocab(with_added_tokens=True)))


class Tokenizer:
    def __init__(self, hf: HFTokenizer, chat_template: str | None, special_tokens: dict[str, str], eos_ids: list[int]):
        self.hf = hf  # the raw tokenizers.Tokenizer (for the detokenizer's DecodeStream)
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_ids
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._template = _template_env().from_string(chat_template) if chat_template else None
        self._added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(hf.decoder, decoders.ByteLevel)
        self._str_cache: dict[int, str] = {}
        self.max_token_chars = _max_token_chars(hf)

    @classmethod
    def from_model_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """chat_template: replaces the model's own (sluice serve --chat-template FILE)."""
        path = Path(path)
        hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        hf.no_truncation()  # (a file may set either: all-MiniLM-L6-v2's cuts at 128 and pads to 128)
        hf.no_padding()
        config = _json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # older layout: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {k: c for k in _SPECIAL_TOKEN_KEYS if (c := _token_content(config.get(k))) is not None}
        eos_ids: list[int] = []
        gen_eos = _json(path / "generation_config.json").get("eos_token_id")
        for tok_id in [
            hf.token_to_id(special.get("eos_token", "")),
            *(gen_eos if isinstance(gen_eos, list) else [gen_eos]),
        ]:
            if isinstance(tok_id, int) and tok_id not in eos_ids:
                eos_ids.append(tok_id)
        return cls(hf, chat_template or template, special, eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; the tokenizer's post-processor adds BOS only where the model needs it."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, in parallel and without the GIL."""
        return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included; a partial character is U+FFFD)."""
        s = self._str_cache.get(token_id)
        if s is None:
            s = self._str_cache[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return s

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw UTF-8 bytes (byte-level BPE tokens may hold part of a character)."""
        piece = self.hf.id_to_token(token_id)
        if self._byte_level and token_id not in self._added and piece and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        return self.token_str(token_id).encode("utf-8")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word tokenized as is and with a leading space (vLLM), without duplicates."""
        for i, word in enumerate(words):
            if not word.strip():
                raise ParamError("bad_words", f"bad_words[{i}] must not be empty")
        texts = [text for word in words for text in (word.lstrip(), " " + word.lstrip())]
        unique = dict.fromkeys(tuple(ids) for ids in self.encode_batch(texts, add_special_tokens=False))
        return [list(ids) for ids in unique]

    def render_chat(
        self,
        messages: list,
        add_generation_prompt: bool = True,
        tools: list | None = None,
        continue_final=False,
        template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text for OpenAI chat `messages` (and `tools`, for templates that render them); raises
        ParamError naming the bad field. `continue_final`: the text ends with the last message's content, its
        turn left open (found by a marker appended to that content: whitespace at its end is kept).
        `template_kwargs` (vLLM's chat_template_kwargs, such as Qwen3's `enable_thinking`): more variables for the
        template, none of them one the template is given already (TEMPLATE_VARIABLES)."""
        if self._template is None:
            raise ParamError("messages", "this model has no chat template; use /v1/completions")
        if not isinstance(messages, list) or not messages:
            raise ParamError("messages", "messages must be a non-empty list")
        template_kwargs = template_kwargs or {}
        if taken := sorted(TEMPLATE_VARIABLES.intersection(template_kwargs)):
            raise ParamError(
                "chat_template_kwargs", f"chat_template_kwargs must not set {taken[0]!r}: the template's own variable"
            )
        chat = [chat_message(i, m) for i, m in enumerate(messages)]
        if continue_final:
            chat[-1]["content"] += _CONTINUE
        try:
            own = {"messages": chat, "add_generation_prompt": add_generation_prompt, "tools": tools}
            text = self._template.render({**template_kwargs, **own, **self.special_tokens})
        except jinja2.TemplateError as e:
            raise ParamError("messages", f"the chat template rejected the messages: {e}") from e
        if not continue_final:
            return text
        if (end := text.rfind(_CONTINUE)) < 0:
            raise ParamError("continue_final_message", "the chat template does not render the last message's content")
        return text[:end]


def chat_message(i: int, message) -> dict:
    """An OpenAI chat message as the template sees it: any role the template renders (OpenAI's, the deprecated
    `function`, a custom one), its content as a string, `name`, and tool calls (a deprecated `function_call`
    becomes one) with their arguments parsed."""
    if not isinstance(message, dict):
        raise ParamError(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or not role.strip():
        raise ParamError(f"messages[{i}].role", f"messages[{i}].role must be a non-empty string; got {role!r}")
    extra = {k: v for k in ("name", "tool_call_id") if isinstance(v := message.get(k), str)}
    calls = message.get("tool_calls") or ([{"id": f"call_{i}", "type": "function", "function": fc}]
                                          if (fc := message.get("function_call")) else None)  # fmt: skip
    if calls:
        extra["tool_calls"] = _tool_calls(i, calls)
    content = message.get("content")
    if content is None and extra.get("tool_calls"):
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ParamError(
                    f"messages[{i}].content[{j}]",
                    f'messages[{i}].content[{j}]: only {{"type": "text", "text": ...}} parts are supported',
                )
            texts.append(part["text"])
        content = "\n".join(texts)  # vLLM joins text parts with newlines for string-content templates
    if not isinstance(content, str):
        raise ParamError(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")
    return {"role": role, "content": content, **extra}


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool calls, their arguments parsed into objects for the template (as vLLM)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ParamError(param, f"{param} must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ParamError(f"{param}[{j}]", f"{param}[{j}] must have function.name and function.arguments strings")
        try:
            arguments = strict_json(fn["arguments"], MAX_JSON_DEPTH)  # (as bodies are parsed)
        except ValueError as e:
            raise ParamError(f"{param}[{j}]", f"{param}[{j}].function.arguments is not valid JSON: {e}") from e
        out.append({**call, "function": {"name": fn["name"], "arguments": arguments}})
    return out
