"""SamplingParams: OpenAI/vLLM semantics, sentinels that mean "off", and validation.

Validation runs in the frontend and the offline API, before anything reaches the engine; every
failure names the offending field (`ParamError.param`) so the HTTP layer can answer 400 with it.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

LOGIT_BIAS_LIMIT = 100.0
MAX_GUIDANCE_SCALE = 20.0

# What a response's logprobs are logprobs of (server-wide, vLLM's --logprobs-mode): the model's distribution
# (log_softmax of the raw logits), or the one actually sampled from (gpu/sampling/sampler.py says which steps).
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]

# The languages a structured output can be given in (issue 15; vLLM's `structured_outputs` keys, plus OpenAI's
# json_object): each compiled by xgrammar (actors/engine/grammar.py).
GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
# Fields that cannot be combined with a grammar: each could ban every token the grammar allows (or, min_tokens,
# the EOS that ends a complete output), leaving a row nothing to sample. Refused with a 400 naming the field.
GRAMMAR_EXCLUSIVE = ("min_tokens", "allowed_token_ids", "bad_words")


def child_seed(seed: int, index: int) -> int:
    """The seed of child `index` of an n > 1 request (vLLM: seed + index; child 0 keeps the parent's seed),
    wrapped into int64."""
    return (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)


class ParamError(ValueError):
    """A request field is invalid; `param` names it (OpenAI error body `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sizes that cost work for the whole life of a request (every step, every token):
    over one, the request is refused with a ParamError naming the field. vLLM has no such limits;
    the defaults are generous enough for any real client. `sluice serve --max-...` sets them."""

    max_n: int = 128  # choices per prompt
    max_logprobs: int = 20  # top-N logprobs and prompt_logprobs (vLLM's --max-logprobs)
    max_stop: int = 64  # stop strings: each decoded chunk is searched for every one
    max_stop_chars: int = 1024  # characters per stop string: up to this many are held back while streaming
    max_bad_words: int = 256  # each (with and without a leading space) is matched every step
    max_bad_word_chars: int = 256  # characters per bad word
    max_logit_bias: int = 1024  # logit_bias entries, added every step
    max_allowed_token_ids: int | None = None  # allowed_token_ids entries; None: the vocabulary size
    max_stop_token_ids: int = 1024  # stop_token_ids entries: each output token is checked against them
    max_choices: int = 256  # prompts x n: the engine requests one call may start
    max_total_tokens: int = 1 << 20  # sum over choices of prompt + max_tokens: the tokens one call may cost
    max_grammar_chars: int = 1 << 16  # characters of a structured output's spec (schema, regex, grammar, choices)


DEFAULT_LIMITS = RequestLimits()


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What a constrained request's output must match; the frontend compiled it once to validate it."""

    kind: GrammarKind
    # json: the JSON schema's text; regex: the pattern; choice: a JSON list of the strings; grammar: EBNF (GBNF);
    # structural_tag: xgrammar's structural tag as JSON text; json_object: "" (any JSON object)
    spec: str = ""


class BeamSearch(msgspec.Struct, frozen=True, kw_only=True):
    """Beam search (vLLM's use_beam_search): the engine keeps the `width` best sequences by cumulative logprob, and
    the choices of one prompt share one search, each answered with the beam of its rank (actors/engine/beams.py)."""

    width: int  # beams kept each step (the request's best_of, or n)
    length_penalty: float = 1.0  # an ended beam's score: cumulative logprob / length ** length_penalty (vLLM's)
    early_stopping: bool | Literal["never"] = False  # HF's and vLLM's: when `width` beams have ended, stop now
    # (true), once no running beam can score better (false), or never before max_tokens ("never")
    group: str = ""  # the search's name: the choices of one prompt share it
    rank: int = 0  # which of the best beams this choice is answered with (0: the best)


# What beam search ranks by (the model's own logprobs): the fields that would change them, with their neutral values
# (by attribute; the request field is BEAM_PARAMS' where it differs).
BEAM_PARAMS = {"structured": "structured_outputs", "bad_words_token_ids": "bad_words"}
BEAM_NEUTRAL = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "min_tokens": (0,), "logprobs": (None,), "prompt_logprobs": (None,), "guidance_scale": (1.0,),
    "structured": (None,), "bad_words_token_ids": (None, []),
}  # fmt: skip


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Per-request sampling and stopping parameters (sentinel values disable a transform)."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; prompt + output tokens
    presence_penalty: float = 0.0  # output tokens
    frequency_penalty: float = 0.0  # output tokens
    logit_bias: dict[int, float] | None = None  # clamped to +-100
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words tokenized by the frontend (each word with and without a leading space)
    bad_words_token_ids: list[list[int]] | None = None
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None  # top-N; 0 = only the sampled token's logprob
    prompt_logprobs: int | None = None
    max_tokens: int = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # classifier-free guidance: sample from l_u + s * (l_c - l_u), l_u the logits of an unconditional companion
    # sequence (the negative prompt, then the same output tokens); 1.0 = off
    guidance_scale: float = 1.0
    negative_prompt_token_ids: list[int] | None = None  # the companion's prompt (None: the model's BOS token alone)
    structured: StructuredOutput | None = None  # grammar-constrained output (None: unconstrained)
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share cached blocks (vLLM's)
    beam: BeamSearch | None = None  # beam search instead of sampling
    # the LoRA adapter the request runs with (the frontend's, from its `model`): the digest of the adapter's files
    # (gpu/loading/lora.py), which keys the engine's adapters and the prefix cache; None: the base model
    lora: str | None = None

    @property
    def guided(self) -> bool:
        return self.guidance_scale != 1.0

    @property
    def reads_output_until(self) -> float:
        """The output length up to which sampling reads the output so far: always with penalties or bad words,
        else until min_tokens (gpu/sampling/metadata.py's reads_output)."""
        reads = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        return math.inf if reads or self.bad_words_token_ids else self.min_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def verify(self, vocab_size: int, limits: RequestLimits | None = DEFAULT_LIMITS) -> None:
        """Raise ParamError for the first invalid field. `limits=None` checks validity only (the engine:
        the frontend that admitted the request enforced its limits)."""
        _int_in("n", self.n, 1, limits.max_n if limits else 1 << 31)
        _float_in("temperature", self.temperature, 0.0, 2.0e4)
        _float_in("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k < 1 << 31:
            raise ParamError("top_k", f"top_k must be -1 (off), 0 (off) or a positive int, got {self.top_k!r}")
        _float_in("min_p", self.min_p, 0.0, 1.0)
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, 1.0e4, lo_open=True)
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if limits is not None:
            self._verify_sizes(vocab_size, limits)
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                _token("logit_bias", tok, vocab_size)
                _finite("logit_bias", bias)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ParamError("allowed_token_ids", "allowed_token_ids must not be empty")
            _tokens("allowed_token_ids", self.allowed_token_ids, vocab_size)
        for seq in self.bad_words_token_ids or []:
            for tok in seq:
                _token("bad_words", tok, vocab_size)
        _int_in("min_tokens", self.min_tokens, 0, 1 << 31)
        _int_in("max_tokens", self.max_tokens, 1, 1 << 31)
        if self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            _int_in("seed", self.seed, -(1 << 63), (1 << 63) - 1)
        max_logprobs = limits.max_logprobs if limits else vocab_size
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, max_logprobs)
        if self.prompt_logprobs is not None:
            _int_in("prompt_logprobs", self.prompt_logprobs, 0, max_logprobs)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParamError("stop", "stop strings must be non-empty strings")
        _tokens("stop_token_ids", self.stop_token_ids, vocab_size)
        _float_in("guidance_scale", self.guidance_scale, 0.0, MAX_GUIDANCE_SCALE, lo_open=True)
        if self.negative_prompt_token_ids is not None:
            if not self.negative_prompt_token_ids:
                raise ParamError("negative_prompt", "negative_prompt must not be empty")
            _tokens("negative_prompt", self.negative_prompt_token_ids, vocab_size)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= 1024):
            raise ParamError("cache_salt", "cache_salt must be a string of 1 to 1024 characters")
        if self.structured is not None:
            for name in GRAMMAR_EXCLUSIVE:
                if getattr(self, name):
                    raise ParamError(name, f"{name} cannot be combined with structured outputs: the grammar decides")
        if self.beam is not None:
            self._verify_beam(vocab_size, limits)

    def _verify_beam(self, vocab_size: int, limits: RequestLimits | None) -> None:
        """Beam search ranks by the model's logprobs: temperature 0 or 1 (both: the model's own distribution), and
        nothing else that would change them; each step reads 2 x width candidates per beam."""
        b = self.beam
        _int_in("best_of", b.width, 1, min(limits.max_n if limits else 1 << 31, vocab_size // 2))
        _int_in("n", self.n, 1, b.width)
        _int_in("n", b.rank, 0, b.width - 1)
        _finite("length_penalty", b.length_penalty)
        if b.early_stopping not in (True, False, "never"):
            raise ParamError(
                "early_stopping", f'early_stopping must be true, false or "never", got {b.early_stopping!r}'
            )
        if self.temperature not in (0.0, 1.0):
            raise ParamError(
                "temperature", "beam search ranks beams by the model's logprobs: temperature must be 0 or 1"
            )
        for attr, neutral in BEAM_NEUTRAL.items():
            if getattr(self, attr) not in neutral:
                name = BEAM_PARAMS.get(attr, attr)
                raise ParamError(
                    name, f"{name} cannot be combined with beam search: it ranks beams by the model's logprobs"
                )

    def _verify_sizes(self, vocab_size: int, limits: RequestLimits) -> None:
        """The per-request sizes bounded by `limits`, checked before anything iterates over them."""
        _at_most("stop", len(self.stop), limits.max_stop, "stop strings")
        for s in self.stop:
            if isinstance(s, str):
                _at_most("stop", len(s), limits.max_stop_chars, "characters in a stop string")
        _at_most("bad_words", len(self.bad_words or ()), limits.max_bad_words, "bad words")
        for w in self.bad_words or ():
            if not isinstance(w, str):
                raise ParamError("bad_words", "bad_words must be strings")
            _at_most("bad_words", len(w), limits.max_bad_word_chars, "characters in a bad word")
        _at_most("logit_bias", len(self.logit_bias or ()), limits.max_logit_bias, "logit_bias entries")
        max_allowed = vocab_size if limits.max_allowed_token_ids is None else limits.max_allowed_token_ids
        _at_most("allowed_token_ids", len(self.allowed_token_ids or ()), max_allowed, "allowed_token_ids entries")
        _at_most("stop_token_ids", len(self.stop_token_ids), limits.max_stop_token_ids, "stop_token_ids entries")
        if self.structured is not None:
            size = len(self.structured.spec)
            _at_most("structured_outputs", size, limits.max_grammar_chars, "characters in the grammar")

    def clamped_logit_bias(self) -> dict[int, float]:
        return {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, b)) for t, b in (self.logit_bias or {}).items()}


def _finite(param: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(param, f"{param} must be a finite number, got {value!r}")
    return float(value)


def _float_in(param: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    v = _finite(param, value)
    if v > hi or v < lo or (lo_open and v == lo):
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise ParamError(param, f"{param} must be in {lo_s}, {hi}], got {value!r}")


def _int_in(param: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(param, f"{param} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ParamError(param, f"{param} must be in [{lo}, {hi}], got {value}")


def _at_most(param: str, size: int, limit: int, what: str) -> None:
    if size > limit:
        raise ParamError(param, f"{param}: {size} {what}, more than the {limit} allowed")


def _tokens(param: str, tokens: list, vocab_size: int) -> None:
    """Every entry a token id: at C speed for a list of ints (what msgspec decodes), entry by entry otherwise."""
    if tokens and all(type(t) is int for t in tokens) and min(tokens) >= 0 and max(tokens) < vocab_size:
        return
    for tok in tokens:
        _token(param, tok, vocab_size)


def _token(param: str, tok, vocab_size: int) -> None:
    if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
        raise ParamError(param, f"{param}: token id {tok!r} is outside the vocabulary [0, {vocab_size})")
