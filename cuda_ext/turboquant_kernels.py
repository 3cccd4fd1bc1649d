"""Decode attention over TurboQuant-packed keys and values (Triton), with a torch reference.

One program per head: the query arrives already rotated (and scaled), keys and values are
read as packed bit planes (``swiftlm.turboquant.packing``: a plane of width w holds 8/w codes
per byte, little-end first; 3-bit codes are a 2-bit plane + a 1-bit plane), centroids are
looked up from the codebooks, scores use the fp16 norms, and an online softmax accumulates
``Σ p_i ‖v_i‖ c[v_i]`` in the rotated domain.  The kernel returns the running max, the
softmax denominator and the unnormalised sum, so the caller can merge it with the 16-bit
window (flash-decoding style) and rotate the result back once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PLANES = {1: (1, 0), 2: (2, 0), 3: (2, 1), 4: (4, 0)}


@triton.jit
def _codes(p0, p1, row_bytes0, row_bytes1, n_idx, d_idx, W0: tl.constexpr, W1: tl.constexpr):
    """[BLOCK_N, D] codes from one or two bit planes."""
    per0: tl.constexpr = 8 // W0
    b0 = tl.load(p0 + n_idx[:, None] * row_bytes0 + (d_idx // per0)[None, :])
    c = (b0.to(tl.int32) >> ((d_idx % per0) * W0)[None, :]) & ((1 << W0) - 1)
    if W1 > 0:
        per1: tl.constexpr = 8 // W1
        b1 = tl.load(p1 + n_idx[:, None] * row_bytes1 + (d_idx // per1)[None, :])
        c = c | (((b1.to(tl.int32) >> ((d_idx % per1) * W1)[None, :]) & ((1 << W1) - 1)) << W0)
    return c


@triton.jit
def _tq_attn_kernel(q_ptr, kp0, kp1, kn_ptr, kc_ptr, vp0, vp1, vn_ptr, vc_ptr, sq_ptr, ks_ptr, kr_ptr,
                    m_out, l_out, acc_out, N, n_ptr, qjl_scale,
                    head_k0, head_k1, head_v0, head_v1, rk0, rk1, rv0, rv1, kn_head, vn_head, ks_head, kr_head,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, REP: tl.constexpr,
                    RP: tl.constexpr, KW0: tl.constexpr, KW1: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr,
                    QJL: tl.constexpr, N_PTR: tl.constexpr):
    """One program per (KV head, chunk of rows): the REP query heads sharing that KV head are
    scored together (rows of a [RP, D] tile, RP >= 16 for tl.dot), so each packed code is unpacked
    and looked up once, not once per query head."""
    g = tl.program_id(0)   # KV head
    sp = tl.program_id(1)  # which CHUNK of rows (split-K: partials merged by the caller)
    S = tl.num_programs(1)
    if N_PTR:  # the row count lives on the device (CUDA graphs: the grid covers the capacity)
        N = tl.load(n_ptr)
    r = tl.arange(0, RP)
    rv = r < REP
    d = tl.arange(0, D)
    h = g * REP + r
    q = tl.load(q_ptr + h[:, None] * D + d[None, :], mask=rv[:, None], other=0.0).to(tl.float32)  # [RP, D]
    if QJL:
        sq = tl.load(sq_ptr + h[:, None] * D + d[None, :], mask=rv[:, None], other=0.0).to(tl.float32)
    m = tl.full((RP,), float("-inf"), tl.float32)
    l = tl.zeros((RP,), tl.float32)
    acc = tl.zeros((RP, D), tl.float32)
    for i in range(0, CHUNK, BLOCK_N):
        n = sp * CHUNK + i + tl.arange(0, BLOCK_N)
        ok = n < N
        nn = tl.where(ok, n, 0)
        kc = _codes(kp0 + g * head_k0, kp1 + g * head_k1, rk0, rk1, nn, d, KW0, KW1)
        kvec = tl.load(kc_ptr + kc)                                   # centroids [BLOCK_N, D]
        kn = tl.load(kn_ptr + g * kn_head + nn).to(tl.float32)
        dot = tl.dot(q, tl.trans(kvec), input_precision="ieee")     # [RP, BLOCK_N]
        if QJL:  # + ‖r‖ √(π/2)/d <S q, sign(S r)>
            sg = _codes(ks_ptr + g * ks_head, ks_ptr + g * ks_head, D // 8, D // 8, nn, d, 1, 0)
            rn = tl.load(kr_ptr + g * kr_head + nn).to(tl.float32)
            qj = tl.dot(sq, tl.trans((2 * sg - 1).to(tl.float32)), input_precision="ieee")
            dot += qjl_scale * rn[None, :] * qj
        s = tl.where(ok[None, :], dot * kn[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk past the rows: all -inf, no NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        vc = _codes(vp0 + g * head_v0, vp1 + g * head_v1, rv0, rv1, nn, d, VW0, VW1)
        vvec = tl.load(vc_ptr + vc)
        vn = tl.load(vn_ptr + g * vn_head + nn).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p * vn[None, :], vvec, input_precision="ieee")
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    tl.store(m_out + h * S + sp, m, mask=rv)
    tl.store(l_out + h * S + sp, l, mask=rv)
    tl.store(acc_out + (h[:, None] * S + sp) * D + d[None, :], acc, mask=rv[:, None])


def _planes(planes: list[torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int, int]:
    w0, w1 = _PLANES[bits]
    p0 = planes[0]
    p1 = planes[1] if w1 else planes[0]
    return p0, p1, p0.stride(0), p1.stride(0), p0.stride(1), p1.stride(1), w0, w1


def tq_decode_attention(q_rot: torch.Tensor, k_planes: list[torch.Tensor], k_norms: torch.Tensor,
                        k_centroids: torch.Tensor, k_bits: int, v_planes: list[torch.Tensor],
                        v_norms: torch.Tensor, v_centroids: torch.Tensor, v_bits: int, block_n: int | None = None,
                        rep: int = 1, chunk: int = 256, qjl: tuple | None = None,
                        n_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_rot [H, D] (rotated, scaled); planes [H // rep, N, bytes] (row stride may exceed the row:
    views of a larger store are fine, as long as the last axis is contiguous); norms [H // rep, >= N];
    centroids [2^bits].  Query head h reads KV head h // rep.  ``qjl``: (S q scaled [H, D], sign
    plane [H // rep, N, D / 8], fp16 residual norms [H // rep, >= N], √(π/2)/d) for QJL keys.
    Rows are split into chunks of ``chunk`` (one program per head and chunk, so long histories fill
    the GPU), and the partials are merged here.  ``n_rows`` (int device tensor [1]): read only that
    many rows of the given planes, with the grid sized for all of them (no host sync: capturable).
    Returns (m [H], l [H], acc [H, D]): softmax max, denominator and Σ p‖v‖c in the rotated domain."""
    H, D = q_rot.shape
    N = k_planes[0].shape[1]
    assert k_norms.stride(1) == 1 and v_norms.stride(1) == 1
    block_n = block_n or (64 if D <= 64 else 32)
    chunk = max(block_n, chunk // block_n * block_n)
    S = max(1, triton.cdiv(N, chunk))
    kp0, kp1, hk0, hk1, rk0, rk1, kw0, kw1 = _planes(k_planes, k_bits)
    vp0, vp1, hv0, hv1, rv0, rv1, vw0, vw1 = _planes(v_planes, v_bits)
    dev = q_rot.device
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
    _tq_attn_kernel[(H // rep, S)](q_rot.float().contiguous(), kp0, kp1, k_norms, k_centroids.float(),
                            vp0, vp1, v_norms, v_centroids.float(), sq, ks, kr, m, l, acc, N,
                            n_rows if n_rows is not None else m, float(qjl_scale),
                            hk0, hk1, hv0, hv1, rk0, rk1, rv0, rv1, k_norms.stride(0), v_norms.stride(0),
                            ks_head, kr_head, D=D, BLOCK_N=block_n, CHUNK=chunk, REP=rep,
                            RP=max(16, triton.next_power_of_2(rep)),
                            KW0=kw0, KW1=kw1, VW0=vw0, VW1=vw1, QJL=qjl is not None,
                            N_PTR=n_rows is not None)
    if S == 1:
        return m[:, 0], l[:, 0], acc[:, 0]
    M = m.max(dim=1).values
    w = torch.exp(m - torch.where(torch.isinf(M), torch.zeros_like(M), M)[:, None])  # no rows at all: 0, not NaN
    return M, (l * w).sum(1), (acc * w[..., None]).sum(1)


def tq_decode_attention_ref(q_rot, k_planes, k_norms, k_centroids, k_bits, v_planes, v_norms, v_centroids, v_bits,
                            rep: int = 1, qjl: tuple | None = None):
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
    kc = k_centroids.float()[unpack(k_planes, k_bits, D)]               # [H, N, D]
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


# ------------------------------------------------------------------------------------ encode
@triton.jit
def _tq_encode_kernel(x_ptr, rt_ptr, b_ptr, p0_ptr, p1_ptr, n_ptr, R,
                      D: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Rows [BR, D]: norm, unit vector, rotation (u @ R^T), codes by counting boundaries below each
    coordinate, packed into one or two bit planes; fp16 norms."""
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    ok = r < R
    d = tl.arange(0, D)
    x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    u = x / tl.where(norm > 0, norm, 1.0)[:, None]
    rt = tl.load(rt_ptr + d[:, None] * D + d[None, :])                     # R^T [D, D]
    y = tl.dot(u, rt, input_precision="ieee")
    c = tl.zeros((BR, D), dtype=tl.int32)
    for i in tl.static_range(NB):
        c += (y > tl.load(b_ptr + i)).to(tl.int32)
    tl.store(n_ptr + r, norm.to(tl.float16), mask=ok)
    PER0: tl.constexpr = 8 // W0
    lo = (c & ((1 << W0) - 1)).reshape(BR, D // PER0, PER0)
    sh0 = (tl.arange(0, PER0) * W0)[None, None, :]
    byte0 = tl.sum(lo << sh0, axis=2)
    j0 = tl.arange(0, D // PER0)
    tl.store(p0_ptr + r[:, None] * (D // PER0) + j0[None, :], byte0.to(tl.uint8), mask=ok[:, None])
    if W1 > 0:
        PER1: tl.constexpr = 8 // W1
        hi = ((c >> W0) & ((1 << W1) - 1)).reshape(BR, D // PER1, PER1)
        sh1 = (tl.arange(0, PER1) * W1)[None, None, :]
        byte1 = tl.sum(hi << sh1, axis=2)
        j1 = tl.arange(0, D // PER1)
        tl.store(p1_ptr + r[:, None] * (D // PER1) + j1[None, :], byte1.to(tl.uint8), mask=ok[:, None])


def tq_encode(x: torch.Tensor, rotation: torch.Tensor, boundaries: torch.Tensor, bits: int, block_rows: int = 16
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """x [..., D] -> (planes [..., D * w / 8] uint8 per plane, norms [...] fp16): TurboQuant-mse
    codes in the ``swiftlm.turboquant.packing`` layout.  ``rotation`` is R (forward: u @ R^T)."""
    shape = x.shape[:-1]
    D = x.shape[-1]
    xf = x.reshape(-1, D).contiguous()
    R = xf.shape[0]
    w0, w1 = _PLANES[bits]
    p0 = torch.empty(R, D * w0 // 8, dtype=torch.uint8, device=x.device)
    p1 = torch.empty(R, D * w1 // 8 if w1 else 1, dtype=torch.uint8, device=x.device)
    norms = torch.empty(R, dtype=torch.float16, device=x.device)
    rt = rotation.float().t().contiguous()
    grid = (triton.cdiv(R, block_rows),)
    _tq_encode_kernel[grid](xf, rt, boundaries.float().contiguous(), p0, p1, norms, R,
                            D=D, BR=block_rows, NB=boundaries.numel(), W0=w0, W1=w1)
    planes = [p0.view(*shape, -1)] + ([p1.view(*shape, -1)] if w1 else [])
    return planes, norms.view(shape)
