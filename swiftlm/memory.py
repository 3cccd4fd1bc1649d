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


def streamable_layout(spec: ModelSpec) -> Any:
    """The checkpoint's ``ExpertLayout`` (from the safetensors headers), or a clear error when
    --stream-experts cannot apply (dense model, GGUF file, no expert tensors found)."""
    from .errors import UnsupportedArchitecture
    from .experts import scan_experts

    if spec.format == "gguf" or not spec.is_moe:
        raise UnsupportedArchitecture(f"--stream-experts needs an MoE model in safetensors; {spec.path} is "
                                      + ("a GGUF file" if spec.format == "gguf" else "not a mixture-of-experts model"))
    layout = scan_experts(spec.weight_files)
    if layout is None:
        raise UnsupportedArchitecture(f"--stream-experts: found no expert tensors in {spec.path}")
    return layout


def expert_plan(spec: ModelSpec, expert_top_k: int = 0) -> dict[str, Any]:
    """What --stream-experts keeps resident and reads: from the safetensors headers."""
    from .experts import clamp_top_k

    layout = streamable_layout(spec)
    k = spec.experts_per_token or 1
    used = clamp_top_k(expert_top_k, k)
    per_expert = layout.bytes_per_expert()
    return {"expert_layout": layout.style, "experts": layout.num_experts, "moe_layers": len(layout.layers),
            "experts_per_token": used, "model_experts_per_token": k,
            "resident_bytes": layout.resident_bytes, "expert_bytes": layout.expert_bytes_total,
            "bytes_per_expert": per_expert, "expert_bytes_per_token": layout.bytes_per_token(used),
            "read_buffer_bytes": used * per_expert}


def memory_plan(spec: ModelSpec, ctx_size: int | None = None, dtype_bytes: int = 2, kv_format: Any = None,
                stream_experts: bool = False, expert_top_k: int = 0) -> dict[str, Any]:
    """Weights as stored on disk, plus a KV cache for one full context: 16-bit, or in ``kv_format``
    (a TurboQuant preset: the layout formula at that context).  With ``stream_experts`` the
    weights counted are the resident (non-expert) bytes plus one token's read buffers, and the
    expected expert bytes read per decoded token are given."""
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
    if stream_experts:
        ex = expert_plan(spec, expert_top_k)
        plan.update({f"stream_{k}": v for k, v in ex.items()})
        plan["weights_bytes"] = ex["resident_bytes"] + ex["read_buffer_bytes"]
    plan["total_bytes"] = plan["weights_bytes"] + plan["kv_cache_bytes"]
    plan["system_memory_bytes"] = system_memory()
    plan["fits"] = plan["total_bytes"] < plan["system_memory_bytes"] * 0.8 if plan["system_memory_bytes"] else None
    return plan
