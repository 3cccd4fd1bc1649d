"""Compressed KV rows decoded into 16-bit rows (Triton), for a prompt chunk's attention over them
(``backends/torch/prompt_attention.py``).

- ``tq_rows``: TurboQuant-mse codes -> centroid times norm, in the rotated domain (the rows are never rotated
  back: the chunk's queries are rotated instead).  Codes in the ``swiftlm.turboquant.packing`` layout (a plane of
  width w holds 8 / w codes per byte, little-end first; 3-bit codes are a 2-bit plane + a 1-bit plane), read
  from a cache's own storage or, through a page table, from code pages (``code_pages.py``).
- ``affine_rows``: ``kv_bits`` codes (8 bits: one byte each; 4 bits: two per byte, low nibble first) -> code times
  scale plus bias per group, coordinates in their natural order.

One program writes BLOCK_N rows of one KV head: each code's byte is loaded (a row's bytes are contiguous), its bits
shifted out, its centroid read from a table of at most 16 floats, and the product rounded once to the output dtype.
Each has a plain-torch reference (``*_ref``) and an equivalence test (tests/test_prompt_attention.py), run on CPU
tensors under ``TRITON_INTERPRET=1`` and on a GPU where one exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PLANES = {1: (1, 0), 2: (2, 0), 3: (2, 1), 4: (4, 0)}
BLOCK_N = 64


@triton.jit
def _source_rows(rows, mask, pt_ptr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Storage rows of code rows ``rows``: themselves, or through the page table (page * PAGE + offset)."""
    if PAGED:
        page = tl.load(pt_ptr + rows // PAGE, mask=mask, other=0).to(tl.int64)
        return page * PAGE + rows % PAGE
    return rows.to(tl.int64)


@triton.jit
def _plane_field(ptr, head_off, row_stride, src, d, mask, W: tl.constexpr):
    """[BLOCK_N, D] W-bit fields of coordinate d of rows ``src`` of one bit plane."""
    PER: tl.constexpr = 8 // W
    b = tl.load(ptr + head_off + src[:, None] * row_stride + (d // PER)[None, :], mask=mask[:, None], other=0)
    return (b.to(tl.int32) >> ((d % PER) * W)[None, :]) & ((1 << W) - 1)


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
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < n
    src = _source_rows(rows, mask, pt_ptr, PAGED, PAGE)
    d = tl.arange(0, D)
    code = _plane_field(p0_ptr, h * p0_sh, p0_sr, src, d, mask, W0)
    if W1:
        code = code | (_plane_field(p1_ptr, h * p1_sh, p1_sr, src, d, mask, W1) << W0)
    c = tl.load(cent_ptr + code)
    nrm = tl.load(norm_ptr + h * nrm_sh + src * nrm_sr, mask=mask, other=0.0).to(tl.float32)
    val = c * nrm[:, None]
    ptrs = out_ptr + h * out_sh + rows.to(tl.int64)[:, None] * out_sr + d[None, :]
    tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=mask[:, None])


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
    int32 [pages], rows per page, -) when the storage is a code-page pool."""
    KVH, _, D = out.shape
    w0, w1 = _PLANES[bits]
    p0 = planes[0]
    p1 = planes[1] if w1 else p0
    paged = pages is not None
    table, page = (pages[0], int(pages[1])) if paged else (p0, 1)
    grid = (triton.cdiv(n, BLOCK_N), KVH)
    _tq_rows_kernel[grid](
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
    )
    return out


def _unpack_ref(planes: list[torch.Tensor], bits: int, d: int) -> torch.Tensor:
    codes, shift = None, 0
    for plane, width in zip(planes, (w for w in _PLANES[bits] if w)):
        sh = torch.arange(0, 8, width, dtype=torch.int32, device=plane.device)
        part = ((plane.to(torch.int32).unsqueeze(-1) >> sh) & ((1 << width) - 1)).reshape(*plane.shape[:-1], d)
        codes = part << shift if codes is None else codes | (part << shift)
        shift += width
    return codes.long()


def _rows_ref(t: torch.Tensor, n: int, pages: tuple | None) -> torch.Tensor:
    if pages is None:
        return t[:, :n]
    P = int(pages[1])
    r = torch.arange(n, device=t.device)
    return t[:, pages[0].long()[r // P] * P + r % P]


def tq_rows_ref(planes, norms, centroids, bits, n, out, pages=None) -> torch.Tensor:
    """``tq_rows`` in plain torch."""
    codes = _unpack_ref([_rows_ref(p, n, pages) for p in planes], bits, out.shape[-1])
    out.copy_(centroids.float()[codes] * _rows_ref(norms, n, pages).float().unsqueeze(-1))
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
    W: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < n
    src = rows.to(tl.int64)
    d = tl.arange(0, D)
    code = _plane_field(p_ptr, h * p_sh, p_sr, src, d, mask, W).to(tl.float32)
    g = (d // GROUP)[None, :]
    off = h * s_sh + src[:, None] * s_sr + g
    scale = tl.load(s_ptr + off, mask=mask[:, None], other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + off, mask=mask[:, None], other=0.0).to(tl.float32)
    ptrs = out_ptr + h * out_sh + rows.to(tl.int64)[:, None] * out_sr + d[None, :]
    tl.store(ptrs, (code * scale + bias).to(out_ptr.dtype.element_ty), mask=mask[:, None])


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
    [KVH, cap, D / group] fp16) into ``out`` [KVH, n, D]: code * scale + bias, natural coordinate order."""
    KVH, _, D = out.shape
    p = planes[0]
    if scale.stride() != bias.stride():
        raise ValueError("affine scale and bias must share a layout")
    grid = (triton.cdiv(n, BLOCK_N), KVH)
    _affine_rows_kernel[grid](
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
        W=bits,
        GROUP=group,
        BLOCK_N=BLOCK_N,
    )
    return out


def affine_rows_ref(planes, scale, bias, bits, group, n, out) -> torch.Tensor:
    """``affine_rows`` in plain torch."""
    D = out.shape[-1]
    codes = planes[0][:, :n].long() if bits == 8 else _unpack_ref([planes[0][:, :n]], 4, D)
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

    norms = (torch.rand(KVH, cap, generator=g) + 0.5).half().to(device)
    for bits in (1, 2, 3, 4):
        cents = torch.randn(1 << bits, generator=g).to(device)
        ps = planes(*(w for w in _PLANES[bits] if w))
        table = torch.randperm(cap // 16, generator=g).to(device=device, dtype=torch.int32)
        for pages in (None, (table, 16, n)):
            a = tq_rows(ps, norms, cents, bits, n, torch.empty(KVH, n, D, dtype=dtype, device=device), pages)
            b = tq_rows_ref(ps, norms, cents, bits, n, torch.empty(KVH, n, D, dtype=dtype, device=device), pages)
            worst = max(worst, rel(a, b))
    for bits in (4, 8):
        ps = planes(bits)
        scale = (torch.rand(KVH, cap, D // 32, generator=g) * 0.1).half().to(device)
        bias = torch.randn(KVH, cap, D // 32, generator=g).half().to(device)
        a = affine_rows(ps, scale, bias, bits, 32, n, torch.empty(KVH, n, D, dtype=dtype, device=device))
        b = affine_rows_ref(ps, scale, bias, bits, 32, n, torch.empty(KVH, n, D, dtype=dtype, device=device))
        worst = max(worst, rel(a, b))
    return worst
