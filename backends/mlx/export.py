"""Write a GGUF's natively-read quantized tensors as an mlx-lm checkpoint (HF names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from swiftlm.convert import hf_name, unpermute_rows
from swiftlm.registry import ModelSpec

from .loader import GGUF_GROUP_SIZE


def export_quantized_gguf(spec: ModelSpec, out: Path, dtype: str) -> dict[str, Any]:
    """Save weights (packed uint32) with scales/biases in ``dtype``; return the mlx-lm
    ``quantization`` config (per-layer entries where bits differ from the default)."""
    raw = mx.load(str(spec.path))
    heads, kv_heads = spec.config["num_attention_heads"], spec.config["num_key_value_heads"]
    mdt = getattr(mx, dtype)
    weights: dict[str, mx.array] = {}
    bits_of: dict[str, int] = {}
    for k, v in raw.items():
        name = hf_name(k)
        if ".self_attn.q_proj." in name:
            v = unpermute_rows(v, heads)
        elif ".self_attn.k_proj." in name:
            v = unpermute_rows(v, kv_heads)
        if v.dtype != mx.uint32:
            v = v.astype(mdt)
        weights[name] = v
    for name, s in weights.items():
        if name.endswith(".scales"):
            base = name[: -len(".scales")]
            bits_of[base] = weights[base + ".weight"].shape[-1] * 32 // (s.shape[-1] * GGUF_GROUP_SIZE)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    default_bits = max(set(bits_of.values()), key=list(bits_of.values()).count) if bits_of else 4
    quant: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": int(default_bits)}
    for base, b in bits_of.items():
        if b != default_bits:
            quant[base] = {"group_size": GGUF_GROUP_SIZE, "bits": int(b)}
    return quant
