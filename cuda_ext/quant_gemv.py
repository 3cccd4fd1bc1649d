"""``y = x @ dequant(w).T`` reading quantized weights: FP8 e4m3 with per-row or block scales, and 4-bit codes
with group-wise scales and zero points.  One Triton kernel serves both formats and every row count: the weight
tile is dequantised in registers and never written back, so a decode step reads 1 (FP8) or ~0.5 (int4) bytes
per weight instead of 2.  Activations stay in their 16-bit dtype; accumulation in fp32.

- one row (bs1 decode): each program owns ``BLOCK_N`` output features and walks K with a multiply-and-sum
  (a matrix-vector product: all its time is reading the weight);
- more rows: ``BLOCK_M`` x ``BLOCK_N`` tiles through ``tl.dot`` on the dequantised (16-bit) weight tile; the
  same kernel is the int4 / block-FP8 GEMM of a few batched decode rows.

Two helpers serve the other paths of backends/torch/quant_linear.py (which one runs for a row count is its
``PATHS`` table): ``fp8_dequant`` / ``int4_dequant`` write the whole weight in the model's dtype into a scratch
buffer for cuBLAS (many rows: one pass over the packed weight, then a GEMM at cuBLAS speed), and
``act_quant_fp8`` rounds the activations to FP8 per row in one launch for ``torch._scaled_mm``.

Layouts (backends/torch/quant_linear.py converts each checkpoint layout to these once, at load):

- FP8: ``w8 [N, K]`` float8_e4m3fn (read as uint8).  Per-row scales ``[N]`` (a per-tensor scale is expanded
  to rows at load) multiply the fp32 accumulator once per output; block scales ``[ceil(N/BH), ceil(K/BW)]``
  multiply each weight.
- int4: ``qw [N, K/8]`` int32, input column 8j+i of row n at bits 4i of word j; ``scales`` and ``zeros``
  ``[N, K/G]`` in the codes' domain (``w = (q - z) * s``).  Act-order checkpoints are permuted at load so
  that groups are contiguous; the caller gathers x's columns in the same order.

``fp8_linear_ref`` / ``int4_linear_ref`` / ``*_dequant_ref`` / ``act_quant_ref`` are the torch references
(dequantise in fp32, matmul in fp32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ROW, BLOCK, GROUP = 0, 1, 2  # the kernel's MODE: FP8 per-row scales, FP8 block scales, int4 group scales


@triton.jit
def _weight_tile(
    w,
    s,
    z,
    n,
    nm,
    k0,
    N,
    K,
    BH,
    BW,
    S_N,
    G,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
    GB: tl.constexpr,
):
    """The weight rows ``n`` x columns [k0, k0 + BLOCK_K) in fp32, dequantised (MODE ROW: unscaled)."""
    k = k0 + tl.arange(0, BLOCK_K)
    km = k < K
    if MODE == 2:
        # eight codes per int32 word: load BLOCK_K / 8 words per row and spread them to [BLOCK_N, BLOCK_K]
        j = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        word = tl.load(w + n[:, None] * (K // 8) + j[None, :], mask=nm[:, None] & (j < K // 8)[None, :], other=0)
        shift = tl.arange(0, 8) * 4
        q = ((word[:, :, None] >> shift[None, None, :]) & 0xF).to(tl.float32)
        q = tl.reshape(q, (BLOCK_N, BLOCK_K))
        if GB > 0:  # groups of GB (a power of two dividing BLOCK_K): one scale and zero per group, broadcast
            g = k0 // GB + tl.arange(0, BLOCK_K // GB)
            gm = nm[:, None] & (g < K // GB)[None, :]
            sc = tl.load(s + n[:, None] * (K // GB) + g[None, :], mask=gm, other=0.0).to(tl.float32)
            zz = tl.load(z + n[:, None] * (K // GB) + g[None, :], mask=gm, other=0.0).to(tl.float32)
            q3 = tl.reshape(q, (BLOCK_N, BLOCK_K // GB, GB))
            wt = tl.reshape((q3 - zz[:, :, None]) * sc[:, :, None], (BLOCK_N, BLOCK_K))
        else:  # any other group width: each column's scale and zero, gathered
            msk = nm[:, None] & km[None, :]
            gi = n[:, None] * (K // G) + (k // G)[None, :]
            sc = tl.load(s + gi, mask=msk, other=0.0).to(tl.float32)
            zz = tl.load(z + gi, mask=msk, other=0.0).to(tl.float32)
            wt = (q - zz) * sc
    else:
        msk = nm[:, None] & km[None, :]
        b = tl.load(w + n[:, None] * K + k[None, :], mask=msk, other=0)
        wt = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if MODE == 1:
            sc = tl.load(s + (n // BH)[:, None] * S_N + (k // BW)[None, :], mask=msk, other=0.0)
            wt = wt * sc
    return wt


@triton.jit
def _quant_mm_kernel(
    x,
    w,
    s,
    z,
    y,
    M,
    N,
    K,
    BH,
    BW,
    S_N,
    G,
    MODE: tl.constexpr,
    GB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        # the products summed elementwise into a [BLOCK_N, BLOCK_K] accumulator, reduced across the threads once
        # after the loop (not once per step: the weight loads of the next step do not wait for a reduction)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            wt = _weight_tile(w, s, z, n, nm, k0, N, K, BH, BW, S_N, G, BLOCK_N, BLOCK_K, MODE, GB)
            xt = tl.load(x + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
            acc += wt * xt[None, :]
        out = tl.sum(acc, axis=1)
        if MODE == 0:
            out = out * tl.load(s + n, mask=nm, other=0.0)
        tl.store(y + n, out.to(y.dtype.element_ty), mask=nm)
    else:
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = m < M
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            xt = tl.load(x + m[:, None] * K + k[None, :], mask=mm[:, None] & (k < K)[None, :], other=0.0)
            wt = _weight_tile(w, s, z, n, nm, k0, N, K, BH, BW, S_N, G, BLOCK_N, BLOCK_K, MODE, GB)
            if x.dtype.element_ty == tl.float32:  # fp32 rows: fp32 products (the GPU's default would be TF32)
                acc2 += tl.dot(xt, tl.trans(wt.to(xt.dtype)), input_precision="ieee")
            else:
                acc2 += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
        if MODE == 0:
            acc2 = acc2 * tl.load(s + n, mask=nm, other=0.0)[None, :]
        tl.store(y + m[:, None] * N + n[None, :], acc2.to(y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _dequant_kernel(
    w,
    s,
    z,
    out,
    N,
    K,
    BH,
    BW,
    S_N,
    G,
    MODE: tl.constexpr,
    GB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_N, BLOCK_K] tile of the weight dequantised into ``out`` [N, K] (the model's dtype)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    wt = _weight_tile(w, s, z, n, nm, k0, N, K, BH, BW, S_N, G, BLOCK_N, BLOCK_K, MODE, GB)
    if MODE == 0:
        wt = wt * tl.load(s + n, mask=nm, other=0.0)[:, None]
    tl.store(out + n[:, None] * K + k[None, :], wt.to(out.dtype.element_ty), mask=nm[:, None] & (k < K)[None, :])


@triton.jit
def _act_quant_kernel(x, q, sx, K, BLOCK_K: tl.constexpr):
    """Row ``program_id`` of x as FP8 e4m3 (written as its bytes) with its float32 scale: absolute maximum / 448."""
    row = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x + row * K + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(sx + row, scale)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x + row * K + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
        c = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
        tl.store(q + row * K + k0 + kk, c.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=k0 + kk < K)


def _tiles(M: int, K: int, g: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps).  One row: 8 output features a program, up to 1024 columns a step
    (cuda_ext/gemv.py's sweep found 4 x 2048 best for 16-bit weights, the same bytes a step as 8 x 1024 of
    FP8 / 8 x 2048 of int4).  Several rows: one row block covers every row up to 64 (the weight tile is
    dequantised once per program, not once per 16 rows), 64 output features and 128 columns a step.
    ``bench_quant_serve.py --sweep`` times the candidates of ``TILE_CANDIDATES`` on the 8B shapes."""
    if M == 1:
        return 1, 8, max(min(1024, triton.next_power_of_2(K)), g), 4
    if M <= 16:
        return 16, 32, max(128, g), 4
    if M <= 64:
        return triton.next_power_of_2(M), 64, max(128, g), 4
    return 128, 64, max(64, g), 8


# the launch configurations bench_quant_serve.py times per row count (the defaults above are one of each)
TILE_CANDIDATES = {
    1: [(1, 8, 1024, 4), (1, 4, 1024, 4), (1, 8, 512, 4), (1, 16, 1024, 8)],
    16: [(16, 32, 128, 4), (16, 64, 128, 4), (16, 64, 256, 8)],
    64: [(64, 64, 128, 4), (64, 128, 64, 8)],
    128: [(128, 64, 64, 8), (64, 64, 64, 4)],
}


def _group_bits(mode: int, group: int) -> int:
    return group if mode == GROUP and group & (group - 1) == 0 and group <= 128 else 0


def _launch(x, w, s, z, N, K, mode, bh=1, bw=1, s_n=0, group=0, tiles=None, out=None) -> torch.Tensor:
    M = x.shape[0]
    gb = _group_bits(mode, group)
    block_m, block_n, block_k, warps = tiles or _tiles(M, K, gb)
    block_k = max(block_k, gb)
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _quant_mm_kernel[grid](
        x, w, s, z, y, M, N, K, bh, bw, s_n, max(group, 1),
        MODE=mode, GB=gb, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return y


def fp8_linear(
    x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None, tiles=None
) -> torch.Tensor:
    """x [M, K] @ (w8 [N, K] * scale).T.  ``scale``: float32, ``[N]`` per row (or one number), or
    ``[ceil(N/bh), ceil(K/bw)]`` for ``block`` (bh, bw)."""
    M, K = x.shape
    N = w8.shape[0]
    assert w8.shape[1] == K and x.is_contiguous() and w8.is_contiguous() and scale.dtype == torch.float32
    if block is not None:
        s = scale.contiguous()
        return _launch(x, w8.view(torch.uint8), s, s, N, K, BLOCK, block[0], block[1], s.shape[1], tiles=tiles)
    s = scale.reshape(-1)
    s = s.expand(N).contiguous() if s.numel() == 1 else s
    return _launch(x, w8.view(torch.uint8), s, s, N, K, ROW, tiles=tiles)


def int4_linear(
    x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, tiles=None
) -> torch.Tensor:
    """x [M, K] @ dequant(qw [N, K/8], scales, zeros [N, K/group]).T."""
    M, K = x.shape
    N = qw.shape[0]
    assert qw.shape[1] * 8 == K and K % group == 0 and group % 8 == 0
    assert x.is_contiguous() and qw.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()
    return _launch(x, qw, scales, zeros, N, K, GROUP, group=group, tiles=tiles)


def _dequant(w, s, z, out, N, K, mode, bh=1, bw=1, s_n=0, group=0) -> torch.Tensor:
    gb = _group_bits(mode, group)
    block_n, block_k = 32, max(128, gb)
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    _dequant_kernel[grid](
        w, s, z, out, N, K, bh, bw, s_n, max(group, 1), MODE=mode, GB=gb, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip
    return out


def fp8_dequant(
    w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``w8 * scale`` into ``out`` [N, K] (a scratch buffer of the model's dtype; bfloat16 when not given)."""
    N, K = w8.shape
    out = out if out is not None else torch.empty((N, K), dtype=torch.bfloat16, device=w8.device)
    if block is not None:
        s = scale.contiguous()
        return _dequant(w8.view(torch.uint8), s, s, out, N, K, BLOCK, block[0], block[1], s.shape[1])
    s = scale.reshape(-1)
    s = s.expand(N).contiguous() if s.numel() == 1 else s
    return _dequant(w8.view(torch.uint8), s, s, out, N, K, ROW)


def int4_dequant(
    qw: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(q - zeros) * scales`` into ``out`` [N, K] (the model's dtype; bfloat16 when not given)."""
    N, K = qw.shape[0], qw.shape[1] * 8
    out = out if out is not None else torch.empty((N, K), dtype=torch.bfloat16, device=qw.device)
    return _dequant(qw, scales, zeros, out, N, K, GROUP, group=group)


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous) -> (x8 [M, K] float8_e4m3fn, sx [M, 1] float32) with ``x ~ x8 * sx``: each row's
    absolute maximum to 448, one launch (torch needs seven small kernels for the same, ``act_quant_ref``)."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.uint8, device=x.device)
    sx = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    _act_quant_kernel[(M,)](x, q, sx, K, BLOCK_K=min(2048, triton.next_power_of_2(K)), num_warps=4)
    return q.view(torch.float8_e4m3fn), sx


def act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sx = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
    return (x.float() / sx).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), sx


def fp8_dequant_ref(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    w = w8.to(torch.float32)
    s = scale.to(torch.float32)
    if block is None:
        return w * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
    bh, bw = block
    return w * s.repeat_interleave(bh, 0)[: w.shape[0]].repeat_interleave(bw, 1)[:, : w.shape[1]]


def int4_dequant_ref(qw: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qw.device)
    q = ((qw.unsqueeze(-1) >> shifts) & 0xF).reshape(qw.shape[0], -1).float()  # [N, K]
    g = torch.arange(q.shape[1], device=q.device) // group
    return (q - zeros.float()[:, g]) * scales.float()[:, g]


def fp8_linear_ref(x, w8, scale, block=None) -> torch.Tensor:
    return (x.float() @ fp8_dequant_ref(w8, scale, block).T).to(x.dtype)


def int4_linear_ref(x, qw, scales, zeros, group) -> torch.Tensor:
    return (x.float() @ int4_dequant_ref(qw, scales, zeros, group).T).to(x.dtype)


def selfcheck(device: str, dtype: torch.dtype, seed: int = 0) -> float:
    """Largest relative error of the kernels against their references: the GEMM for FP8 (per-row and block
    scales) and int4 at 1, 3 and 40 rows, odd N (masked tails); the activations' FP8 rounding; the weights
    dequantised into the model's dtype.  Under ``TRITON_INTERPRET=1`` the activations' rounding is left out: the
    interpreter's float32 -> e4m3 cast drops the carry of a round-up to the next power of two (125.9 -> 64), which a
    GPU does not; tests/test_quant_formats.py checks the kernel there with that known difference."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    N, K, G = 200, 256, 64
    w8 = (torch.randn(N, K, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    srow = (torch.rand(N, generator=g) * 0.01).to(device)
    sblk = (torch.rand(2, 2, generator=g) * 0.01).to(device)
    qw = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), generator=g, dtype=torch.int64).to(torch.int32).to(device)
    s4 = (torch.rand(N, K // G, generator=g) * 0.01).to(device=device, dtype=dtype)
    z4 = torch.randint(0, 16, (N, K // G), generator=g).to(device=device, dtype=dtype)
    worst = 0.0
    for M in (1, 3, 40):
        x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
        for got, ref in (
            (fp8_linear(x, w8, srow), fp8_linear_ref(x, w8, srow)),
            (fp8_linear(x, w8, sblk, (128, 128)), fp8_linear_ref(x, w8, sblk, (128, 128))),
            (int4_linear(x, qw, s4, z4, G), int4_linear_ref(x, qw, s4, z4, G)),
        ):
            worst = max(worst, float((got.float() - ref.float()).norm() / (ref.float().norm() + 1e-12)))
        if os.environ.get("TRITON_INTERPRET") != "1":  # see below
            q8, sx = act_quant_fp8(x)
            r8, rs = act_quant_ref(x)
            a, b = q8.float() * sx, r8.float() * rs
            worst = max(worst, float((a - b).norm() / (b.norm() + 1e-12)))
    for got, ref in (
        (fp8_dequant(w8, srow, out=torch.empty(N, K, dtype=dtype, device=device)), fp8_dequant_ref(w8, srow)),
        (fp8_dequant(w8, sblk, (128, 128), torch.empty(N, K, dtype=dtype, device=device)),
         fp8_dequant_ref(w8, sblk, (128, 128))),
        (int4_dequant(qw, s4, z4, G, torch.empty(N, K, dtype=dtype, device=device)), int4_dequant_ref(qw, s4, z4, G)),
    ):  # fmt: skip
        worst = max(worst, float((got.float() - ref).norm() / (ref.norm() + 1e-12)))
    return worst
