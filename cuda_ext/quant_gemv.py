"""``y = x @ dequant(w).T`` for a decode step's few rows (M <= 16), reading quantized weights: FP8 e4m3 with
per-tensor, per-row or block scales, and 4-bit codes with group-wise scales and zero points.  The weight is
dequantised in registers and never written back, so a decode step reads 1 (FP8) or ~0.5 (int4) bytes per
weight instead of 2.  Activations stay in their 16-bit dtype; accumulation in fp32.

Layouts (backends/torch/quant_linear.py converts each checkpoint layout to these once, at load):

- FP8: ``w8 [N, K]`` float8_e4m3fn (passed as uint8), scale ``s`` read at ``[n // BH, k // BW]`` with strides
  (per tensor: BH = N, BW = K; per row: BH = 1, BW = K; 128x128 blocks: BH = BW = 128).
- int4: ``qw [N, K/8]`` int32, input column 8j+i of row n at bits 4i of word j (GPTQ's order, transposed;
  compressed-tensors' pack-quantized as stored); ``scales`` and ``zeros`` ``[N, K/G]`` in the codes' domain
  (``w = (q - z) * s``).  Act-order checkpoints are permuted at load so that groups are contiguous; the
  caller gathers x's columns in the same order.

``fp8_linear_small_m_ref`` / ``int4_linear_small_m_ref`` are the torch references (dequantise, then matmul in
fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemv_kernel(
    x,
    w,
    s,
    y,
    M,
    N,
    K,
    BH,
    BW,
    S_N,
    S_K,
    M_BLK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, M_BLK)
    mm = m < M
    acc = tl.zeros((M_BLK, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        km = k < K
        msk = nm[:, None] & km[None, :]
        b = tl.load(w + n[:, None] * K + k[None, :], mask=msk, other=0)
        sc = tl.load(s + (n // BH)[:, None] * S_N + (k // BW)[None, :] * S_K, mask=msk, other=0.0)
        wt = b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc.to(tl.float32)
        xt = tl.load(x + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
    tl.store(y + m[:, None] * N + n[None, :], acc.to(y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _int4_gemv_kernel(
    x,
    qw,
    s,
    z,
    y,
    M,
    N,
    K,
    G,
    M_BLK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, M_BLK)
    mm = m < M
    K8 = K // 8
    NG = K // G
    acc = tl.zeros((M_BLK, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        km = k < K
        msk = nm[:, None] & km[None, :]
        word = tl.load(qw + n[:, None] * K8 + (k // 8)[None, :], mask=msk, other=0)
        q = (word >> ((k % 8) * 4)[None, :]) & 0xF
        g = (k // G)[None, :]
        sc = tl.load(s + n[:, None] * NG + g, mask=msk, other=0.0).to(tl.float32)
        zz = tl.load(z + n[:, None] * NG + g, mask=msk, other=0.0).to(tl.float32)
        wt = (q.to(tl.float32) - zz) * sc
        xt = tl.load(x + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
    tl.store(y + m[:, None] * N + n[None, :], acc.to(y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def _m_blk(M: int) -> int:
    assert 1 <= M <= 16, M
    return triton.next_power_of_2(M)


def fp8_linear_small_m(
    x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """x [M, K] (M <= 16) @ (w8 [N, K] * scale).T.  ``scale``: one number, ``[N]`` / ``[N, 1]`` per row, or
    ``[ceil(N/bh), ceil(K/bw)]`` for ``block`` (bh, bw)."""
    M, K = x.shape
    N = w8.shape[0]
    assert w8.shape[1] == K and x.is_contiguous() and w8.is_contiguous()
    s = scale.float().contiguous()
    if block is not None:
        bh, bw, s_n, s_k = block[0], block[1], s.shape[1], 1
    elif s.numel() == 1:
        bh, bw, s_n, s_k = N, K, 0, 0
    else:
        bh, bw, s_n, s_k = 1, K, 1, 0
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_n, block_k = (4, 512) if M == 1 else (16, 128)
    _fp8_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w8.view(torch.uint8), s, y, M, N, K, bh, bw, s_n, s_k, M_BLK=_m_blk(M), BLOCK_N=block_n, BLOCK_K=block_k
    )
    return y


def int4_linear_small_m(
    x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] (M <= 16) @ dequant(qw [N, K/8], scales, zeros [N, K/group]).T."""
    M, K = x.shape
    N = qw.shape[0]
    assert qw.shape[1] * 8 == K and K % group == 0 and group % 8 == 0
    assert x.is_contiguous() and qw.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_n, block_k = (4, 512) if M == 1 else (16, 128)
    _int4_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, qw, scales, zeros, y, M, N, K, group, M_BLK=_m_blk(M), BLOCK_N=block_n, BLOCK_K=block_k
    )
    return y


def fp8_dequant_ref(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    from swiftlm.backends.torch.quant_unpack import fp8_weight

    return fp8_weight(w8, scale, block)


def int4_dequant_ref(qw: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    from swiftlm.backends.torch.quant_unpack import unpack_last

    q = unpack_last(qw, 4).float()  # [N, K]
    g = torch.arange(q.shape[1], device=q.device) // group
    return (q - zeros.float()[:, g]) * scales.float()[:, g]


def fp8_linear_small_m_ref(x, w8, scale, block=None) -> torch.Tensor:
    return (x.float() @ fp8_dequant_ref(w8, scale, block).T).to(x.dtype)


def int4_linear_small_m_ref(x, qw, scales, zeros, group) -> torch.Tensor:
    return (x.float() @ int4_dequant_ref(qw, scales, zeros, group).T).to(x.dtype)
