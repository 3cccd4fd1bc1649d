"""Quantizers for compressed KV caches (torch): TurboQuant codes and affine groups.

``TurboCodec``: the torch twin of ``swiftlm.turboquant`` (same rotation matrix, codebook and bit
planes, so its codes equal the numpy reference's).  ``AffineCodec``: MLX-style group quantization
(scale and bias per ``group`` coordinates, 4 or 8 bits), the ``kv_bits`` cache.

Both decode a block of rows at a time; attention never holds more than one block of decoded
history (``online_attention``).  The rows are decoded by one gather per packed byte (or per 12-bit
group for 3-bit codes) from a table whose entries are whole groups of centroids, read as one wide
element each (``wide_table``), into a reused per-thread buffer (``workspace``): on CPU that is what
makes a compressed row cheaper to read than a 16-bit one.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swiftlm.turboquant import TurboQuantMSE, TurboQuantProd
from swiftlm.turboquant.packing import PLANES


def pack(codes: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """codes [..., d] (integer < 2^bits) -> uint8 planes (``swiftlm.turboquant.packing`` layout)."""
    codes = codes.to(torch.int32)
    d = codes.shape[-1]
    out, shift = [], 0
    for width in PLANES[bits]:
        per = 8 // width
        part = ((codes >> shift) & ((1 << width) - 1)).view(*codes.shape[:-1], d // per, per)
        # made on the device (no host copy: encoding runs inside CUDA-graph captures of compression)
        weights = torch.bitwise_left_shift(
            torch.ones(per, dtype=torch.int32, device=codes.device),
            torch.arange(per, dtype=torch.int32, device=codes.device) * width,
        )
        out.append((part * weights).sum(-1).to(torch.uint8))
        shift += width
    return out


def unpack(planes: list[torch.Tensor], bits: int, d: int) -> torch.Tensor:
    """uint8 planes -> codes [..., d] (int64, ready for indexing)."""
    codes, shift = None, 0
    for plane, width in zip(planes, PLANES[bits]):
        sh = torch.arange(0, 8, width, dtype=torch.int32, device=plane.device)
        part = ((plane.to(torch.int32).unsqueeze(-1) >> sh) & ((1 << width) - 1)).reshape(*plane.shape[:-1], d)
        codes = part << shift if codes is None else codes | (part << shift)
        shift += width
    return codes.long()


def byte_lut(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Table from packed bytes to the values of the codes they hold.  1/2/4 bits: [256, 8/bits]
    (one plane byte).  3 bits: [4096, 4]: index = byte of the 2-bit plane * 16 + the nibble of the
    1-bit plane covering the same four codes."""
    dev = values.device
    if bits == 3:
        lo = torch.arange(256, device=dev)
        hi = torch.arange(16, device=dev)
        sh = torch.arange(4, device=dev)
        lo_codes = (lo[:, None] >> (2 * sh)) & 3  # [256, 4]
        hi_codes = (hi[:, None] >> sh) & 1  # [16, 4]
        codes = lo_codes[:, None, :] | (hi_codes[None, :, :] << 2)  # [256, 16, 4]
        return values[codes.reshape(4096, 4)]
    per = 8 // bits
    b = torch.arange(256, device=dev)
    codes = (b[:, None] >> (bits * torch.arange(per, device=dev))) & ((1 << bits) - 1)
    return values[codes]


def lut_decode(lut: torch.Tensor, planes: list[torch.Tensor], bits: int, d: int) -> torch.Tensor:
    p0 = planes[0]
    if bits == 3:
        p1 = planes[1].long()
        nib = torch.stack([p1 & 15, p1 >> 4], dim=-1)  # [..., d/8, 2]
        idx = p0.long().view(*p0.shape[:-1], d // 8, 2) * 16 + nib
    else:
        idx = p0.long()
    out = torch.nn.functional.embedding(idx.reshape(-1), lut)
    return out.view(*p0.shape[:-1], d)


_WIDE = {4: torch.float32, 8: torch.float64, 16: torch.complex128}
_ws = threading.local()


def workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat scratch tensor of at least ``numel`` elements, reused across calls of this thread (a
    fresh multi-MB allocation per step costs page faults that are a sizeable part of a decode step)."""
    bufs = _ws.__dict__.setdefault("bufs", {})
    key = (name, dtype, device)
    t = bufs.get(key)
    if t is None or t.numel() < numel:
        # a normal tensor even when first asked for under inference_mode: an inference tensor could not
        # be written in place by a later call outside it (a test, an eval script)
        with torch.inference_mode(False):
            t = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return t[:numel]


def wide_table(lut: torch.Tensor) -> torch.Tensor:
    """``lut`` [E, w] as a 1-D table of E elements of w values each (float64 / complex128 reinterpreting
    2 / 4 float32 values), so that one ``index_select`` element copies a whole entry; [E, w] itself when
    no dtype has that width."""
    lut = lut.contiguous()
    dt = _WIDE.get(lut.shape[1] * lut.element_size())
    return lut.view(dt).view(-1) if dt is not None else lut


def lut_index(planes: list[torch.Tensor], bits: int, s: int, e: int, out: torch.Tensor) -> torch.Tensor:
    """int32 rows of ``byte_lut`` for rows [s, e) of planes [G, cap, bytes], written into ``out``:
    the plane byte itself (1/2/4 bits), or for 3 bits 2-bit byte * 16 + the nibble of the 1-bit plane
    covering the same four codes (built in int16: the 1-bit byte k's two nibbles are spread into
    the two bytes of an int16, which read as bytes line up with 2-bit bytes 2k and 2k + 1).
    Returns [G, e - s, entries per row]."""
    p0 = planes[0][:, s:e]
    if bits != 3:
        return out.view(p0.shape).copy_(p0)
    if sys.byteorder != "little":
        idx = out.view(*p0.shape[:-1], -1, 2).copy_(p0.view(*p0.shape[:-1], -1, 2)).mul_(16)
        idx[..., 0].add_(planes[1][:, s:e] & 15)
        idx[..., 1].add_(planes[1][:, s:e] >> 4)
        return idx.view(p0.shape)
    x = planes[1][:, s:e].to(torch.int16)
    nib = ((x & 15) | ((x & 240) << 4)).view(torch.uint8)
    return out.view(p0.shape).copy_(p0.to(torch.int16).mul_(16).add_(nib))


def gather_rows(table: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, d: int) -> torch.Tensor:
    """Entries ``idx`` [G, n, k] of a ``wide_table`` into float buffer ``out``: returns [G, n, d]."""
    G, n = idx.shape[:2]
    flat = idx.reshape(-1)
    if table.dim() == 1:
        torch.index_select(table, 0, flat, out=out.view(table.dtype)[: flat.numel()])
    else:
        torch.index_select(table, 0, flat, out=out.view(flat.numel(), table.shape[1]))
    return out.view(G, n, d)


@dataclass
class Encoded:
    planes: list[torch.Tensor]
    norms: torch.Tensor  # fp16
    signs: torch.Tensor | None = None  # QJL: packed sign bits [..., d/8]
    rnorms: torch.Tensor | None = None  # QJL: fp16 residual norms


class TurboCodec:
    """TurboQuant-mse (or -prod with ``qjl``) for head dim ``d`` on ``device``."""

    def __init__(
        self, d: int, bits: int, seed: int, device: torch.device, qjl: bool = False, dtype: torch.dtype = torch.float32
    ):
        self.d, self.bits, self.qjl, self.dtype = d, bits, qjl, dtype
        self.mse_bits = bits - 1 if qjl else bits
        ref = TurboQuantProd(d, bits, seed) if qjl else TurboQuantMSE(d, bits, seed)
        mse = ref.mse if qjl else ref
        self.R = torch.tensor(mse.rotation.matrix, dtype=dtype, device=device)  # forward: x @ R^T
        self.centroids = torch.tensor(mse.codebook.centroids, dtype=dtype, device=device)
        self.boundaries = torch.tensor(mse.codebook.boundaries, dtype=dtype, device=device)
        self.S = torch.tensor(ref.S, dtype=dtype, device=device) if qjl else None
        self.qjl_scale = math.sqrt(math.pi / 2) / d
        self.lut = byte_lut(self.centroids, self.mse_bits)
        self.table = wide_table(self.lut)
        if qjl:  # sign bits as ±1: entry b = the low four signs of byte b, entry 256 + b its high four
            signs = byte_lut(torch.tensor([-1.0, 1.0], dtype=dtype, device=device), 1)
            self.sign_table = wide_table(torch.cat([signs[:, :4], signs[:, 4:]]))
            # ``sign_rows`` order: the low four signs of each byte, then the high four
            order = torch.tensor([8 * k + 4 * h + t for h in (0, 1) for k in range(d // 8) for t in range(4)])
            self.S_rows = self.S[order.to(device)].contiguous()
        self.use_triton = False  # the fused encode kernel (cuda_ext), switched on by the cache on CUDA

    def encode(self, x: torch.Tensor) -> Encoded:
        if self.use_triton and not self.qjl:
            from swiftlm.cuda_ext.tq_codes import tq_encode

            planes, norms = tq_encode(x, self.R, self.boundaries, self.mse_bits)
            return Encoded(planes, norms)
        x = x.to(self.dtype)
        norms = torch.linalg.vector_norm(x, dim=-1)
        u = x / torch.where(norms > 0, norms, torch.ones_like(norms)).unsqueeze(-1)
        codes = torch.bucketize(u @ self.R.T, self.boundaries)
        enc = Encoded(pack(codes, self.mse_bits), norms.to(torch.float16))
        if self.qjl:
            r = u - self.centroids[codes] @ self.R
            enc.signs = pack((r @ self.S.T >= 0).to(torch.int32), 1)[0]
            enc.rnorms = torch.linalg.vector_norm(r, dim=-1).to(torch.float16)
        return enc

    def unit(self, planes: list[torch.Tensor]) -> torch.Tensor:
        """Centroids [..., d] in the rotated domain, looked up a byte at a time (``byte_lut``)."""
        return lut_decode(self.lut, planes, self.mse_bits, self.d)

    def unit_rows(self, planes: list[torch.Tensor], s: int, e: int) -> torch.Tensor:
        """``unit`` of rows [s, e) of code storage [G, cap, bytes]: [G, e - s, d] fp32 in a workspace
        buffer (valid until the next call of this thread)."""
        G, n, dev = planes[0].shape[0], e - s, planes[0].device
        per = 4 if self.mse_bits == 3 else 8 // self.mse_bits  # codes per table entry
        idx = lut_index(planes, self.mse_bits, s, e, workspace("idx", G * n * self.d // per, torch.int32, dev))
        return gather_rows(self.table, idx, workspace("unit", G * n * self.d, self.dtype, dev), self.d)

    def sign_rows(self, signs: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """QJL signs of rows [s, e) as ±1 [G, e - s, d] fp32, coordinates in the order of ``S_rows``
        (workspace buffer, like ``unit_rows``)."""
        p = signs[:, s:e]
        G, n, nb = p.shape
        idx = workspace("idx", G * n * 2 * nb, torch.int32, p.device).view(G, n, 2, nb)
        idx.copy_(p.unsqueeze(2).expand(G, n, 2, nb))
        idx[:, :, 1].add_(256)
        return gather_rows(self.sign_table, idx, workspace("signs", G * n * self.d, self.dtype, p.device), self.d)

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Reconstructed vectors (for tests; attention never calls this on the history).  For a
        QJL key this is the vector whose inner products equal the estimator's."""
        u = self.unit(enc.planes) @ self.R
        if self.qjl:
            s = unpack([enc.signs], 1, self.d).to(self.dtype) * 2 - 1
            u = u + (enc.rnorms.to(self.dtype) * self.qjl_scale).unsqueeze(-1) * (s @ self.S)
        return u * enc.norms.to(self.dtype).unsqueeze(-1)


class AffineCodec:
    """Affine group quantization along the head dim: ``x ≈ q * scale + bias`` per group."""

    def __init__(self, d: int, bits: int, group: int, dtype: torch.dtype = torch.float32):
        from swiftlm.turboquant.presets import effective_group

        group = effective_group(d, group) or math.gcd(d, group)  # same choice as MLX where MLX can
        self.d, self.bits, self.group, self.dtype = d, bits, group, dtype
        # ``code_rows`` order: 4 bits: per group the codes of its low nibbles, then of its high ones
        self.order = self.inverse = None
        if bits == 4:
            half = group // 2
            self.order = torch.tensor(
                [g * group + 2 * i + h for g in range(d // group) for h in (0, 1) for i in range(half)]
            )
            self.inverse = torch.argsort(self.order)

    def encode(self, x: torch.Tensor) -> Encoded:
        g = x.to(self.dtype).reshape(*x.shape[:-1], self.d // self.group, self.group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = torch.where(hi > lo, (hi - lo) / (2**self.bits - 1), torch.ones_like(hi)).to(torch.float16)
        bias = lo.to(torch.float16)
        q = torch.clamp(torch.round((g - bias.to(self.dtype)) / scale.to(self.dtype)), 0, 2**self.bits - 1)
        codes = q.reshape(*x.shape[:-1], self.d).to(torch.int32)
        planes = [codes.to(torch.uint8)] if self.bits == 8 else pack(codes, self.bits)
        return Encoded(planes, scale.squeeze(-1), bias.squeeze(-1))  # norms=scale, signs=bias

    def decode_planes(self, planes: list[torch.Tensor], scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q = planes[0].long() if self.bits == 8 else unpack(planes, self.bits, self.d)
        g = q.to(self.dtype).reshape(*q.shape[:-1], self.d // self.group, self.group)
        return (g * scale.to(self.dtype).unsqueeze(-1) + bias.to(self.dtype).unsqueeze(-1)).reshape(q.shape)

    def code_rows(self, planes: list[torch.Tensor], s: int, e: int) -> torch.Tensor:
        """The integer codes of rows [s, e) as fp32 [G, e - s, d], coordinates in ``order`` (None:
        natural; 4 bits: each group's low nibbles, codes 0, 2, 4, .., then its high ones), in a
        workspace buffer valid until the next call of this thread."""
        p = planes[0][:, s:e]
        G, n = p.shape[0], e - s
        out = workspace("codes", G * n * self.d, self.dtype, p.device)
        if self.bits == 8:
            return out.view(G, n, self.d).copy_(p)
        groups, half = self.d // self.group, self.group // 2
        o = out.view(G, n, groups, 2, half)
        o[:, :, :, 0].copy_((p & 15).view(G, n, groups, half))
        o[:, :, :, 1].copy_((p >> 4).view(G, n, groups, half))
        return out.view(G, n, self.d)

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.decode_planes(enc.planes, enc.norms, enc.signs)


def online_attention(
    blocks: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]],
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Softmax over all blocks' scores, accumulated one block at a time (flash-decoding style).

    Each block is (scores [G, M, n], already scaled; values [G, n, D], or a function of the block's
    unnormalised probabilities [G, M, n] returning Σ p v [G, M, D]; mask [.., M, n] or None; domain).  Values of domain 1 are in the rotated TurboQuant domain: their weighted sums are kept
    apart so the caller rotates that sum back once.  Returns ({domain: Σ p v} [G, M, D], Σ p [G, M, 1]),
    both fp32 and not yet normalised."""
    m = l = None
    acc: dict[int, torch.Tensor] = {}
    for s, v, mask, dom in blocks:
        s = s.float()
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        bm = s.amax(-1, keepdim=True)
        m_new = bm if m is None else torch.maximum(m, bm)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe)
        if m is not None:
            alpha = torch.exp(m - m_safe)
            l = l * alpha
            for k in acc:
                acc[k] = acc[k] * alpha
        part = v(p) if callable(v) else p @ v.float()
        acc[dom] = acc[dom] + part if dom in acc else part
        l = p.sum(-1, keepdim=True) if l is None else l + p.sum(-1, keepdim=True)
        m = m_new
    return acc, l
