"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

After a uniformly random rotation, each coordinate ``x`` of a unit vector in ``R^d`` has the
density ``f_d(x) = Γ(d/2) / (√π Γ((d-1)/2)) · (1 - x²)^((d-3)/2)`` on [-1, 1] (variance 1/d);
for large ``d`` it approaches N(0, 1/d).  The codebook with ``2^b`` levels minimising the mean
squared error for that density is found by Lloyd's iteration (boundaries at midpoints,
centroids at conditional means) on a fine grid.  ``d * mse`` is the expected squared error of
a whole unit vector, the figure TurboQuant reports (0.36, 0.117, 0.03, 0.009 for b = 1..4 in
the Gaussian limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

GRID = 1 << 16


@dataclass(frozen=True)
class Codebook:
    d: int | None  # None: the Gaussian limit (unit variance, scaled by 1/sqrt(d) at use)
    bits: int
    centroids: np.ndarray  # sorted, float64, 2^bits entries
    boundaries: np.ndarray  # 2^bits - 1 decision thresholds
    mse: float  # expected squared error per coordinate under the density

    @property
    def vector_mse(self) -> float:
        """Expected ||x - x̂||² for a unit vector (d coordinates)."""
        return self.mse if self.d is None else self.d * self.mse

    def quantize(self, x: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.boundaries, x).astype(np.uint8)

    def dequantize(self, idx: np.ndarray) -> np.ndarray:
        return self.centroids[idx]


def _density(d: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Grid points and normalised weights (probability mass per grid cell)."""
    if d is None:
        x = np.linspace(-8.0, 8.0, GRID)
        logf = -0.5 * x * x
    else:
        if d < 3:
            raise ValueError("head dims below 3 are not supported")
        x = np.linspace(-1.0, 1.0, GRID + 2)[1:-1]  # open interval: (1 - x²) > 0
        logf = 0.5 * (d - 3) * np.log1p(-x * x)
    w = np.exp(logf - logf.max())
    return x, w / w.sum()


@cache
def lloyd_max(d: int | None, bits: int, iters: int = 400) -> Codebook:
    """The MSE-optimal ``2^bits``-level codebook for a coordinate at head dim ``d`` (cached)."""
    if not 1 <= bits <= 8:
        raise ValueError("bits must be 1..8")
    x, w = _density(d)
    cdf = np.cumsum(w)
    k = 1 << bits
    c = np.interp((np.arange(k) + 0.5) / k, cdf, x)  # start from the quantiles
    wx = np.cumsum(w * x)
    for _ in range(iters):
        b = 0.5 * (c[1:] + c[:-1])
        cut = np.searchsorted(x, b)
        edges = np.concatenate([[0], cut, [len(x)]])
        mass = np.diff(np.concatenate([[0.0], cdf])[edges])
        first = np.diff(np.concatenate([[0.0], wx])[edges])
        new = np.where(mass > 0, first / np.maximum(mass, 1e-300), c)
        if np.max(np.abs(new - c)) < 1e-12:
            c = new
            break
        c = new
    # the density is even, so the optimum is odd-symmetric; the grid's cell edges leave a bias of about one grid
    # step (d = 128, 4 bits: c[i] + c[15 - i] ~ -6e-5) that is removed here.  Exact symmetry is what lets the
    # CUDA lookup of 4-bit codes use an 8-entry table and a sign flip (cuda_ext/tq_codes.prmt_asm4s).
    c = 0.5 * (c - c[::-1])
    b = 0.5 * (c[1:] + c[:-1])
    cut = np.searchsorted(x, b)
    edges = np.concatenate([[0], cut, [len(x)]])
    mse = 0.0
    for i in range(k):  # E[(x - c_i)²] over cell i
        lo, hi = edges[i], edges[i + 1]
        ww, xx = w[lo:hi], x[lo:hi]
        mse += float(np.sum(ww * (xx - c[i]) ** 2))
    return Codebook(d, bits, c, b, mse)


def scaled(cb: Codebook, d: int) -> Codebook:
    """A Gaussian-limit codebook scaled to coordinates of variance 1/d."""
    if cb.d is not None:
        return cb
    s = 1.0 / math.sqrt(d)
    return Codebook(d, cb.bits, cb.centroids * s, cb.boundaries * s, cb.mse / d)
