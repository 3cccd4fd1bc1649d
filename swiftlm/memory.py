"""Memory facts and the memory plan printed by `swiftlm info` and `swiftlm --info`."""

from __future__ import annotations

import os
from typing import Any

from .registry import ModelSpec


def system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


def kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    cfg = config.get("text_config") or config
    layers = int(cfg.get("num_hidden_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads))
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def memory_plan(spec: ModelSpec, ctx_size: int | None = None, dtype_bytes: int = 2, kv_format: Any = None
                ) -> dict[str, Any]:
    """Weights as stored on disk, plus a KV cache for one full context: 16-bit, or in ``kv_format``
    (a TurboQuant preset: the layout formula at that context)."""
    ctx = min(ctx_size or spec.context_length, spec.context_length or ctx_size or 0)
    per_tok = kv_bytes_per_token(spec.config, dtype_bytes)
    plan = {
        "weights_bytes": spec.size_bytes,
        "context_tokens": ctx,
        "kv_bytes_per_token": per_tok,
        "kv_cache_bytes": per_tok * ctx,
    }
    if kv_format is not None and getattr(kv_format, "kind", "fp16") == "turbo" and ctx:
        from .turboquant.presets import COMPRESS_BLOCK, turbo_layout_bytes

        cfg = spec.config.get("text_config") or spec.config
        heads = int(cfg.get("num_attention_heads") or 1)
        n_dense = min(ctx, kv_format.window + COMPRESS_BLOCK - 1)
        f = turbo_layout_bytes(kv_format, n_code=ctx - n_dense, n_dense=n_dense,
                               layers=int(cfg.get("num_hidden_layers") or 0),
                               kv_heads=int(cfg.get("num_key_value_heads") or heads),
                               head_dim=int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads)))
        plan["kv_format"] = kv_format.name
        plan["kv_cache_16bit_bytes"] = plan["kv_cache_bytes"]
        plan["kv_cache_bytes"] = f["codes_allocated"] + f["dense_allocated"] + f["uncompressed_layers"]
    plan["total_bytes"] = plan["weights_bytes"] + plan["kv_cache_bytes"]
    plan["system_memory_bytes"] = system_memory()
    plan["fits"] = plan["total_bytes"] < plan["system_memory_bytes"] * 0.8 if plan["system_memory_bytes"] else None
    return plan
