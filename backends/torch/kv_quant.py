"""Quantizers for compressed KV caches (torch): TurboQuant codes and affine groups.

``TurboCodec``: the torch twin of ``swiftlm.turboquant`` (same rotation matrix, codebook and bit
planes, so its codes equal the numpy reference's).  ``AffineCodec``: MLX-style group quantization
(scale and bias per ``group`` coordinates, 4 or 8 bits), the ``kv_bits`` cache.

Both decode a block of rows at a time; attention never holds more than one block of decoded
history (``online_attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

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
        weights = torch.tensor([1 << (j * width) for j in range(per)], dtype=torch.int32, device=codes.device)
        out.append((part * weights).sum(-1).to(torch.uint8))
        shift += width
    return out


def unpack(planes: list[torch.Tensor], bits: int, d: int) -> torch.Tensor:
    """uint8 planes -> codes [..., d] (int64, ready for indexing)."""
    codes, shift = None, 0
    for plane, width in zip(planes, PLANES[bits]):
        per = 8 // width
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
        lo_codes = (lo[:, None] >> (2 * sh)) & 3                   # [256, 4]
        hi_codes = (hi[:, None] >> sh) & 1                        # [16, 4]
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
        nib = torch.stack([p1 & 15, p1 >> 4], dim=-1)                       # [..., d/8, 2]
        idx = p0.long().view(*p0.shape[:-1], d // 8, 2) * 16 + nib
    else:
        idx = p0.long()
    out = torch.nn.functional.embedding(idx.reshape(-1), lut)
    return out.view(*p0.shape[:-1], d)


@dataclass
class Encoded:
    planes: list[torch.Tensor]
    norms: torch.Tensor                 # fp16
    signs: torch.Tensor | None = None   # QJL: packed sign bits [..., d/8]
    rnorms: torch.Tensor | None = None  # QJL: fp16 residual norms


class TurboCodec:
    """TurboQuant-mse (or -prod with ``qjl``) for head dim ``d`` on ``device``."""

    def __init__(self, d: int, bits: int, seed: int, device: torch.device, qjl: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.d, self.bits, self.qjl, self.dtype = d, bits, qjl, dtype
        self.mse_bits = bits - 1 if qjl else bits
        ref = TurboQuantProd(d, bits, seed) if qjl else TurboQuantMSE(d, bits, seed)
        mse = ref.mse if qjl else ref
        self.R = torch.tensor(mse.rotation.matrix, dtype=dtype, device=device)   # forward: x @ R^T
        self.centroids = torch.tensor(mse.codebook.centroids, dtype=dtype, device=device)
        self.boundaries = torch.tensor(mse.codebook.boundaries, dtype=dtype, device=device)
        self.S = torch.tensor(ref.S, dtype=dtype, device=device) if qjl else None
        self.qjl_scale = math.sqrt(math.pi / 2) / d
        self.lut = byte_lut(self.centroids, self.mse_bits)
        self.use_triton = False  # the fused encode kernel (cuda_ext), switched on by the cache on CUDA

    def encode(self, x: torch.Tensor) -> Encoded:
        if self.use_triton and not self.qjl:
            from swiftlm.cuda_ext.turboquant_kernels import tq_encode

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

    def encode(self, x: torch.Tensor) -> Encoded:
        g = x.to(self.dtype).reshape(*x.shape[:-1], self.d // self.group, self.group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = torch.where(hi > lo, (hi - lo) / (2 ** self.bits - 1), torch.ones_like(hi)).to(torch.float16)
        bias = lo.to(torch.float16)
        q = torch.clamp(torch.round((g - bias.to(self.dtype)) / scale.to(self.dtype)), 0, 2 ** self.bits - 1)
        codes = q.reshape(*x.shape[:-1], self.d).to(torch.int32)
        planes = [codes.to(torch.uint8)] if self.bits == 8 else pack(codes, self.bits)
        return Encoded(planes, scale.squeeze(-1), bias.squeeze(-1))  # norms=scale, signs=bias

    def decode_planes(self, planes: list[torch.Tensor], scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q = planes[0].long() if self.bits == 8 else unpack(planes, self.bits, self.d)
        g = q.to(self.dtype).reshape(*q.shape[:-1], self.d // self.group, self.group)
        return (g * scale.to(self.dtype).unsqueeze(-1) + bias.to(self.dtype).unsqueeze(-1)).reshape(q.shape)

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.decode_planes(enc.planes, enc.norms, enc.signs)


def online_attention(blocks: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]]
                     ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Softmax over all blocks' scores, accumulated one block at a time (flash-decoding style).

    Each block is (scores [G, M, n], already scaled; values [G, n, D]; mask [.., M, n] or None;
    domain).  Values of domain 1 are in the rotated TurboQuant domain: their weighted sums are kept
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
        part = p @ v.float()
        acc[dom] = acc[dom] + part if dom in acc else part
        l = p.sum(-1, keepdim=True) if l is None else l + p.sum(-1, keepdim=True)
        m = m_new
    return acc, l
