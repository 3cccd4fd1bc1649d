"""The FP8 KV cache (``--kv-cache-dtype fp8``): K and V stored as float8 e4m3 with fixed scales per
(layer, KV head), one for K and one for V.

Write: ``e4m3(clamp(x / scale, -448, 448))``; read: ``float(e4m3) * scale`` in the compute dtype.  The
scales come from the checkpoint when it has them (compressed-tensors / llm-compressor and vLLM's
names: ``model.layers.N.self_attn.k_scale`` / ``v_scale``, or ``...k_proj.output_scale`` /
``v_proj.output_scale``), else 1.0 (e4m3 holds magnitudes up to 448 with 3 mantissa bits).  Fixed
scales keep a sequence's KV independent of what else runs in its batch (batched == solo exactly).

The stores that hold the rows (``kv_cache.SeqCache``, ``kv_pool.SlotPool``) quantise on write with
``quantize`` and dequantise on read with ``dequantize``; the Triton paged decode kernel dequantises
a tile as it loads it (``cuda_ext.paged_attention``, its ``k_scale`` / ``v_scale`` arguments)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("swiftlm.torch")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn magnitude


def check_kv_cache_dtype(cfg: Any) -> None:
    """``--kv-cache-dtype fp8`` with a setting it does not combine with: ``ConfigError`` (``Settings.check_kv``
    says the same before anything loads; this covers a ``Backend.load`` called directly)."""
    if cfg is None or getattr(cfg, "kv_cache_dtype", "auto") != "fp8":
        return
    from swiftlm.config import kv_cache_dtype_conflict
    from swiftlm.errors import ConfigError

    why = kv_cache_dtype_conflict(cfg, "torch")
    if why:
        raise ConfigError(why)


def kv_storage_dtype(name: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype KV rows are stored in for ``--kv-cache-dtype name`` (auto: the model's ``dtype``)."""
    return FP8 if name == "fp8" else dtype


@dataclass
class KVScales:
    """Per layer, per KV head scales: ``k`` and ``v`` float32 [layers, KVH] (on the KV's device), and
    their [layers, KVH, 1, 1] views for broadcasting over [KVH, T, D] rows."""

    k: torch.Tensor
    v: torch.Tensor
    source: str = "default 1.0"

    @classmethod
    def ones(cls, layers: int, kv_heads: int, device: torch.device | str = "cpu") -> KVScales:
        one = torch.ones((layers, kv_heads), dtype=torch.float32, device=device)
        return cls(one, one.clone())

    def to(self, device: torch.device) -> KVScales:
        return KVScales(self.k.to(device), self.v.to(device), self.source)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V scales as [KVH, 1, 1] (for rows [KVH, T, D])."""
        return self.k[i].view(-1, 1, 1), self.v[i].view(-1, 1, 1)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` / ``scale`` saturated to +-448 and rounded to e4m3 (``scale`` broadcasts over ``x``)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 rows back in ``dtype``: float32(q) * scale, then cast."""
    return (q.float() * scale).to(dtype)


_NAMES = (
    (re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k|v)_scale$"), "self_attn.{}_scale"),
    (re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$"), "self_attn.{}_proj.output_scale"),
    (re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.attn\.(k|v)_scale$"), "self_attn.attn.{}_scale"),
)


def scale_names(name: str) -> tuple[int, str] | None:
    """(layer, 'k' or 'v') when ``name`` is a checkpoint tensor holding a KV-cache scale, else None."""
    for rx, _ in _NAMES:
        m = rx.search(name)
        if m:
            return int(m.group(1)), m.group(2)
    return None


def checkpoint_scales(path: str | Path | None, layers: int, kv_heads: int) -> KVScales:
    """The KV-cache scales a safetensors checkpoint directory carries (per tensor: one value for every KV
    head; per head: ``kv_heads`` values), else 1.0.  A layer without its scales keeps 1.0 (logged)."""
    out = KVScales.ones(layers, kv_heads)
    if path is None:
        return out
    root = Path(path)
    if root.is_file():
        return out  # a .gguf: no KV scales
    files = sorted(root.glob("*.safetensors"))
    index = root / "model.safetensors.index.json"
    if index.exists():
        wanted = {n: f for n, f in json.loads(index.read_text()).get("weight_map", {}).items() if scale_names(n)}
        files = sorted({root / f for f in wanted.values()})
    if not files:
        return out
    from safetensors import safe_open

    found: dict[tuple[int, str], torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for n in st.keys():
                hit = scale_names(n)
                if hit is not None and hit[0] < layers:
                    found[hit] = st.get_tensor(n).float().flatten()
    if not found:
        return out
    for (i, which), t in found.items():
        dst = out.k if which == "k" else out.v
        if t.numel() not in (1, kv_heads):
            raise ValueError(f"KV-cache scale of layer {i} ({which}) has {t.numel()} values; expected 1 or {kv_heads}")
        if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
            raise ValueError(f"KV-cache scale of layer {i} ({which}) is not a positive finite number: {t.tolist()}")
        dst[i] = t.expand(kv_heads) if t.numel() == 1 else t
    missing = 2 * layers - len(found)
    if missing:
        log.warning("FP8 KV cache: %d of %d layer scales missing in the checkpoint; those use 1.0", missing, 2 * layers)
    out.source = "checkpoint"
    return out


def describe(scales: Any) -> str:
    """The KV dtype in words, for the start-up log and ``swiftlm info``."""
    if scales is None:
        return ""
    return f"fp8 (e4m3, scales: {scales.source})"
