"""A GGUF file's card: a small HF-style directory in the cache holding what the engine and the front read besides the
weights (config.json, tokenizer files, chat template, generation_config.json) and `gguf.json`, the GGUF files whose
tensors the loader maps in place (gpu/loading/gguf_file.py): no weight is converted or copied.

The card is made once per file (its name carries the file's path, size and mtime: a changed or moved file gets a new
card) by
transformers' GGUF readers (the architecture's hyper-parameters, the tokenizer from `tokenizer.ggml.*`, the chat
template: read once per metadata, `gguf/readings/<digest>`, which a model's quantizations share), written into a
temporary sibling and renamed into place (the card exists if and only if it is complete).
config.json's `dtype` is the weights' float type where every matrix is one (F16, BF16), else float32; the fields
transformers' reading leaves out (its config classes' defaults) are read from the metadata as llama.cpp reads them
(`_fields`). A split model
(`NAME-00001-of-0000N.gguf`) is named by its first file; the card lists every part.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from gpu.loading.convert import cache_dir
from gpu.loading.errors import ModelLoadError

CARD_FORMAT = 3  # (raised when a card's contents change: a card written by an older Sluice is not reused)
SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
FLOAT_TYPES = {"F16": "float16", "BF16": "bfloat16"}
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # (Phi-3's longrope, as llama.cpp's)


def parts_of(path: Path) -> list[Path]:
    """The files of a model: a split model's every part (from its first), else the file alone."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    if m[2] != "00001":
        raise ModelLoadError(f"{path}: name a split model by its first part ({m[1]}-00001-of-{m[3]}.gguf)")
    parts = [path.with_name(f"{m[1]}-{i:05d}-of-{m[3]}.gguf") for i in range(1, int(m[3]) + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path}: parts of the split model are missing: {', '.join(missing)}")
    return parts


def gguf_model_name(file: str | Path) -> str:
    """The model a GGUF file holds, by name: its stem, a split file's without `-0000N-of-0000M`."""
    return re.sub(r"-\d{5}-of-\d{5}$", "", Path(file).stem)


def gguf_card(path: str | Path) -> Path:
    """The card directory of a .gguf, made on first use."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    parts = parts_of(path)
    stat = path.stat()
    where = hashlib.sha256(f"{CARD_FORMAT}:{path}".encode()).hexdigest()[:12]  # (moved, another file, an older card)
    card = cache_dir() / "gguf" / f"{path.stem}-{where}-{stat.st_size}-{stat.st_mtime_ns}"
    if card.is_dir():
        return card
    (card.parent / "readings").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{card.name}.tmp-", dir=card.parent))
    try:
        _write(path, parts, tmp)
        try:
            tmp.rename(card)
        except OSError:
            if not card.is_dir():  # (else a concurrent start won the race: keep its card)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return card


def _write(path: Path, parts: list[Path], out: Path) -> None:
    from gpu.loading.gguf_file import GGUFFile

    first = GGUFFile(path)  # (a file that is not GGUF is refused here, by name)
    files = [first, *(GGUFFile(part, meta=first.meta) for part in parts[1:])]
    kinds = {f.header[n][0].name for f in files for n in f.header if len(f.shape(n)) == 2}
    head = any("output.weight" in f.header for f in files)  # (in any part: transformers looks in the first only)
    reading = cache_dir() / "gguf" / "readings" / _digest(first.meta, head)
    if not reading.is_dir():  # (one reading per metadata: a model's quantizations share it)
        scratch = Path(tempfile.mkdtemp(prefix=f".{reading.name}.tmp-", dir=reading.parent))
        try:
            _read(first, scratch)
            scratch.rename(reading)
        except OSError:
            if not reading.is_dir():  # (else a concurrent start read it first)
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(reading, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = FLOAT_TYPES.get(kinds.pop(), "float32") if len(kinds) == 1 else "float32"
    config["tie_word_embeddings"] = not head
    factors = [next((f.tensor(n).tolist() for f in files if n in f.header), None) for n in LONGROPE_FACTORS]
    config |= _fields(first.meta, first.arch, config, factors)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "gguf.json").write_text(json.dumps({"files": [str(p) for p in parts]}))
    out.chmod(0o755)


def _read(first, out: Path) -> None:
    """transformers' reading of the file's metadata: config.json, generation_config.json, the tokenizer's files.
    `first`: the (first) file, parsed (gpu/loading/gguf_file.py), which transformers' config reader is handed in
    place of gguf-py's GGUFReader (`GGUFFile.as_reader`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gguf
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS

    path, reader = first.path, gguf.GGUFReader
    gguf.GGUFReader = lambda _, *args, **kwargs: first.as_reader()  # (transformers imports it at each call)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # (transformers' readers name what they cannot take)
        raise ModelLoadError(f"{path}: cannot read its architecture or tokenizer: {e}") from e
    finally:
        gguf.GGUFReader = reader
    config.architectures = [CAUSAL_LMS.get(config.model_type, config.model_type)]  # (a GGUF names none)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def _fields(meta: dict, arch: str, config: dict, factors: list) -> dict:
    """What transformers' reading leaves out of `config` (it maps a few keys per architecture and takes its config
    class's defaults for the rest), read from the metadata as llama.cpp reads it:
    - every family: the heads' width (`attention.key_length`: Qwen3's 128 is not hidden / heads) and the share of it
      rotary turns (`rope.dimension_count`: Phi-3's partial rotary);
    - longrope (Phi-3 128k, Phi-3.5): `factors`, the long and short factors per frequency (the file's
      rope_factors_long/short tensors, None where it has none), with the original context length and the attention
      factor from `rope.scaling.*`;
    - Gemma 2: the soft-caps; Gemma 2 and 3: the queries' scale, which no key holds: llama.cpp takes the heads' width
      but for the 27B models (46 and 62 layers), hidden / heads; Gemma 3's global layers' linear rotary scaling;
    - MoE: llama.cpp writes Mixtral as `llama` with experts; Qwen3-MoE's experts' width is
      `expert_feed_forward_length`."""
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    head_dim = int(key("attention.key_length", 0)) or config["hidden_size"] // config["num_attention_heads"]
    rope = dict(config.get("rope_parameters") or {})  # (transformers 5's; per layer type for Gemma 3)
    fields = {"head_dim": head_dim, "rope_parameters": rope}
    if rotary := key("rope.dimension_count"):  # (in rope_parameters where they are one dict: transformers 5's Phi-3)
        (fields if "full_attention" in rope or not rope else rope)["partial_rotary_factor"] = int(rotary) / head_dim
    if any(f is not None for f in factors) and not all(factors):
        missing = next(n for n, f in zip(LONGROPE_FACTORS, factors, strict=True) if not f)
        raise ModelLoadError(f"{missing} is missing or empty beside the other longrope factors")
    if all(factors):
        orig = int(key("rope.scaling.original_context_length", config["max_position_embeddings"]))
        rope |= {"rope_type": "longrope", "long_factor": factors[0], "short_factor": factors[1],
                 "original_max_position_embeddings": orig}  # fmt: skip
        if (attention := key("rope.scaling.attn_factor")) is not None:  # (else HF's, from the lengths)
            rope["attention_factor"] = float(attention)
        fields["original_max_position_embeddings"] = orig  # (HF's Phi-3 keeps it beside the scaling, and lets it win)
    if arch == "gemma2":
        fields |= {
            "attn_logit_softcapping": key("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": key("final_logit_softcapping", 30.0),
        }  # fmt: skip (llama.cpp's defaults)
    if arch in ("gemma2", "gemma3"):
        big = config["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[arch]
        fields["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
    if arch == "gemma3" and key("rope.scaling.type") == "linear" and (factor := key("rope.scaling.factor", 1.0)) != 1:
        rope["full_attention"] = {**rope.get("full_attention", {}), "rope_type": "linear", "factor": float(factor)}
    experts, width = int(key("expert_count", 0)), key("expert_feed_forward_length")
    if experts and arch == "llama":
        if not (used := int(key("expert_used_count", 0))):
            raise ModelLoadError(f"{arch}.expert_count is {experts} but {arch}.expert_used_count is missing or 0")
        fields |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts}
        fields |= {"num_experts_per_tok": used} | ({"intermediate_size": int(width)} if width else {})
    elif experts and arch == "qwen3moe" and width:
        fields["moe_intermediate_size"] = int(width)
    return fields


FILE_KEYS = ("general.file_type", "general.quantization_version", "split.")  # (what differs between quantizations)


def _digest(meta: dict, head: bool) -> str:
    """A digest of the metadata but for FILE_KEYS, and of whether the file has an output head (transformers reads
    tied embeddings from its absence): equal for the quantizations of one model."""
    digest = hashlib.sha256(b"head" if head else b"tied")
    for key in sorted(k for k in meta if not k.startswith(FILE_KEYS)):
        value = meta[key]
        digest.update(key.encode() + (value.tobytes() if hasattr(value, "tobytes") else repr(value).encode()))
    return digest.hexdigest()[:32]
