"""Affine ``kv_bits`` caches (``CompressedCache`` of kind "affine") through the Triton kernels of
``swiftlm.cuda_ext.affine_kv_kernels``: one decode row's attention, eager or inside a CUDA graph.

- ``attend_row``: the eager single-row path (``CompressedCache._attend`` with ``use_triton``): the
  compressed rows through the split-K kernel, the 16-bit rows the step wrote (not yet quantized)
  exactly, in the combine kernel.
- ``static_row`` / ``decode_affine_static``: the graph step of a static cache (``capacity=``).  The new
  row is quantized into the code storage at position ``n_code`` (a device tensor) by the fused
  encoder, which gives exactly ``AffineCodec.encode``'s codes, scales and biases (what the eager
  path stores when it compresses the row after attending); attention reads the ``n_code`` earlier
  rows through their codes and the new row in 16 bits, as the eager path does.  After a replay the
  host only advances ``n_code`` (``CompressedCache.after_graph_step``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


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


def decode_affine_static(
    model: Any,
    kv: Any,
    token: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    arange: torch.Tensor,
    fused: bool = False,
) -> torch.Tensor:
    """One decode token over a static affine cache, every shape fixed (one CUDA graph per cache):
    ``graphs.decode_turbo_static``'s arguments (``n_dense`` is 0: an affine cache quantizes every row).
    ``fused``: the elementwise stages as the Triton kernels of ``fused_decode`` (rope in one kernel, the
    residual add + RMSNorm and SiLU * up fused), as the 16-bit graphed step runs them.  Logits [V]."""
    from .decode_rows import project_qkv
    from .rope import apply_rope

    a = model.a
    H, KVH, D = a.heads, a.kv_heads, a.head_dim
    x = model.embed(token)
    if fused:
        from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows

        from .fused_decode import _after_attention, _qkv

        slot = pos.new_zeros(1)
        # the rope kernel writes the new k, v rows into a "pool" whose row stride is 0: this buffer
        row = torch.empty((2, 1, KVH, 1, D), dtype=kv.dense_dtype, device=x.device)
        K, V = row[0].expand(1, KVH, 2, D), row[1].expand(1, KVH, 2, D)
        h = model.layers[0].input_layernorm(x)
        for i, blk in enumerate(model.layers):
            qkv, H, KVH, D = _qkv(blk.self_attn, h, a.qk_norm)
            q = rope_kv_write_rows(qkv, model.cos, model.sin, pos, slot, K, V, H, KVH, D)  # [1, H, D]
            o = kv.attend_static(i, q[0], n_code, None, k=row[0, 0], v=row[1, 0])
            h = _after_attention(model, i, x, o)
        w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        from .linear_rows import rows_linear

        return rows_linear(h, w)[0]
    cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)  # [1, 1, D]
    for i, blk in enumerate(model.layers):
        attn = blk.self_attn
        q, k, v = project_qkv(attn, blk.input_layernorm(x))  # [1, H, D], [1, KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = kv.attend_static(i, q[0], n_code, None, k=k.view(KVH, 1, D), v=v.view(KVH, 1, D))
        x = x + attn.o_proj(o)
        x = x + blk.mlp(blk.post_attention_layernorm(x))
    x = model.norm(x)
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(x, w)[0]
