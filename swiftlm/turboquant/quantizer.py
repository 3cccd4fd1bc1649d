"""TurboQuant vector quantizers (Zandieh et al., arXiv 2504.19874), in numpy.

``TurboQuantMSE``: store ``‖x‖`` (fp16); rotate ``x / ‖x‖`` with a seeded random rotation; quantize
each coordinate with the Lloyd-Max codebook of the post-rotation density at this head dim; the
reconstruction is ``‖x‖ · R^T c[idx]``.

``TurboQuantProd``: a (b-1)-bit MSE quantizer plus a 1-bit QJL sketch of the residual
``r = u - û`` (``u = x / ‖x‖``): ``sign(S r)`` with ``S`` a seeded Gaussian matrix (independent of the
rotation) and ``‖r‖`` (fp16).  ``<q, x>`` is estimated as
``‖x‖ (<q, û> + ‖r‖ √(π/2) / d · <S q, sign(S r)>)``, which is unbiased (E over S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .codebook import Codebook, lloyd_max
from .packing import pack, packed_bytes, unpack
from .rotation import Rotation


def _codebook(d: int, bits: int) -> Codebook:
    return lloyd_max(d, bits)


@dataclass
class MSEEncoded:
    norms: np.ndarray  # [n] float16
    planes: list[np.ndarray]  # packed codes (see packing)

    def nbytes(self) -> int:
        return self.norms.nbytes + sum(p.nbytes for p in self.planes)


@dataclass
class TurboQuantMSE:
    d: int
    bits: int
    seed: int = 0
    rotation: Rotation = field(init=False)
    codebook: Codebook = field(init=False)

    def __post_init__(self) -> None:
        self.rotation = Rotation(self.d, self.seed)
        self.codebook = _codebook(self.d, self.bits)

    def encode(self, x: np.ndarray) -> MSEEncoded:
        x = np.asarray(x, dtype=np.float64)
        norms = np.linalg.norm(x, axis=-1)
        u = x / np.where(norms > 0, norms, 1.0)[..., None]
        codes = self.codebook.quantize(self.rotation.forward(u))
        return MSEEncoded(norms.astype(np.float16), pack(codes, self.bits))

    def decode_unit(self, enc: MSEEncoded) -> np.ndarray:
        """The reconstructed unit directions, still in the rotated domain (what attention
        kernels score against after rotating the query once)."""
        return self.codebook.dequantize(unpack(enc.planes, self.bits, self.d))

    def decode(self, enc: MSEEncoded) -> np.ndarray:
        return self.rotation.inverse(self.decode_unit(enc)) * enc.norms.astype(np.float64)[..., None]

    def bytes_per_vector(self) -> int:
        return packed_bytes(self.d, self.bits) + 2


@dataclass
class ProdEncoded:
    mse: MSEEncoded
    signs: np.ndarray  # [n, d/8] uint8: the QJL sign bits, packed
    residual_norms: np.ndarray  # [n] float16

    def nbytes(self) -> int:
        return self.mse.nbytes() + self.signs.nbytes + self.residual_norms.nbytes


@dataclass
class TurboQuantProd:
    d: int
    bits: int  # total bits per coordinate: (bits - 1) for the MSE part, 1 for QJL
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bits < 2:
            raise ValueError("the prod variant needs at least 2 bits (1 MSE + 1 QJL)")
        self.mse = TurboQuantMSE(self.d, self.bits - 1, self.seed)
        rng = np.random.default_rng([self.seed, 0x0A1])  # independent of the rotation's seed stream
        self.S = rng.standard_normal((self.d, self.d))

    def encode(self, x: np.ndarray) -> ProdEncoded:
        x = np.asarray(x, dtype=np.float64)
        enc = self.mse.encode(x)
        norms = np.linalg.norm(x, axis=-1)
        u = x / np.where(norms > 0, norms, 1.0)[..., None]
        r = u - self.mse.rotation.inverse(self.mse.decode_unit(enc))
        bits = (r @ self.S.T >= 0).astype(np.uint8)
        return ProdEncoded(enc, pack(bits, 1)[0], np.linalg.norm(r, axis=-1).astype(np.float16))

    def inner(self, q: np.ndarray, enc: ProdEncoded) -> np.ndarray:
        """Unbiased estimates of <q, x> for each encoded x (q: [d] or [n, d])."""
        q = np.asarray(q, dtype=np.float64)
        u_hat = self.mse.rotation.inverse(self.mse.decode_unit(enc.mse))
        signs = unpack([enc.signs], 1, self.d).astype(np.float64) * 2 - 1
        qjl = (q @ self.S.T) * signs
        est = (q * u_hat).sum(-1) + enc.residual_norms.astype(np.float64) * math.sqrt(math.pi / 2) / self.d * qjl.sum(
            -1
        )
        return enc.mse.norms.astype(np.float64) * est

    def bytes_per_vector(self) -> int:
        return self.mse.bytes_per_vector() + self.d // 8 + 2
