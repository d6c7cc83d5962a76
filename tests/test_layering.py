"""The product's imports run one way: no module of actors/, messages/, gpu/ or frontend/ reaches itself through its
imports (every import statement counts, typing-only and function-local ones too: a lazy import is still a
dependency), and each gpu/ package imports only its own modules and those of lower rank (gpu/__init__.py's table)."""

import ast
import concurrent.futures
import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("actors", "messages", "gpu", "frontend")
GPU_RANK = {
    "gpu.batch": 0,
    "gpu.kernels": 1,
    "gpu.distributed": 1,
    "gpu.sampling": 1,
    "gpu.attention": 2,
    "gpu.layers": 3,
    "gpu.models": 4,
    "gpu.loading": 5,
    "gpu.runner": 6,
}


def modules() -> dict[str, Path]:
    found = {}
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def parse(text: str) -> ast.Module:
    """ast.parse in a thread of its own with the cyclic collector paused: CPython 3.11's AST constructor checks the
    thread's recursion counter before and after, and raised "AST constructor recursion depth mismatch" once in a full
    suite run (the counter moved under it: a finalizer run by a collection, or a counter an earlier test left off)."""
    gc.disable()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(ast.parse, text).result()
    finally:
        gc.enable()


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules `name` imports (`from a import b` counts as a.b where that is a module, else as a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_reaches_back_to_its_module():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def rank(module: str) -> tuple[str, int] | None:
    return next(((pkg, r) for pkg, r in GPU_RANK.items() if module == pkg or module.startswith(pkg + ".")), None)


def test_gpu_packages_import_only_downward():
    upward = []
    for name, targets in graph().items():
        if not name.startswith("gpu."):
            continue
        here = rank(name)
        assert here is not None, f"{name}: a gpu/ package with no rank in GPU_RANK"
        for target in targets:
            assert not target.startswith(("actors", "frontend")), f"{name} imports {target}"
            there = rank(target)
            if there is not None and there[0] != here[0] and there[1] >= here[1]:
                upward.append(f"{name} (rank {here[1]}) imports {target} (rank {there[1]})")
    assert upward == []
