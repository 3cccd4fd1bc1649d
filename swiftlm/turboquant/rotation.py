"""Seeded random rotations.

Power-of-two head dims use a randomised Walsh-Hadamard transform ``x -> H · D · x / √d`` (D a
random ±1 diagonal; O(d log d), what kernels implement).  Other head dims (e.g. 80, 96) use a
dense Haar-random orthogonal matrix from the QR decomposition of a seeded Gaussian matrix: a
Hadamard matrix does not exist at those sizes, and padding to the next power of two would
change the coordinate distribution the codebooks are built for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised fast Walsh-Hadamard transform over the last axis (power-of-two length)."""
    x = np.array(x, dtype=np.float64, copy=True)
    n = x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        x = y.reshape(*x.shape[:-1], n)
        h *= 2
    return x


@dataclass
class Rotation:
    d: int
    seed: int

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, 0x7055])
        self.hadamard = _is_pow2(self.d)
        if self.hadamard:
            self.signs = rng.choice([-1.0, 1.0], size=self.d)
            self.matrix = hadamard(self.d) * self.signs[None, :] / np.sqrt(self.d)  # H·D/√d
        else:
            q, r = np.linalg.qr(rng.standard_normal((self.d, self.d)))
            self.matrix = q * np.sign(np.diag(r))[None, :]  # Haar-distributed

    def forward(self, x: np.ndarray) -> np.ndarray:
        if self.hadamard:
            return fwht(x * self.signs) / np.sqrt(self.d)
        return x @ self.matrix.T

    def inverse(self, y: np.ndarray) -> np.ndarray:
        if self.hadamard:
            return fwht(y) / np.sqrt(self.d) * self.signs
        return y @ self.matrix
