"""``y = x @ w.T`` for a decode step's few rows (M <= 16), as a Triton kernel that streams the weight
once at full memory bandwidth.

At one decode row a linear layer is a matrix-vector product: all its time is reading ``w``.  cuBLAS
picks GEMM tilings made for larger M; for the small, many-per-step matrices of a decode step (a 1B
model's o_proj is 8 MB: ~3 us at 3 TB/s) its launch tail and partial waves cost a large share.  Here
each program owns ``BLOCK_N`` output features (4 by default) and walks K.  A tiling may also split K
(``split_k`` > 1: partial sums added into an fp32 buffer with ``tl.atomic_add``); the default does not, so
decode stays deterministic, and ``scripts/bench_gemv.py`` sweeps it.

``linear_small_m(x, w)`` takes x [M, K] (M <= 16) and w [N, K] (both contiguous, the same dtype)
and returns [M, N] in x's dtype, accumulated in fp32.  ``linear_small_m_ref`` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_kw


@triton.jit
def _gemv_kernel(
    x,
    w,
    y,
    M,
    N,
    K,
    K_PER,
    M_BLK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    GDC: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER
    if M_BLK == 1:
        acc = tl.zeros((BLOCK_N,), tl.float32)
        if GDC:  # programmatic dependent launch (pdl.py): the first weight tile before waiting for x
            k = k_lo + kk
            km = k < K
            wt = tl.load(w + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            tl.extra.cuda.gdc_wait()
            for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
                k = k0 + kk
                km = k < K
                xt = tl.load(x + k, mask=km, other=0.0)
                acc += tl.sum(wt.to(tl.float32) * xt.to(tl.float32)[None, :], axis=1)
                kn = k + BLOCK_K
                wt = tl.load(w + n[:, None] * K + kn[None, :], mask=nm[:, None] & (kn < K)[None, :], other=0.0)
            tl.extra.cuda.gdc_launch_dependents()
        else:
            for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
                k = k0 + kk
                km = k < K
                wt = tl.load(w + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                xt = tl.load(x + k, mask=km, other=0.0)
                acc += tl.sum(wt.to(tl.float32) * xt.to(tl.float32)[None, :], axis=1)
        if ATOMIC:
            tl.atomic_add(y + n, acc, mask=nm)
        else:
            tl.store(y + n, acc.to(y.dtype.element_ty), mask=nm)
    else:
        m = tl.arange(0, M_BLK)
        mm = m < M
        acc2 = tl.zeros((M_BLK, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
            k = k0 + kk
            km = k < K
            wt = tl.load(w + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            xt = tl.load(x + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            acc2 += tl.dot(xt, tl.trans(wt))
        ptr = y + m[:, None] * N + n[None, :]
        msk = mm[:, None] & nm[None, :]
        if ATOMIC:
            tl.atomic_add(ptr, acc2, mask=msk)
        else:
            tl.store(ptr, acc2.to(y.dtype.element_ty), mask=msk)


def _config(M: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, split_k, num_warps) as the sweep of ``scripts/bench_gemv.py`` picks them.  No split of
    K by default (atomic partial sums would make the result depend on their order: decode stays
    deterministic); a decode step's matrices have N >= 2048, 256+ programs."""
    if M == 1:  # 4 output features a program: the sweep's best for every matrix of a decode step
        # (docs/results/gemv_h100.json)
        return 4, min(2048, triton.next_power_of_2(K)), 1, 4
    return 32, 128, 1, 4


def linear_small_m(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T for M <= 16 (contiguous, one dtype); fp32 accumulation, x's dtype out."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= 16 and w.shape[1] == K and x.is_contiguous() and w.is_contiguous()
    block_n, block_k, split, warps = config or _config(M, K)
    k_per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    atomic = split > 1
    y = (torch.zeros if atomic else torch.empty)((M, N), dtype=torch.float32 if atomic else x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, k_per))
    kw = launch_kw(x) if M == 1 and not atomic else {"GDC": False}  # PDL: one row, no split K (pdl.py)
    _gemv_kernel[grid](
        x,
        w,
        y,
        M,
        N,
        K,
        K_PER=k_per,
        M_BLK=1 if M == 1 else 16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ATOMIC=atomic,
        num_warps=warps,
        **kw,
    )
    return y.to(x.dtype) if atomic else y


def linear_small_m_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T).to(x.dtype)
