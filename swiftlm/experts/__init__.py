"""SSD expert streaming, backend-agnostic part: where each expert's bytes lie in the
safetensors files (``layout``), and reading the routed experts' slabs with concurrent
``pread`` (or from an mmap) into reusable buffers, counting every byte (``reader``).
The backends (``swiftlm.backends.mlx.streamed_moe``, ``swiftlm.backends.torch.streamed_moe``)
turn the bytes into arrays and compute."""

from .layout import ExpertLayout, ExpertSlab, clamp_top_k, scan_experts
from .reader import ExpertReader, StreamStats

__all__ = ["ExpertLayout", "ExpertSlab", "clamp_top_k", "scan_experts", "ExpertReader", "StreamStats"]
