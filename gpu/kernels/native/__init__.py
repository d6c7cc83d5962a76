"""Native CPU kernels: a C++ extension (csrc/) built by `make setup` (build.py) once per ISA, AVX2 + FMA and AVX-512,
into the environment; the one this CPU runs is loaded at first use. Absent (no compiler, not built, an older build
than the sources, a CPU with neither ISA), callers get None and use torch's kernels, with one warning saying why.

`ops()` is the op namespace (torch.ops.sluice_<isa>): `panels(rows, cols, dtype) -> packed` (zeros; float32,
bfloat16 or float16 weights), `pack_into(packed, src, offset)` (rows of it), `pack(weight) -> packed`,
`panel_rows(packed, ids, out_features) -> float32 rows` (a tied embedding's lookup), `linear(x, packed,
out_features, bias, act=0) -> y`, `linear_out(x, packed, bias, y, act=0)` (act 1: GELU, erf's; csrc/linear.cpp
says what they guarantee) and `paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
window, softcap) -> out` (csrc/attention.cpp), `encoder_attention(q, k, v, lens, heads, scale, bias) -> out` (packed
encoder inputs: csrc/encoder_attention.cpp), `row_sum(x) -> [rows, 1]` (csrc/reduce.cpp), and the decoder's small steps `add_rms_norm`, `rope_and_write_kv`, `act_and_mul`
(csrc/fused.cpp; the kernel set of kernels.py), `huge_copy(t)` and `huge_empty(sizes, dtype)` (the memory the kernels stream weights from: linear.cpp), and the
block formats' `block_linear(x, blocks, kind, bias)`, `block_linear_out`, `block_rows(blocks, ids, kind, in)`
(csrc/blocks.cpp, block_values.cpp) and `quantize_rows(x, kind)` (csrc/quantize.cpp).
`torch.classes.sluice_<isa>.Decoder` is the layer loop as one call (csrc/decoder.cpp; built by
gpu/runner/native_loop.py).
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger("sluice.native")

BUILD_DIR = Path(sys.prefix) / "sluice-native"
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))  # (compiled; the headers they include count for staleness too)
ISAS = ("avx2", "avx512")  # what build.py builds, in preference order: the last this CPU runs is used
# (AVX-512 without VNNI, Skylake-SP's, runs the AVX2 build: the AVX-512 block kernels' products are VNNI's)
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma", "f16c"},
}


BUILT = BUILD_DIR / ".built"  # written once every ISA built (the Makefile's target: a failed build is tried again)


def library_path(isa: str) -> Path:
    return BUILD_DIR / isa / f"sluice_{isa}.so"


@functools.cache
def cpu_isas() -> tuple[str, ...]:
    """The built ISAs this CPU runs (its flags in /proc/cpuinfo; none elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return tuple(isa for isa in ISAS if _NEEDS[isa] <= flags)


def _unloadable(isa: str | None) -> str | None:
    """Why `isa`'s library (None: the widest this CPU runs) cannot be loaded, short of loading it; None if it can."""
    runs = cpu_isas()
    isa = isa or (runs[-1] if runs else None)
    if isa is None or isa not in runs:
        return f"this CPU does not run {isa or 'AVX2 or AVX-512'}"
    path = library_path(isa)
    if not path.exists():
        return f"{path} is not built (make setup builds it)"
    if any(s.stat().st_mtime > path.stat().st_mtime for s in (*SOURCES, *CSRC.glob("*.h"))):
        return f"{path} is older than its sources (make setup rebuilds it)"
    return None


def available() -> bool:
    """Whether `ops()` would find a library to load, without loading it (a process that only sizes a cache, as the
    scheduler does, reads this)."""
    return _unloadable(None) is None


@functools.cache
def ops(isa: str | None = None):
    """The kernels for `isa` (default: the widest this CPU runs), loaded once; None where they cannot be (why is
    logged once)."""
    why = _unloadable(isa)
    if why is not None:
        return _absent(why)
    runs = cpu_isas()
    path = library_path(isa or runs[-1])
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:  # (built for another torch, or cut short)
        return _absent(f"{path} does not load ({e}); make setup rebuilds it")
    return getattr(torch.ops, f"sluice_{isa or runs[-1]}")


def _absent(why: str) -> None:
    log.warning("native CPU kernels unavailable: %s; using torch's", why)
    return None
