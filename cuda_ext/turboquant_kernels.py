"""Decode attention over TurboQuant-packed keys and values (Triton), with a torch reference.

One program per head: the query arrives already rotated (and scaled), keys and values are
read as packed bit planes (``swiftlm.turboquant.packing``: a plane of width w holds 8/w codes
per byte, little-end first; 3-bit codes are a 2-bit plane + a 1-bit plane), centroids are
looked up from the codebooks, scores use the fp16 norms, and an online softmax accumulates
``Σ p_i ‖v_i‖ c[v_i]`` in the rotated domain.  The kernel returns the running max, the
softmax denominator and the unnormalised sum, so the caller can merge it with the 16-bit
window (flash-decoding style) and rotate the result back once.  The code-tile helpers (unpacking, the
``prmt`` lookups, selector words) and the fused encoder are in ``tq_codes.py``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import launch_kw
from .tq_codes import _PLANES, _codes, _field, _mux_tile, _planes, _prmt_for, _signs_nat, _swar_ok
from .tq_combine import _tq_combine_kernel


@triton.jit
def _page_of(pt_ptr, first, N, PAGE: tl.constexpr):
    """The page holding row ``first`` of the sequence (its table entry; 0 past N).  The codes are pages of PAGE
    rows, a multiple of the tile, so a tile sits in one page: row r of the sequence is row r % PAGE of page
    ``pt_ptr[r // PAGE]``.  The loops read the next tile's entry one tile ahead (a load that waits for nothing),
    so its latency hides behind the current tile (read in the tile itself, every tile would wait for it)."""
    return tl.load(pt_ptr + first // PAGE, mask=first < N, other=0).to(tl.int64)


@triton.jit
def _tq_range_trans(
    q,
    kp0,
    kp1,
    rk0,
    rk1,
    kn,
    kc_ptr,
    vp0,
    vp1,
    rv0,
    rv1,
    vn,
    vc_ptr,
    lo,
    per,
    N,
    m,
    l,
    pt_ptr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RP: tl.constexpr,
    KW0: tl.constexpr,
    KW1: tl.constexpr,
    VW0: tl.constexpr,
    VW1: tl.constexpr,
    KASM: tl.constexpr,
    KPRMT: tl.constexpr,
    VASM: tl.constexpr,
    VPRMT: tl.constexpr,
    KSWAR: tl.constexpr,
    VSWAR: tl.constexpr,
    PAGE: tl.constexpr,
):
    """``_tq_attn_kernel``'s loop with the code tiles as first operands: scores^T [BLOCK_N, RP] = K q^T
    and the value sum kept transposed, acc^T [D, RP] += V^T p^T (fp16 operands, natural order, no QJL).
    Pointers are already offset to the program's KV head.  Returns (m, l, acc^T)."""
    qT = tl.trans(q)  # [D, RP] fp16
    accT = tl.zeros((D, RP), tl.float32)
    # the denominator is kept per row and summed once after the loop: the rows of a tile sit in all warps, so a
    # sum over them per tile is a shared-memory exchange and a barrier
    lT = tl.zeros((BLOCK_N, RP), tl.float32)
    if PAGE > 0:
        pg = _page_of(pt_ptr, lo, N, PAGE)
    for t in range(0, per):
        first = lo + t * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        ok = n < N
        if PAGE > 0:
            nn = tl.where(ok, pg * PAGE + (n - (first // PAGE) * PAGE), 0)
            pg = _page_of(pt_ptr, first + BLOCK_N, N, PAGE)  # the next tile's
        else:
            nn = tl.where(ok, n, 0)
        kvec = _mux_tile(kp0, kp1, rk0, rk1, nn, kc_ptr, KW0, KW1, BLOCK_N, D, KASM, KPRMT, KSWAR)
        knv = tl.load(kn + nn).to(tl.float32)
        sT = tl.dot(kvec, qT)  # [BLOCK_N, RP]
        sT = tl.where(ok[:, None], sT * knv[:, None], float("-inf"))
        m_new = tl.maximum(m, tl.max(sT, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        pT = tl.exp(sT - m_safe[None, :])
        vvec = _mux_tile(vp0, vp1, rv0, rv1, nn, vc_ptr, VW0, VW1, BLOCK_N, D, VASM, VPRMT, VSWAR)
        vnv = tl.load(vn + nn).to(tl.float32)
        pvT = (pT * vnv[:, None]).to(tl.float16)
        accT = accT * alpha[None, :] + tl.dot(tl.trans(vvec), pvT)
        lT = lT * alpha[None, :] + pT
        m = m_new
    return m, l + tl.sum(lT, axis=0), accT


@triton.jit
def _tq_attn_kernel(
    q_ptr,
    kp0,
    kp1,
    kn_ptr,
    kc_ptr,
    vp0,
    vp1,
    vn_ptr,
    vc_ptr,
    sq_ptr,
    ks_ptr,
    kr_ptr,
    m_out,
    l_out,
    acc_out,
    N,
    n_ptr,
    qjl_scale,
    offs_ptr,
    head_k0,
    head_k1,
    head_v0,
    head_v1,
    rk0,
    rk1,
    rv0,
    rv1,
    kn_head,
    vn_head,
    ks_head,
    kr_head,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REP: tl.constexpr,
    RP: tl.constexpr,
    KW0: tl.constexpr,
    KW1: tl.constexpr,
    VW0: tl.constexpr,
    VW1: tl.constexpr,
    QJL: tl.constexpr,
    N_PTR: tl.constexpr,
    F16: tl.constexpr,
    KNAT: tl.constexpr,
    VNAT: tl.constexpr,
    KASM: tl.constexpr,
    KPRMT: tl.constexpr,
    VASM: tl.constexpr,
    VPRMT: tl.constexpr,
    KSWAR: tl.constexpr = 0,
    VSWAR: tl.constexpr = 0,
    TRANS: tl.constexpr = 0,
    GDC: tl.constexpr = 0,
    BATCH: tl.constexpr = 0,
    DIAG: tl.constexpr = 0,
    pt_ptr=None,
    PAGE: tl.constexpr = 0,
    EARLY: tl.constexpr = 1,
    BAL: tl.constexpr = 1,
):
    """One program per (KV head, split): the REP query heads sharing that KV head are scored
    together (rows of an [RP, D] tile, RP >= 16 for tl.dot), so each packed code is unpacked and
    looked up once, not once per query head.  Split ``sp`` of S owns a contiguous range of whole
    BLOCK_N tiles, sized from the row count (read on the device when N_PTR: a CUDA graph replays
    with any count).  Codes are unpacked in s-major order; the query (and QJL's S q) is loaded in
    the keys' s-major order, and the value sum is kept in the values' order and stored back in the
    natural one.  F16: dots on fp16 operands with fp32 accumulation (tensor cores); else fp32.
    TRANS (fp16, natural-order tiles): the code tiles are the dots' first operands (scores^T = K q^T,
    sum^T = V^T p^T), as in the affine kernel.  GDC: programmatic dependent launch (``pdl.py``).
    BATCH (> 0: the KV heads per sequence): several sequences' caches in one launch, program (b * BATCH
    + g, split); sequence b's tensors sit at ``offs`` [B, 8] elements (planes, norms, QJL signs and
    residual norms) from the given ones (sequence 0's), its row count at ``n_ptr`` + b.
    PAGE (> 0): the planes, norms and QJL tensors are a page pool (``_page_of``) and ``pt_ptr`` the
    sequence's page table (BATCH: ``offs`` is [B, 9], sequence b's table at ``offs[b, 8]`` elements from it).
    EARLY (PDL builds): the dependent combine pass may launch as soon as every program has passed its wait (it
    attends the 16-bit rows before its own wait for these partials); EARLY=0: once each program's loop is done.
    BAL: split ``sp`` owns tiles [sp * tiles // S, (sp + 1) * tiles // S), so the splits differ by at most one tile and
    none is empty while there are at least S tiles; BAL=0: ceil(tiles / S) tiles each, the last splits short or empty.
    """
    g = tl.program_id(0)  # KV head
    sp = tl.program_id(1)  # split
    S = tl.num_programs(1)
    if GDC:
        tl.extra.cuda.gdc_wait()
        if EARLY != 0:
            tl.extra.cuda.gdc_launch_dependents()
    hg = g  # query heads g * REP .. of the [B * H, D] query rows
    if BATCH > 0:
        b = g // BATCH
        g = g % BATCH
        ob = offs_ptr + b * (9 if PAGE > 0 else 8)
        # offsets are multiples of 16 elements (turbo_batch checks): the loads stay as wide as for one cache
        kp0 += tl.multiple_of(tl.load(ob), 16)
        kp1 += tl.multiple_of(tl.load(ob + 1), 16)
        kn_ptr += tl.multiple_of(tl.load(ob + 2), 16)
        vp0 += tl.multiple_of(tl.load(ob + 3), 16)
        vp1 += tl.multiple_of(tl.load(ob + 4), 16)
        vn_ptr += tl.multiple_of(tl.load(ob + 5), 16)
        if QJL:
            ks_ptr += tl.multiple_of(tl.load(ob + 6), 16)
            kr_ptr += tl.multiple_of(tl.load(ob + 7), 16)
        N = tl.load(n_ptr + b)
        if PAGE > 0:
            pt_ptr += tl.load(ob + 8)
    elif N_PTR:
        N = tl.load(n_ptr)
    KPER: tl.constexpr = 8 // KW0
    VPER: tl.constexpr = 8 // VW0
    KSW: tl.constexpr = D // KPER
    VSW: tl.constexpr = D // VPER
    kj, ks_ = tl.arange(0, KSW), tl.arange(0, KPER)
    vj, vs_ = tl.arange(0, VSW), tl.arange(0, VPER)
    col = tl.arange(0, D)
    # s-major column -> coordinate; the fp16 select-tree / prmt paths (KNAT, VNAT) give natural order
    kcoord = col if KNAT else (col % KSW) * KPER + col // KSW  # keys (and the query, QJL's S q)
    vcoord = col if VNAT else (col % VSW) * VPER + col // VSW  # values (the accumulator)
    r = tl.arange(0, RP)
    rv = r < REP
    h = hg * REP + r
    q = tl.load(q_ptr + h[:, None] * D + kcoord[None, :], mask=rv[:, None], other=0.0)  # [RP, D]
    q = q.to(tl.float16) if F16 else q.to(tl.float32)
    if QJL:
        sq = tl.load(sq_ptr + h[:, None] * D + kcoord[None, :], mask=rv[:, None], other=0.0)
        sq = sq.to(tl.float16) if F16 else sq.to(tl.float32)
    tiles = tl.cdiv(N, BLOCK_N)
    if BAL:
        t0 = sp * tiles // S
        per = (sp + 1) * tiles // S - t0
        lo = t0 * BLOCK_N
    else:
        per = tl.cdiv(tiles, S)
        lo = sp * per * BLOCK_N
    m = tl.full((RP,), float("-inf"), tl.float32)
    l = tl.zeros((RP,), tl.float32)
    if TRANS:
        m, l, accT = _tq_range_trans(
            q,
            kp0 + g * head_k0,
            kp1 + g * head_k1,
            rk0,
            rk1,
            kn_ptr + g * kn_head,
            kc_ptr,
            vp0 + g * head_v0,
            vp1 + g * head_v1,
            rv0,
            rv1,
            vn_ptr + g * vn_head,
            vc_ptr,
            lo,
            per,
            N,
            m,
            l,
            pt_ptr,
            D,
            BLOCK_N,
            RP,
            KW0,
            KW1,
            VW0,
            VW1,
            KASM,
            KPRMT,
            VASM,
            VPRMT,
            KSWAR,
            VSWAR,
            PAGE,
        )
        if GDC:
            if EARLY == 0:
                tl.extra.cuda.gdc_launch_dependents()
        tl.store(m_out + h * S + sp, m, mask=rv)
        tl.store(l_out + h * S + sp, l, mask=rv)
        tl.store(acc_out + (h[None, :] * S + sp) * D + col[:, None], accT, mask=rv[None, :])
        return
    acc = tl.zeros((RP, D), tl.float32)
    lv = tl.zeros((RP, BLOCK_N), tl.float32)  # the denominator per row, summed after the loop (as in the TRANS loop)
    if PAGE > 0:
        pg = _page_of(pt_ptr, lo, N, PAGE)
    for t in range(0, per):
        first = lo + t * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        ok = n < N
        if PAGE > 0:
            nn = tl.where(ok, pg * PAGE + (n - (first // PAGE) * PAGE), 0)
            pg = _page_of(pt_ptr, first + BLOCK_N, N, PAGE)  # the next tile's
        else:
            nn = tl.where(ok, n, 0)
        if KNAT:
            kvec = _mux_tile(
                kp0 + g * head_k0, kp1 + g * head_k1, rk0, rk1, nn, kc_ptr, KW0, KW1, BLOCK_N, D, KASM, KPRMT, KSWAR
            )
        else:
            kc = _codes(kp0 + g * head_k0, kp1 + g * head_k1, rk0, rk1, nn, kj, ks_, KW0, KW1, KPER, BLOCK_N, D)
            kvec = tl.load(kc_ptr + kc)  # centroids [BLOCK_N, D]
            kvec = kvec.to(tl.float16) if F16 else kvec
        kn = tl.load(kn_ptr + g * kn_head + nn).to(tl.float32)
        dot = tl.dot(q, tl.trans(kvec), input_precision="ieee") if not F16 else tl.dot(q, tl.trans(kvec))
        if QJL:  # + |r| sqrt(pi/2)/d <S q, sign(S r)>
            if KNAT:
                sgn = _signs_nat(ks_ptr + g * ks_head, nn, D, BLOCK_N)
            else:
                sg = tl.reshape(_field(ks_ptr + g * ks_head, D // 8, nn, kj, ks_, 1, KPER), (BLOCK_N, D))
                sgn = (2 * sg - 1).to(tl.float16) if F16 else (2 * sg - 1).to(tl.float32)
            qj = tl.dot(sq, tl.trans(sgn), input_precision="ieee") if not F16 else tl.dot(sq, tl.trans(sgn))
            rn = tl.load(kr_ptr + g * kr_head + nn).to(tl.float32)
            dot += qjl_scale * rn[None, :] * qj
        s = tl.where(ok[None, :], dot * kn[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a range past the rows: all -inf, no NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        if VNAT:
            vvec = _mux_tile(
                vp0 + g * head_v0, vp1 + g * head_v1, rv0, rv1, nn, vc_ptr, VW0, VW1, BLOCK_N, D, VASM, VPRMT, VSWAR
            )
        else:
            vc = _codes(vp0 + g * head_v0, vp1 + g * head_v1, rv0, rv1, nn, vj, vs_, VW0, VW1, VPER, BLOCK_N, D)
            vvec = tl.load(vc_ptr + vc)
        vn = tl.load(vn_ptr + g * vn_head + nn).to(tl.float32)
        pv = p * vn[None, :]
        if DIAG == 2:  # diagnostics: no value side
            acc = acc * alpha[:, None]
        elif F16:
            acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float16), vvec.to(tl.float16))
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, vvec, input_precision="ieee")
        lv = lv * alpha[:, None] + p
        m = m_new
    l = l + tl.sum(lv, axis=1)
    if GDC:
        if EARLY == 0:
            tl.extra.cuda.gdc_launch_dependents()
    tl.store(m_out + h * S + sp, m, mask=rv)
    tl.store(l_out + h * S + sp, l, mask=rv)
    tl.store(acc_out + (h[:, None] * S + sp) * D + vcoord[None, :], acc, mask=rv[:, None])


_SM_COUNT: dict[int, int] = {}
_TUNE: dict[str, int] = {}  # launch knobs (num_warps / num_stages / TRANS) set by scripts/bench_tq_kernel.py sweeps
# the combine pass's knobs (SB, BLOCK_R, DS, num_warps), same use; SWIFTLM_TQ_COMBINE="SB=0,num_warps=8" sets them
# for a whole process (a diagnostic knob for end-to-end runs)
_COMBINE: dict[str, int] = {
    k: int(v) for k, v in (kv.split("=") for kv in filter(None, os.environ.get("SWIFTLM_TQ_COMBINE", "").split(",")))
}
_LAST: dict[str, object] = {}  # the last launched split / combine kernels (their registers and spills, for benchmarks)
_REGS: dict[tuple, tuple] = {}  # _split_pass's variant key -> the split kernel's (registers, spills)
# the split kernel's register cap where the code tiles are first operands (ptxas maxnreg; SWIFTLM_TQ_MAXNREG, 0:
# none): four 4-warp programs per SM need <= 128.  Uncapped, ptxas can give the graphed step's k4v3 kernel (row
# count read on the device) a few registers more, which leaves room for only three programs per SM; the cap costs
# no spills (scripts/bench_tq_kernel.py --maxnreg times the caps).
MAXNREG = int(os.environ.get("SWIFTLM_TQ_MAXNREG", "128") or 0)
TRANS_DEFAULT = int(os.environ["SWIFTLM_TQ_TRANS"]) if os.environ.get("SWIFTLM_TQ_TRANS") else None
# the split pass lets its combine pass launch right after its wait (the combine attends the 16-bit rows meanwhile);
# SWIFTLM_TQ_EARLY=0: only once its loop is done (an A/B knob)
EARLY = int(os.environ.get("SWIFTLM_TQ_EARLY", "1") or 0)
# the splits' tile ranges differ by at most one tile (SM loads even); SWIFTLM_TQ_BALANCE=0: ceil-sized ranges (A/B)
BALANCE = int(os.environ.get("SWIFTLM_TQ_BALANCE", "1") or 0)


# split programs per SM: 4 for one sequence's row (its 16-bit window and merge then wait on fewer, longer splits),
# 16 for several sequences' rows in one launch; SWIFTLM_TQ_PROGRAMS_PER_SM sets both ("8") or each ("4,16"), an A/B
# knob.  Through `swiftlm serve` on an H200 (8B shape, 32K, k4v3, with the combine's one-load merge below): one
# stream's inter-token p50 went 5.64 -> 5.55 ms with 4 (16: 5.83); eight streams' batched rows 13.1 ms with 8 against
# 16-bit's 12.6, 14.4 with 4, 12.5 with 16 (docs/results/tq_s30/, tq_s31/).
_PPS_ENV = [int(x) for x in os.environ.get("SWIFTLM_TQ_PROGRAMS_PER_SM", "").split(",") if x.strip()]
PROGRAMS_PER_SM = (_PPS_ENV[0], _PPS_ENV[-1]) if _PPS_ENV else (4, 16)  # (one sequence, batched rows)
AFFINE_PROGRAMS_PER_SM = _PPS_ENV[-1] if _PPS_ENV else 8  # the kv_bits kernels (measured with 8)


def _splits(device: torch.device, groups: int, rows: int, block_n: int, per_sm: int | None = None) -> int:
    """Splits per KV head: about ``per_sm`` (default: ``PROGRAMS_PER_SM``'s one-sequence count) programs per SM in
    all (enough loads in flight to keep the memory busy; ``scripts/bench_tq_kernel.py --splits`` sweeps the count), never more than the row
    tiles (on the CPU interpreter, ranges of 256 rows)."""
    if device.type != "cuda":
        return max(1, triton.cdiv(rows, 256))
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    per_sm = per_sm or PROGRAMS_PER_SM[0]
    return max(1, min(triton.cdiv(per_sm * _SM_COUNT[idx], groups), triton.cdiv(rows, block_n), 256))


def _split_pass(
    q_rot,
    k_planes,
    k_norms,
    k_centroids,
    k_bits,
    v_planes,
    v_norms,
    v_centroids,
    v_bits,
    block_n,
    rep,
    qjl,
    n_rows,
    f16,
    splits,
    batch=None,
    pages=None,
):
    """The split kernel's launch (``tq_decode_attention`` documents the arguments)."""
    H, D = q_rot.shape
    N = k_planes[0].shape[1] if pages is None else int(pages[2])
    assert k_norms.stride(1) == 1 and v_norms.stride(1) == 1
    kp0, kp1, hk0, hk1, rk0, rk1, kw0, kw1 = _planes(k_planes, k_bits)
    vp0, vp1, hv0, hv1, rv0, rv1, vw0, vw1 = _planes(v_planes, v_bits)
    dev = q_rot.device
    block_n = block_n or (64 if f16 or D <= 64 else 32)
    if pages is not None:
        assert pages[1] % block_n == 0 and pages[0].dtype == torch.int32, (
            "pages: int32 table, rows a multiple of the tile"
        )
    S = splits or _splits(dev, H // rep, N, block_n, PROGRAMS_PER_SM[batch is not None])
    m = torch.empty(H, S, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(H, S, D, dtype=torch.float32, device=dev)
    if qjl is not None:
        sq, ks, kr, qjl_scale = qjl
        sq = sq.float().contiguous()
        assert kr.stride(1) == 1 and ks.stride(2) == 1 and ks.stride(1) == D // 8
        ks_head, kr_head = ks.stride(0), kr.stride(0)
    else:
        sq, ks, kr, qjl_scale, ks_head, kr_head = q_rot, kp0, k_norms, 0.0, 0, 0
    # fp16 and 2-4-bit codes: natural coordinate order, prmt lookups on CUDA (select trees elsewhere)
    knat = f16 and D % 8 == 0 and kw0 + kw1 in (2, 3, 4)
    vnat = f16 and D % 8 == 0 and vw0 + vw1 in (2, 3, 4)
    kswar = knat and _swar_ok(k_planes, kw0, kw1, D, k_centroids)
    vswar = vnat and _swar_ok(v_planes, vw0, vw1, D, v_centroids)
    kasm = _prmt_for(k_centroids, kw0 + kw1, kswar) if knat else ""
    vasm = _prmt_for(v_centroids, vw0 + vw1, vswar) if vnat else ""
    tune = dict(_TUNE)
    # code tiles as first operands where the keys are read as words: the looked-up tiles then need no move
    # into the second operand's layout (scripts/bench_tq_kernel.py times both); SWIFTLM_TQ_TRANS=0/1 overrides
    trans = tune.pop("TRANS", kswar if TRANS_DEFAULT is None else TRANS_DEFAULT) and knat and vnat and qjl is None
    if "GDC" not in tune:
        tune.update(launch_kw(q_rot))
    if MAXNREG and trans and dev.type == "cuda" and "maxnreg" not in tune and tune.get("num_warps", 4) == 4:
        tune["maxnreg"] = MAXNREG
    offs, kvh = batch if batch is not None else (m, 0)
    _LAST["split"] = _tq_attn_kernel[(H // rep, S)](
        q_rot.float().contiguous(),
        kp0,
        kp1,
        k_norms,
        k_centroids.float(),
        vp0,
        vp1,
        v_norms,
        v_centroids.float(),
        sq,
        ks,
        kr,
        m,
        l,
        acc,
        N,
        n_rows if n_rows is not None else m,
        float(qjl_scale),
        offs,
        hk0,
        hk1,
        hv0,
        hv1,
        rk0,
        rk1,
        rv0,
        rv1,
        k_norms.stride(0),
        v_norms.stride(0),
        ks_head,
        kr_head,
        D=D,
        BLOCK_N=block_n,
        REP=rep,
        RP=max(16, triton.next_power_of_2(rep)),
        KW0=kw0,
        KW1=kw1,
        VW0=vw0,
        VW1=vw1,
        QJL=qjl is not None,
        N_PTR=n_rows is not None,
        F16=f16,
        KNAT=knat,
        VNAT=vnat,
        KASM=kasm or "none",
        KPRMT=int(bool(kasm)),
        VASM=vasm or "none",
        VPRMT=int(bool(vasm)),
        KSWAR=int(kswar),
        VSWAR=int(vswar),
        TRANS=int(bool(trans)),
        BATCH=kvh,
        pt_ptr=pages[0] if pages is not None else m,
        PAGE=int(pages[1]) if pages is not None else 0,
        EARLY=tune.pop("EARLY", EARLY),
        BAL=tune.pop("BAL", BALANCE),
        **tune,
    )
    key = (k_bits, v_bits, int(bool(trans)), n_rows is not None, kvh, pages is not None)
    if key not in _REGS:  # once per variant: this runs on every eager step
        k = _LAST["split"]
        _REGS[key] = (getattr(k, "n_regs", None), getattr(k, "n_spills", None))
    return m, l, acc


def tq_decode_attention(
    q_rot: torch.Tensor,
    k_planes: list[torch.Tensor],
    k_norms: torch.Tensor,
    k_centroids: torch.Tensor,
    k_bits: int,
    v_planes: list[torch.Tensor],
    v_norms: torch.Tensor,
    v_centroids: torch.Tensor,
    v_bits: int,
    block_n: int | None = None,
    rep: int = 1,
    qjl: tuple | None = None,
    n_rows: torch.Tensor | None = None,
    f16: bool = False,
    splits: int | None = None,
    pages: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_rot [H, D] (rotated, scaled); planes [H // rep, N, bytes] (row stride may exceed the row:
    views of a larger store are fine, as long as the last axis is contiguous); norms [H // rep, >= N];
    centroids [2^bits].  Query head h reads KV head h // rep.  ``qjl``: (S q scaled [H, D], sign
    plane [H // rep, N, D / 8], fp16 residual norms [H // rep, >= N], sqrt(pi/2)/d) for QJL keys.
    Rows are split into ``splits`` ranges per KV head (default: enough programs to fill the GPU),
    merged here.  ``n_rows`` (int device tensor [1]): read only that many rows of the given planes,
    with the ranges computed on the device (no host sync: capturable).  ``f16``: fp16 operands with
    fp32 accumulation in the dots (tensor cores), else fp32 throughout.
    ``pages`` = (table int32 [pages], rows per page, rows): the planes, norms and QJL
    tensors are a pool of pages, [H // rep, pool rows, ...], and row r of the sequence is pool row
    table[r // rows per page] * rows per page + r % rows per page; ``rows`` (host int) replaces the planes'
    row count (the largest ``n_rows`` may give).  Rows per page: a multiple of ``block_n``.  With ``batch``
    (``tq_decode_attention_full``) the table is sequence 0's and ``offs`` [B, 9] gives the others' offsets.
    Returns (m [H], l [H], acc [H, D]): softmax max, denominator and sum p|v|c in the rotated domain."""
    m, l, acc = _split_pass(
        q_rot,
        k_planes,
        k_norms,
        k_centroids,
        k_bits,
        v_planes,
        v_norms,
        v_centroids,
        v_bits,
        block_n,
        rep,
        qjl,
        n_rows,
        f16,
        splits,
        pages=pages,
    )
    if m.shape[1] == 1:
        return m[:, 0], l[:, 0], acc[:, 0]
    M = m.max(dim=1).values
    w = torch.exp(m - torch.where(torch.isinf(M), torch.zeros_like(M), M)[:, None])  # no rows at all: 0, not NaN
    return M, (l * w).sum(1), (acc * w[..., None]).sum(1)


def tq_decode_attention_full(
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k_planes: list[torch.Tensor],
    k_norms: torch.Tensor,
    k_centroids: torch.Tensor,
    k_bits: int,
    v_planes: list[torch.Tensor],
    v_norms: torch.Tensor,
    v_centroids: torch.Tensor,
    v_bits: int,
    v_rotation: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    rep: int = 1,
    qjl: tuple | None = None,
    n_rows: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    f16: bool = True,
    block_n: int | None = None,
    splits: int | None = None,
    batch: tuple | None = None,
    pages: tuple | None = None,
) -> torch.Tensor:
    """The whole decode-row attention of a TurboQuant layer in two kernels: the split pass over
    the packed codes (``tq_decode_attention``'s arguments) and a combine pass that merges the
    splits, rotates the code part back with ``v_rotation`` (R: x = u @ R), attends the 16-bit rows
    ``dk``/``dv`` [H // rep, R, D] with the unrotated query ``q`` [H, D] times ``scale`` (``valid``
    [R] bool masks a static buffer's rows) and normalises.  Returns [H, D] in ``q``'s dtype.

    ``batch`` = (offs [B, 8], dense offs [B, 2] (int64 elements), n_dense [B], query heads per sequence):
    B sequences' caches of one format in the same two launches; the tensors given are sequence 0's,
    q / q_rot are [B * H, D], ``n_rows`` [B] (``_tq_attn_kernel``'s BATCH).  ``pages``: as for
    ``tq_decode_attention`` (with ``batch``, offs is [B, 9]: column 8, sequence b's page table's offset)."""
    H, D = q.shape
    m, l, acc = _split_pass(
        q_rot,
        k_planes,
        k_norms,
        k_centroids,
        k_bits,
        v_planes,
        v_norms,
        v_centroids,
        v_bits,
        block_n,
        rep,
        qjl,
        n_rows,
        f16,
        splits,
        (batch[0], batch[3] // rep) if batch is not None else None,
        pages,
    )
    S = m.shape[1]
    out = torch.empty(H, D, dtype=q.dtype, device=q.device)
    assert dk.stride(2) == 1 and dv.stride(2) == 1
    R = dk.shape[1]
    # 64 rows of the 16-bit buffer at a time: a static cache's 160-row buffer in 3 steps, not 10.  One sequence's
    # row: its splits (66 for 8 KV heads on 132 SMs) merged in one load.  4 warps: with the 16-bit rows attended
    # before the wait, the merge after it is the critical part; on an H200 at 131K (8B shape, k4v3) it added 4.1 us
    # per layer to the step with 4 warps, 6.5 with 8 (scripts/gpu_kv_step_ab.sh)
    kw = {"SB": 32, "BLOCK_R": 64, "num_warps": 4, "DS": min(D, 32)}
    if batch is None and S <= 128:
        kw.update(SB=0)
    kw.update(_COMBINE)
    ds = kw["DS"]
    if "GDC" not in kw:
        kw.update(launch_kw(q))
    if batch is not None:
        kw.update(BATCH_H=batch[3], doffs_ptr=batch[1], nd_ptr=batch[2])
    _LAST["combine"] = _tq_combine_kernel[(H, D // ds)](
        m,
        l,
        acc,
        v_rotation.float().contiguous(),
        q.contiguous(),
        dk,
        dv,
        valid if valid is not None else m,
        out,
        R,
        S,
        float(scale),
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        D=D,
        BS=max(2, triton.next_power_of_2(S)),
        REP=rep,
        VALID=valid is not None and batch is None,
        **kw,
    )
    return out


@triton.jit
def _rotate_rows_kernel(x_ptr, m_ptr, out_ptr, D: tl.constexpr, DS: tl.constexpr, GDC: tl.constexpr):
    """Program (row h, DS output columns): out[h, cols] = x[h, :] @ M[:, cols], fp32."""
    h = tl.program_id(0)
    e = tl.program_id(1) * DS + tl.arange(0, DS)
    d = tl.arange(0, D)
    mat = tl.load(m_ptr + d[:, None] * D + e[None, :])  # constant during a step: before the wait
    if GDC:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + h * D + d).to(tl.float32)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + h * D + e, tl.sum(x[:, None] * mat, axis=0))


def rotate_rows(x: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    """x [H, D] (any float dtype) @ mat [D, D] (fp32) -> fp32 [H, D]: the decode row's query rotated
    (and scaled, ``mat`` = R^T * scale) in one kernel on CUDA instead of a cast, a matmul and a scale."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return x.float() @ mat
    H, D = x.shape
    out = torch.empty(H, D, dtype=torch.float32, device=x.device)
    ds = min(D, 32)
    _rotate_rows_kernel[(H, D // ds)](x.contiguous(), mat, out, D=D, DS=ds, num_warps=4, **launch_kw(x))
    return out


def tq_decode_attention_ref(
    q_rot,
    k_planes,
    k_norms,
    k_centroids,
    k_bits,
    v_planes,
    v_norms,
    v_centroids,
    v_bits,
    rep: int = 1,
    qjl: tuple | None = None,
):
    """Plain torch: unpack, look up, softmax; same (m, l, acc) contract."""
    if rep > 1:
        k_planes = [p.repeat_interleave(rep, 0) for p in k_planes]
        v_planes = [p.repeat_interleave(rep, 0) for p in v_planes]
        k_norms, v_norms = k_norms.repeat_interleave(rep, 0), v_norms.repeat_interleave(rep, 0)
    N = k_planes[0].shape[1]
    k_norms, v_norms = k_norms[:, :N], v_norms[:, :N]

    def unpack(planes, bits, D):
        w0, w1 = _PLANES[bits]
        out, shift = None, 0
        for plane, w in ((planes[0], w0), (planes[1] if w1 else None, w1)):
            if not w:
                continue
            per = 8 // w
            parts = [(plane.to(torch.int64) >> (j * w)) & ((1 << w) - 1) for j in range(per)]
            part = torch.stack(parts, dim=-1).reshape(*plane.shape[:-1], D)
            out = part << shift if out is None else out | (part << shift)
            shift += w
        return out

    D = q_rot.shape[1]
    kc = k_centroids.float()[unpack(k_planes, k_bits, D)]  # [H, N, D]
    dots = torch.einsum("hnd,hd->hn", kc, q_rot.float())
    if qjl is not None:
        sq, ks, kr, qjl_scale = qjl
        ks, kr = ks.repeat_interleave(rep, 0), kr.repeat_interleave(rep, 0)[:, :N]
        signs = unpack([ks], 1, D).float() * 2 - 1
        dots = dots + qjl_scale * kr.float() * torch.einsum("hnd,hd->hn", signs, sq.float())
    s = dots * k_norms.float()
    m = s.max(dim=1).values
    p = torch.exp(s - m[:, None])
    vc = v_centroids.float()[unpack(v_planes, v_bits, D)] * v_norms.float()[..., None]
    return m, p.sum(dim=1), torch.einsum("hn,hnd->hd", p, vc)
