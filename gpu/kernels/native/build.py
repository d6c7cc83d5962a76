"""Build the native CPU kernels (gpu/kernels/native/csrc) with the machine's C++ compiler and ninja, through torch's
cpp_extension: one library per ISA, side by side, never `-march=native` (a binary for this CPU could crash on
another): AVX2 + FMA + F16C, and AVX-512 with VNNI. `make setup` runs it; a machine without a compiler gets a clear message and the
torch fallback (gpu/kernels/native/__init__.py). Idempotent: ninja rebuilds only what changed.

    python -m gpu.kernels.native.build
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

from gpu.kernels.native import BUILD_DIR, BUILT, ISAS, SOURCES, library_path

log = logging.getLogger("sluice.native")

BUILD_TIMEOUT_S = 900  # one ISA's library (~30 s on 2 cores)
FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"],
}


def build(isa: str) -> None:
    from torch.utils import cpp_extension

    out = BUILD_DIR / isa
    out.mkdir(parents=True, exist_ok=True)
    (out / "lock").unlink(missing_ok=True)  # (cpp_extension's, left by a build that was killed: it would wait forever)
    cpp_extension.load(
        name=f"sluice_{isa}",
        sources=[str(s) for s in SOURCES],
        extra_cflags=["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", f"-DSLUICE_NS=sluice_{isa}", *FLAGS[isa]],
        extra_ldflags=["-fopenmp"],  # (torch's parallel_for is OpenMP's in its CPU build)
        build_directory=str(out),
        is_python_module=False,
        verbose=False,
    )  # (it loads what it built: only the ISA this CPU runs is built in this process, the other in a child)


def main() -> int:
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # (ninja's
    compiler = shutil.which("c++") or shutil.which("g++")  # wheel in the environment, whether it is active or not)
    if compiler is None or shutil.which("ninja") is None:
        print("native CPU kernels not built: no C++ compiler or ninja found; Sluice uses torch's kernels instead")
        return 0
    built = 0
    for isa in ISAS:
        t0 = time.monotonic()
        try:
            _build_in_child(isa)
        except Exception as e:  # (a compiler that cannot build it, or a build past BUILD_TIMEOUT_S: torch's kernels)
            print(f"native CPU kernels ({isa}) not built: {e}; Sluice uses torch's kernels for it")
            continue
        built += 1
        print(f"native CPU kernels ({isa}): {library_path(isa)} ({time.monotonic() - t0:.0f} s)")
    if built == len(ISAS):
        BUILT.touch()
    return 0


def _build_in_child(isa: str) -> None:
    """Build in a process of its own: cpp_extension loads what it built, and a library for an ISA this CPU lacks
    must never be loaded here (the child may die of loading it, by a signal: the build is done then; a failed build
    exits with an error, and an older library left in place must not pass for it)."""
    import subprocess

    code = f"from gpu.kernels.native.build import build; build({isa!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode > 0 or not library_path(isa).exists():
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()] or done.stderr.splitlines()
        raise RuntimeError(errors[0] if errors else f"exit {done.returncode}")


if __name__ == "__main__":
    sys.exit(main())
