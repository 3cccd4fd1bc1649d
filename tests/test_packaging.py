"""Packaging, plugin discovery, and the no-mlx/no-torch import rule."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
from conftest import ROOT


def test_import_swiftlm_imports_neither_mlx_nor_torch():
    code = (
        "import sys, swiftlm, swiftlm.engine, swiftlm.registry, swiftlm.cli, swiftlm.llm, swiftlm.backend, "
        "swiftlm.convert, swiftlm.config, swiftlm.backends.mlx, swiftlm.backends.torch, swiftlm.cuda_ext, "
        "swiftlm.prefix_cache, swiftlm.server.app, swiftlm.turboquant, swiftlm.turboquant.presets, "
        "swiftlm.media, swiftlm.media.model, swiftlm.media.sources, swiftlm.media.items; "
        "bad = [m for m in ('mlx', 'mlx.core', 'mlx_lm', 'torch') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mlx_backend_registered_as_entry_point():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="swiftlm.backends")}
    assert eps.get("mlx") == "swiftlm.backends.mlx:MLXBackend"


def test_broken_plugin_is_reported_not_fatal(monkeypatch):
    from swiftlm import backend as b

    good = list(metadata.entry_points(group="swiftlm.backends"))
    broken = metadata.EntryPoint(name="broken", value="swiftlm_no_such_module:Backend", group="swiftlm.backends")
    monkeypatch.setattr(b.metadata, "entry_points", lambda group: good + [broken])
    found = b.discover_backends()
    assert found["broken"].availability.ok is False
    assert "failed to load" in found["broken"].availability.reason
    assert "mlx" in found


def test_requested_backend_missing_is_a_clear_error():
    from swiftlm.backend import choose_backend
    from swiftlm.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="'nope' is not installed"):
        choose_backend("nope")


def test_backends_importable_under_swiftlm_namespace():
    import swiftlm.backends.mlx as m

    assert m.__file__.replace("\\", "/").endswith("backends/mlx/__init__.py")


@pytest.mark.parametrize("requested", ["torch", "auto"])
def test_choosing_torch_does_not_load_mlx(requested):
    """Probing MLX loads mlx.core and its threads; a torch server must not carry them (a torch
    server with mlx.core loaded can abort at exit: SIGABRT on SIGTERM)."""
    import subprocess
    import sys

    code = (
        "import sys, platform; from swiftlm.backend import choose_backend; "
        f"b, why = choose_backend({requested!r}); print(b.name, 'mlx.core' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if requested == "auto" and out[0] != "torch":
        pytest.skip("auto picks MLX first on this platform (Apple Silicon)")
    assert out == ["torch", "False"]
