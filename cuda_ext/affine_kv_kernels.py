"""Decode attention over affine ``kv_bits`` KV codes (Triton), the fused row encoder, torch references.

The cache (``backends/torch/compressed_cache.py``, codec ``AffineCodec``) holds, per KV head and
position, the integer codes of the key and of the value ([KVH, cap, D] bytes for 8 bits, [KVH, cap,
D / 2] for 4 bits: byte j = code 2j | code 2j+1 << 4) and an fp16 scale and bias per group of
``group`` coordinates ([KVH, cap, D / group]): x ~ code * scale + bias.

``affine_decode_attention``: one decode row (queries [H, D]) in two kernels, flash-decoding style.

- ``_affine_attn_kernel``, grid (KV head, split): a program owns a contiguous range of whole
  BLOCK_N-row tiles of one KV head (the range from the row count, read on the device when it is a
  tensor, so a CUDA graph replays with any count) and scores the REP query heads that share the KV
  head together (columns of a [D, RP] query tile, RP >= 16 for ``tl.dot``): each code is loaded and
  dequantized once per KV head, not once per query head.  A tile of codes (4 bits: low and high
  nibbles put back in coordinate order) is dequantized with its rows' scales and biases broadcast
  over each group and fed to the dots as their first operand (scores^T = K q^T, sum^T = V^T p^T):
  fp16 operands with fp32 accumulation for 16-bit models (codes are turned into exact fp16 numbers
  by bit operations, ``_u8_f16``; the dequantized value is rounded once or twice to fp16, finer than a
  bf16 cache row), fp32 ("ieee") otherwise.  Online softmax in the exp2 domain; the program stores
  its running max, denominator and unnormalised value sum.
- ``_affine_combine_kernel``, grid (query head, D / 32): merges the splits and attends the 16-bit
  rows the cache keeps (the eager path's not-yet-quantized rows, or a graph step's new row), then
  normalises.

``affine_encode_rows``: the fused encoder (``_affine_encode_kernel``): per group min / max, the fp16
scale and bias, codes, packed store at a position given on the device: exactly the codes, scales and
biases of ``AffineCodec.encode`` on the same device (see ``_recip``).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from .pdl import launch_kw
from .tq_combine import dense_rows_online, merge_splits

_LOG2E = 1.4426950408889634
_RINT = tl.constexpr(
    12582912.0
)  # 1.5 * 2^23: (y + _RINT) - _RINT rounds |y| < 2^22 to the nearest integer, ties to even


def supported(head_dim: int, group: int, bits: int) -> bool:
    """Shapes the kernels take (and the tests cover): head dims 32, 64, 128; power-of-two groups of 16 to
    the head dim (one group per row included)."""
    pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    return bits in (4, 8) and head_dim in (32, 64, 128) and pow2(group) and 16 <= group <= head_dim


# ------------------------------------------------------------------------------------ kernels
@triton.jit
def _u8_f16(c):
    """Integer codes 0..255 -> exact fp16 without a conversion instruction: 0x6400 | c is the fp16
    number 1024 + c."""
    return (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _scales(
    ptr,
    rows,
    row_stride,
    G: tl.constexpr,
    GS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    F16: tl.constexpr,
    T: tl.constexpr,
):
    """Per-group fp16 scales (or biases) of ``rows`` broadcast to [BLOCK_N, D] (T: [D, BLOCK_N])."""
    gi = tl.arange(0, G)
    if T:
        x = tl.load(ptr + rows[None, :] * row_stride + gi[:, None])  # [G, BLOCK_N]
        x = tl.reshape(tl.broadcast_to(x[:, None, :], (G, GS, BLOCK_N)), (D, BLOCK_N))
    else:
        x = tl.load(ptr + rows[:, None] * row_stride + gi[None, :])  # [BLOCK_N, G]
        x = tl.reshape(tl.broadcast_to(x[:, :, None], (BLOCK_N, G, GS)), (BLOCK_N, D))
    return x if F16 else x.to(tl.float32)


@triton.jit
def _dequant(
    c_ptr,
    s_ptr,
    b_ptr,
    rows,
    c_row,
    s_row,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    GS: tl.constexpr,
    D: tl.constexpr,
    F16: tl.constexpr,
    T: tl.constexpr,
):
    """Rows code * scale + bias: [BLOCK_N, D], or transposed [D, BLOCK_N] (T).  F16: fp16 math (the
    codes exact, one fp16 rounding per product and sum), else fp32."""
    col = tl.arange(0, D)
    if BITS == 8:
        if T:
            c = tl.load(c_ptr + rows[None, :] * c_row + col[:, None])
        else:
            c = tl.load(c_ptr + rows[:, None] * c_row + col[None, :])
    else:  # byte j holds coordinates 2j (low nibble) and 2j + 1
        j = tl.arange(0, D // 2)
        if T:
            bt = tl.load(c_ptr + rows[None, :] * c_row + j[:, None])  # [D / 2, BLOCK_N]
            c = tl.reshape(tl.permute(tl.join(bt & 15, bt >> 4), (0, 2, 1)), (D, BLOCK_N))
        else:
            bt = tl.load(c_ptr + rows[:, None] * c_row + j[None, :])
            c = tl.interleave(bt & 15, bt >> 4)
    c = _u8_f16(c) if F16 else c.to(tl.float32)
    return c * _scales(s_ptr, rows, s_row, G, GS, BLOCK_N, D, F16, T) + _scales(
        b_ptr, rows, s_row, G, GS, BLOCK_N, D, F16, T
    )


@triton.jit
def _affine_attn_kernel(
    q_ptr,
    kc_ptr,
    ks_ptr,
    kb_ptr,
    vc_ptr,
    vs_ptr,
    vb_ptr,
    m_out,
    l_out,
    acc_out,
    N,
    n_ptr,
    qk_scale,
    kc_head,
    kc_row,
    ks_head,
    ks_row,
    vc_head,
    vc_row,
    vs_head,
    vs_row,
    D: tl.constexpr,
    GS: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REP: tl.constexpr,
    RP: tl.constexpr,
    N_PTR: tl.constexpr,
    F16: tl.constexpr,
    GDC: tl.constexpr,
):
    """Transposed products: scores^T = K q^T [BLOCK_N, RP] and (Σ p v)^T = V^T p^T [D, RP], so that
    both dequantized tiles are the dots' first operands, which saves moving them into the second
    operand's layout (4-bit codes gain most; ``scripts/bench_tq_kernel.py --kv-bits`` times it)."""
    g = tl.program_id(0)  # KV head
    sp = tl.program_id(1)  # split
    S = tl.num_programs(1)
    if GDC:  # programmatic dependent launch (pdl.py): q and this step's codes come from earlier kernels
        tl.extra.cuda.gdc_wait()
    if N_PTR:
        N = tl.load(n_ptr)
    G: tl.constexpr = D // GS
    r = tl.arange(0, RP)
    rv = r < REP
    h = g * REP + r
    col = tl.arange(0, D)
    qT = tl.load(q_ptr + h[None, :] * D + col[:, None], mask=rv[None, :], other=0.0)  # [D, RP]
    qT = qT.to(tl.float16) if F16 else qT.to(tl.float32)
    g64 = g.to(tl.int64)
    kc, ks, kb = kc_ptr + g64 * kc_head, ks_ptr + g64 * ks_head, kb_ptr + g64 * ks_head
    vc, vs, vb = vc_ptr + g64 * vc_head, vs_ptr + g64 * vs_head, vb_ptr + g64 * vs_head
    tiles = tl.cdiv(N, BLOCK_N)
    per = tl.cdiv(tiles, S)
    lo = sp * per * BLOCK_N
    m = tl.full((RP,), float("-inf"), tl.float32)
    l = tl.zeros((RP,), tl.float32)
    acc = tl.zeros((D, RP), tl.float32)
    for t in range(0, per):
        n = lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = n < N
        nn = tl.where(ok, n, 0)
        kd = _dequant(kc, ks, kb, nn, kc_row, ks_row, BITS, BLOCK_N, G, GS, D, F16, False)  # [BLOCK_N, D]
        if F16:
            sT = tl.dot(kd, qT)
        else:
            sT = tl.dot(kd, qT, input_precision="ieee")
        sT = tl.where(ok[:, None], sT * qk_scale, float("-inf"))  # [BLOCK_N, RP]
        m_new = tl.maximum(m, tl.max(sT, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a range past the rows: all -inf, no NaN
        alpha = tl.math.exp2(m - m_safe)
        pT = tl.math.exp2(sT - m_safe[None, :])
        vdT = _dequant(vc, vs, vb, nn, vc_row, vs_row, BITS, BLOCK_N, G, GS, D, F16, True)  # [D, BLOCK_N]
        if F16:
            acc = acc * alpha[None, :] + tl.dot(vdT, pT.to(tl.float16))
        else:
            acc = acc * alpha[None, :] + tl.dot(vdT, pT, input_precision="ieee")
        l = l * alpha + tl.sum(pT, axis=0)
        m = m_new
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(m_out + h * S + sp, m, mask=rv)
    tl.store(l_out + h * S + sp, l, mask=rv)
    tl.store(acc_out + (h[None, :] * S + sp) * D + col[:, None], acc, mask=rv[None, :])


@triton.jit
def _affine_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    q_ptr,
    dk_ptr,
    dv_ptr,
    valid_ptr,
    out_ptr,
    R,
    S,
    qk_scale,
    dk_head,
    dk_row,
    dv_head,
    dv_row,
    D: tl.constexpr,
    DS: tl.constexpr,
    BS: tl.constexpr,
    REP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    VALID: tl.constexpr,
    GDC: tl.constexpr,
):
    """One program per (query head, DS output coordinates): merge the head's S split partials,
    attend the R 16-bit rows ``dk``/``dv`` [KVH, R, D] (scores over all D, values for the slice;
    ``valid`` masks rows), normalise, store in the output's dtype.  Scores in the exp2 domain."""
    h = tl.program_id(0)
    c0 = tl.program_id(1) * DS
    if GDC:
        tl.extra.cuda.gdc_wait()
    g = h // REP
    d = tl.arange(0, D)
    e = c0 + tl.arange(0, DS)
    mc, l, acc = merge_splits(m_ptr, l_ptr, acc_ptr, h, S, e, D, BS, True)  # acc [DS]
    q = tl.load(q_ptr + h * D + d).to(tl.float32)
    acc, l, _ = dense_rows_online(
        acc,
        l,
        mc,
        q,
        dk_ptr,
        dv_ptr,
        valid_ptr,
        g,
        dk_head,
        dk_row,
        dv_head,
        dv_row,
        d,
        e,
        R,
        qk_scale,
        BLOCK_R,
        VALID,
        True,
    )
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + h * D + e, (acc / tl.where(l > 0, l, 1.0)).to(out_ptr.dtype.element_ty))


@triton.jit
def _affine_encode_kernel(
    xk_ptr,
    xv_ptr,
    kc_ptr,
    ks_ptr,
    kb_ptr,
    vc_ptr,
    vs_ptr,
    vb_ptr,
    at_ptr,
    at,
    T,
    cap,
    levels,
    inv_levels,
    xk_head,
    xk_row,
    xv_head,
    xv_row,
    c_head,
    c_row,
    s_head,
    s_row,
    D: tl.constexpr,
    GS: tl.constexpr,
    BITS: tl.constexpr,
    BR: tl.constexpr,
    AT_PTR: tl.constexpr,
    RECIP: tl.constexpr,
    GDC: tl.constexpr,
):
    """Grid (KV head, keys / values, row blocks): BR rows [BR, groups, group] of x -> per group
    min, max, fp16 scale = (max - min) / levels (1 where max == min) and fp16 bias = min, codes =
    clamp(round((x - bias) / scale), 0, levels) (fp32, IEEE division, ties to even), stored packed at
    positions at + row (rows at or past ``cap`` are dropped).  RECIP: (max - min) times the fp32
    reciprocal of ``levels`` instead of the division (what torch does on CUDA for a scalar divisor)."""
    hd = tl.program_id(0)
    which = tl.program_id(1)
    blk = tl.program_id(2)
    if GDC:
        tl.extra.cuda.gdc_wait()
    if AT_PTR:
        at = tl.load(at_ptr)
    G: tl.constexpr = D // GS
    if which == 0:
        x_ptr, x_head, x_row, c_ptr, s_ptr, b_ptr = xk_ptr, xk_head, xk_row, kc_ptr, ks_ptr, kb_ptr
    else:
        x_ptr, x_head, x_row, c_ptr, s_ptr, b_ptr = xv_ptr, xv_head, xv_row, vc_ptr, vs_ptr, vb_ptr
    r = blk * BR + tl.arange(0, BR)
    ok = r < T
    rr = tl.where(ok, r, 0)
    gi = tl.arange(0, G)
    e = tl.arange(0, GS)
    x = tl.load(x_ptr + hd * x_head + rr[:, None, None] * x_row + (gi[:, None] * GS + e[None, :])[None, :, :])
    x = x.to(tl.float32)  # [BR, G, GS]
    lo = tl.min(x, axis=2)
    hi = tl.max(x, axis=2)
    if RECIP:
        step = (hi - lo) * inv_levels
    else:
        step = tl.math.div_rn(hi - lo, tl.zeros_like(hi) + levels)
    scale = tl.where(hi > lo, step, 1.0).to(tl.float16)
    bias = lo.to(tl.float16)
    y = tl.math.div_rn(x - bias.to(tl.float32)[:, :, None], tl.broadcast_to(scale.to(tl.float32)[:, :, None], x.shape))
    y = (y + _RINT) - _RINT
    code = tl.minimum(tl.maximum(y, 0.0), levels).to(tl.int32)
    pos = at + r
    keep = ok & (pos < cap)
    row = hd.to(tl.int64) * c_head + pos.to(tl.int64) * c_row
    if BITS == 8:
        tl.store(
            c_ptr + row[:, None, None] + (gi[:, None] * GS + e[None, :])[None, :, :],
            code.to(tl.uint8),
            mask=keep[:, None, None],
        )
    else:
        pair = tl.reshape(code, (BR, G, GS // 2, 2))
        byte = tl.sum(pair << (tl.arange(0, 2) * 4)[None, None, None, :], axis=3)
        j = tl.arange(0, GS // 2)
        tl.store(
            c_ptr + row[:, None, None] + (gi[:, None] * (GS // 2) + j[None, :])[None, :, :],
            byte.to(tl.uint8),
            mask=keep[:, None, None],
        )
    srow = hd.to(tl.int64) * s_head + pos.to(tl.int64) * s_row
    tl.store(s_ptr + srow[:, None] + gi[None, :], scale, mask=keep[:, None])
    tl.store(b_ptr + srow[:, None] + gi[None, :], bias, mask=keep[:, None])
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()


# ------------------------------------------------------------------------------------ host side
# launch knobs of the split pass (num_warps, num_stages, BLOCK_N) for sweeps; SWIFTLM_AFFINE_TUNE="num_warps=8,BLOCK_N=128"
# sets them for a whole process (a diagnostic knob for end-to-end runs)
_TUNE: dict = {
    k: int(v) for k, v in (kv.split("=") for kv in filter(None, os.environ.get("SWIFTLM_AFFINE_TUNE", "").split(",")))
}


def _splits(device: torch.device, groups: int, rows: int, block_n: int) -> int:
    from .turboquant_kernels import AFFINE_PROGRAMS_PER_SM
    from .turboquant_kernels import _splits as tq_splits

    # 8 programs per SM: the TurboQuant kernel's counts were measured on that kernel only
    return tq_splits(device, groups, rows, block_n, AFFINE_PROGRAMS_PER_SM)


def _block_n(f16: bool, D: int) -> int:
    return 64 if f16 or D <= 64 else 32


def affine_split_pass(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_bias: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_bias: torch.Tensor,
    bits: int,
    group: int,
    scale: float,
    rep: int = 1,
    n_rows: torch.Tensor | None = None,
    f16: bool | None = None,
    block_n: int | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split pass alone: (m [H, S], l [H, S], acc [H, S, D]) in the exp2 domain (m is a max of
    q.k * scale * log2(e)); see ``affine_decode_attention`` for the arguments."""
    H, D = q.shape
    KVH, N = k_codes.shape[:2]
    assert H == KVH * rep and supported(D, group, bits), (q.shape, k_codes.shape, group, bits)
    assert k_codes.shape[2] == D * bits // 8 and k_scale.shape[2] == D // group
    assert k_codes.stride(2) == 1 and v_codes.stride(2) == 1 and k_scale.stride(2) == 1 and v_scale.stride(2) == 1
    assert k_bias.stride() == k_scale.stride() and v_bias.stride() == v_scale.stride()
    if f16 is None:
        f16 = q.dtype in (torch.float16, torch.bfloat16)
    tune = dict(_TUNE)
    tuned_n = tune.pop("BLOCK_N", 0)
    block_n = block_n or tuned_n or _block_n(f16, D)
    S = splits or _splits(q.device, KVH, N, block_n)
    m = torch.empty(H, S, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(H, S, D, dtype=torch.float32, device=q.device)
    _affine_attn_kernel[(KVH, S)](
        q.contiguous(),
        k_codes,
        k_scale,
        k_bias,
        v_codes,
        v_scale,
        v_bias,
        m,
        l,
        acc,
        N,
        n_rows if n_rows is not None else m,
        float(scale) * _LOG2E,
        k_codes.stride(0),
        k_codes.stride(1),
        k_scale.stride(0),
        k_scale.stride(1),
        v_codes.stride(0),
        v_codes.stride(1),
        v_scale.stride(0),
        v_scale.stride(1),
        D=D,
        GS=group,
        BITS=bits,
        BLOCK_N=block_n,
        REP=rep,
        RP=max(16, triton.next_power_of_2(rep)),
        N_PTR=n_rows is not None,
        F16=bool(f16),
        **launch_kw(q),
        **tune,
    )
    return m, l, acc


def affine_decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_bias: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_bias: torch.Tensor,
    bits: int,
    group: int,
    scale: float,
    *,
    rep: int = 1,
    n_rows: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    f16: bool | None = None,
    block_n: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V for one decode row over affine codes and optional 16-bit rows.

    q [H, D] (query head h reads KV head h // rep); codes [H // rep, N, D * bits / 8] uint8 and
    fp16 scales / biases [H // rep, N, D / group] (views of a larger store are fine: any head and
    row strides, contiguous last axis).  ``n_rows`` (int device tensor [1]): read only that many of
    the N rows, the split ranges computed on the device (no host sync: capturable).  ``dk``/``dv``
    [H // rep, R, D]: 16-bit rows attended exactly after the codes (``valid`` [R] bool masks them).
    ``f16``: fp16 dot operands with fp32 accumulation (default for 16-bit q), else fp32 throughout.
    Returns [H, D] in q's dtype."""
    H, D = q.shape
    m, l, acc = affine_split_pass(
        q, k_codes, k_scale, k_bias, v_codes, v_scale, v_bias, bits, group, scale, rep, n_rows, f16, block_n, splits
    )
    S = m.shape[1]
    out = torch.empty(H, D, dtype=q.dtype, device=q.device)
    if dk is None:
        dk = dv = torch.zeros(H // rep, 0, D, dtype=q.dtype, device=q.device)
    assert dk.stride(2) == 1 and dv.stride(2) == 1 and dk.shape == dv.shape
    ds = min(D, 32)
    _affine_combine_kernel[(H, D // ds)](
        m,
        l,
        acc,
        q.contiguous(),
        dk,
        dv,
        valid if valid is not None else m,
        out,
        dk.shape[1],
        S,
        float(scale) * _LOG2E,
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        D=D,
        DS=ds,
        BS=max(2, triton.next_power_of_2(S)),
        REP=rep,
        BLOCK_R=16,
        VALID=valid is not None,
        num_warps=4,
        **launch_kw(q),
    )
    return out


def _unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., D * bits / 8] -> int64 codes [..., D]."""
    c = codes.long()
    if bits == 8:
        return c
    return torch.stack([c & 15, c >> 4], dim=-1).flatten(-2)


def _dequant_ref(codes, scale, bias, bits, group):
    c = _unpack_codes(codes, bits).double()
    x = c.view(*c.shape[:-1], -1, group) * scale.double().unsqueeze(-1) + bias.double().unsqueeze(-1)
    return x.view(c.shape)


def affine_decode_attention_ref(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_bias: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_bias: torch.Tensor,
    bits: int,
    group: int,
    scale: float,
    *,
    rep: int = 1,
    n_rows: torch.Tensor | int | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    **_tuning,
) -> torch.Tensor:
    """Plain torch (float64; host syncs, not capturable): decode the codes, softmax over them and the
    16-bit rows.  Same contract as ``affine_decode_attention``."""
    H, D = q.shape
    n = k_codes.shape[1] if n_rows is None else int(n_rows.reshape(-1)[0]) if torch.is_tensor(n_rows) else n_rows
    K = _dequant_ref(k_codes[:, :n], k_scale[:, :n], k_bias[:, :n], bits, group)
    V = _dequant_ref(v_codes[:, :n], v_scale[:, :n], v_bias[:, :n], bits, group)
    if dk is not None:
        keep = torch.ones(dk.shape[1], dtype=torch.bool, device=dk.device) if valid is None else valid.bool()
        K = torch.cat([K, dk[:, keep].double()], 1)
        V = torch.cat([V, dv[:, keep].double()], 1)
    K, V = K.repeat_interleave(rep, 0), V.repeat_interleave(rep, 0)
    if K.shape[1] == 0:
        return torch.zeros_like(q)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q.double(), K) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", p, V).to(q.dtype)


def _recip(device: torch.device) -> bool:
    """Does ``AffineCodec.encode``'s ``(hi - lo) / levels`` multiply by the fp32 reciprocal on this
    device?  torch's CUDA division by a CPU scalar does (``div_true_kernel_cuda``); the CPU kernel divides."""
    return device.type == "cuda"


def affine_encode_rows(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_bias: torch.Tensor,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_bias: torch.Tensor | None,
    bits: int,
    group: int,
    at: torch.Tensor | int,
    block_rows: int = 16,
) -> None:
    """Quantize rows k (and v) [KVH, T, D] and store them at positions at .. at + T - 1 of the code
    storage ([KVH, cap, D * bits / 8], scales / biases [KVH, cap, D / group]); ``at`` an int or an
    int device tensor [1] (capturable); rows at or past cap are dropped.  One launch for both."""
    KVH, T, D = k.shape
    assert supported(D, group, bits) and k_codes.shape[2] == D * bits // 8
    assert k_codes.stride(2) == 1 and k_scale.stride(2) == 1 and k_bias.stride() == k_scale.stride()
    if k.stride(2) != 1:
        k = k.contiguous()
    if v is None:
        v, v_codes, v_scale, v_bias = k, k_codes, k_scale, k_bias
    elif v.stride(2) != 1:
        v = v.contiguous()
    assert v.shape == k.shape and v_codes.stride() == k_codes.stride() and v_scale.stride() == k_scale.stride()
    levels = (1 << bits) - 1
    inv = float(np.float32(1.0) / np.float32(levels))
    at_t = at if torch.is_tensor(at) else None
    grid = (KVH, 2 if v is not k else 1, triton.cdiv(T, block_rows))
    _affine_encode_kernel[grid](
        k,
        v,
        k_codes,
        k_scale,
        k_bias,
        v_codes,
        v_scale,
        v_bias,
        at_t if at_t is not None else k_scale,
        0 if at_t is not None else int(at),
        T,
        k_codes.shape[1],
        float(levels),
        inv,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_codes.stride(0),
        k_codes.stride(1),
        k_scale.stride(0),
        k_scale.stride(1),
        D=D,
        GS=group,
        BITS=bits,
        BR=block_rows,
        AT_PTR=at_t is not None,
        RECIP=_recip(k.device),
        **launch_kw(k),
    )


def selfcheck(device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> float:
    """Relative error kernel vs reference (grouped heads, a row count from the device smaller than
    the storage, 16-bit rows; 4 and 8 bits) and the encoder vs ``AffineCodec.encode`` (any differing
    code, scale or bias counts as error 1)."""
    from swiftlm.backends.torch.kv_quant import AffineCodec

    g = torch.Generator(device="cpu").manual_seed(seed)
    KVH, rep, D, cap, n, R = 2, 4, 64, 80, 45, 3
    worst = 0.0
    for bits, group in ((4, 32), (8, 64)):
        codec = AffineCodec(D, bits, group)
        x = (torch.randn(2, KVH, cap, D, generator=g) * 2).to(device=device, dtype=dtype)
        enc_k, enc_v = codec.encode(x[0]), codec.encode(x[1])
        store = [torch.zeros_like(t) for t in (enc_k.planes[0], enc_k.norms, enc_k.signs) for _ in (0, 1)]
        store = store[0::2] + store[1::2]  # keys' codes, scales, biases, then the values'
        affine_encode_rows(x[0], x[1], *store, bits, group, torch.tensor([0], device=device))
        for got, want in zip(
            store, (enc_k.planes[0], enc_k.norms, enc_k.signs, enc_v.planes[0], enc_v.norms, enc_v.signs)
        ):
            if not torch.equal(got, want):
                return 1.0
        q = torch.randn(KVH * rep, D, generator=g).to(device=device, dtype=dtype)
        dk = torch.randn(KVH, R, D, generator=g).to(device=device, dtype=dtype)
        dv = torch.randn(KVH, R, D, generator=g).to(device=device, dtype=dtype)
        valid = torch.tensor([True, False, True], device=device)
        args = (q, *store, bits, group, D**-0.5)
        kw = dict(rep=rep, n_rows=torch.tensor([n], device=device), dk=dk, dv=dv, valid=valid)
        a = affine_decode_attention(*args, splits=2, **kw)
        r = affine_decode_attention_ref(*args, **kw)
        worst = max(worst, float((a.double() - r.double()).norm() / (r.double().norm() + 1e-12)))
    return worst


__all__ = [
    "affine_decode_attention",
    "affine_decode_attention_ref",
    "affine_encode_rows",
    "affine_split_pass",
    "selfcheck",
    "supported",
]
