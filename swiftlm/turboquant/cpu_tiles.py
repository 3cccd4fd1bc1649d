"""The building blocks of the CPU attention kernels (``cpu_attention``, ``cpu_merge``), numba only: the tile decode
through a code table, the vectorised exponential and the running-softmax update of a tile of scores, an affine row's
codes, ``_at`` (an address as a pointer: the batched kernels read each sequence's storage where it lies) and
``_compile`` (a specialised kernel, cached on disk).  Inlined into each specialised kernel."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

try:  # optional (the torch extra installs it): without it the backends run their own paths
    import numba as nb
except ImportError:  # pragma: no cover - exercised where numba is absent
    nb = None

_decode_tile = _exp_tile = _softmax_tile = _affine_row = _at = None  # numba present: the compiled helpers

# no NaN/Inf assumptions: the running max starts at -inf
_FM = {"reassoc", "contract", "arcp", "nsz", "afn"}
TILE = 64  # rows scored before their softmax update
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 split in two (Cody-Waite): k * _LN2_HI is exact for |k| < 2^9
_LN2_LO = np.float32(1.428606765330187e-06)


def _helpers():
    """The kernels' building blocks, generic in their size arguments: inlined into each
    specialised kernel, where those arguments are constants.  (Module-level rather than closures:
    numba's disk cache keys a kernel by what its closure captures, which must pickle the same in
    every process.)"""
    global _decode_tile, _exp_tile, _softmax_tile, _affine_row

    @nb.njit(inline="always", fastmath=_FM)
    def _decode_tile(tab, p0, p1, t0, cnt, T, bits, D):
        """Rows t0 .. t0 + cnt of packed planes into rows 0 .. cnt of the tile ``T`` [TILE, D / 2] (an int64
        view of the fp32 tile), through ``tab``, the int64 view of a code table (``wide_table``): an entry's
        values move as 8-byte words.  1/2/4 bits: one entry of 8/bits values per byte of plane 0; 3 bits: an
        entry of 4 values indexed by plane-0 byte * 16 + the nibble of plane 1 covering the same four codes
        (``kv_quant.byte_lut``).  A whole tile is decoded before the dot products read it: a row decoded and
        read at once would stall on the 8-byte stores under the wide loads."""
        if bits == 3:
            for jj in range(cnt):
                j = t0 + jj
                for k in range(D // 8):
                    hb = p1[j, k]
                    i0 = np.int64(p0[j, 2 * k]) * 16 + (hb & 15)
                    i1 = np.int64(p0[j, 2 * k + 1]) * 16 + (hb >> 4)
                    T[jj, 4 * k] = tab[i0, 0]
                    T[jj, 4 * k + 1] = tab[i0, 1]
                    T[jj, 4 * k + 2] = tab[i1, 0]
                    T[jj, 4 * k + 3] = tab[i1, 1]
        else:
            w = 4 // bits  # words per byte's entry
            for jj in range(cnt):
                j = t0 + jj
                for k in range(D * bits // 8):
                    i = p0[j, k]
                    for u in range(w):
                        T[jj, k * w + u] = tab[i, u]

    @nb.njit(inline="always", fastmath=_FM)
    def _exp_tile(x, cnt, E, Ef):
        """x[:cnt] (<= 0) -> exp(x) in place, in loops LLVM vectorises (numba's math.exp is a scalar call):
        exp(x) = 2^k e^r with k = round(x / ln 2), r = x - k ln 2 in [-ln2/2, ln2/2], e^r by its degree-6
        Taylor polynomial (truncation < 1.2e-7 relative), 2^k written as exponent bits into E (int32; Ef is its
        float32 view).  x below -87 is taken as -87 (e^-87 ~ 1.6e-38: nothing next to the tile's max of 1)."""
        for i in range(cnt):
            v = max(x[i], np.float32(-87.0))
            k = np.floor(v * _LOG2E + np.float32(0.5))
            E[i] = (np.int32(k) + 127) << 23
            r = v - k * _LN2_HI - k * _LN2_LO
            y = np.float32(1.0 / 720)
            y = y * r + np.float32(1.0 / 120)
            y = y * r + np.float32(1.0 / 24)
            y = y * r + np.float32(1.0 / 6)
            y = y * r + np.float32(0.5)
            y = y * r + np.float32(1.0)
            x[i] = y * r + np.float32(1.0)
        for i in range(cnt):
            x[i] *= Ef[i]

    @nb.njit(inline="always", fastmath=_FM)
    def _softmax_tile(sc, cnt, m, l, acc, M, D, E, Ef):
        """Scores sc [M, TILE] (first ``cnt``) -> probabilities against the running max m, with
        l and acc rescaled to the new max (E, Ef: ``_exp_tile``'s scratch)."""
        for t in range(M):
            bm = m[t]
            for jj in range(cnt):
                bm = max(bm, sc[t, jj])
            alpha = math.exp(m[t] - bm) if m[t] > -np.inf else np.float32(0.0)
            l[t] *= alpha
            for d in range(D):
                acc[t, d] *= alpha
            m[t] = bm
            row = sc[t]
            for jj in range(cnt):
                row[jj] -= bm
            _exp_tile(row, cnt, E, Ef)
            s = np.float32(0.0)
            for jj in range(cnt):
                s += row[jj]
            l[t] += s

    @nb.njit(inline="always", fastmath=_FM)
    def _affine_row(p, j, row, bits, D):
        if bits == 8:
            for d in range(D):
                row[d] = np.float32(p[j, d])
        else:
            for k in range(D // 2):
                b = p[j, k]
                row[2 * k] = np.float32(b & 15)
                row[2 * k + 1] = np.float32(b >> 4)


def _address():
    """``_at(addr, like)``: an int64 address as a pointer (for ``nb.carray``) to elements of ``like``'s type: an
    array (its dtype) or a numpy scalar type.  The batched kernels read each sequence's storage where it lies: the
    sequences' rows have different counts and capacities, so they are not one array."""
    global _at
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def _at(typingctx, addr, like):
        if not isinstance(addr, types.Integer):
            return None
        if isinstance(like, types.Array):
            dtype = like.dtype
        elif isinstance(like, types.NumberClass):
            dtype = like.instance_type
        else:
            return None
        ptr = types.CPointer(dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(addr, like), codegen


if nb is not None:
    _helpers()
    _address()


def _digest() -> str:
    """A digest of this module's and ``cpu_affine``'s source: numba's disk cache checks a kernel against its own
    source file only, not against the helpers it inlines from here."""
    from . import cpu_affine

    try:
        return hashlib.sha1(b"".join(Path(f).read_bytes() for f in (__file__, cpu_affine.__file__))).hexdigest()[:8]
    except OSError:  # pragma: no cover - no source files (a frozen install): nothing edits them either
        return ""


_DIGEST = _digest()


def _compile(fn, name: str, par: bool):
    """njit ``fn`` (a closure over its specialisation) with an on-disk cache.  numba keys its cache
    index by the function's qualified name, not by the values a closure captured: the name carries
    every captured constant, so each specialisation gets its own cache entry, and the helpers' digest (``_digest``),
    so that an edit of them compiles the kernels again."""
    fn.__qualname__ = fn.__name__ = f"kernel_{name}_{_DIGEST}" + ("" if par else "_serial")
    return nb.njit(parallel=par, fastmath=_FM, nogil=True, cache=True)(fn)
