"""Random-weight checkpoints of real shapes, for measuring memory and speed at the sizes people serve (speed and memory
do not depend on the weights' values): built and saved by HF transformers as bfloat16 safetensors in shards of 2 GB,
beside SmolLM2's tokenizer files (the vocabulary is SmolLM2's, 49152 tokens).

    python scripts/make_test_models.py {3b,1b} OUT_DIR
    python scripts/make_test_models.py {q4_k_m,q8_0} SRC_DIR OUT.gguf

- 3b: Llama-3.2-3B's shape (hidden 3072, 28 layers, 24 heads of 128, 8 KV heads, intermediate 8192, tied
  embeddings): 2.97B parameters, 5.9 GB, ~2 minutes on 2 cores.
- 1b: Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, intermediate 8192, tied): 1.07B, 2.1 GB.
- q4_k_m, q8_0: a GGUF of SRC_DIR's shapes and tokenizer written by tests/gguf_writer.py, random Q4_K blocks with
  Q6_K for the embedding, v and down (llama.cpp's Q4_K_M puts Q6_K on those, v and down in some layers only: this file
  is a little larger), or gguf-py's Q8_0 of SRC_DIR's weights. (Without llama.cpp's own quantizer here: convert and
  quantize with llama.cpp as ../shared/notes/peers.md says where it is built.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import gguf
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.loading.convert import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

SHAPES = {
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
               intermediate_size=8192),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192),
}  # fmt: skip


Q = gguf.GGMLQuantizationType
GGUF_TYPES = {"q4_k_m": (Q.Q4_K, {"embed_tokens": Q.Q6_K, "v_proj": Q.Q6_K, "down_proj": Q.Q6_K}), "q8_0": (Q.Q8_0, {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=[*SHAPES, *GGUF_TYPES])
    ap.add_argument("paths", type=Path, nargs="+", help="OUT_DIR, or SRC_DIR OUT.gguf")
    args = ap.parse_args()
    if args.shape in GGUF_TYPES:
        from tests.gguf_writer import write_gguf

        kind, kinds = GGUF_TYPES[args.shape]
        t0 = time.monotonic()
        write_gguf(args.paths[0], args.paths[1], kind, kinds=kinds)
        print(f"{args.paths[1]}: {args.paths[1].stat().st_size / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s")
        return
    args.out = args.paths[0]
    config = transformers.LlamaConfig(
        **SHAPES[args.shape], vocab_size=49152, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2, dtype="bfloat16",
    )  # fmt: skip
    t0 = time.monotonic()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # (built in bfloat16: never a float32 copy of the model)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(args.out, max_shard_size="2GB")
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir() / name, args.out / name)
    (args.out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {params / 1e9:.2f}B parameters in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
