"""Markers by what a test needs, found from its code.

Every collected test gets the markers below whose patterns occur in its own source, in the source of the
fixtures it uses (transitively) or in the module-level helper functions those call (transitively).  A marker
written on a test or module by hand is kept as well.  The fast tier (``scripts/test.sh --fast``) is every test
with none of ``HEAVY``.  ``pytest -m server``, ``-m "interp or gpu"`` and so on run any subset.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from functools import cache

# marker -> (what it means, source patterns that imply it)
MARKERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "server": (
        "starts a `swiftlm serve` process",
        ("ServerProc(", '"serve"', "'serve'"),
    ),
    "model": (
        "loads a real torch or MLX model in this process (the bundled SmolLM2 or a generated checkpoint)",
        (
            "LLM(",
            "AsyncLLM(",
            "load_engine(",
            "build_engine(",
            "make_engine(",
            "load_model(",
            "backend.load(",
            "Backend().load(",
            "mlx_lm.load(",
            "from_pretrained(",
            '"torch_llm"',
            '"mlx_llm"',
            "tiny_llm",
        ),
    ),
    "checkpoint": (
        "writes a checkpoint with scripts/make_checkpoint.py (a subprocess)",
        ("make_ckpt(", "make_checkpoint"),
    ),
    "subprocess": (
        "runs the CLI or a script in a Python subprocess",
        ("run_cli(", "subprocess.", "Popen("),
    ),
    "jit": (
        "compiles numba kernels (seconds to minutes of compilation the first time in a process)",
        ("numba",),
    ),
    "interp": (
        "runs Triton kernels under TRITON_INTERPRET=1",
        ("TRITON_INTERPRET",),
    ),
    "multiproc": (
        "spawns ranks, replicas or an engine process",
        (
            "mlx.launch",
            "torch.multiprocessing",
            "mp.spawn",
            "--tensor-parallel",
            "--pipeline-parallel",
            "--data-parallel",
            "tensor_parallel=",
            "pipeline_parallel=",
            "data_parallel=",
            "engine_process=",
            "--engine-process",
        ),
    ),
    "install": (
        "builds wheels or fresh virtual environments",
        ("install.sh", "bundle.sh", "uninstall.sh", '"venv"', "-m venv", "pip wheel", '"build"', "pipx", "uv tool"),
    ),
    "fuzz": (
        "property-based or schema fuzzing (schemathesis, hypothesis)",
        ("schemathesis", "hypothesis"),
    ),
    "gpu": (
        "needs a CUDA GPU (skipped without one)",
        ("needs_cuda", "cuda.is_available()"),
    ),
    "metal": (
        "needs Apple's Metal (skipped elsewhere)",
        ("needs_metal", "metal_available"),
    ),
}
# what the fast tier leaves out (the slow marker is written by hand on a test)
HEAVY = ("server", "model", "subprocess", "jit", "interp", "multiproc", "install", "fuzz", "slow")
FAST_EXPR = "not (" + " or ".join(HEAVY) + ")"

# fixtures that are light by design (the fake backend plugin): not looked into
LIGHT_FIXTURES = {"fake_llm", "fake_app", "fake_replies"}

_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def _source(obj) -> str:
    try:
        return _source_cached(obj)
    except TypeError:  # unhashable
        return _source_uncached(obj)


@cache
def _source_cached(obj) -> str:  # a fixture or helper is looked up for every test that uses it
    return _source_uncached(obj)


def _source_uncached(obj) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return ""


@cache
def _module_toplevel(module) -> str:
    """A test module's own statements outside its functions and classes (imports, importorskip, pytestmark)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return ""
    keep = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


@cache
def _module_functions(module) -> dict[str, str]:
    """Module-level functions (and classes) of a test module, by name -> source."""
    out = {}
    for name, obj in vars(module).items():
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == module.__name__:
            out[name] = _source(obj)
    return out


def _strip_docstrings(src: str) -> str:
    """The code without docstrings and comments (a docstring that mentions a server must not mark a test)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return src
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                body[0] = ast.Pass()
    return ast.unparse(tree)


@cache
def _code(src: str) -> str:
    return _strip_docstrings(src) if src else ""


def needs(item) -> set[str]:
    """The markers implied by what ``item`` runs."""
    module = getattr(item, "module", None)
    helpers = _module_functions(module) if module is not None else {}
    sources: list[str] = []
    seen: set[str] = set()

    def add(src: str) -> None:
        code = _code(src)
        if not code or code in seen:
            return
        seen.add(code)
        sources.append(code)
        for name in _CALL.findall(code):
            if name in helpers:
                add(helpers[name])

    if module is not None:
        add(_module_toplevel(module))
    add(_source(getattr(item, "function", None)))
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        for name in info.names_closure:
            if name in LIGHT_FIXTURES:
                continue
            for fdef in info.name2fixturedefs.get(name, ()):
                add(_source(fdef.func))
    text = "\n".join(sources)
    return {m for m, (_, pats) in MARKERS.items() if any(p in text for p in pats)}
