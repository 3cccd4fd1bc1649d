"""torch backend: NVIDIA GPUs (bf16) and the fast CPU path on Linux (fp32).

Registered as the ``torch`` entry point.  Importing this package does not import torch.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from swiftlm.backend import Availability
from swiftlm.registry import ModelSpec


class TorchBackend:
    name = "torch"

    def available(self) -> Availability:
        if importlib.util.find_spec("torch") is None:
            return Availability(
                False,
                reason="torch is not installed (pip install 'swiftlm[torch]'; on a CPU-only "
                "Linux machine pin the CPU wheel, e.g. torch==2.13.0)",
            )
        try:
            import torch
        except Exception as exc:
            return Availability(False, reason=f"torch failed to import: {exc}")
        if torch.cuda.is_available():
            return Availability(True, device=f"cuda ({torch.cuda.get_device_name(0)})")
        return Availability(True, device=f"cpu ({torch.get_num_threads()} threads)")

    def load(self, spec: ModelSpec, cfg: Any) -> Any:
        from swiftlm.media.processor import is_multimodal

        from .fallback import NAME, load_fallback, path_for

        fp8 = getattr(cfg, "kv_cache_dtype", "auto") == "fp8"
        if fp8 and (is_multimodal(spec) or path_for(spec) == NAME):
            from swiftlm.errors import ConfigError

            what = "vision / audio models" if is_multimodal(spec) else "the transformers fallback"
            raise ConfigError(f"--kv-cache-dtype fp8 is not built for {what} ({spec.arch}); leave it at auto")
        if is_multimodal(spec):
            from .vlm import load_multimodal

            return load_multimodal(spec, cfg)
        if path_for(spec) == NAME:  # an architecture model.py does not implement: transformers runs it
            return load_fallback(spec, cfg)
        from .runner import load_model

        model = load_model(spec, cfg)
        model.ops.end_thread()  # the engine thread computes from now on (CPU: ops.release_omp_pool)
        return model

    def model_path(self, spec: ModelSpec) -> str:
        """ "native" or "transformers fallback": how this backend would run ``spec`` (for ``swiftlm info``)."""
        from .fallback import path_for

        return path_for(spec)

    def check_tensor_parallel(self, spec: ModelSpec, world: int) -> None:
        """--tensor-parallel ``world``: ConfigError (one sentence) if this model cannot be split so."""
        from .loader import check_arch, checkpoint_config
        from .parallel import make_plan

        check_arch(spec)
        config = checkpoint_config(spec)
        for r in range(world):
            make_plan(config, r, world)

    def check_pipeline_parallel(self, spec: ModelSpec, world: int) -> None:
        """--pipeline-parallel ``world``: ConfigError (one sentence) if this model cannot be split so."""
        from .loader import check_arch, checkpoint_config
        from .pipeline import check_split

        check_arch(spec)
        check_split(checkpoint_config(spec), world)


__all__ = ["TorchBackend"]
