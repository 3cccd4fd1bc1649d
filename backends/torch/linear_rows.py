"""Matmuls over a few rows (a decode step's [B, hidden] activations): ``rows_linear`` picks the
fastest way on the device (MKL's GEMM for padded rows on CPU, the Triton GEMV of ``cuda_ext.gemv``
for one CUDA row, oneDNN-packed weights on CPU where ``cpu_packed.pack`` made them), ``linear_rows`` /
``out_proj`` route modules through it, and ``lora_add`` adds LoRA adapters' terms to a fused projection.
``rows_linear`` and ``linear`` (``F.linear`` for any row count) are the projections' entry points: a quantized
weight (quant_linear.QuantLinear, kept quantized on CUDA) goes wherever a weight tensor goes and is applied
by its own ``__call__``.  Imports nothing else of this package but ``cpu_packed`` and ``quant_linear``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_packed import linear as _packed_linear
from .cpu_packed import packed as _packed
from .quant_linear import QuantLinear, QuantParts


def lora_add(owner: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """LoRA adapters (lora.py): the selected rows' low-rank terms added to a fused projection's output."""
    lo = owner.__dict__.get("lora")
    return y if lo is None else lo(x, y)


_GEMV: list[bool] = []


def _gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One CUDA row through ``cuda_ext.gemv`` (half-precision weights; the Triton kernels self-checked;
    ``SWIFTLM_GEMV=0`` keeps cuBLAS, for A/B runs)."""
    if not _GEMV:
        import os

        from swiftlm.cuda_ext import enabled

        _GEMV.append(os.environ.get("SWIFTLM_GEMV", "1") != "0" and enabled("cuda"))
    return _GEMV[0] and x.dtype == w.dtype and w.dtype in (torch.bfloat16, torch.float16) and w.is_contiguous()


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a few rows.  On CPU, MKL's sgemm for x @ W^T with 3-64 rows packs the
    whole weight each call, which ``(W @ x^T)^T`` does not.  One or two rows are padded to three:
    MKL's GEMV reads the weights more slowly than its GEMM (scripts/bench_cpu_linear.py; the padded
    rows are zeros and their results are dropped).  One row on CUDA (half precision) is the Triton
    matrix-vector kernel of ``cuda_ext.gemv``, which beats cuBLAS on the matrices of a decode step
    (``scripts/bench_gemv.py``, docs/results/gemv_h100.json).
    A CPU weight with a oneDNN-packed copy (``cpu_packed``) is multiplied through that, for any row count
    (fewer than three rows padded to three, as above), unless gradients flow through ``x`` (fine-tuning
    LoRA adapters: the op has no backward)."""
    if not isinstance(w, torch.Tensor):  # a quantized weight (QuantLinear, QuantParts) applies itself
        return w(x, b)
    n = x.shape[0]
    if x.device.type == "cpu" and x.dim() == 2:
        p = _packed(w)
        # (a prefill chunk of any length stays on MKL: oneDNN keeps a primitive per row count, so
        # prompts of every length would grow the process's memory)
        if p is not None and n <= 64 and x.dtype == torch.float32 and not x.requires_grad:  # (no backward)
            if n < 3:
                return _packed_linear(torch.cat([x, x.new_zeros(3 - n, x.shape[1])]), p, b)[:n]
            return _packed_linear(x.contiguous(), p, b)
    if n == 1 and b is None and x.is_cuda and x.dim() == 2 and _gemv_ok(x, w):
        from swiftlm.cuda_ext.gemv import linear_small_m

        return linear_small_m(x.contiguous(), w)
    if x.device.type == "cpu" and x.dim() == 2 and 1 <= n <= 64:
        if n < 3:
            x = torch.cat([x, x.new_zeros(3 - n, x.shape[1])])
        out = (w @ x.t()).t()[:n]
        return out + b if b is not None else out
    return F.linear(x, w, b)


def linear(x: torch.Tensor, w: torch.Tensor | QuantLinear | QuantParts, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (cuBLAS at every row count), or a quantized weight's own kernels."""
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else w(x, b)


def linear_rows(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` through ``rows_linear`` for a plain ``nn.Linear`` without hooks; any other module (a
    tensor-parallel row layer, an o_proj / down_proj with a LoRA forward hook) is called as it is."""
    if type(lin) is nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks and x.dim() == 2:
        return rows_linear(x, lin.weight, lin.bias)
    return lin(x)


def out_proj(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``rows_linear`` through an output projection (``o_proj`` / ``down_proj``); a tensor-parallel
    row layer (parallel.RowParallelLinear) then sums the ranks' partial outputs."""
    y = lora_add(lin, x, rows_linear(x, lin.weight))
    reduce = getattr(lin, "reduce", None)
    return reduce(y) if reduce is not None else y
