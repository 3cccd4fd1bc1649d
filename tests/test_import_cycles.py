"""No import cycle among the modules of the core (``swiftlm/``) and of the bundled backends (``backends/torch``,
``backends/mlx``): each package's graph of imports, module-level and function-level alike (a function-level
import that only breaks a cycle still is one), read with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import swiftlm

CORE = Path(swiftlm.__file__).parent
BACKENDS = Path(__file__).parent.parent / "backends"

# package -> (its folder, the cycles allowed in it, each named); the test fails on a new cycle and on a listed
# one that no longer exists.
PACKAGES: dict[str, tuple[Path, set[frozenset[str]]]] = {
    "swiftlm": (CORE, set()),
    "swiftlm.backends.torch": (BACKENDS / "torch", set()),
    "swiftlm.backends.mlx": (BACKENDS / "mlx", set()),
}


def _modules(root: Path, package: str) -> dict[str, Path]:
    mods = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join([package, *parts])] = f
    return mods


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports anywhere in its source."""
    mods = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                # ``from pkg import mod`` names a module; ``from mod import name`` the module itself
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def test_graph_and_cycle_finder_on_a_known_graph(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")  # function level counts
    (pkg / "c.py").write_text("import p.a\n")
    (pkg / "d.py").write_text("from .sub import e\nfrom .a import y\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "e.py").write_text("from ..d import z\n")
    g = import_graph(pkg, "p")
    assert g["p.a"] == {"p.b"} and g["p.b"] == {"p.c"} and g["p.c"] == {"p.a"}
    assert g["p.d"] == {"p.sub.e", "p.a"} and g["p.sub.e"] == {"p.d"}
    assert sorted(map(sorted, cycles(g))) == [["p.a", "p.b", "p.c"], ["p.d", "p.sub.e"]]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle(package):
    root, known = PACKAGES[package]
    found = set(cycles(import_graph(root, package)))
    assert found - known == set(), "new import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found - known)
    assert known - found == set(), "gone (drop them from PACKAGES): " + "; ".join(sorted(map(str, known - found)))
