"""llama.cpp's own quantizers on fixed rows, saved for the suite (tests/golden/llama_cpp_blocks.npz, read by
tests/test_quantize_rows.py): the bytes that llama.cpp's `quantize_row_{q8_0,q4_0,q5_0,q4_K}_ref` write, called through
ctypes from a built libggml-base (../shared/notes/peers.md builds it), beside the rows and llama.cpp's version.

    python scripts/make_golden_blocks.py LIBGGML_BASE_SO [--out tests/golden/llama_cpp_blocks.npz]

Rows: 12 of 512 (two Q4_K blocks, sixteen of 32): normal x 3, heavy-tailed (Student's t, 2 degrees of freedom), one
with an all-zero block and one whose largest |x| comes twice with both signs. Written without pickle (np.savez).
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

FORMATS = {"q8_0": 34, "q4_0": 18, "q5_0": 22, "q4_K": 144}  # (llama.cpp's name: bytes a block)
ELEMS = {"q8_0": 32, "q4_0": 32, "q5_0": 32, "q4_K": 256}
OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "llama_cpp_blocks.npz"


def rows() -> np.ndarray:
    rng = np.random.default_rng(50)
    x = np.concatenate([rng.standard_normal((8, 512)) * 3, rng.standard_t(2, (4, 512))]).astype(np.float32)
    x[1, 256:288] = 0.0
    x[2, 7], x[2, 300] = 40.0, -40.0
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib", help="a built libggml-base.so")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    lib = ctypes.CDLL(args.lib)
    lib.ggml_commit.restype = lib.ggml_version.restype = ctypes.c_char_p
    x = rows()
    saved = {"x": x, "version": np.array(f"{lib.ggml_version().decode()} {lib.ggml_commit().decode()}")}
    for name, size in FORMATS.items():
        out = np.zeros(x.size // ELEMS[name] * size, np.uint8)
        fn = getattr(lib, f"quantize_row_{name}_ref")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn(x.ctypes.data, out.ctypes.data, x.size)
        saved[name] = out.reshape(x.shape[0], -1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **saved)
    print(f"{args.out}: llama.cpp {saved['version']}, {x.shape[0]} rows of {x.shape[1]}, {', '.join(FORMATS)}")


if __name__ == "__main__":
    main()
