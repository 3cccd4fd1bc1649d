"""Compressed KV rows decoded into 16-bit rows (Triton), for a prompt chunk's attention over them
(``backends/torch/prompt_attention.py``).

- ``tq_rows``: TurboQuant-mse codes -> centroid times norm, in the rotated domain (the rows are never rotated
  back: the chunk's queries are rotated instead), read from a cache's own storage or, through a page table, from
  code pages (``code_pages.py``).
- ``affine_rows``: ``kv_bits`` codes -> code times scale plus bias per group, coordinates in their natural order.

Neither writes the packed layout again: the codes are read by the decode-attention kernels' own helpers
(the bit planes of ``swiftlm.turboquant.packing``) and ``affine_kv_kernels._dequant``.  One program writes BLOCK_N
rows of one KV head, each value rounded once, to the output dtype:

- 16-bit outputs (the GPU's case) of 2- to 4-bit codes: ``tq_codes._mux_tile``, the decode kernels' lookups of the
  fp16 centroids (byte permutes on CUDA), in coordinate order, times the fp32 norm: the rows the decode kernels
  attend to for a 16-bit model.
- otherwise: ``tq_codes._codes`` (codes in "s-major" column order, put back in coordinate order by the store) and
  the fp32 centroids, so that the rows equal the codecs' torch decode (``TurboCodec.unit_rows`` times the norm).

Affine rows are code times scale plus bias in fp32, as ``AffineCodec.decode_planes``.  The references (``*_ref``)
decode through ``swiftlm.turboquant.packing.unpack``, the layout's specification (16-bit outputs: the centroids
rounded to fp16 first); ``selfcheck`` and tests/test_prompt_attention.py compare them (CPU tensors under
``TRITON_INTERPRET=1``, and on a GPU where one exists).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .affine_kv_kernels import _dequant
from .affine_kv_kernels import supported as affine_supported
from .tq_codes import _PLANES, _codes, _mux_tile, _prmt_for, _swar_ok

BLOCK_N = 64


def tq_supported(head_dim: int) -> bool:
    """Head dims ``tq_rows`` takes: powers of two from 16 (its tiles are [BLOCK_N, head_dim])."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@triton.jit
def _tq_rows_kernel(
    p0_ptr,
    p1_ptr,
    norm_ptr,
    cent_ptr,
    out_ptr,
    pt_ptr,
    n,
    p0_sh,
    p0_sr,
    p1_sh,
    p1_sr,
    nrm_sh,
    nrm_sr,
    out_sh,
    out_sr,
    D: tl.constexpr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    NAT: tl.constexpr,
    ASM: tl.constexpr,
    PRMT: tl.constexpr,
    SWAR: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < n
    if PAGED:  # code row r -> pool row page * PAGE + r % PAGE
        page = tl.load(pt_ptr + rows // PAGE, mask=ok, other=0).to(tl.int64)
        src = tl.where(ok, page * PAGE + rows % PAGE, 0)
    else:
        src = tl.where(ok, rows, 0).to(tl.int64)
    p0, p1 = p0_ptr + h * p0_sh, p1_ptr + h * p1_sh
    nrm = tl.load(norm_ptr + h * nrm_sh + src * nrm_sr).to(tl.float32)
    col = tl.arange(0, D)
    if NAT:  # the decode kernels' fp16 lookups (byte permutes on CUDA), coordinates in natural order
        val = _mux_tile(p0, p1, p0_sr, p1_sr, src, cent_ptr, W0, W1, BLOCK_N, D, ASM, PRMT, SWAR).to(tl.float32)
        val = val * nrm[:, None]
        coord = col
    else:  # fp32 centroids gathered by code; codes in s-major column order
        PER: tl.constexpr = 8 // W0
        SW: tl.constexpr = D // PER
        code = _codes(p0, p1, p0_sr, p1_sr, src, tl.arange(0, SW), tl.arange(0, PER), W0, W1, PER, BLOCK_N, D)
        val = tl.load(cent_ptr + code) * nrm[:, None]
        coord = (col % SW) * PER + col // SW  # s-major column -> coordinate
    ptrs = out_ptr + h * out_sh + rows.to(tl.int64)[:, None] * out_sr + coord[None, :]
    tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def tq_rows(
    planes: list[torch.Tensor],
    norms: torch.Tensor,
    centroids: torch.Tensor,
    bits: int,
    n: int,
    out: torch.Tensor,
    pages: tuple | None = None,
) -> torch.Tensor:
    """Code rows [0, n) of ``planes`` [KVH, cap, bytes] (uint8) with ``norms`` [KVH, cap] (fp16) into ``out``
    [KVH, n, D] (any float dtype, unit stride along D): ``centroids[code] * norm``.  ``pages``: (page table
    int32, rows per page, -) when the storage is a code-page pool."""
    KVH, _, D = out.shape
    w0, w1 = _PLANES[bits]
    p0 = planes[0]
    p1 = planes[1] if w1 else p0
    paged = pages is not None
    table, page = (pages[0], int(pages[1])) if paged else (p0, 1)
    nat = out.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and bits in (2, 3, 4)
    swar = nat and _swar_ok(planes, w0, w1, D, centroids)
    asm = _prmt_for(centroids, bits, swar) if nat else ""
    _tq_rows_kernel[(triton.cdiv(n, BLOCK_N), KVH)](
        p0,
        p1,
        norms,
        centroids.float().contiguous(),
        out,
        table,
        n,
        p0.stride(0),
        p0.stride(1),
        p1.stride(0),
        p1.stride(1),
        norms.stride(0),
        norms.stride(1),
        out.stride(0),
        out.stride(1),
        D=D,
        W0=w0,
        W1=w1,
        BLOCK_N=BLOCK_N,
        PAGED=paged,
        PAGE=page,
        NAT=int(nat),
        ASM=asm or "none",
        PRMT=int(bool(asm)),
        SWAR=int(swar),
    )
    return out


@triton.jit
def _affine_rows_kernel(
    p_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    n,
    p_sh,
    p_sr,
    s_sh,
    s_sr,
    out_sh,
    out_sr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < n
    src = tl.where(ok, rows, 0).to(tl.int64)
    val = _dequant(
        p_ptr + h * p_sh, s_ptr + h * s_sh, b_ptr + h * s_sh, src, p_sr, s_sr, BITS, BLOCK_N, D // GROUP, GROUP, D, 0, 0
    )
    ptrs = out_ptr + h * out_sh + rows.to(tl.int64)[:, None] * out_sr + tl.arange(0, D)[None, :]
    tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def affine_rows(
    planes: list[torch.Tensor],
    scale: torch.Tensor,
    bias: torch.Tensor,
    bits: int,
    group: int,
    n: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Code rows [0, n) of a ``kv_bits`` cache (``planes[0]`` [KVH, cap, D * bits / 8] uint8, ``scale`` / ``bias``
    [KVH, cap, D / group] fp16) into ``out`` [KVH, n, D]: code * scale + bias in fp32, natural coordinate order.
    Shapes: ``affine_kv_kernels.supported``."""
    KVH, _, D = out.shape
    p = planes[0]
    if scale.stride() != bias.stride() or scale.stride(2) != 1:
        raise ValueError("affine scale and bias must share a layout with groups innermost")
    _affine_rows_kernel[(triton.cdiv(n, BLOCK_N), KVH)](
        p,
        scale,
        bias,
        out,
        n,
        p.stride(0),
        p.stride(1),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        out.stride(1),
        D=D,
        BITS=bits,
        GROUP=group,
        BLOCK_N=BLOCK_N,
    )
    return out


# ------------------------------------------------------------------------------------ references
def _rows_ref(t: torch.Tensor, n: int, pages: tuple | None) -> torch.Tensor:
    if pages is None:
        return t[:, :n]
    P = int(pages[1])
    r = torch.arange(n, device=t.device)
    return t[:, pages[0].long()[r // P] * P + r % P]


def _unpack_ref(planes: list[torch.Tensor], bits: int, d: int) -> torch.Tensor:
    """Integer codes through ``swiftlm.turboquant.packing.unpack`` (the layout's numpy specification)."""
    from swiftlm.turboquant.packing import unpack

    codes = unpack([p.cpu().numpy() for p in planes], bits, d)
    return torch.from_numpy(codes.astype(np.int64)).to(planes[0].device)


def tq_rows_ref(planes, norms, centroids, bits, n, out, pages=None) -> torch.Tensor:
    """``tq_rows`` through the specification."""
    codes = _unpack_ref([_rows_ref(p, n, pages) for p in planes], bits, out.shape[-1])
    if out.dtype in (torch.float16, torch.bfloat16) and out.shape[-1] % 8 == 0 and bits in (2, 3, 4):
        centroids = centroids.half()  # the fp16 lookups of ``tq_rows``
    out.copy_(centroids.float()[codes] * _rows_ref(norms, n, pages).float().unsqueeze(-1))
    return out


def affine_rows_ref(planes, scale, bias, bits, group, n, out) -> torch.Tensor:
    """``affine_rows`` through the specification (8 bits: one byte per code)."""
    D = out.shape[-1]
    codes = planes[0][:, :n].long() if bits == 8 else _unpack_ref([planes[0][:, :n]], bits, D)
    g = codes.float().view(*codes.shape[:2], D // group, group)
    out.copy_((g * scale[:, :n].float().unsqueeze(-1) + bias[:, :n].float().unsqueeze(-1)).view(codes.shape))
    return out


def selfcheck(device: str, dtype: torch.dtype, seed: int = 0) -> float:
    """Largest relative error of the two kernels against their references on random codes (every TurboQuant width,
    paged and not; 4- and 8-bit affine codes), rows that end inside a block."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    KVH, cap, D, n = 2, 160, 64, 133  # cap: 10 pages of 16 rows
    worst = 0.0

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-12))

    def planes(*widths: int) -> list[torch.Tensor]:
        return [
            torch.randint(0, 256, (KVH, cap, D * w // 8), generator=g, dtype=torch.uint8).to(device) for w in widths
        ]

    def empty() -> torch.Tensor:
        return torch.empty(KVH, n, D, dtype=dtype, device=device)

    norms = (torch.rand(KVH, cap, generator=g) + 0.5).half().to(device)
    for bits in (1, 2, 3, 4):
        cents = torch.randn(1 << bits, generator=g).to(device)
        ps = planes(*(w for w in _PLANES[bits] if w))
        table = torch.randperm(cap // 16, generator=g).to(device=device, dtype=torch.int32)
        for pages in (None, (table, 16, n)):
            a = tq_rows(ps, norms, cents, bits, n, empty(), pages)
            worst = max(worst, rel(a, tq_rows_ref(ps, norms, cents, bits, n, empty(), pages)))
    for bits in (4, 8):
        ps = planes(bits)
        scale = (torch.rand(KVH, cap, D // 32, generator=g) * 0.1).half().to(device)
        bias = torch.randn(KVH, cap, D // 32, generator=g).half().to(device)
        a = affine_rows(ps, scale, bias, bits, 32, n, empty())
        worst = max(worst, rel(a, affine_rows_ref(ps, scale, bias, bits, 32, n, empty())))
    return worst


__all__ = ["BLOCK_N", "affine_rows", "affine_rows_ref", "affine_supported", "selfcheck", "tq_rows", "tq_rows_ref"]
