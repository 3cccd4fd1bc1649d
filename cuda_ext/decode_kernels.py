"""Fused elementwise stages of one decode token (memory-bound; each saves launches and a
round trip through device memory):

- ``rope_kv_write_rows``: split each fused QKV row into heads, rotate q and k (rotate-half RoPE), write k
  and v into the row's own slot of a slot pool at its own position (device tensors, so CUDA graphs can
  replay it; rope tables indexed in the kernel), return the rotated q.  One sequence's own cache is a
  one-slot pool.  Replaces ~12 torch kernels.
- ``add_rmsnorm``: ``x += delta`` then ``rmsnorm(x) * w``, in one pass, per row.  Replaces 2-3.
- ``silu_mul``: ``silu(gate) * up`` from the fused [gate; up] rows.  Replaces 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_kw


# --------------------------------------------------------------------------- rope + KV write, batched
@triton.jit
def _rope_kv_rows_kernel(
    qkv,
    cos,
    sin,
    pos_ptr,
    slot_ptr,
    row_ptr,
    q_out,
    k_pool,
    v_pool,
    ks_ptr,
    vs_ptr,
    slot_stride,
    head_stride,
    row_stride,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    GDC: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    if GDC:  # programmatic dependent launch (pdl.py): the previous kernel's writes first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b)
    row = tl.load(row_ptr + b)  # the cache row written (the position itself, or its row in a paged block)
    src = qkv + b * ((H + 2 * KVH) * D)
    i = tl.arange(0, HALF)
    if h < H + KVH:
        base = h * D
        x1 = tl.load(src + base + i).to(tl.float32)
        x2 = tl.load(src + base + HALF + i).to(tl.float32)
        c1 = tl.load(cos + pos * D + i).to(tl.float32)  # the tables [ctx, D], row ``pos``
        c2 = tl.load(cos + pos * D + HALF + i).to(tl.float32)
        s1 = tl.load(sin + pos * D + i).to(tl.float32)
        s2 = tl.load(sin + pos * D + HALF + i).to(tl.float32)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        if h < H:
            dq = q_out + (b * H + h) * D
            tl.store(dq + i, o1.to(q_out.dtype.element_ty))
            tl.store(dq + HALF + i, o2.to(q_out.dtype.element_ty))
        else:
            dst = k_pool + slot * slot_stride + (h - H) * head_stride + row * row_stride
            if KV_FP8:  # e4m3 pool: k / scale saturated to +-448 (kv_fp8.quantize)
                sc = tl.load(ks_ptr + (h - H))
                o1 = tl.minimum(tl.maximum(o1 / sc, -448.0), 448.0)
                o2 = tl.minimum(tl.maximum(o2 / sc, -448.0), 448.0)
            tl.store(dst + i, o1.to(k_pool.dtype.element_ty))
            tl.store(dst + HALF + i, o2.to(k_pool.dtype.element_ty))
    else:
        j = tl.arange(0, D)
        val = tl.load(src + h * D + j)
        if KV_FP8:
            val = val.to(tl.float32) / tl.load(vs_ptr + (h - H - KVH))
            val = tl.minimum(tl.maximum(val, -448.0), 448.0)
        dst = v_pool + slot * slot_stride + (h - H - KVH) * head_stride + row * row_stride
        tl.store(dst + j, val.to(v_pool.dtype.element_ty))


def rope_kv_write_rows(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    H: int,
    KVH: int,
    D: int,
    rows: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """B decode rows at once: qkv [B, (H+2KVH)*D] (contiguous); cos/sin the whole rope tables [ctx, D];
    pos, slots [B] (device ints); pools [S, KVH, C, D] (a slot pool's layer, or a paged pool's blocks).
    Rotates q and k of row b at position pos[b], writes k and v into slot (block) slots[b], row rows[b]
    (default pos[b]).  Returns q rotated, [B, H, D].  e4m3 pools (--kv-cache-dtype fp8) take ``k_scale`` /
    ``v_scale`` (float32 [KVH]): rows are stored as e4m3(clamp(x / scale, +-448))."""
    B = qkv.shape[0]
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and k_pool.stride(3) == 1
    q = torch.empty((B, H, D), dtype=qkv.dtype, device=qkv.device)
    rows = pos if rows is None else rows
    fp8 = k_pool.dtype == torch.float8_e4m3fn
    assert not fp8 or (k_scale is not None and v_scale is not None), "an e4m3 pool needs k_scale and v_scale"
    _rope_kv_rows_kernel[(B, H + 2 * KVH)](
        qkv,
        cos,
        sin,
        pos,
        slots,
        rows,
        q,
        k_pool,
        v_pool,
        k_scale if fp8 else pos,  # (unread without KV_FP8)
        v_scale if fp8 else pos,
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        H=H,
        KVH=KVH,
        D=D,
        HALF=D // 2,
        KV_FP8=fp8,
        **launch_kw(qkv),
    )
    return q


def rope_kv_write_rows_ref(qkv, cos, sin, pos, slots, k_pool, v_pool, H, KVH, D, rows=None, k_scale=None, v_scale=None):
    B = qkv.shape[0]
    rows = pos if rows is None else rows
    q, k, v = qkv.float().split([H * D, KVH * D, KVH * D], dim=-1)
    c, s = cos[pos].float().view(B, 1, D), sin[pos].float().view(B, 1, D)

    def rot(x, n):
        x = x.view(B, n, D)
        half = D // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

    kr, vr = rot(k, KVH), v.view(B, KVH, D)
    if k_scale is not None:
        kr = (kr / k_scale.float().view(1, KVH, 1)).clamp(-448.0, 448.0)
        vr = (vr / v_scale.float().view(1, KVH, 1)).clamp(-448.0, 448.0)
    k_pool[slots, :, rows] = kr.to(k_pool.dtype)
    v_pool[slots, :, rows] = vr.to(v_pool.dtype)
    return rot(q, H).to(qkv.dtype)


# --------------------------------------------------------------------------- add + RMSNorm
@triton.jit
def add_rmsnorm_row(x, delta, w, out, eps, i, m, N: tl.constexpr):
    """One row: ``x[i] += delta`` (fp32 values; the sum rounded once to x's dtype as it is stored), then
    ``out[i] = rmsnorm(x) * w``.  Shared by ``_add_rmsnorm_kernel`` and the peer-sum kernel (peer_sum.py), so
    the two give the same bits for the same sum."""
    h = tl.load(x + i, mask=m, other=0.0).to(tl.float32) + delta
    hs = h.to(x.dtype.element_ty)
    tl.store(x + i, hs, mask=m)
    hf = hs.to(tl.float32)  # normalise the stored (rounded) residual, as the unfused code does
    r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    y = (hf * r).to(x.dtype.element_ty).to(tl.float32) * tl.load(w + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out + i, y.to(out.dtype.element_ty), mask=m)


@triton.jit
def _add_rmsnorm_kernel(x, delta, w, out, eps, N: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    r0 = tl.program_id(0) * N  # one program per row of [rows, N] (contiguous)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.arange(0, BLOCK)
    m = i < N
    add_rmsnorm_row(x + r0, tl.load(delta + r0 + i, mask=m, other=0.0).to(tl.float32), w, out + r0, eps, i, m, N)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """In place ``x += delta`` (x, delta: [rows, N], contiguous); returns ``rmsnorm(x) * w`` per row."""
    N = x.shape[-1]
    assert x.is_contiguous() and delta.is_contiguous()
    out = torch.empty_like(x)
    _add_rmsnorm_kernel[(x.numel() // N,)](x, delta, w, out, eps, N=N, BLOCK=triton.next_power_of_2(N), **launch_kw(x))
    return out


def add_rmsnorm_ref(x, delta, w, eps):
    x.copy_((x.float() + delta.float()).to(x.dtype))
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float() * w.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------- SiLU * up
@triton.jit
def _silu_mul_kernel(gu, out, I: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    pid, row = tl.program_id(0), tl.program_id(1)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    gu, out = gu + row * 2 * I, out + row * I
    i = pid * BLOCK + tl.arange(0, BLOCK)
    m = i < I
    g = tl.load(gu + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + I + i, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out + i, y.to(out.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2I] (contiguous) -> silu(gate) * up, [rows, I]."""
    I = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * I)
    assert gate_up.is_contiguous()
    out = torch.empty((rows, I), dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(triton.cdiv(I, BLOCK), rows)](gate_up, out, I=I, BLOCK=BLOCK, **launch_kw(gate_up))
    return out


def silu_mul_ref(gate_up):
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
