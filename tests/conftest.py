"""Shared fixtures.  Models: the bundled SmolLM2 GGUF (real weights) and tiny random
checkpoints written by scripts/make_checkpoint.py (mechanics only, never quality)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# the fake backend plugin (tests/plugins: a module and its dist-info with the swiftlm.backends entry point)
sys.path.insert(0, str(ROOT / "tests" / "plugins"))

import tiers  # noqa: E402  (tests/ is on sys.path: pytest puts a rootdir conftest's folder there)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Processes under TRITON_INTERPRET=1 use the Triton kernels without cuda_ext.enabled()'s startup self-check (~3.5 s
# of interpreted launches per process, in each of the ~15 subprocesses that build a GraphDecoder): the tests compare
# the kernels with their references themselves, and with the check a broken kernel would be switched off and the
# test would compare the plain path with itself.  test_cuda_ext.py runs the check once (test_selfcheck_passes_...).
os.environ.setdefault("SWIFTLM_TRITON_SELFCHECK", "0")
# ... and their nested jit calls skip Triton's redundant re-patching of triton.language (tests/interp_site/
# sitecustomize.py: a start-up hook that does nothing without TRITON_INTERPRET=1; ~15% of an interpreted test's time).
_INTERP_SITE = str(ROOT / "tests" / "interp_site")
if _INTERP_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_INTERP_SITE, os.environ.get("PYTHONPATH")) if p)

HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx / mlx-lm not installed on this machine")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed on this machine")

# Behaviour tests run once per backend; a backend whose package is absent is skipped with the reason.
BACKENDS = [pytest.param("mlx", marks=needs_mlx), pytest.param("torch", marks=needs_torch)]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
]


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [PY, "-m", "swiftlm.cli", *args], capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT
    )


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    from swiftlm.registry import bundled_model_path

    return bundled_model_path()


# Checkpoints are written once per test run and copied to where each test wants them: the same arguments give
# the same files (make_checkpoint.py is seeded).  The cache is shared by the xdist workers of one run.
_CKPT_SOURCES = [
    ROOT / "scripts" / "make_checkpoint.py",
    ROOT / "scripts" / "make_multimodal.py",
    ROOT / "scripts" / "quantize_checkpoint.py",
    ROOT / "swiftlm" / "convert.py",
    ROOT / "swiftlm" / "tokenizer.py",
]
_ckpt_cache: Path | None = None


def _make_ckpt_uncached(out: Path, args: tuple[str, ...]) -> None:
    if "--quantize" in args:  # mlx-lm's converter: in its own process, as a user runs it
        subprocess.run(
            [PY, str(ROOT / "scripts" / "make_checkpoint.py"), str(out), "--force", *args],
            check=True,
            capture_output=True,
            text=True,
        )
        return
    import contextlib
    import io
    import runpy

    main = runpy.run_path(str(ROOT / "scripts" / "make_checkpoint.py"))["main"]
    with contextlib.redirect_stdout(io.StringIO()):
        main([str(out), "--force", *args])


def make_ckpt(out: Path, *args: str) -> Path:
    """scripts/make_checkpoint.py OUT ARGS, from this run's cache when the same checkpoint was written before."""
    import fcntl
    import hashlib
    import shutil

    if _ckpt_cache is None:
        _make_ckpt_uncached(out, args)
        return out
    h = hashlib.sha256("\0".join(args).encode())
    for f in _CKPT_SOURCES:
        h.update(f.read_bytes() if f.exists() else b"")
    entry = _ckpt_cache / h.hexdigest()[:24]
    _ckpt_cache.mkdir(parents=True, exist_ok=True)
    with open(str(entry) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not entry.exists():
            tmp = Path(str(entry) + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _make_ckpt_uncached(tmp, args)
            tmp.rename(entry)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(entry, out)
    return out


def run_once(key: str, compute):
    """``compute()``'s result, computed once per test run by whichever xdist worker asks first and shared with the
    others through this run's cache (pickled; a worker that asks while another computes waits for it).  For
    expensive deterministic results several test files compare against (the transformers reference's greedy runs)."""
    import fcntl
    import pickle

    if _ckpt_cache is None:
        return compute()
    entry = _ckpt_cache / "results" / f"{key}.pkl"
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(str(entry) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not entry.exists():
            result = compute()
            tmp = Path(str(entry) + ".tmp")
            tmp.write_bytes(pickle.dumps(result))
            tmp.rename(entry)
            return result  # the worker that computed it keeps its own (a model need not be read back)
        return pickle.loads(entry.read_bytes())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "llama", "--arch", "llama", "--dtype", "float32", "--shard-mb", "4"
    )


@pytest.fixture(scope="session")
def mlx_llm():
    if not HAS_MLX:
        pytest.skip("mlx / mlx-lm not installed on this machine")
    from swiftlm import LLM

    llm = LLM(backend="mlx", parallel=4)
    yield llm
    llm.close()


@pytest.fixture(scope="session", params=BACKENDS)
def tiny_llm(request, tiny_llama):
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend=request.param, parallel=4)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def torch_llm():
    if not HAS_TORCH:
        pytest.skip("torch not installed on this machine")
    from swiftlm import LLM

    llm = LLM(backend="torch", parallel=4)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def hf_reference(bundled_gguf):
    """transformers' own GGUF loader (dequantized to fp32 torch): the reference model.  Loaded once per test run
    (``run_once``: ~8 s on the 2-core machine); a second xdist worker that needs it (test_cli_convert.py beside
    test_reference_*.py) unpickles the same module, the same fp32 tensors, in ~1 s.

    Two of gguf-py's pure functions are memoized while it loads: transformers parses the file twice (once for the
    config, once for the tensors: ~4 s each, most of it the tokenizer's 49k-entry metadata) and builds the same
    tensor-name map once per tensor (~5 s for SmolLM2's 272).  The same reader and the same map, read only: the
    weights are bit-identical to an unpatched load (checked when this was written), ~15 s down to ~8 s."""
    import functools
    from unittest import mock

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")

    def load():
        readers: dict = {}

        def reader(path, *args, **kwargs):
            key = (str(path), args, tuple(sorted(kwargs.items())))
            if key not in readers:
                readers[key] = real_reader(path, *args, **kwargs)
            return readers[key]

        real_reader = gguf.GGUFReader
        name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
        with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(bundled_gguf.parent), gguf_file=bundled_gguf.name, dtype=torch.float32
            )
        model.eval()
        return model

    return run_once(f"hf-reference-model-{bundled_gguf.stat().st_size}", load)


# ------------------------------------------------------------------ markers by what a test needs (tests/tiers.py)
def pytest_configure(config):
    global _ckpt_cache
    for name, (what, _) in tiers.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    import tempfile
    import uuid

    if hasattr(config, "workerinput"):
        run = config.workerinput["testrunuid"]
    else:  # the controller picks the run's id, and xdist hands it to every worker
        run = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
        if hasattr(config.option, "testrunuid"):
            config.option.testrunuid = run
    _ckpt_cache = Path(tempfile.gettempdir()) / f"swiftlm-test-ckpts-{os.getuid()}" / run
    if not hasattr(config, "workerinput"):
        config._swiftlm_ckpt_cache = _ckpt_cache
        _drop_stale_runs(_ckpt_cache.parent)


def _drop_stale_runs(root: Path, hours: float = 6.0) -> None:
    """Checkpoint caches of earlier runs that were killed before their clean-up (a run's cache is up to ~2.5 GB;
    a few of them left behind fill a small disk half-way through the next run).  Only directories untouched for
    ``hours``: a run going on beside this one keeps its cache."""
    import shutil
    import time

    if not root.is_dir():
        return
    for old in root.iterdir():
        try:
            if time.time() - old.stat().st_mtime > hours * 3600:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def pytest_unconfigure(config):
    import shutil

    cache = getattr(config, "_swiftlm_ckpt_cache", None)  # the controller (or a run without xdist) cleans up
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        have = {m.name for m in item.iter_markers()}
        for name in sorted(tiers.needs(item) - have):
            item.add_marker(getattr(pytest.mark, name))
    # an xdist worker under --no-loadscope-reorder (scripts/test.sh, whole suite): the longest files first, so the
    # workers end together (tests/file_order.py); a run without xdist keeps pytest's own order
    if hasattr(config, "workerinput") and not getattr(config.option, "loadscopereorder", True):
        import file_order

        items[:] = file_order.longest_first(items)


# ------------------------------------------------------------------ the fake backend (fast tier)
@pytest.fixture(scope="session")
def fake_llm():
    """An LLM on the fake backend plugin over the bundled model's tokenizer: no torch, no MLX, milliseconds a
    step.  Tests set ``swiftlm_fake_backend.REPLIES`` to choose what it answers."""
    from swiftlm import LLM

    llm = LLM(backend="fake", parallel=4, max_tokens=64, ctx_size=1024)
    yield llm
    llm.close()


@pytest.fixture
def fake_replies():
    """The fake model's scripted replies (prompt substring -> reply), emptied after the test."""
    import swiftlm_fake_backend

    swiftlm_fake_backend.REPLIES.clear()
    yield swiftlm_fake_backend.REPLIES
    swiftlm_fake_backend.REPLIES.clear()


@pytest.fixture(scope="session")
def fake_app(fake_llm):
    """The whole HTTP app in this process (Starlette's TestClient) around the fake engine."""
    from starlette.testclient import TestClient

    from swiftlm.server.app import create_app

    app = create_app(fake_llm.settings, engine=fake_llm.engine, spec=fake_llm.spec, backend="fake")
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
