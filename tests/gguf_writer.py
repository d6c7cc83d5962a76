"""A GGUF file written from a tiny HF checkpoint by gguf-py's writer, as llama.cpp's converter writes it: the
architecture's hyper-parameters, SmolLM2's BPE tokenizer (tokens, merges, special ids, chat template), the tensors
under gguf-py's names with llama's q and k rows permuted for rotary as the converter does (`permute`) and Gemma's
norms stored as 1 + w (its `Gemma2Model.modify_tensors`), each in the type asked (F32, F16, BF16, or a block type
quantized by gguf-py), norms and biases in F32. Test-only: the reference the loader's reading must undo."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from gpu.layers.moe import expert_weight
from gpu.loading.config import weight_files
from gpu.loading.mapped import MappedFile

FLOAT = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
RANDOM = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`: rotary halves interleaved into pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model_dir: Path,
    out: Path,
    kind: gguf.GGMLQuantizationType,
    arch: str = "llama",
    values: dict | None = None,
    kinds: dict | None = None,
    rope_freqs: torch.Tensor | None = None,
    **split,
) -> Path:
    """`values`: filled with each matrix's value as the file holds it (float32, HF's name and row order); `kinds`: a
        projection's own type (by its module's name: {"v_proj": Q6_K}), else `kind`; `split`: gguf-py's
        split_max_tensors / split_max_size (files NAME-0000k-of-0000N.gguf; the first returned); `rope_freqs`: Llama 3.x's
    rotary factors tensor. A MoE model's experts are stacked per layer and projection (`ffn_{gate,up,down}_exps`,
    [experts, out, in], of the kind `kinds["experts.gate" / ".up" / ".down"]`, else `kinds["experts"]`, else
    `kind`), its router kept F32 as llama.cpp's quantizer keeps it."""
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
    w.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}  # (transformers 5 writes rope_theta in there)
    rope = rope.get("full_attention", rope)  # (Gemma 3's global layers'; llama.cpp's local base is 10000)
    w.add_rope_freq_base(float(config.get("rope_theta", rope.get("rope_theta", 10000.0))))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "longrope":  # (llama.cpp's Phi3MiniModel: the factors as tensors, two keys)
        orig = config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    if arch.startswith("gemma"):
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    w.add_vocab_size(config["vocab_size"])
    add_tokenizer(w, model_dir, config)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy())
    archs = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(archs[arch], config["num_hidden_layers"])
    rng, stacks, kinds = np.random.default_rng(0), {}, kinds or {}
    for f in map(MappedFile, weight_files(model_dir)):
        for hf in sorted(f.header, key=lambda name: name.startswith("lm_head")):  # (the head last, as llama.cpp's)
            base, _, suffix = hf.rpartition(".")
            two, expert = len(f.shape(hf)) == 2, expert_weight(hf)
            name = f"experts.{expert[0].rpartition('.')[2]}" if expert else base.rpartition(".")[2]
            own = kinds.get(name, kinds.get("experts", kind) if expert else kind)
            router = base.endswith((".block_sparse_moe.gate", ".mlp.gate"))
            as_kind = own if two and not router else gguf.GGMLQuantizationType.F32  # (norms and biases: F32)
            t = f.tensor(hf)
            t = t + 1 if arch.startswith("gemma") and base.endswith("norm") else t  # (the converter's 1 + w)
            data, held = stored(t, as_kind, rng, values is not None)
            if values is not None and two:
                values[hf] = torch.from_numpy(held)
            if arch == "llama" and base.endswith(("q_proj", "k_proj")):  # (rows: whole blocks)
                data = permute(data, heads if base.endswith("q_proj") else kv)
            raw = as_kind if data.dtype == np.uint8 else None
            if expert:
                stacks.setdefault(expert[0], ({}, raw))[0][expert[1]] = data
            else:
                w.add_tensor(f"{names.get_name(base)}.{suffix}", data, raw_dtype=raw)
    for stacked, (each, raw) in stacks.items():  # (model.layers.<i>.<mlp>.experts.<gate|up|down>)
        layer, proj = stacked.split(".")[2], stacked.rpartition(".")[2]
        w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([each[e] for e in sorted(each)]), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if not split else out.with_name(f"{out.stem}-00001-of-{len(w.tensors):05d}.gguf")


def stored(
    t: torch.Tensor, kind: gguf.GGMLQuantizationType, rng, value: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """(what the file stores for `t` as `kind`, the float32 value that holds): F32/F16 arrays; BF16's bits and
    gguf-py's quantized blocks as [rows, row bytes] bytes; the K formats, which gguf-py cannot quantize, random blocks
    of finite small scales (not `t`'s values, never read: the returned value is what the model then holds)."""
    a = t.float().numpy() if kind not in RANDOM else np.empty(t.shape, np.float32)
    if kind in FLOAT:
        return a.astype(FLOAT[kind]), a.astype(FLOAT[kind]).astype(np.float32)
    if kind == gguf.GGMLQuantizationType.BF16:  # (its bits, rounded to nearest even by torch)
        b = torch.from_numpy(a).bfloat16()
        return b.view(torch.int16).numpy().view(np.uint8).reshape(a.shape[0], -1), b.float().numpy()
    if kind in RANDOM:
        elems, size = gguf.GGML_QUANT_SIZES[kind]
        blocks = rng.integers(0, 256, (a.shape[0], a.shape[1] // elems, size), dtype=np.uint8)
        six = kind == gguf.GGMLQuantizationType.Q6_K
        scales = slice(208, 210) if six else slice(0, 4)
        d = rng.uniform(0.5, 1.5, (*blocks.shape[:2], (scales.stop - scales.start) // 2)).astype(np.float16)
        blocks[..., scales] = (d * (3e-5 if six else 2e-4)).view(np.uint8)
        blocks = blocks.reshape(a.shape[0], -1)
    else:
        blocks = gguf.quants.quantize(a, kind)
    return blocks, gguf.quants.dequantize(blocks, kind).reshape(a.shape) if value else None


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
