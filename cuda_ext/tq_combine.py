"""The TurboQuant decode row's second pass and the helpers that attend 16-bit rows (Triton): the 16-bit window rows
attended while the split pass still runs, then the split pass's partials (max, denominator, value sum per split,
``turboquant_kernels._tq_attn_kernel``) merged per query head, rotated back, joined with the window's part and
normalised.  The affine ``kv_bits`` kernels (``affine_kv_kernels.py``) share the merge and the 16-bit rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_splits(m_ptr, l_ptr, acc_ptr, h, S, cols, D: tl.constexpr, BS: tl.constexpr, EXP2: tl.constexpr):
    """A combine kernel's first stage: head ``h``'s S split partials (max m [H, S], denominator l
    [H, S], value sums acc [H, S, D]) merged onto their common max.  Returns (max, l, acc[cols]);
    EXP2: the partials' scores are in the exp2 domain."""
    sidx = tl.arange(0, BS)
    sok = sidx < S
    ms = tl.load(m_ptr + h * S + sidx, mask=sok, other=float("-inf"))
    mc = tl.max(ms, axis=0)
    mc_safe = tl.where(mc == float("-inf"), 0.0, mc)
    if EXP2:
        w = tl.exp2(ms - mc_safe)
    else:
        w = tl.exp(ms - mc_safe)
    l = tl.sum(w * tl.load(l_ptr + h * S + sidx, mask=sok, other=0.0), axis=0)
    accs = tl.load(acc_ptr + (h * S + sidx[:, None]) * D + cols[None, :], mask=sok[:, None], other=0.0)
    return mc, l, tl.sum(w[:, None] * accs, axis=0)


@triton.jit
def dense_rows_online(
    acc,
    l,
    m,
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
    scale,
    BLOCK_R: tl.constexpr,
    VALID: tl.constexpr,
    EXP2: tl.constexpr,
):
    """A combine kernel's 16-bit rows: continue the online softmax (running value sum ``acc`` [DS] for
    coordinates ``e``, denominator ``l``, max ``m``) over the R rows dk/dv [KVH, R, D] of KV head ``g``,
    scores q . k over all D coordinates ``d`` times ``scale`` (``valid`` [R] masks rows when VALID; EXP2:
    scores already in the exp2 domain).  Returns (acc, l, m), not normalised."""
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        ok = rr < R
        if VALID:
            ok = ok & (tl.load(valid_ptr + rr, mask=rr < R, other=0) != 0)
        kd = tl.load(dk_ptr + g * dk_head + rr[:, None] * dk_row + d[None, :], mask=ok[:, None], other=0.0)
        sc = tl.sum(kd.to(tl.float32) * q[None, :], axis=1) * scale
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if EXP2:
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(sc - m_safe)
        else:
            alpha = tl.exp(m - m_safe)
            p = tl.exp(sc - m_safe)
        vd = tl.load(dv_ptr + g * dv_head + rr[:, None] * dv_row + e[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vd.to(tl.float32), axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    return acc, l, m


@triton.jit
def merge_splits_chunked(m_ptr, l_ptr, acc_ptr, h, S, cols, D: tl.constexpr, SB: tl.constexpr):
    """``merge_splits`` over SB splits at a time (two passes: the max, then the weighted sums), so that
    a head's [S, len(cols)] partials never sit in registers at once (S grows with the GPU's SM count)."""
    sidx = tl.arange(0, SB)
    mv = tl.full((SB,), float("-inf"), tl.float32)
    for s0 in range(0, S, SB):
        mv = tl.maximum(mv, tl.load(m_ptr + h * S + s0 + sidx, mask=s0 + sidx < S, other=float("-inf")))
    mc = tl.max(mv, axis=0)
    mc_safe = tl.where(mc == float("-inf"), 0.0, mc)
    lv = tl.zeros((SB,), tl.float32)
    acc = tl.zeros((SB, cols.shape[0]), tl.float32)
    for s0 in range(0, S, SB):
        s = s0 + sidx
        ok = s < S
        w = tl.exp(tl.load(m_ptr + h * S + s, mask=ok, other=float("-inf")) - mc_safe)
        lv += w * tl.load(l_ptr + h * S + s, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(acc_ptr + (h * S + s[:, None]) * D + cols[None, :], mask=ok[:, None], other=0.0)
    return mc, tl.sum(lv, axis=0), tl.sum(acc, axis=0)


@triton.jit
def _tq_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    rot_ptr,
    q_ptr,
    dk_ptr,
    dv_ptr,
    valid_ptr,
    out_ptr,
    R,
    S,
    scale,
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
    SB: tl.constexpr = 0,
    GDC: tl.constexpr = 0,
    BATCH_H: tl.constexpr = 0,
    doffs_ptr=None,
    nd_ptr=None,
    PRE: tl.constexpr = 1,
):
    """One program per (query head, DS output coordinates): merge the head's S split partials
    ([BS, D] at once, or SB splits at a time when SB > 0), rotate the code part back for its
    coordinates (acc @ R[:, slice]), attend over the 16-bit rows (dense window, original domain;
    ``valid`` masks a static buffer's rows; scores over all D, values for the slice) and write the
    normalised slice in the output's dtype.  BATCH_H (> 0: query heads per sequence): rows of several
    sequences, b = h // BATCH_H; its 16-bit buffers at ``doffs`` [B, 2] elements from the given ones and
    its first ``nd`` [B] + 1 buffer rows valid (instead of ``valid``).  PRE (PDL builds): the 16-bit rows are
    attended before the wait for the split pass (PRE=0: after it, an A/B knob)."""
    h = tl.program_id(0)
    c0 = tl.program_id(1) * DS
    if GDC:
        if PRE == 0:
            tl.extra.cuda.gdc_wait()
    d = tl.arange(0, D)
    e = c0 + tl.arange(0, DS)
    # Before the wait: everything but the split partials.  The split pass lets this kernel launch only after its
    # own wait, so every kernel before it (the query's RoPE, the 16-bit rows' writes, the step's inputs) has
    # completed; only the partials may still be in flight.  The 16-bit rows' part of the softmax (original
    # domain) is computed here, off the path that follows the split pass's last program.
    if BATCH_H > 0:
        b = h // BATCH_H
        g = (h % BATCH_H) // REP
        dk_ptr += tl.multiple_of(tl.load(doffs_ptr + 2 * b), 16)
        dv_ptr += tl.multiple_of(tl.load(doffs_ptr + 2 * b + 1), 16)
        R = tl.load(nd_ptr + b) + 1
    else:
        g = h // REP
    q = tl.load(q_ptr + h * D + d).to(tl.float32)
    lw = tl.sum(tl.zeros((DS,), tl.float32), axis=0)  # a 0-d fp32 zero (the form compiled on the H200's Triton)
    accw, lw, mw = dense_rows_online(
        tl.zeros((DS,), tl.float32),
        lw,
        lw - float("inf"),
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
        scale,
        BLOCK_R,
        VALID,
        False,
    )
    rot = tl.load(rot_ptr + d[:, None] * D + e[None, :])  # R[:, slice] [D, DS]
    if GDC:
        if PRE != 0:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel (a GEMV) may load its first weights meanwhile
    if SB > 0:
        mc, l, acc = merge_splits_chunked(m_ptr, l_ptr, acc_ptr, h, S, d, D, SB)
    else:
        mc, l, acc = merge_splits(m_ptr, l_ptr, acc_ptr, h, S, d, D, BS, False)  # acc [D], rotated domain
    code = tl.sum(acc[:, None] * rot, axis=0)  # (acc @ R)[slice]
    mx = tl.maximum(mc, mw)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    a = tl.exp(mc - mx)
    bw = tl.exp(mw - mx)
    code = code * a + accw * bw
    l = l * a + lw * bw
    tl.store(out_ptr + h * D + e, (code / l).to(out_ptr.dtype.element_ty))
