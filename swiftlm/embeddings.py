"""Text embeddings from a model's final hidden states (core: numpy only).

The backend returns each input's final-norm hidden states (``Model.hidden_states``); the core
pools them, optionally truncates to ``dimensions`` (Matryoshka-trained models) and L2-normalises.

Pooling per model:
- a sentence-transformers ``1_Pooling/config.json`` beside the weights decides (``lasttoken``,
  ``mean``, ``cls``), as the model's authors configured it;
- otherwise an embedding-only checkpoint (``architectures`` like ``Qwen3Model``: no LM head) is a
  decoder embedding model and pools the last token;
- otherwise (a generative model asked for embeddings) the mean over tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

POOLINGS = ("last", "mean", "cls")


def is_embedding_only(config: dict) -> bool:
    """True for checkpoints without a language-model head (``XxxModel`` architectures)."""
    archs = config.get("architectures") or []
    return bool(archs) and all(a.endswith("Model") and not a.endswith("LMHeadModel") for a in archs)


def pooling_for(spec: Any) -> str:
    path = Path(getattr(spec, "path", "") or "")
    cfg_file = (path if path.is_dir() else path.parent) / "1_Pooling" / "config.json"
    if cfg_file.is_file():
        try:
            st = json.loads(cfg_file.read_text())
        except (OSError, ValueError):
            st = {}
        if st.get("pooling_mode_lasttoken"):
            return "last"
        if st.get("pooling_mode_cls_token"):
            return "cls"
        if st.get("pooling_mode_mean_tokens"):
            return "mean"
    return "last" if is_embedding_only(getattr(spec, "config", None) or {}) else "mean"


def pool(hidden: np.ndarray, mode: str) -> np.ndarray:
    """[T, H] hidden states of one input -> [H] (float64 accumulation, float32 result)."""
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        raise ValueError("pooling needs [T, H] hidden states with T >= 1")
    if mode == "last":
        v = hidden[-1]
    elif mode == "cls":
        v = hidden[0]
    elif mode == "mean":
        v = hidden.astype(np.float64).mean(axis=0)
    else:
        raise ValueError(f"unknown pooling {mode!r}; one of {', '.join(POOLINGS)}")
    return np.asarray(v, dtype=np.float32)


def finish(vec: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """Truncate to ``dimensions`` (when given) and L2-normalise."""
    v = vec[:dimensions] if dimensions else vec
    v = v.astype(np.float64)
    n = float(np.linalg.norm(v))
    return (v / n if n > 0 else v).astype(np.float32)


def embed(hidden: Sequence[np.ndarray], mode: str, dimensions: int | None = None) -> list[np.ndarray]:
    return [finish(pool(np.asarray(h, dtype=np.float32), mode), dimensions) for h in hidden]
