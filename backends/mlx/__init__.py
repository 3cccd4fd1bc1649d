"""MLX backend (Apple Silicon with Metal; also runs on Linux CPU through ``mlx[cpu]``).

Registered as the ``mlx`` entry point.  Importing this package does not import mlx; the
backend reports whether mlx can be used through ``available()``.
"""

from __future__ import annotations

import importlib.util
import platform
from typing import Any

from swiftlm.backend import Availability
from swiftlm.registry import ModelSpec


class MLXBackend:
    name = "mlx"

    def available(self) -> Availability:
        for mod, pkg in (("mlx", "mlx"), ("mlx_lm", "mlx-lm")):
            if importlib.util.find_spec(mod) is None:
                return Availability(False, reason=f"{pkg} is not installed (pip install 'swiftlm[mlx]')")
        try:
            import mlx.core as mx
        except Exception as exc:  # e.g. a wheel for the wrong platform
            return Availability(False, reason=f"mlx failed to import: {exc}")
        dev = mx.default_device()
        kind = "gpu (Metal)" if dev.type == mx.DeviceType.gpu else f"cpu ({platform.machine()})"
        return Availability(True, device=kind)

    def load(self, spec: ModelSpec, cfg: Any) -> Any:
        from swiftlm.config import kv_cache_dtype_conflict
        from swiftlm.media.processor import is_multimodal

        why = kv_cache_dtype_conflict(cfg, "mlx")  # --kv-cache-dtype fp8: the torch backend's
        if why:
            from swiftlm.errors import ConfigError

            raise ConfigError(why)
        _clear_streams_at_exit()
        if is_multimodal(spec):
            if getattr(cfg, "adapter", None):
                from swiftlm.errors import ConfigError

                raise ConfigError("--adapter is not supported for multimodal models on the mlx backend")
            from .vlm import load_multimodal

            return load_multimodal(spec, cfg)
        from .model import load_model

        return load_model(spec, cfg)

    def join_distributed(self, cfg: Any) -> Any:
        """``--distributed``: this process's rank in the ``mx.distributed`` group (distributed.MLXRanks)."""
        from .distributed import join

        return join(cfg)

    def check_distributed(self, spec: ModelSpec, cfg: Any, size: int | None = None) -> str:
        """'tensor' or 'pipeline' for ``spec`` (over ``size`` ranks); a ConfigError when mlx-lm cannot split it."""
        from .distributed import check

        return check(spec, cfg, size)

    def export_quantized_gguf(self, spec: ModelSpec, out: Any, dtype: str) -> dict:
        """Used by `swiftlm convert --keep-quantized`."""
        from .export import export_quantized_gguf

        return export_quantized_gguf(spec, out, dtype)


_registered = False


def _clear_streams_at_exit() -> None:
    """MLX streams must be destroyed by their thread before interpreter shutdown (mlx#4110): the
    engine thread does it as it ends (ops.end_thread); this covers the main thread."""
    global _registered
    if _registered:
        return
    import atexit
    import threading

    import mlx.core as mx

    def clear() -> None:
        if threading.current_thread() is threading.main_thread():
            mx.clear_streams()

    atexit.register(clear)
    _registered = True


__all__ = ["MLXBackend"]
