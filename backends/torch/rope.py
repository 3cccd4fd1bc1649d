"""Rotary position embeddings for the torch backend's native layers: the rope scaling dict of a config
(under either name), its type, the cos / sin tables (default, linear, dynamic, YaRN and Llama-3.1
frequency scaling) and their application to q / k.  Imports nothing else of this package."""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")


def rope_params(c: dict) -> dict | None:
    """The rope scaling dict, under either name (transformers 5 writes ``rope_parameters``)."""
    rs = c.get("rope_scaling") or c.get("rope_parameters")
    return dict(rs) if isinstance(rs, dict) else None


def rope_type(rs: dict | None) -> str:
    return str((rs or {}).get("rope_type", (rs or {}).get("type", "default")) or "default")


def rope_tables(a: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables [ctx, head_dim] for ``a`` (a model_config.Args: rope_theta, rope_scaling, head_dim, ctx)."""
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim))
    rs = a.rope_scaling or {}
    kind, attn_factor = rope_type(rs), 1.0
    # "dynamic" (NTK) rescales only past max_position_embeddings, which is also our context limit
    # (Args.ctx): within it transformers computes the plain frequencies, and so do we.
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "yarn":  # YaRN (Qwen2.5 long context): per-frequency blend of interpolation and extrapolation
        factor, dim, base = rs["factor"], a.head_dim, a.rope_theta
        old = rs["original_max_position_embeddings"]
        attn_factor = rs.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def corr(rot: float) -> float:
            return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr(rs.get("beta_fast") or 32), corr(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrap = 1 - ramp
        inv = inv / factor * (1 - extrap) + inv * extrap
    if kind == "llama3":  # Llama-3.1 frequency scaling
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    t = torch.arange(a.ctx, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attn_factor).float().to(device), (emb.sin() * attn_factor).float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
