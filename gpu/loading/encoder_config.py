"""An encoder checkpoint's configuration (config.json of a BERT-style model) and how its outputs are pooled: from
sentence-transformers' files where the directory has them (`modules.json`, its Pooling module's `config.json`,
`sentence_bert_config.json`'s `max_seq_length`, a Normalize module), overridden field by field by `--pooler-config`
(vLLM's flag: `{"pooling_type": "MEAN", "normalize": true}`), else CLS pooling, normalized (vLLM's default for
encoders).

A decoder family's checkpoint is served for pooling too (`DecoderPooling`: Qwen3-Embedding's recipe, the last
token's state by default). `is_pooling_model(path)` decides the runner `sluice serve DIR` picks: an encoder
architecture, or a decoder whose sentence-transformers files pool it. `pooling_config` reads either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from gpu.kernels.reference import ACTIVATIONS
from gpu.loading.config import ModelConfig, weight_files
from gpu.loading.errors import ModelLoadError
from gpu.loading.random_weights import RANDOM

# config.json's `architectures`: the encoder is what is served, whatever head the file names (its tensors skipped)
ENCODERS = tuple(f"{family}{head}" for family in ("Bert", "Roberta", "XLMRoberta", "MPNet")
                 for head in ("Model", "ForMaskedLM", "ForPreTraining", "ForSequenceClassification"))  # fmt: skip
PAD_POSITIONS = ("roberta", "xlm-roberta", "mpnet")  # model types whose positions count from the padding id
MPNET_BUCKETS = 32  # (the relative-position buckets HF's MPNet indexes, whatever its config says)
POOLING_TYPES = ("CLS", "MEAN", "MAX", "LAST")
ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_max_tokens": "MAX",
            "pooling_mode_lasttoken": "LAST"}  # fmt: skip
ST_NAMES = {"cls": "CLS", "mean": "MEAN", "max": "MAX", "lasttoken": "LAST"}  # (pooling_mode, sentence-transformers 6)


@dataclass(frozen=True)
class Pooling:
    """How an input's hidden states become its embedding."""

    pooling_type: str = "CLS"  # one of POOLING_TYPES: the first token's state, the mean, the max, the last token's
    normalize: bool = True  # L2-normalized

    @classmethod
    def override(cls, base: Pooling, raw: str, more: tuple[str, ...] = ()) -> tuple[Pooling, dict]:
        """`base` with --pooler-config's JSON fields (pooling_type, normalize) over it, and the fields of `more`."""
        try:
            fields = json.loads(raw)
            assert isinstance(fields, dict)
        except (ValueError, AssertionError) as e:
            raise ModelLoadError(f"--pooler-config: not a JSON object: {raw!r}") from e
        if unknown := set(fields) - {"pooling_type", "normalize", *more}:
            raise ModelLoadError(f"--pooler-config: unknown fields {sorted(unknown)}")
        kind = str(fields.get("pooling_type", base.pooling_type)).upper()
        if kind not in POOLING_TYPES:
            raise ModelLoadError(f"--pooler-config: pooling_type {kind!r} is not one of {', '.join(POOLING_TYPES)}")
        pooling = replace(base, pooling_type=kind, normalize=bool(fields.get("normalize", base.normalize)))
        return pooling, {k: fields[k] for k in more if k in fields}


@dataclass(frozen=True)
class EncoderConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_positions: int | None  # RoBERTa's padding id, positions counted from it + 1; None: from 0 (BERT's)
    relative_buckets: int  # MPNet's relative attention bias table's rows; 0: none (absolute positions alone)
    max_model_len: int  # sentence-transformers' max_seq_length where given, else the positions
    pooling: Pooling
    labels: tuple[str, ...]  # a cross-encoder's (BertForSequenceClassification: id2label, in order); () an embedder's
    score_sigmoid: bool  # a cross-encoder's score is its logit through a sigmoid (sentence-transformers' default for
    # one label, or its config's activation_fn), else the logit itself
    dimensions: tuple[int, ...]  # matryoshka (config.json's matryoshka_dimensions, or all for is_matryoshka): the
    # sizes a request's `dimensions` may cut an embedding to; () for a model not trained for it

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def from_path(cls, path: str | Path, pooler_config: str | None = None) -> EncoderConfig:
        path = Path(path)
        raw = _json(path / "config.json")
        arch = (raw.get("architectures") or [""])[0]
        if arch not in ENCODERS:
            raise ModelLoadError(f"{path}: architecture {arch!r} is not an encoder served here ({', '.join(ENCODERS)})")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"{path}: position_embedding_type {raw['position_embedding_type']!r} is not served")
        if weight_files(path)[0].name == RANDOM:  # (raises when weights are missing)
            raise ModelLoadError(f"{path}: random weights (--load-format dummy) are served for decoder models only")
        positions = int(raw.get("max_position_embeddings", 512))
        mpnet = raw.get("model_type") == "mpnet"
        pad = int(raw.get("pad_token_id", 1)) if raw.get("model_type") in PAD_POSITIONS else None
        pad = 1 if mpnet else pad  # (HF's MPNet counts from 1, whatever the config's padding id)
        buckets = int(raw.get("relative_attention_num_buckets", MPNET_BUCKETS)) if mpnet else 0
        if mpnet and buckets < MPNET_BUCKETS:
            raise ModelLoadError(f"{path}: relative_attention_num_buckets {buckets}: MPNet indexes {MPNET_BUCKETS}")
        usable = positions - (0 if pad is None else pad + 1)  # (RoBERTa's first pad + 1 rows are never a position)
        seq = served_length(path, usable)
        labels, sigmoid = _labels(path, raw, arch)
        if raw.get("hidden_act", "gelu") not in ACTIVATIONS:
            raise ModelLoadError(f"{path}: hidden_act {raw['hidden_act']!r} is not served ({', '.join(ACTIVATIONS)})")
        pooling = sentence_transformers_pooling(path) or Pooling()
        if pooler_config:
            pooling, _ = Pooling.override(pooling, pooler_config)
        try:
            return cls(
                path=path, architecture=arch, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]), max_position_embeddings=positions,
                type_vocab_size=0 if mpnet else int(raw.get("type_vocab_size", 2)), layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                hidden_act=raw.get("hidden_act", "gelu"), pad_positions=pad, relative_buckets=buckets,
                max_model_len=seq,
                pooling=pooling, dimensions=_matryoshka(raw), labels=labels, score_sigmoid=sigmoid,
            )  # fmt: skip
        except KeyError as e:
            raise ModelLoadError(f"{path}/config.json: missing {e.args[0]}") from None


def served_length(path: Path, positions: int) -> int:
    """The length sentence-transformers embeds (max_seq_length, else the tokenizer's model_max_length) within the
    model's `positions`; refuses a do_lower_case config (sentence-transformers lowercases the text before its
    tokenizer: not done here)."""
    st = _json(path / "sentence_bert_config.json")
    if st.get("do_lower_case"):
        raise ModelLoadError(f"{path}: sentence_bert_config.json's do_lower_case is not served")
    seq = st.get("max_seq_length") or _json(path / "tokenizer_config.json").get("model_max_length") or positions
    return min(int(seq), positions)


def sentence_transformers_pooling(path: Path) -> Pooling | None:
    """The Pooling of a sentence-transformers directory (modules.json: a Transformer, a Pooling, a Normalize; any
    other module, a Dense say, is refused: its output would not be the model's), or None without a Pooling."""
    modules = _json(path / "modules.json", [])
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    if other := set(kinds) - {"Transformer", "Pooling", "Normalize"}:
        raise ModelLoadError(f"{path}: sentence-transformers modules {sorted(other)} are not served")
    st = _json(path / kinds["Pooling"].get("path", "") / "config.json")
    named = st.get("pooling_mode")  # (sentence-transformers 6's: a name, or a list of them)
    named = [named] if isinstance(named, str) else named or []
    modes = [ST_NAMES.get(str(m).lower(), str(m)) for m in named]
    modes += [mode for key, mode in ST_MODES.items() if st.get(key)]
    unknown = [k for k, v in st.items() if k.startswith("pooling_mode_") and v and k not in ST_MODES]
    if len(modes) != 1 or modes[0] not in POOLING_TYPES or unknown:
        raise ModelLoadError(f"{path}: sentence-transformers pooling {st} is not one of {', '.join(POOLING_TYPES)}")
    return Pooling(pooling_type=modes[0], normalize="Normalize" in kinds)


def _labels(path: Path, raw: dict, arch: str) -> tuple[tuple[str, ...], bool]:
    """A classifier's labels in order, and whether its score is sigmoid(logit) (sentence-transformers' CrossEncoder)."""
    if not arch.endswith("ForSequenceClassification"):
        return (), False
    names = raw.get("id2label") or {str(i): f"LABEL_{i}" for i in range(int(raw.get("num_labels", 2)))}
    labels = tuple(names[str(i)] for i in range(len(names)))
    activation = (
        (raw.get("sentence_transformers") or {}).get("activation_fn")
        or raw.get("sbert_ce_default_activation_function")
        or _json(path / "config_sentence_transformers.json").get("activation_fn")  # (sentence-transformers 6's)
    )
    return labels, activation.endswith("Sigmoid") if activation else len(labels) == 1


def _matryoshka(raw: dict) -> tuple[int, ...]:
    """The embedding sizes a matryoshka model serves (vLLM's reading of config.json)."""
    if dims := raw.get("matryoshka_dimensions"):
        return tuple(sorted(int(d) for d in dims))
    return tuple(range(1, int(raw["hidden_size"]) + 1)) if raw.get("is_matryoshka") else ()


@dataclass(frozen=True)
class DecoderPooling:
    """A decoder served as an embedder (Qwen3-Embedding's recipe): its ModelConfig, and how its states are pooled
    (its sentence-transformers files, else the last token's state, normalized: vLLM's default for a decoder)."""

    model: ModelConfig
    pooling: Pooling
    dimensions: tuple[int, ...]
    labels: tuple[str, ...] = ()  # a yes/no reranker's: its "yes" token (one label; else none: an embedder)
    score_sigmoid: bool = False  # (a reranker's score: sigmoid(l_yes - l_no), the softmax's P(yes) over the two)
    score_tokens: tuple[int, int] | None = None  # a yes/no reranker's ("no", "yes") token ids (--pooler-config's
    # classifier_from_token, vLLM's hf-overrides field: Qwen3-Reranker's recipe)
    type_vocab_size: int = 1  # (no segments)

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def path(self) -> Path:
        return self.model.path

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len


def pooling_config(path: str | Path, pooler_config: str | None = None) -> EncoderConfig | DecoderPooling:
    """The model in `path` served for pooling: an encoder, or a decoder family's checkpoint as an embedder."""
    path = Path(path)
    if path.suffix == ".gguf" or _architecture(path) in ENCODERS:
        return EncoderConfig.from_path(path, pooler_config)
    model = ModelConfig.from_path(path)
    model = replace(model, max_model_len=served_length(path, model.max_model_len))
    pooling, more = sentence_transformers_pooling(path) or Pooling("LAST", True), {}
    if pooler_config:
        pooling, more = Pooling.override(pooling, pooler_config, ("classifier_from_token",))
    if (pair := more.get("classifier_from_token")) is None:
        return DecoderPooling(model, pooling, _matryoshka(_json(path / "config.json")))
    if {"pooling_type", "normalize"} & set(json.loads(pooler_config)):
        raise ModelLoadError("--pooler-config: a yes/no reranker (classifier_from_token) pools its last token's logits")
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t in vocab for t in pair)):
        raise ModelLoadError(
            f"--pooler-config: classifier_from_token must name two tokens of the vocabulary, not {pair!r}"
        )
    return DecoderPooling(
        model, Pooling("LAST", False), (), (pair[1],), True, score_tokens=(vocab[pair[0]], vocab[pair[1]])
    )


def is_pooling_model(path: str | Path) -> bool:
    """Whether `sluice serve DIR` serves the directory for pooling, not generation: an encoder, or a decoder whose
    sentence-transformers files pool it (an embedder saved as one: Qwen3-Embedding's)."""
    path = Path(path)
    if path.suffix == ".gguf" or not (path / "config.json").is_file():
        return False
    return _architecture(path) in ENCODERS or sentence_transformers_pooling(path) is not None


def _architecture(path: Path) -> str:
    return (_json(path / "config.json").get("architectures") or [""])[0]


def _json(path: Path, default=None):
    try:
        return json.loads(path.read_text()) if path.is_file() else ({} if default is None else default)
    except ValueError as e:
        raise ModelLoadError(f"{path}: not JSON ({e})") from None
