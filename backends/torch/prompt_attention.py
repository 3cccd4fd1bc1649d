"""A prompt chunk over a compressed KV cache: the codes decoded once per chunk, then one fused attention call.

A chunk of T query rows (``PROMPT_ROWS`` or more) attends over the layer's compressed rows and its 16-bit rows
(the window plus the chunk's own rows).  The compressed rows are decoded once into one [KVH, n_code + n_dense, D]
key tensor and one value tensor, the 16-bit rows copied behind them, and ``attend.chunk_attention``, the 16-bit
prompt path's own call (SDPA: flash on CUDA; causal within the chunk, full to the past), attends:

- TurboQuant rows are decoded in the rotated domain (``x @ R^T``): centroids times the norm, no rotation of the
  history.  The queries and the 16-bit keys are rotated by the key codec's R, the 16-bit values by the value
  codec's, and the output is rotated back once.  A QJL key adds its sign term, mapped into the rotated domain by
  one [D, D] matrix.
- affine ``kv_bits`` rows are decoded as code times scale plus bias per group, in natural coordinates.

Where the cache runs its Triton kernels (CUDA) the codes are decoded by ``cuda_ext.code_rows`` (one pass over the
packed bytes, through the page table for code pages); elsewhere by the codecs' torch decoders, DECODE_ROWS rows at a
time.  The blockwise path (``code_attention.code_blocks``) scored every block of codes against every query in
fp32 with the softmax merged in Python: on CUDA a block held SCORE_BUDGET / (KVH * rep * T) rows, 128 on an 8B
shape with 512-token chunks, so each chunk of a long prompt launched hundreds of small kernels per layer.  Decode
rows and short verify blocks keep that path (and the decode kernels): their numbers do not change.

Numerics: the decoded rows are the values the blockwise path multiplies (centroid times fp16 norm, code times scale
plus bias), so with fp32 models (CPU) the output equals attention over the decoded history to fp32 rounding.  With
16-bit models (CUDA) keys, values and queries are rounded once to the model's dtype so that the flash kernel runs,
as the 16-bit cache's prompt chunks are, and TurboQuant centroids are the decode kernels' fp16 ones; the blockwise
path kept everything in fp32, so a prompt's logits move by about that rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from .attend import chunk_attention

PROMPT_ROWS = 16  # query rows (a prompt chunk) from which a chunk takes this path; fewer: the blockwise path
DECODE_ROWS = 8192  # compressed rows decoded at a time (per KV head) into the key / value tensors


def prompt_attention(cache: Any, L: Any, q: torch.Tensor, start: int) -> torch.Tensor:
    """q [H, T, D] at positions [start, start + T) over layer ``L`` of ``cache`` (its 16-bit rows end at
    start + T) -> out [T, H*D] in q's dtype."""
    H, T, D = q.shape
    KVH = cache.a.kv_heads
    kernel = _kernel_ok(cache, D)
    if not kernel:  # the torch decode reads codes by position: paged codes gathered first
        L = cache._code_view(L)
    dk, dv = cache._dense(L)
    n, nd = L.n_code, dk.shape[1]
    if n + nd != start + T:
        raise RuntimeError(f"prompt chunk at {start}+{T} over a cache holding {n} + {nd} positions")
    dt = q.dtype
    if not n:  # nothing compressed yet (early chunks, layers kept in 16-bit): the 16-bit rows as they are
        out = chunk_attention(q, dk.to(dt), dv.to(dt), start, H // KVH)[0]
        return out.transpose(0, 1).reshape(T, H * D)
    keys = torch.empty((KVH, n + nd, D), dtype=dt, device=q.device)
    vals = torch.empty_like(keys)
    if cache.fmt.kind == "affine":  # decoded in natural coordinates: nothing to move
        _affine_codes(cache, L, keys[:, :n], vals[:, :n], kernel)
        keys[:, n:], vals[:, n:] = dk, dv
        out = chunk_attention(q, keys, vals, start, H // KVH)[0]
        return out.transpose(0, 1).reshape(T, H * D)
    _turbo_codes(cache, L, keys[:, :n], vals[:, :n], kernel)
    rk, rv = cache.kc.R, cache.vc.R  # the domain of the codes: x @ R^T (R orthogonal)
    keys[:, n:] = dk.float() @ rk.T
    vals[:, n:] = dv.float() @ rv.T
    out = chunk_attention((q.float() @ rk.T).to(dt), keys, vals, start, H // KVH)[0]  # [H, T, D], rotated
    return (out.float() @ rv).to(dt).transpose(0, 1).reshape(T, H * D)


def _kernel_ok(cache: Any, D: int) -> bool:
    """Decode through ``cuda_ext.code_rows`` (the cache runs its Triton kernels, on shapes they take)?"""
    if not cache.use_triton:
        return False
    from swiftlm.cuda_ext import code_rows  # Triton: imported only where the cache runs its kernels

    if cache.fmt.kind == "affine":
        return code_rows.affine_supported(D, cache.kc.group, cache.kc.bits)
    return code_rows.tq_supported(D)


def _turbo_codes(cache: Any, L: Any, keys: torch.Tensor, vals: torch.Tensor, kernel: bool) -> None:
    """TurboQuant code rows [0, n_code) of ``L`` into ``keys`` / ``vals`` [KVH, n_code, D] in the rotated domain:
    centroids times the norm; a QJL key adds its sign term, |r| * scale * signs @ S @ R^T, times the norm."""
    n = L.n_code
    kc, vc = cache.kc, cache.vc
    qjl = (kc.S_rows @ kc.R.T) * kc.qjl_scale if kc.qjl else None  # ±1 signs (``sign_rows`` order) -> rotated
    if kernel:
        from swiftlm.cuda_ext.code_rows import tq_rows

        pages = cache._pages_arg(n)
        tq_rows(L.kp, L.kn, kc.centroids, kc.mse_bits, n, keys, pages)
        tq_rows(L.vp, L.vn, vc.centroids, vc.mse_bits, n, vals, pages)
        if qjl is not None:  # the sign term in torch, block by block, signs and norms by position
            ks, kr, kn = L.ks, L.kr, L.kn
            if cache.paged:  # only these three gathered out of the pool (not the whole code view)
                idx = cache._rows_at(0, n)
                ks, kr, kn = ks.index_select(1, idx), kr.index_select(1, idx), kn.index_select(1, idx)
            for b in range(0, n, DECODE_ROWS):
                e = min(n, b + DECODE_ROWS)
                w = (kr[:, b:e].float() * kn[:, b:e].float()).unsqueeze(-1)
                keys[:, b:e] += torch.matmul(kc.sign_rows(ks, b, e).mul_(w), qjl).to(keys.dtype)
        return
    for b in range(0, n, DECODE_ROWS):
        e = min(n, b + DECODE_ROWS)
        u = kc.unit_rows(L.kp, b, e)
        if qjl is not None:
            signs = kc.sign_rows(L.ks, b, e).mul_(L.kr[:, b:e].float().unsqueeze(-1))
            u.baddbmm_(signs, qjl.expand(u.shape[0], -1, -1))
        keys[:, b:e] = u.mul_(L.kn[:, b:e].float().unsqueeze(-1))
        vals[:, b:e] = vc.unit_rows(L.vp, b, e).mul_(L.vn[:, b:e].float().unsqueeze(-1))


def _affine_codes(cache: Any, L: Any, keys: torch.Tensor, vals: torch.Tensor, kernel: bool) -> None:
    """``kv_bits`` code rows [0, n_code) of ``L`` into ``keys`` / ``vals``: code times scale plus bias per group."""
    n = L.n_code
    kc = cache.kc
    if kernel:
        from swiftlm.cuda_ext.code_rows import affine_rows

        affine_rows(L.kp, L.kn, L.ks, kc.bits, kc.group, n, keys)
        affine_rows(L.vp, L.vn, L.vb, kc.bits, kc.group, n, vals)
        return
    for b in range(0, n, DECODE_ROWS):
        e = min(n, b + DECODE_ROWS)
        keys[:, b:e] = kc.decode_planes([p[:, b:e] for p in L.kp], L.kn[:, b:e], L.ks[:, b:e])
        vals[:, b:e] = kc.decode_planes([p[:, b:e] for p in L.vp], L.vn[:, b:e], L.vb[:, b:e])
