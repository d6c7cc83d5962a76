"""Every Triton kernel the product launches compiles for an H100 (sm_90, through Triton's own ptxas) on a machine
without a GPU: the interpreter that runs them on CPU checks no types, so a branch that only a compiler would refuse
(a dtype mismatch, an int64 offset cast, a constexpr used as a value) is found here, not on a card's few minutes.

KERNELS names each kernel (module, name) with its argument types (pointers as the GPU path launches them: bfloat16
activations and caches, float32 scratch, int64 indices; integers not named are i32) and the constexpr variants it is
launched in. test_every_launched_kernel_is_listed holds the table to the source: a new kernel in gpu/ fails it until
it is listed. Run as a script (`python tests/test_triton_compile.py`), it compiles them; the test runs that in a
subprocess, TRITON_INTERPRET off (the suite's processes interpret: tests/conftest.py)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BF16, F32, I64 = "*bf16", "*fp32", "*i64"
ATTENTION = dict(out=BF16, q=BF16, k_cache=BF16, v_cache=BF16, partials=F32, block_tables=I64, seq_lens=I64)
ATTENTION |= dict(query_start=I64, scale="fp32", softcap="fp32")
HEADS = dict(NUM_HEADS=6, HEAD_DIM=80, HEAD_DIM_PAD=128)  # (GQA 3, a head_dim not a power of two)
TILES = dict(GROUP=3, BLOCK_SIZE=16, BLOCK_Q=5, BLOCK_M=16, SOFTCAP=True, PRECISION="tf32")
RAW = dict(raw=BF16)
PREPARE = RAW | dict(x=F32, starts=I64, tokens=I64, values=F32, penalties=F32)
SAMPLE = dict(x=F32, params="*fp64", greedy="*i1", u="*fp64", seed_index=I64, seeds=I64, positions=I64, out=I64)
SAMPLE |= RAW | dict(tops=F32, log_totals=F32, lps=F32, ranks=I64)
ROPE = dict(q=BF16, k=BF16, v=BF16, q_out=BF16, k_cache=BF16, v_cache=BF16, cos=BF16, sin=BF16, slots=I64)
GQA8 = dict(HEAD_DIM=128, ROT_DIM=128, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_D=128)  # (Llama-3.1-8B's heads)
SAMPLER_OPTIONS = {"num_warps": 8}
# (module, kernel): (pointer and float argument types, constexpr variants, compile options)
KERNELS = {
    ("gpu.kernels.triton.attention", "_attention_kernel"): (
        ATTENTION,
        [HEADS | TILES | {"SPLIT": split, "TILE_N": "TILE_N", "DOT": "bfloat16"} for split in (False, True)],
        {},
    ),
    ("gpu.kernels.triton.attention", "_reduce_kernel"): (dict(out=BF16, partials=F32), [HEADS | {"SPLITS_PAD": 4}], {}),
    ("gpu.kernels.triton.fused", "_rope_kv_kernel"): (ROPE, [GQA8, dict(GQA8, ROT_DIM=64)], {}),
    ("gpu.kernels.triton.fused", "_add_rms_norm_kernel"): (
        dict(x=BF16, residual=BF16, weight=BF16, out=BF16, eps="fp32", offset="fp32"),
        [dict(HAS_RESIDUAL=r, ROUND_NORMED=n, BLOCK=4096) for r in (True, False) for n in (True, False)],
        {},
    ),
    ("gpu.kernels.triton.fused", "_act_and_mul_kernel"): (dict(x=BF16, out=BF16), [{"ACT": 0, "BLOCK": 1024}], {}),
    ("gpu.kernels.triton.lora", "_shrink"): (
        dict(x=BF16, a=BF16, slots=I64, xa=F32),
        [{"BLOCK_J": "BLOCK_J", "BLOCK_K": "BLOCK_K"}],
        {},
    ),
    ("gpu.kernels.triton.lora", "_expand"): (
        dict(xa=F32, b=BF16, slots=I64, y=BF16),
        [{"BLOCK_O": "BLOCK_O", "BLOCK_R": 16}],
        {},
    ),
    ("gpu.sampling.threshold_triton", "_draw_kernel"): (
        dict(x=F32, row_max=F32, cols="*fp64", rows=I64, out=I64),
        [{"BLOCK": 2048}],
        SAMPLER_OPTIONS,
    ),
    ("gpu.sampling.fused_triton", "_prepare_kernel"): (
        PREPARE,
        [{"EDITS": on, "BLOCK": 2048} for on in (True, False)],
        SAMPLER_OPTIONS | {"enable_fp_fusion": False},
    ),
    ("gpu.sampling.fused_triton", "_sample_kernel"): (
        SAMPLE,
        [{"LOGPROBS": on, "BLOCK": 2048} for on in (True, False)],
        SAMPLER_OPTIONS,
    ),
}


def constant(module, value):
    """A variant's value: a string names the module's constant (its tile sizes), or triton.language's dtype."""
    import triton.language as tl

    if isinstance(value, str) and hasattr(module, value):
        return getattr(module, value)
    return getattr(tl, value) if value in ("bfloat16", "float16", "float32") else value


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for (module_name, name), (types, variants, options) in KERNELS.items():
        module = importlib.import_module(module_name)
        fn = getattr(module, name)
        for variant in variants:
            constexprs = {k: constant(module, v) for k, v in variant.items()}
            signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
            kernel = triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)
            assert kernel.asm["cubin"], (name, variant)
            print(f"{module_name}.{name} {constexprs}: {len(kernel.asm['cubin'])} bytes of sm_90 code")


def launched_kernels() -> set[tuple[str, str]]:
    """(module, name) of each @triton.jit function in gpu/ that its module launches (`name[grid](...)`)."""
    found = set()
    for path in (ROOT / "gpu").rglob("*.py"):
        text = path.read_text()
        for name in re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+)\(", text):
            if re.search(rf"\b{name}\[", text):
                found.add((".".join(path.relative_to(ROOT).with_suffix("").parts), name))
    return found


def test_every_launched_kernel_is_listed():
    assert launched_kernels() == set(KERNELS)


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {
        "TRITON_CACHE_DIR": str(tmp_path),
        "TRITON_DEFAULT_FP_FUSION": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("sm_90 code") == sum(len(v[1]) for v in KERNELS.values())


if __name__ == "__main__":
    compile_all()
