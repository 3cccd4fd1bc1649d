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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def make_ckpt(out: Path, *args: str) -> Path:
    subprocess.run(
        [PY, str(ROOT / "scripts" / "make_checkpoint.py"), str(out), "--force", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


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
    """transformers' own GGUF loader (dequantized to fp32 torch): the reference model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(bundled_gguf.parent), gguf_file=bundled_gguf.name, dtype=torch.float32
    )
    model.eval()
    return model
