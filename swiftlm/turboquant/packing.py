"""The packed-code layout: the one specification every backend's TurboQuant and ``kv_bits`` codes follow.

**Bit planes.**  A ``b``-bit code is stored as bit planes whose widths divide 8, so a code is never split
across bytes: 1 -> [1], 2 -> [2], 3 -> [2, 1] (the low two bits in a 2-bit plane, the high bit in a 1-bit
plane), 4 -> [4] (``PLANES``).  Each plane packs ``8 / width`` codes per byte, little-end first: coordinate
``i`` of a plane of width ``w`` is bits ``[(i % (8/w)) * w, (i % (8/w)) * w + w)`` of byte ``i // (8/w)``.
Storage is exactly ``b`` bits per code; ``d`` must be a multiple of 8.  ``pack`` / ``unpack`` below are the
reference; ``tests/test_packed_layout.py`` checks it against this text and each backend against it.

**One TurboQuant row** (one head's key or value at one position, ``d`` coordinates):

- codes: the MSE code of each coordinate of ``u R^T`` (``u = x / ||x||``, ``R`` the seeded rotation,
  rotation.py), the index of its bucket among the codebook's sorted boundaries (codebook.py; code ``c``
  decodes to ``centroids[c]``), in the planes above (``d * b / 8`` bytes);
- norm: ``||x||`` of the unrotated vector, fp16 (2 bytes; a zero vector has norm 0 and codes of ``u = 0``);
- keys of a QJL preset (``kXqjl-vY``) add the residual ``r = u - centroids[codes] R``: its signs, bit ``i``
  = 1 when ``(r S^T)_i >= 0`` (``S`` the seeded Gaussian matrix, quantizer.py), as one 1-bit plane
  (``d / 8`` bytes, the same bit order), and ``||r||`` in fp16 (2 bytes).  The key's MSE code then has
  ``X`` bits and the row ``X + 1`` bits per coordinate before the norms (``KVFormat.key_row_bytes``).

**One affine row** (``kv_bits``): per group of ``g`` coordinates an fp16 scale ``(max - min) / (2^b - 1)``
(1 for a constant group) and an fp16 bias ``min``, and the codes ``clamp(round((x - bias) / scale), 0,
2^b - 1)``: 4-bit codes in the planes above, 8-bit codes one byte each.

Backends keep codes, norms and signs in separate arrays (planes ``[..., d * w / 8]``, norms ``[...]``);
the kernels (numpy reference attention, numba on a CPU, Triton, Metal) read them in this layout.
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
