"""Affine ``kv_bits`` caches (``CompressedCache`` of kind "affine") through the Triton kernels of
``swiftlm.cuda_ext.affine_kv_kernels``: one decode row's attention, eager or inside a CUDA graph.

- ``attend_row``: the eager single-row path (``CompressedCache._attend`` with ``use_triton``): the
  compressed rows through the split-K kernel, the 16-bit rows the step wrote (not yet quantized)
  exactly, in the combine kernel.
- ``static_row``: the graph step of a static cache (``capacity=``; ``graphs.decode_turbo_static`` and its fused
  twin run it for both compressed kinds).  The new
  row is quantized into the code storage at position ``n_code`` (a device tensor) by the fused
  encoder, which gives exactly ``AffineCodec.encode``'s codes, scales and biases (what the eager
  path stores when it compresses the row after attending); attention reads the ``n_code`` earlier
  rows through their codes and the new row in 16 bits, as the eager path does.  After a replay the
  host only advances ``n_code`` (``CompressedCache.after_graph_step``).
"""

from __future__ import annotations

from typing import Any

import torch


def kernel_ok(cache: Any) -> bool:
    """Do the kernels take this cache's head dim, group size and bits (and is Triton there)?"""
    try:
        from swiftlm.cuda_ext.affine_kv_kernels import supported
    except ImportError:  # no triton
        return False
    return supported(cache.a.head_dim, cache.kc.group, cache.kc.bits)


def static_ok(a: Any, fmt: Any) -> bool:
    """Can a static cache of this affine format decode through the graph step (``graphable``)?"""
    from swiftlm.cuda_ext.affine_kv_kernels import supported

    from .kv_quant import AffineCodec

    return (
        fmt.kind == "affine"
        and not fmt.threshold
        and supported(a.head_dim, AffineCodec(a.head_dim, fmt.key_bits, fmt.group_size).group, fmt.key_bits)
    )


def _attend(
    cache: Any, L: Any, q: torch.Tensor, codes: tuple, n_rows: torch.Tensor | None, dk: torch.Tensor, dv: torch.Tensor
) -> torch.Tensor:
    from swiftlm.cuda_ext.affine_kv_kernels import affine_decode_attention

    H, D = q.shape
    out = affine_decode_attention(
        q, *codes, cache.kc.bits, cache.kc.group, D**-0.5, rep=H // cache.a.kv_heads, n_rows=n_rows, dk=dk, dv=dv
    )
    return out.reshape(1, H * D)


def attend_row(cache: Any, L: Any, q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """q [H, D] over the layer's ``n_code`` compressed rows and the 16-bit rows dk/dv [KVH, R, D]: [1, H*D]."""
    n = L.n_code
    codes = (L.kp[0][:, :n], L.kn[:, :n], L.ks[:, :n], L.vp[0][:, :n], L.vn[:, :n], L.vb[:, :n])
    return _attend(cache, L, q, codes, None, dk, dv)


def static_row(
    cache: Any, L: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_code: torch.Tensor
) -> torch.Tensor:
    """Capturable: quantize the new row k, v [KVH, 1, D] into the codes at ``n_code`` (device [1]) and
    attend q [H, D] to the ``n_code`` earlier rows (codes) and the new row (16-bit, in the cache's
    16-bit dtype like the eager path's buffer): [1, H*D]."""
    from swiftlm.cuda_ext.affine_kv_kernels import affine_encode_rows

    k, v = k.to(cache.dense_dtype), v.to(cache.dense_dtype)
    codes = (L.kp[0], L.kn, L.ks, L.vp[0], L.vn, L.vb)
    affine_encode_rows(k, v, *codes, cache.kc.bits, cache.kc.group, n_code)
    return _attend(cache, L, q, codes, n_code, k, v)
