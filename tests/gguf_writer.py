"""A GGUF file written from a tiny HF checkpoint by gguf-py's writer, as llama.cpp's converter writes it: the
architecture's hyper-parameters, SmolLM2's BPE tokenizer (tokens, merges, special ids, chat template), the tensors
under gguf-py's names with llama's q and k rows permuted for rotary as the converter does (`permute`), each in the type
asked (F32, F16, BF16, or a block type quantized by gguf-py), norms and biases in F32. Test-only: the reference the
loader's reading must undo."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

FLOAT = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`: rotary halves interleaved into pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, kind: gguf.GGMLQuantizationType, arch: str = "llama", **split) -> Path:
    """`split`: gguf-py's split_max_tensors / split_max_size (files NAME-0000k-of-0000N.gguf; the first returned)."""
    config = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(out, arch, **split)
    w.add_name(f"tiny {arch}")
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_vocab_size(config["vocab_size"])
    add_tokenizer(w, model_dir, config)
    kinds = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(kinds[arch], config["num_hidden_layers"])
    for hf, t in load_file(model_dir / "model.safetensors").items():
        base, _, suffix = hf.rpartition(".")
        a = t.float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            a = permute(a, heads if base.endswith("q_proj") else kv)
        add(w, f"{names.get_name(base)}.{suffix}", a, kind if a.ndim == 2 else gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if not split else out.with_name(f"{out.stem}-00001-of-{len(w.tensors):05d}.gguf")


def add(w: gguf.GGUFWriter, name: str, a: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
    if kind in FLOAT:
        w.add_tensor(name, a.astype(FLOAT[kind]))
    elif kind == gguf.GGMLQuantizationType.BF16:  # (its bits, rounded to nearest even by torch)
        bits = torch.from_numpy(a).bfloat16().view(torch.int16).numpy().view(np.uint8)
        w.add_tensor(name, bits.reshape(a.shape[0], -1), raw_dtype=kind)
    else:  # (the blocks' bytes, [rows, row bytes]: gguf-py derives the shape)
        w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)


def add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if vocab[t] in special else 1 for t in tokens])  # (control, normal)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(config.get("bos_token_id", 1))
    w.add_eos_token_id(config.get("eos_token_id", 2))
    w.add_chat_template((model_dir / "chat_template.jinja").read_text())
