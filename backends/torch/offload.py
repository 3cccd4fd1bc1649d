"""Partial offload (``--gpu-layers N``): transformer layers [0, N) on the main device, [N, L) on
the CPU, so a model somewhat larger than device memory still runs.

- The embedding, the final norm and the LM head stay on the main device: the LM head is the
  largest single matrix and its GEMV is cheap on the GPU, and the logits stay where the sampler is.
- The CPU layers hold their weights and their KV rows in ``--offload-dtype`` (float32 by default:
  a bf16 checkpoint widens exactly, and CPU fp32 GEMMs are fast everywhere; bfloat16 halves the
  host memory and the bytes read per token on CPUs with AMX / AVX512-BF16).
- Activations cross each boundary once per forward: GPU -> CPU before layer N (with the step's
  rope rows and masks), CPU -> GPU after the last layer (through pinned memory, non-blocking).
- CUDA graphs, the slot pool and the overlapped step are off when layers are offloaded: a graph
  cannot hold CPU work, and the step waits for the CPU half anyway.

Nothing here imports ``model.py`` at module level (``model.py`` and ``decode_rows.py`` import the two crossing
helpers, ``kv_cache.py`` imports ``layer_places``).
"""

from __future__ import annotations

from typing import Any

import torch

from swiftlm.errors import ConfigError

CPU = torch.device("cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def offload_split(cfg: Any, layers: int) -> int | None:
    """The first CPU layer under ``cfg.gpu_layers`` (None: nothing offloaded).  Refuses what
    does not combine with it, in one sentence."""
    n = getattr(cfg, "gpu_layers", None) if cfg is not None else None
    if n is None or n >= layers:
        return None
    for flag, on in (
        ("--stream-experts", getattr(cfg, "stream_experts", False)),
        ("--turbo-kv", getattr(cfg, "turbo_kv", None)),
        ("--speculative", getattr(cfg, "speculative", None) or getattr(cfg, "draft_model", None)),
    ):
        if on:
            raise ConfigError(f"--gpu-layers does not combine with {flag} in this version")
    return int(n)


def place(model: Any, first_cpu: int, device: torch.device, off_dtype: torch.dtype) -> None:
    """Move ``model`` (built on the CPU in the main dtype) to its places: layers [0, first_cpu),
    the embedding, the norm, the head and the rope tables to ``device``; the other layers stay on
    the CPU, cast to ``off_dtype``.  Replaces ``model.to(device)`` (never the whole model on the GPU)."""
    for name, child in model.named_children():
        if name != "layers":
            child.to(device)
    for i, layer in enumerate(model.layers):
        if i < first_cpu:
            layer.to(device)
        else:
            layer.to(device=CPU, dtype=off_dtype)
    model.cos, model.sin = model.cos.to(device), model.sin.to(device)
    model.a.offload = (first_cpu, CPU, off_dtype)


def _move(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if not t.is_floating_point():
        return t.to(device)
    if device.type == "cuda" and t.device.type == "cpu":  # host -> device through pinned memory, async
        return t.to(dtype).pin_memory().to(device, non_blocking=True)
    return t.to(device, dtype)


def to_offload(a: Any, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Activations, rope rows and masks into the CPU layers' device and dtype (once per forward)."""
    _, dev, dt = a.offload
    return tuple(_move(t, dev, dt) for t in ts)


def from_offload(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The last CPU layer's output back to the main device and dtype (where ``like`` lives)."""
    return _move(x, like.device, like.dtype)


def layer_places(a: Any, device: torch.device, dtype: torch.dtype) -> list[tuple[torch.device, torch.dtype]]:
    """(device, dtype) of each layer's KV rows."""
    off = getattr(a, "offload", None)
    return [(off[1], off[2]) if off is not None and i >= off[0] else (device, dtype) for i in range(a.layers)]


def kv_bytes_per_token(a: Any, device: torch.device, dtype: torch.dtype) -> int:
    per = 2 * a.kv_heads * a.head_dim
    return sum(per * torch.finfo(dt).bits // 8 for _, dt in layer_places(a, device, dtype))


def split_report(model: Any) -> dict[str, Any]:
    """Where the parameters are, counted from the tensors: {device/dtype: bytes}, and the split."""
    out: dict[str, int] = {}
    for p in list(model.parameters()) + [t for layer in model.layers for t in _fused(layer)]:
        key = f"{p.device.type}/{str(p.dtype)[6:]}"
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    off = getattr(model.a, "offload", None)
    return {
        "gpu_layers": off[0] if off else model.a.layers,
        "cpu_layers": model.a.layers - off[0] if off else 0,
        "bytes_by_place": out,
    }


def _fused(layer: Any) -> list[torch.Tensor]:
    ts = [t for t in getattr(layer.self_attn, "qkv", ()) if t is not None]
    if hasattr(layer.mlp, "gate_up"):
        ts.append(layer.mlp.gate_up)
    return ts
