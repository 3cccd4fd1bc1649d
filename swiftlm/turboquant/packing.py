"""Bit packing that never splits a code across bytes.

A ``b``-bit code is stored as bit planes whose widths divide 8: 1 -> [1], 2 -> [2], 3 -> [2, 1]
(the low two bits in a 2-bit plane, the high bit in a 1-bit plane), 4 -> [4].  Each plane packs
``8 / width`` codes per byte, little-end first, so a kernel reads code ``i`` of a plane from byte
``i // (8 / width)`` at shift ``(i % (8 / width)) * width``.  Storage is exactly ``b`` bits per
code (``d`` must be a multiple of 8).
"""

from __future__ import annotations

import numpy as np

PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,)}


def pack(codes: np.ndarray, bits: int) -> list[np.ndarray]:
    """codes [..., d] uint8 < 2^bits -> one uint8 array [..., d * width / 8] per plane."""
    codes = np.asarray(codes, dtype=np.uint8)
    d = codes.shape[-1]
    if d % 8:
        raise ValueError("the packed dimension must be a multiple of 8")
    out, shift = [], 0
    for width in PLANES[bits]:
        per = 8 // width
        part = (codes >> shift) & ((1 << width) - 1)
        part = part.reshape(*codes.shape[:-1], d // per, per).astype(np.uint16)
        byte = np.zeros(part.shape[:-1], dtype=np.uint16)
        for j in range(per):
            byte |= part[..., j] << (j * width)
        out.append(byte.astype(np.uint8))
        shift += width
    return out


def unpack(planes: list[np.ndarray], bits: int, d: int) -> np.ndarray:
    codes, shift = None, 0
    for plane, width in zip(planes, PLANES[bits]):
        per = 8 // width
        parts = [(plane >> (j * width)) & ((1 << width) - 1) for j in range(per)]
        part = np.stack(parts, axis=-1).reshape(*plane.shape[:-1], d).astype(np.uint8)
        codes = part << shift if codes is None else codes | (part << shift)
        shift += width
    return codes


def packed_bytes(d: int, bits: int) -> int:
    return d * bits // 8
