"""TurboQuant codes on the GPU (Triton): the fused encoder that packs them, and the tile helpers that unpack
packed codes and look their centroids up inside the decode-attention kernels (``turboquant_kernels.py``).

Layout (``swiftlm.turboquant.packing``): a plane of width w holds 8 / w codes per byte, little-end first; 3-bit
codes are a 2-bit plane + a 1-bit plane.  Lookups on CUDA are byte permutes (``prmt``) in inline PTX with the
fp16 centroids as immediates (``prmt_asm4s`` / ``prmt_asm`` for 4-bit codes, ``prmt_asm16`` / ``prmt_asm3`` for 2-
and 3-bit ones); under the CPU interpreter, trees of selects on the code bits.  Where the rows are aligned, codes are
read as whole words: 32-bit words of the 2-bit plane (16 codes) with 16-bit words of the 1-bit plane, turned into
selector nibbles inside the asm (``prmt_asm16``), and 32-bit words of 4-bit codes, whose nibbles are selectors
already (``prmt_asm4s``).
The inline PTX is checked on a CPU by an emulator of the instructions it uses (tests/ptx_emu.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_PLANES = {1: (1, 0), 2: (2, 0), 3: (2, 1), 4: (4, 0)}


@triton.jit
def _field(ptr, row_bytes, nn, j, s, W: tl.constexpr, PER0: tl.constexpr):
    """[BLOCK_N, PER0, SW] W-bit fields of a bit plane (8 // W fields per byte, little-end first)
    for coordinate ``PER0 * j + s`` of each row: the "s-major" order, in which a plane whose bytes
    hold PER0 fields is read as one contiguous [BLOCK_N, SW] byte tile (SW = D / PER0, vectorised
    loads) and split by shifts -- no byte is loaded once per field.  A narrower plane (more fields
    per byte, e.g. the 1-bit plane of 3-bit codes or QJL signs) is read with index j // G."""
    G: tl.constexpr = (8 // W) // PER0
    b = tl.load(ptr + nn[:, None] * row_bytes + (j // G)[None, :]).to(tl.int32)  # [BLOCK_N, SW]
    sh = ((j % G) * PER0)[None, None, :] + s[None, :, None]  # field within its byte
    return (b[:, None, :] >> (sh * W)) & ((1 << W) - 1)


@triton.jit
def _codes(
    p0,
    p1,
    row_bytes0,
    row_bytes1,
    nn,
    j,
    s,
    W0: tl.constexpr,
    W1: tl.constexpr,
    PER0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    """[BLOCK_N, D] codes in s-major column order (column s * SW + j is coordinate PER0 * j + s)."""
    c = _field(p0, row_bytes0, nn, j, s, W0, PER0)
    if W1 > 0:
        c = c | (_field(p1, row_bytes1, nn, j, s, W1, PER0) << W0)
    return tl.reshape(c, (BLOCK_N, D))


@triton.jit
def _u16_to_f16(x):
    return (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _mux(x, c_ptr, BITS: tl.constexpr):
    """fp16 centroid of each code in ``x`` by a tree of selects on its bits (2^BITS - 1 selects,
    no memory access per element: the centroids are BITS-many scalar loads)."""
    b0 = (x & 1) != 0
    v = tl.where(b0, tl.load(c_ptr + 1).to(tl.float16), tl.load(c_ptr).to(tl.float16))
    if BITS >= 2:
        b1 = (x & 2) != 0
        v = tl.where(b1, tl.where(b0, tl.load(c_ptr + 3).to(tl.float16), tl.load(c_ptr + 2).to(tl.float16)), v)
        if BITS >= 3:
            b2 = (x & 4) != 0
            w = tl.where(b0, tl.load(c_ptr + 5).to(tl.float16), tl.load(c_ptr + 4).to(tl.float16))
            w = tl.where(b1, tl.where(b0, tl.load(c_ptr + 7).to(tl.float16), tl.load(c_ptr + 6).to(tl.float16)), w)
            v = tl.where(b2, w, v)
            if BITS >= 4:
                b3 = (x & 8) != 0
                u = tl.where(b0, tl.load(c_ptr + 9).to(tl.float16), tl.load(c_ptr + 8).to(tl.float16))
                u = tl.where(
                    b1, tl.where(b0, tl.load(c_ptr + 11).to(tl.float16), tl.load(c_ptr + 10).to(tl.float16)), u
                )
                y = tl.where(b0, tl.load(c_ptr + 13).to(tl.float16), tl.load(c_ptr + 12).to(tl.float16))
                y = tl.where(
                    b1, tl.where(b0, tl.load(c_ptr + 15).to(tl.float16), tl.load(c_ptr + 14).to(tl.float16)), y
                )
                u = tl.where(b2, y, u)
                v = tl.where(b3, u, v)
    return v


@triton.jit
def _natural8(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Eight [BLOCK_N, D // 8] tensors (v_t: code 8c + t at element c) -> [BLOCK_N, D] in code order
    (tl.join adds its axis innermost, so the last join picks bit 0 of t)."""
    ev = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    od = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(ev, od), (BLOCK_N, D))


@triton.jit
def _natural16(
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, BLOCK_N: tl.constexpr, D: tl.constexpr
):
    """Sixteen [BLOCK_N, D // 16] tensors (v_t: code 16c + t at element c) -> [BLOCK_N, D] in code order
    (each join adds the next lower bit of t as the innermost axis)."""
    a0, a1, a2, a3 = tl.join(v0, v8), tl.join(v1, v9), tl.join(v2, v10), tl.join(v3, v11)
    a4, a5, a6, a7 = tl.join(v4, v12), tl.join(v5, v13), tl.join(v6, v14), tl.join(v7, v15)
    b0, b1, b2, b3 = tl.join(a0, a4), tl.join(a1, a5), tl.join(a2, a6), tl.join(a3, a7)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, D))


@triton.jit
def _code2(w, hb, t: tl.constexpr, W1: tl.constexpr):
    """Code t of sixteen: two bits of the 2-bit plane's word, plus bit t of the 1-bit plane's word."""
    c = (w >> (2 * t)) & 3
    if W1 > 0:
        c = c | (((hb >> t) & 1) << 2)
    return c


@triton.jit
def _mux_tile(
    p0,
    p1,
    row_bytes0,
    row_bytes1,
    nn,
    c_ptr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    ASM: tl.constexpr,
    PRMT: tl.constexpr,
    SWAR: tl.constexpr = 0,
):
    """[BLOCK_N, D] fp16 centroids in natural order: one contiguous byte tile per plane, codes
    split off by shifts, ``_mux`` per code, interleaved back into coordinate order.  ``PRMT`` (CUDA):
    the byte-permute lookups of ``ASM`` (``prmt_asm`` / ``prmt_asm3``) instead of the select trees.
    ``SWAR`` (D % 16 == 0): codes read as whole words, 2- and 3-bit ones sixteen per 32-bit word of the
    2-bit plane (and 16-bit word of the 1-bit plane) looked up by ``prmt_asm16``, 4-bit ones eight per
    32-bit word by ``prmt_asm4s`` (symmetric codebooks); the select trees per code without ``PRMT``."""
    if W0 == 2 and SWAR:  # 16 codes per 32-bit word of the 2-bit plane (+ a 16-bit word of the 1-bit plane)
        jw = tl.arange(0, D // 16)
        w = tl.load(p0.to(tl.pointer_type(tl.int32)) + nn[:, None] * (row_bytes0 // 4) + jw[None, :])
        if W1 > 0:
            hb = tl.load(p1.to(tl.pointer_type(tl.int16)) + nn[:, None] * (row_bytes1 // 2) + jw[None, :])
            hb = hb.to(tl.int32)
        else:
            hb = w
        if PRMT:
            (v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15) = tl.inline_asm_elementwise(
                ASM, "=h," * 16 + "r,r", [w, hb], dtype=(tl.float16,) * 16, is_pure=True, pack=1
            )
        else:
            NB: tl.constexpr = W0 + W1
            v0, v1 = _mux(_code2(w, hb, 0, W1), c_ptr, NB), _mux(_code2(w, hb, 1, W1), c_ptr, NB)
            v2, v3 = _mux(_code2(w, hb, 2, W1), c_ptr, NB), _mux(_code2(w, hb, 3, W1), c_ptr, NB)
            v4, v5 = _mux(_code2(w, hb, 4, W1), c_ptr, NB), _mux(_code2(w, hb, 5, W1), c_ptr, NB)
            v6, v7 = _mux(_code2(w, hb, 6, W1), c_ptr, NB), _mux(_code2(w, hb, 7, W1), c_ptr, NB)
            v8, v9 = _mux(_code2(w, hb, 8, W1), c_ptr, NB), _mux(_code2(w, hb, 9, W1), c_ptr, NB)
            v10, v11 = _mux(_code2(w, hb, 10, W1), c_ptr, NB), _mux(_code2(w, hb, 11, W1), c_ptr, NB)
            v12, v13 = _mux(_code2(w, hb, 12, W1), c_ptr, NB), _mux(_code2(w, hb, 13, W1), c_ptr, NB)
            v14, v15 = _mux(_code2(w, hb, 14, W1), c_ptr, NB), _mux(_code2(w, hb, 15, W1), c_ptr, NB)
        return _natural16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, BLOCK_N, D)
    if W0 == 4 and SWAR:  # 32-bit words of eight codes (code 8c + t in nibble t of word c)
        jw = tl.arange(0, D // 8)
        w = tl.load(p0.to(tl.pointer_type(tl.int32)) + nn[:, None] * (row_bytes0 // 4) + jw[None, :])
        if PRMT:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 8, is_pure=True, pack=1
            )
        else:
            v0, v1 = _mux(w & 15, c_ptr, 4), _mux((w >> 4) & 15, c_ptr, 4)
            v2, v3 = _mux((w >> 8) & 15, c_ptr, 4), _mux((w >> 12) & 15, c_ptr, 4)
            v4, v5 = _mux((w >> 16) & 15, c_ptr, 4), _mux((w >> 20) & 15, c_ptr, 4)
            v6, v7 = _mux((w >> 24) & 15, c_ptr, 4), _mux((w >> 28) & 15, c_ptr, 4)
        return _natural8(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, D)
    if W0 == 4 and PRMT:
        j = tl.arange(0, D // 2)
        b = tl.load(p0 + nn[:, None] * row_bytes0 + j[None, :])
        lo, hi = tl.inline_asm_elementwise(
            ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
        out = tl.interleave(lo, hi)
    elif W0 == 4:
        j = tl.arange(0, D // 2)
        b = tl.load(p0 + nn[:, None] * row_bytes0 + j[None, :]).to(tl.int32)
        out = tl.interleave(_mux(b & 15, c_ptr, 4), _mux(b >> 4, c_ptr, 4))
    else:
        j = tl.arange(0, D // 4)
        b = tl.load(p0 + nn[:, None] * row_bytes0 + j[None, :]).to(tl.int32)
        if W1 > 0:  # coordinates 4j..4j+3 take bits 4(j%2).. of byte j//2 of the 1-bit plane
            b1 = tl.load(p1 + nn[:, None] * row_bytes1 + (j // 2)[None, :]).to(tl.int32)
            b = b | (((b1 >> ((j % 2) * 4)[None, :]) & 15) << 8)
    if W0 == 2 and PRMT:  # the four 2/3-bit codes as prmt's four selector nibbles, one lookup each
        sel = (b & 3) | ((b & 0xC) << 2) | ((b & 0x30) << 4) | ((b & 0xC0) << 6)
        if W1 > 0:
            sel = sel | ((b >> 6) & 4) | ((b >> 3) & 0x40) | (b & 0x400) | ((b << 3) & 0x4000)
        o0, o1 = tl.inline_asm_elementwise(ASM, "=r,=r,r", [sel], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        v0, v1, v2, v3 = _u16_to_f16(o0), _u16_to_f16(o0 >> 16), _u16_to_f16(o1), _u16_to_f16(o1 >> 16)
        out = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))
    elif W0 == 2:
        B: tl.constexpr = W0 + W1
        v0 = _mux((b & 3) | ((b >> 6) & 4), c_ptr, B)
        v1 = _mux(((b >> 2) & 3) | ((b >> 7) & 4), c_ptr, B)
        v2 = _mux(((b >> 4) & 3) | ((b >> 8) & 4), c_ptr, B)
        v3 = _mux(((b >> 6) & 3) | ((b >> 9) & 4), c_ptr, B)
        out = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))
    return out


@triton.jit
def _signs_nat(ptr, nn, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, D] QJL signs (+-1, fp16) in natural coordinate order from a 1-bit plane."""
    j = tl.arange(0, D // 8)
    t = tl.arange(0, 8)
    b = tl.load(ptr + nn[:, None] * (D // 8) + j[None, :]).to(tl.int32)
    bits = (b[:, :, None] >> t[None, None, :]) & 1
    return tl.reshape(2 * bits - 1, (BLOCK_N, D)).to(tl.float16)


def _planes(planes: list[torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int, int]:
    w0, w1 = _PLANES[bits]
    p0 = planes[0]
    p1 = planes[1] if w1 else planes[0]
    return p0, p1, p0.stride(0), p1.stride(0), p0.stride(1), p1.stride(1), w0, w1


def _fp16_bits(centroids) -> list[int]:
    """A codebook's fp16 centroids as 16-bit patterns (one host read of a tensor; a list passes through)."""
    if isinstance(centroids, torch.Tensor):
        return [int(v) & 0xFFFF for v in centroids.detach().float().half().view(torch.int16).cpu().tolist()]
    return list(centroids)


def _byte_tables(bits: list[int], n: int) -> tuple[list[str], list[str]]:
    """The first ``n`` fp16 patterns (zero-padded) as ``prmt`` tables: 32-bit immediates of their low bytes and
    of their high bytes, four entries per word."""
    bits = (bits + [0] * n)[:n]

    def word(vals: list[int]) -> str:
        return f"0x{vals[0] | vals[1] << 8 | vals[2] << 16 | vals[3] << 24:08X}"

    lo = [word([b & 0xFF for b in bits[i : i + 4]]) for i in range(0, n, 4)]
    hi = [word([b >> 8 for b in bits[i : i + 4]]) for i in range(0, n, 4)]
    return lo, hi


def _table8(bits: list[int]) -> str:
    """PTX loading an 8-entry table into tqa0, tqa1 (low bytes) and tqb0, tqb1 (high bytes)."""
    lo, hi = _byte_tables(bits, 8)
    return f"mov.b32 tqa0, {lo[0]}; mov.b32 tqa1, {lo[1]}; mov.b32 tqb0, {hi[0]}; mov.b32 tqb1, {hi[1]}; "


def prmt_asm(centroids: torch.Tensor) -> str:
    """Inline PTX turning 4 bytes of 4-bit code pairs into their 8 fp16 centroids: the 16 fp16
    centroids are split into low and high bytes held as immediates; ``prmt`` picks 4 bytes out of
    8 by 4 nibble selectors, so two ``prmt`` per byte half (entries 0-7 and 8-15, chosen by the
    code's bit 3 with ``lop3``) look up four codes at once, and two more assemble the fp16 pairs.
    Outputs: $0, $1 the low nibbles' centroids (fp16x2), $2, $3 the high nibbles'; input $4."""
    bits = _fp16_bits(centroids)
    assert len(bits) == 16
    lo, hi = _byte_tables(bits, 16)
    tables = lo + hi

    def half(src: str, o0: str, o1: str) -> str:
        return (
            f"and.b32 tqt, {src}, 0x07070707; shr.b32 tqx, tqt, 4; or.b32 tqx, tqx, tqt; prmt.b32 tqs, tqx, tqx, 0x0020; "
            "prmt.b32 tqr0, tqa0, tqa1, tqs; prmt.b32 tqr1, tqa2, tqa3, tqs; prmt.b32 tqh0, tqb0, tqb1, tqs; prmt.b32 tqh1, tqb2, tqb3, tqs; "
            f"and.b32 tqm, {src}, 0x08080808; shr.b32 tqm, tqm, 3; mul.lo.u32 tqm, tqm, 255; "
            "lop3.b32 tqrl, tqr1, tqr0, tqm, 0xE4; lop3.b32 tqrh, tqh1, tqh0, tqm, 0xE4; "
            f"prmt.b32 {o0}, tqrl, tqrh, 0x5140; prmt.b32 {o1}, tqrl, tqrh, 0x7362; "
        )

    movs = "".join(
        f"mov.b32 {n}, {v}; " for n, v in zip(["tqa0", "tqa1", "tqa2", "tqa3", "tqb0", "tqb1", "tqb2", "tqb3"], tables)
    )
    return (
        "{ .reg .b32 tqa0, tqa1, tqa2, tqa3, tqb0, tqb1, tqb2, tqb3, tqt, tqx, tqs, tqm, tqr0, tqr1, tqh0, tqh1, tqrl, tqrh, tqu; "
        + movs
        + half("$4", "$0", "$1")
        + "shr.b32 tqu, $4, 4; "
        + half("tqu", "$2", "$3")
        + "}"
    )


def prmt_asm3(centroids: torch.Tensor) -> str:
    """Inline PTX for 2- and 3-bit codes: input $2 holds four codes as ``prmt`` selector nibbles
    (built in the kernel from the 2-bit plane's byte and the 1-bit plane's bits); one ``prmt`` per
    byte half looks the four centroids up in the <= 8 entries held as immediates, two more
    assemble the fp16 pairs: $0 = codes 0 and 1, $1 = codes 2 and 3."""
    return (
        "{ .reg .b32 tqa0, tqa1, tqb0, tqb1, tqrl, tqrh; "
        + _table8(_fp16_bits(centroids))
        + "prmt.b32 tqrl, tqa0, tqa1, $2; prmt.b32 tqrh, tqb0, tqb1, $2; "
        "prmt.b32 $0, tqrl, tqrh, 0x5140; prmt.b32 $1, tqrl, tqrh, 0x7362; }"
    )


def prmt_asm16(centroids: torch.Tensor, w1: int) -> str:
    """Inline PTX for sixteen 2- or 3-bit codes: input $16 is a 32-bit word of the 2-bit plane (code t in bits
    2t, 2t + 1), $17 (3-bit codes, w1 = 1) a word whose low 16 bits are the 1-bit plane's (code t in bit t).
    The selector nibbles need no per-code work: word & 0x33333333 holds the even codes' two low bits in its
    eight nibbles and (word >> 2) & 0x33333333 the odd codes'; the 1-bit plane is spread to every other bit
    once (four shift + lop3 pairs) and merged into bit 2 of those nibbles.  Per four codes one ``prmt`` per
    byte half looks the centroids up in the <= 8 entries held as immediates and two more assemble fp16 pairs.
    Outputs $0..$15: the sixteen fp16 centroids in code order (16-bit registers)."""

    def four(sel: str, o0: str, o1: str) -> str:
        return (
            f"prmt.b32 tqrl, tqa0, tqa1, {sel}; prmt.b32 tqrh, tqb0, tqb1, {sel}; "
            f"prmt.b32 {o0}, tqrl, tqrh, 0x5140; prmt.b32 {o1}, tqrl, tqrh, 0x7362; "
        )

    spread = ""
    if w1:  # 1-bit plane: bit t -> bit 2t; then even codes take it at bit 4k + 2 via << 2, odd ones in place
        spread = "and.b32 tqm, $17, 0xFFFF; " + "".join(
            f"shl.b32 tqt, tqm, {sh}; lop3.b32 tqm, tqm, tqt, {mask}, 0xA8; "
            for sh, mask in ((8, "0x00FF00FF"), (4, "0x0F0F0F0F"), (2, "0x33333333"), (1, "0x55555555"))
        )
    sels = "and.b32 tqA, $16, 0x33333333; shr.b32 tqB, $16, 2; and.b32 tqB, tqB, 0x33333333; "
    if w1:
        sels += (
            "shl.b32 tqt, tqm, 2; lop3.b32 tqA, tqA, tqt, 0x44444444, 0xF8; lop3.b32 tqB, tqB, tqm, 0x44444444, 0xF8; "
        )
    look = (
        four("tqA", "tqo0", "tqo1")
        + "shr.b32 tqs, tqA, 16; "
        + four("tqs", "tqo2", "tqo3")
        + four("tqB", "tqo4", "tqo5")
        + "shr.b32 tqs, tqB, 16; "
        + four("tqs", "tqo6", "tqo7")
    )
    # tqo0..3 hold the even codes 0, 2, .., 14 in pairs, tqo4..7 the odd ones
    outs = "".join(f"mov.b32 {{${a}, ${a + 2}}}, tqo{i}; " for i, a in enumerate([0, 4, 8, 12, 1, 5, 9, 13]))
    return (
        "{ .reg .b32 tqa0, tqa1, tqb0, tqb1, tqm, tqt, tqA, tqB, tqs, tqrl, tqrh, "
        "tqo0, tqo1, tqo2, tqo3, tqo4, tqo5, tqo6, tqo7; "
        + _table8(_fp16_bits(centroids))
        + spread
        + sels
        + look
        + outs
        + "}"
    )


def symmetric_fp16(centroids: torch.Tensor) -> bool:
    """Whether a sorted codebook's fp16 centroids are odd-symmetric bit for bit (c[n-1-i] == -c[i]): the
    Lloyd-Max codebooks of the rotated coordinates are (their density is even), which ``prmt_asm4s`` needs."""
    bits = _fp16_bits(centroids)
    return all(b == bits[-1 - i] ^ 0x8000 for i, b in enumerate(bits))


def prmt_asm4s(centroids: torch.Tensor) -> str:
    """Inline PTX for 4-bit codes of an odd-symmetric codebook (``symmetric_fp16``), read as 32-bit words of
    eight codes (code t in nibble t): c[8 + m] = -c[7 - m], so code x looks up entry x & 7, or 7 - (x & 7)
    when bit 3 is set (one xor for all eight nibbles), in the 8-entry table c[0..7] held as immediates, and
    bit 3 flips the looked-up high byte's sign bit (bits 3 and 7 of each input byte brought to the bit 7s by
    one shift and one ``prmt``).  Per eight codes 17 ALU ops and one multiply, against 29 for ``prmt_asm``.
    Outputs $0..$7: the eight fp16 centroids in code order (16-bit registers); input $8."""
    bits = _fp16_bits(centroids)
    assert len(bits) == 16

    def four(sel: str, sgn: str, o0: str, o1: str) -> str:
        return (
            f"prmt.b32 tqrl, tqa0, tqa1, {sel}; prmt.b32 tqrh, tqb0, tqb1, {sel}; "
            f"prmt.b32 tqg, tqv, $8, {sgn}; lop3.b32 tqrh, tqrh, tqg, 0x80808080, 0x78; "
            f"prmt.b32 {o0}, tqrl, tqrh, 0x5140; prmt.b32 {o1}, tqrl, tqrh, 0x7362; "
        )

    return (
        "{ .reg .b32 tqa0, tqa1, tqb0, tqb1, tqs, tqx, tqxh, tqv, tqg, tqrl, tqrh, tqo0, tqo1, tqo2, tqo3; "
        + _table8(bits[:8])
        + "shr.b32 tqs, $8, 3; and.b32 tqs, tqs, 0x11111111; mul.lo.u32 tqs, tqs, 7; "
        "lop3.b32 tqx, $8, tqs, 0x77777777, 0x28; shl.b32 tqv, $8, 4; "
        + four("tqx", "0x5140", "tqo0", "tqo1")
        + "shr.b32 tqxh, tqx, 16; "
        + four("tqxh", "0x7362", "tqo2", "tqo3")
        + "mov.b32 {$0, $1}, tqo0; mov.b32 {$2, $3}, tqo1; mov.b32 {$4, $5}, tqo2; mov.b32 {$6, $7}, tqo3; }"
    )


_BOOKS: dict[tuple, tuple] = {}  # (data_ptr, device) -> (centroids, fp16 patterns, odd-symmetric, {asm key: PTX})


def _book(centroids: torch.Tensor) -> tuple:
    """A CUDA codebook's fp16 patterns, symmetry and built lookups, from one host read on its first (eager) use."""
    key = (centroids.data_ptr(), centroids.device)
    hit = _BOOKS.get(key)
    if hit is None or hit[0] is not centroids:
        bits = _fp16_bits(centroids)
        hit = _BOOKS[key] = (centroids, bits, symmetric_fp16(bits), {})
    return hit


def _prmt_for(centroids: torch.Tensor, bits: int, swar: bool = False) -> str:
    """The inline PTX lookup for a codebook on CUDA ('' elsewhere, or with SWIFTLM_TQ_PRMT=0: the
    select trees).  ``swar``: the form for words of codes (``prmt_asm16`` for 2- and 3-bit codes,
    ``prmt_asm4s`` for 4-bit codes of a symmetric codebook)."""
    if bits not in (2, 3, 4) or centroids.device.type != "cuda" or os.environ.get("SWIFTLM_TQ_PRMT", "1") == "0":
        return ""
    _, fp16, _, asms = _book(centroids)
    asm = asms.get((bits, swar))
    if asm is None:
        if bits == 4:
            asm = prmt_asm4s(fp16) if swar else prmt_asm(fp16)
        else:
            asm = prmt_asm16(fp16, bits - 2) if swar else prmt_asm3(fp16)
        asms[(bits, swar)] = asm
    return asm


def _swar_ok(planes: list[torch.Tensor], w0: int, w1: int, D: int, centroids: torch.Tensor | None = None) -> bool:
    """The word paths read the 2-bit plane as 32-bit and the 1-bit plane as 16-bit words, and 4-bit
    codes as 32-bit words: every row and head offset must be aligned to that
    (SWIFTLM_TQ_SWAR=0: the byte path).  4-bit words on CUDA also need an odd-symmetric codebook
    (``prmt_asm4s``)."""
    if w0 not in (2, 4) or D % 16 or os.environ.get("SWIFTLM_TQ_SWAR", "1") == "0":
        return False
    if w0 == 4 and centroids is not None and centroids.device.type == "cuda" and not _book(centroids)[2]:
        return False
    p0 = planes[0]
    ok = p0.data_ptr() % 4 == 0 and p0.stride(0) % 4 == 0 and p0.stride(1) % 4 == 0
    if w1:
        p1 = planes[1]
        ok = ok and p1.data_ptr() % 2 == 0 and p1.stride(0) % 2 == 0 and p1.stride(1) % 2 == 0
    return ok


# ------------------------------------------------------------------------------------ encode
# R (rows x KV heads) only bounds the mask and is not specialised: Triton would compile a kernel apart for R % 16 == 0,
# and whether the rows compressed at once are even or odd depends on the load.  Under a churn load on an H200 this
# kernel compiled twice after the start-up warm-up (2.5 and 3.6 s, the step waiting); R is the argument of it that
# varies with the load (the pointers are fresh or whole-row allocations)
@triton.jit(do_not_specialize=["R"])
def _tq_encode_kernel(
    x_ptr,
    rt_ptr,
    b_ptr,
    p0_ptr,
    p1_ptr,
    n_ptr,
    R,
    D: tl.constexpr,
    BR: tl.constexpr,
    NB: tl.constexpr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    KB: tl.constexpr,
):
    """Rows [BR, D]: norm, unit vector, rotation (u @ R^T), codes by counting boundaries below each
    coordinate, packed into one or two bit planes; fp16 norms.  The rotation runs over slabs of KB rows of
    R^T (a whole [D, D] R^T held by one program spilled its registers: 5 ms for 262K rows of 128 on an H100)."""
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    ok = r < R
    d = tl.arange(0, D)
    x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    inv = 1.0 / tl.where(norm > 0, norm, 1.0)
    k = tl.arange(0, KB)
    y = tl.zeros((BR, D), dtype=tl.float32)
    for k0 in tl.static_range(0, D, KB):
        xs = tl.load(x_ptr + r[:, None] * D + (k0 + k)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        rt = tl.load(rt_ptr + (k0 + k)[:, None] * D + d[None, :])  # R^T rows [k0, k0 + KB)
        y += tl.dot(xs * inv[:, None], rt, input_precision="ieee")
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


def tq_encode(
    x: torch.Tensor, rotation: torch.Tensor, boundaries: torch.Tensor, bits: int, block_rows: int = 32
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
    _tq_encode_kernel[grid](
        xf,
        rt,
        boundaries.float().contiguous(),
        p0,
        p1,
        norms,
        R,
        D=D,
        BR=block_rows,
        NB=boundaries.numel(),
        W0=w0,
        W1=w1,
        KB=min(D, 32),
    )
    planes = [p0.view(*shape, -1)] + ([p1.view(*shape, -1)] if w1 else [])
    return planes, norms.view(shape)
