"""The MLX backend's list of supported architectures is what mlx-lm can actually load: every name
imports as an mlx-lm model module with ``Model`` and ``ModelArgs`` (after mlx-lm's own remapping), and
mlx-lm's helper modules are not reported as architectures."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("mlx_lm")


def test_every_listed_architecture_is_loadable_by_mlx_lm():
    from mlx_lm.utils import MODEL_REMAPPING

    from swiftlm.backends.mlx.loader import supported_architectures

    names = supported_architectures()
    assert {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma", "mistral"} <= names
    broken = []
    for name in sorted(names):
        try:
            mod = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(name, name)}")
        except BaseException as exc:  # noqa: BLE001 - olmo's module calls sys.exit(1) without ai2-olmo
            broken.append(f"{name}: {type(exc).__name__}")
            continue
        if not (hasattr(mod, "Model") and hasattr(mod, "ModelArgs")):
            broken.append(f"{name}: no Model/ModelArgs")
    assert not broken, broken


def test_helper_modules_are_not_architectures():
    from swiftlm.backends.mlx.loader import supported_architectures

    names = supported_architectures()
    for helper in (
        "base",
        "cache",
        "rope_utils",
        "switch_layers",
        "activations",
        "pipeline",
        "mla",
        "ssm",
        "gated_delta",
        "bitlinear_layers",
    ):
        assert helper not in names, helper


def test_architecture_needing_an_absent_package_is_not_listed():
    """mlx-lm's olmo module needs the ai2-olmo package (its import exits the process without it): listed
    only where that package is installed."""
    import importlib.util

    from swiftlm.backends.mlx.loader import supported_architectures

    assert ("olmo" in supported_architectures()) == (importlib.util.find_spec("hf_olmo") is not None)
