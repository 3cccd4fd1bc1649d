"""Compressed-KV decode attention on the CPU, compiled with numba (numpy + numba only).

Shared by both backends: ``backends/torch/cpu_kernels.py``, ``backends/mlx/turbo_cache.py`` and
``backends/mlx/affine_cpu.py`` (``kv_bits``) are the glue that hands their arrays over as numpy
views.  A block-wise path that decodes compressed rows into a full-width fp32 buffer with a table
gather, then multiplies it with the queries, writes every compressed row out at full width and reads
it back: it costs more memory traffic than the fp32 row it replaces.  These kernels never leave more
than one tile of decoded rows in memory: per tile of TILE rows they expand the codes through a small
per-byte table into a buffer that stays in L1, take the dot products with the query heads of its KV
head, update a running softmax (flash-decoding: each task owns one span of rows of one KV head and
returns its max, denominator and unnormalised value sum; the exponentials in vectorised loops,
``_exp_tile``) and add the rows' weighted values.  TurboQuant values are summed in the
rotated domain and rotated back once by the caller; affine (``kv_bits``) values in the original
domain.

Layout (``swiftlm.turboquant.packing``; both backends' caches write the same bytes): row-major bit
planes [KVH, cap, D * width / 8] uint8, QJL sign bytes [KVH, cap, D / 8] (bit t of byte k is
coordinate 8k + t), the code tables of ``byte_lut``; norms and residual norms as fp32 [KVH, >=n]
(the caches hold fp16: the glue passes fp32 copies of the first n; affine scales and biases may also come
as the fp16 storage itself, ``cpu_affine``).

Each kernel is specialised (head dim, query heads per KV head, code widths) when first used and
compiled by numba (a few seconds, cached on disk where the package directory is writable; without numba's parallel
loops where the kernels run on one thread, ``parallel``); without
numba, or with ``SWIFTLM_NUMBA=0``, ``enabled()`` is False and the backends run their own path.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading

import numpy as np

from .cpu_affine import _f32

log = logging.getLogger(__name__)

try:  # optional (the torch extra installs it): without it the backends run their own paths
    import numba as nb
except ImportError:  # pragma: no cover - exercised where numba is absent
    nb = None

# no NaN/Inf assumptions: the running max starts at -inf
_FM = {"reassoc", "contract", "arcp", "nsz", "afn"}
TILE = 64  # rows scored before their softmax update
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 split in two (Cody-Waite): k * _LN2_HI is exact for |k| < 2^9
_LN2_LO = np.float32(1.428606765330187e-06)
MIN_SPAN = 512  # rows per task at least
# one kernel at a time per process: numba's thread pool (workqueue/omp layers) does not take
# concurrent launches from two threads (two engines, e.g. two models served at once)
_LOCK = threading.Lock()


def enabled() -> bool:
    return nb is not None and os.environ.get("SWIFTLM_NUMBA", "1") != "0"


# numba threads a kernel runs on: numba's own count unless a backend sets one (``use_threads``)
_THREADS = [0]


def use_threads(n: int) -> None:
    """Run the kernels on ``n`` threads (the torch backend: torch's own count, on the OpenMP pool they share)."""
    _THREADS[0] = max(1, n)


_OMP = os.environ.get("OMP_NUM_THREADS", "")
_ENV_THREADS = int(_OMP) if _OMP.isdigit() else 0  # read once: threads() runs before every kernel launch


def threads() -> int:
    """Threads the kernels run on: ``use_threads``'s count, else OMP_NUM_THREADS, else numba's whole pool."""
    if nb is None:
        return 1
    want = _THREADS[0] or _ENV_THREADS or nb.config.NUMBA_NUM_THREADS
    return max(1, min(want, nb.config.NUMBA_NUM_THREADS))


def parallel() -> bool:
    """Whether the kernels are compiled with numba's parallel loops: not when they run on one thread (a parallel
    k4v3 kernel took ~11 s to compile against ~7 on the 2-core CI machine, and runs no faster on one thread).  Both compute each task alike; with fastmath LLVM may order a sum differently in each, so
    their outputs agree to fp32 rounding, not always bit for bit."""
    return threads() > 1


def _launch_threads() -> int:
    """The thread count for a kernel launched from this thread, set to ``threads()`` (numba keeps a count per
    calling thread, its full pool by default).  Called under _LOCK before each launch."""
    n = nb.get_num_threads()
    want = threads()
    if want != n:
        nb.set_num_threads(want)
    return want


def splits(n: int, kv_heads: int) -> int:
    """Tasks per KV head: enough for every thread, no task shorter than MIN_SPAN rows."""
    want = -(-4 * threads() // kv_heads)
    return max(1, min(want, -(-n // MIN_SPAN)))


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


if nb is not None:
    _helpers()


@functools.cache
def turbo_kernel(D: int, M: int, kbits: int, vbits: int, qjl: bool, par: bool):
    """Split-K attention over TurboQuant codes for M query heads per KV head (see module doc); ``par``: with
    numba's parallel loops over the tasks (``parallel()``).

    Arguments: qr [KVH, M, D] rotated, scaled queries; st [KVH, D/8, 256, M]: Σ over the eight
    signs of a byte of (scaled S q) * sign, per sign byte position, byte value and query head (QJL;
    unused otherwise); qjl_scale; ktab, kp0, kp1 key table (``wide_table``) / planes; kn [KVH, >=n] key norms, fp32
    or the uint16 bits of fp16 (read through ``_f32``, as kr and vn); ks [KVH, cap, D/8] sign bytes, kr [KVH, >=n]
    residual norms (QJL); vtab, vp0,
    vp1, vn the values'; n rows; S tasks per KV head; outputs m, l [KVH, S, M], acc [KVH, S, M, D]."""
    nsb = D // 8

    def kernel(qr, st, qjl_scale, ktab, kp0, kp1, kn, ks, kr, vtab, vp0, vp1, vn, n, S, m_out, l_out, acc_out):
        KVH = qr.shape[0]
        span = (n + S - 1) // S
        for task in nb.prange(KVH * S):
            h, s = task // S, task % S
            lo, hi = s * span, min(n, (s + 1) * span)
            m = np.full(M, -np.inf, dtype=np.float32)
            l = np.zeros(M, dtype=np.float32)
            acc = np.zeros((M, D), dtype=np.float32)
            kt = np.zeros((TILE, D), dtype=np.float32)
            vt = np.zeros((TILE, D), dtype=np.float32)
            kt64 = kt.reshape(TILE * D).view(np.int64).reshape(TILE, D // 2)
            vt64 = vt.reshape(TILE * D).view(np.int64).reshape(TILE, D // 2)
            sg = np.empty(M, dtype=np.float32)
            sc = np.empty((M, TILE), dtype=np.float32)
            E = np.zeros(TILE, dtype=np.int32)
            Ef = E.view(np.float32)
            q, kp0h, kp1h, vp0h, vp1h = qr[h], kp0[h], kp1[h], vp0[h], vp1[h]
            for t0 in range(lo, hi, TILE):
                cnt = min(hi, t0 + TILE) - t0
                _decode_tile(ktab, kp0h, kp1h, t0, cnt, kt64, kbits, D)
                _decode_tile(vtab, vp0h, vp1h, t0, cnt, vt64, vbits, D)
                for jj in range(cnt):
                    j = t0 + jj
                    if qjl:  # Σ_d (S q)_d sign_d, a table entry per sign byte and query head
                        for t in range(M):
                            sg[t] = 0.0
                        for k in range(nsb):
                            b = ks[h, j, k]
                            for t in range(M):
                                sg[t] += st[h, k, b, t]
                        w = qjl_scale * _f32(kr[h, j])
                    for t in range(M):
                        x = np.float32(0.0)
                        for d in range(D):
                            x += q[t, d] * kt[jj, d]
                        if qjl:
                            x += w * sg[t]
                        sc[t, jj] = x * _f32(kn[h, j])
                _softmax_tile(sc, cnt, m, l, acc, M, D, E, Ef)
                for jj in range(cnt):
                    nj = _f32(vn[h, t0 + jj])
                    for t in range(M):
                        w = sc[t, jj] * nj
                        for d in range(D):
                            acc[t, d] += w * vt[jj, d]
            m_out[h, s] = m
            l_out[h, s] = l
            acc_out[h, s] = acc

    return _compile(kernel, f"turbo_d{D}_m{M}_k{kbits}{'q' if qjl else ''}_v{vbits}", par)


@functools.cache
def affine_kernel(D: int, M: int, bits: int, group: int, par: bool):
    """Split-K attention over affine codes (``kv_bits``): codes [KVH, cap, D*bits/8] (4 bits: code
    2k in the low nibble of byte k), scale / bias [KVH, >=n, D/group] per row and group, fp32 or the uint16 bit
    patterns of fp16 (the torch cache's own storage: converted as read; numba compiles one kernel per type).
    score = Σ_g scale_g (q_g . code_g) + bias_g Σ q_g; values code * scale + bias.  Arguments:
    q [KVH, M, D] scaled; kp, kscale, kbias, vp, vscale, vbias; n; S; outputs as ``turbo_kernel``; ``par`` as
    there."""
    G = D // group

    def kernel(q, kp, kscale, kbias, vp, vscale, vbias, n, S, m_out, l_out, acc_out):
        KVH = q.shape[0]
        span = (n + S - 1) // S
        for task in nb.prange(KVH * S):
            h, s = task // S, task % S
            lo, hi = s * span, min(n, (s + 1) * span)
            m = np.full(M, -np.inf, dtype=np.float32)
            l = np.zeros(M, dtype=np.float32)
            acc = np.zeros((M, D), dtype=np.float32)
            bsum = np.zeros((M, G), dtype=np.float32)
            qs = np.zeros((M, G), dtype=np.float32)  # Σ q per group
            row = np.empty(D, dtype=np.float32)
            sc = np.empty((M, TILE), dtype=np.float32)
            E = np.zeros(TILE, dtype=np.int32)
            Ef = E.view(np.float32)
            qh, kph, vph = q[h], kp[h], vp[h]
            for t in range(M):
                for g in range(G):
                    y = np.float32(0.0)
                    for d in range(g * group, (g + 1) * group):
                        y += qh[t, d]
                    qs[t, g] = y
            for t0 in range(lo, hi, TILE):
                cnt = min(hi, t0 + TILE) - t0
                for jj in range(cnt):
                    j = t0 + jj
                    _affine_row(kph, j, row, bits, D)
                    for t in range(M):
                        x = np.float32(0.0)
                        for g in range(G):
                            y = np.float32(0.0)
                            for d in range(g * group, (g + 1) * group):
                                y += qh[t, d] * row[d]
                            x += _f32(kscale[h, j, g]) * y + _f32(kbias[h, j, g]) * qs[t, g]
                        sc[t, jj] = x
                # the running bias sums live apart from acc: rescale them with it
                for t in range(M):
                    bm = m[t]
                    for jj in range(cnt):
                        if sc[t, jj] > bm:
                            bm = sc[t, jj]
                    if m[t] > -np.inf:
                        alpha = math.exp(m[t] - bm)
                        for g in range(G):
                            bsum[t, g] *= alpha
                _softmax_tile(sc, cnt, m, l, acc, M, D, E, Ef)
                for jj in range(cnt):
                    j = t0 + jj
                    _affine_row(vph, j, row, bits, D)
                    for g in range(G):
                        vs = _f32(vscale[h, j, g])
                        vb = _f32(vbias[h, j, g])
                        for t in range(M):
                            p = sc[t, jj]
                            w = p * vs
                            bsum[t, g] += p * vb
                            for d in range(g * group, (g + 1) * group):
                                acc[t, d] += w * row[d]
            for t in range(M):
                for g in range(G):
                    for d in range(g * group, (g + 1) * group):
                        acc[t, d] += bsum[t, g]
            m_out[h, s] = m
            l_out[h, s] = l
            acc_out[h, s] = acc

    return _compile(kernel, f"affine_d{D}_m{M}_b{bits}_g{group}", par)


def _compile(fn, name: str, par: bool):
    """njit ``fn`` (a closure over its specialisation) with an on-disk cache.  numba keys its cache
    index by the function's qualified name, not by the values a closure captured: the name carries
    every captured constant, so each specialisation gets its own cache entry."""
    fn.__qualname__ = fn.__name__ = f"kernel_{name}" + ("" if par else "_serial")
    return nb.njit(parallel=par, fastmath=_FM, nogil=True, cache=True)(fn)


# ------------------------------------------------------------------------------ numpy-level calls
# placeholders of the right types where an input is unused (numba compiles one signature)
EMPTY2 = np.zeros((1, 1), np.float32)
EMPTY3 = np.zeros((1, 1, 1), np.uint8)
EMPTY4 = np.zeros((1, 1, 1, 1), np.float32)
NO_PLANE = np.zeros((1, 1, 1), np.uint8)
# [256, 8] ±1: bit t of byte b (QJL signs are packed little-end first, one bit per coordinate)
SIGNS = (((np.arange(256)[:, None] >> np.arange(8)) & 1) * 2 - 1).astype(np.float32)


def planes(ps) -> tuple[np.ndarray, np.ndarray]:
    """A code's bit planes as the kernel's (plane 0, plane 1) pair (one-plane widths: a placeholder)."""
    return ps[0], (ps[1] if len(ps) > 1 else NO_PLANE)


def wide_table(tab: np.ndarray) -> np.ndarray:
    """A code table [entries, values] fp32 (``byte_lut``) as the kernels read it: int64 [entries, values / 2], its
    values two to a word."""
    return np.ascontiguousarray(tab, np.float32).view(np.int64)


def qjl_table(sq: np.ndarray) -> np.ndarray:
    """sq [KVH, M, D] (scaled S q) -> st [KVH, D/8, 256, M]: Σ over the eight signs of sign byte k
    with value b of sq * sign, the kernel's per-byte QJL table."""
    KVH, M, D = sq.shape
    t = sq.reshape(KVH, M, D // 8, 8).astype(np.float32, copy=False) @ SIGNS.T  # [KVH, M, D/8, 256]
    return np.ascontiguousarray(t.transpose(0, 2, 3, 1))


def turbo_spans(
    qr,
    n: int,
    kbits: int,
    vbits: int,
    ktab,
    kplanes,
    kn,
    vtab,
    vplanes,
    vn,
    st=None,
    ks=None,
    kr=None,
    qjl_scale: float = 0.0,
):
    """Run ``turbo_kernel`` over compressed rows [0, n): qr [KVH, M, D] rotated, scaled queries;
    k/v tables, plane lists [KVH, cap, bytes] and fp32 norms [KVH, >=n]; QJL keys: st
    (``qjl_table``), ks sign bytes, kr fp32 residual norms.  All C-contiguous numpy arrays (views
    of the caller's storage).  Returns the per-task (m, l, acc) [KVH, S, M], [KVH, S, M, D]."""
    KVH, M, D = qr.shape
    S = splits(n, KVH)
    m_o = np.empty((KVH, S, M), np.float32)
    l_o = np.empty((KVH, S, M), np.float32)
    a_o = np.empty((KVH, S, M, D), np.float32)
    qjl = st is not None
    if not qjl:
        st, ks, kr = EMPTY4, EMPTY3, EMPTY2
    kernel = turbo_kernel(D, M, kbits, vbits, qjl, parallel())
    kp0, kp1 = planes(kplanes)
    vp0, vp1 = planes(vplanes)
    kw, vw = wide_table(ktab), wide_table(vtab)
    with _LOCK:
        _launch_threads()
        kernel(qr, st, np.float32(qjl_scale), kw, kp0, kp1, kn, ks, kr, vw, vp0, vp1, vn, n, S, m_o, l_o, a_o)
    return m_o, l_o, a_o


def affine_spans(q, kp, kscale, kbias, vp, vscale, vbias, n: int, bits: int, group: int):
    """Run ``affine_kernel`` over rows [0, n): q [KVH, M, D] fp32 scaled queries; kp / vp codes
    [KVH, cap, D*bits/8] uint8; scales and biases [KVH, >=n, D/group], fp32 or fp16 as uint16 bits.  All
    C-contiguous numpy arrays (views of the caller's storage).  Returns the per-task (m, l, acc) like
    ``turbo_spans``."""
    KVH, M, D = q.shape
    S = splits(n, KVH)
    m_o = np.empty((KVH, S, M), np.float32)
    l_o = np.empty((KVH, S, M), np.float32)
    a_o = np.empty((KVH, S, M, D), np.float32)
    kernel = affine_kernel(D, M, bits, group, parallel())
    with _LOCK:
        _launch_threads()
        kernel(q, kp, kscale, kbias, vp, vscale, vbias, n, S, m_o, l_o, a_o)
    return m_o, l_o, a_o


def _merge_window(m_o, l_o, a_o, q, dk, dv, R, out):
    """One decode row's attention from the code kernel's per-task partials and the 16-bit rows, in one pass:
    m_o / l_o [KVH, S, M], a_o [KVH, S, M, D] (``turbo_spans`` / ``affine_spans``); q [KVH, M, D] the scaled
    queries in natural coordinates; dk / dv [KVH, nd, D] fp32 (the window and the step's own rows); R [D, D] the
    values' rotation when a_o is in the rotated domain (TurboQuant), else [0, 0].  out [KVH, M, D] = (a @ R +
    Σ p v) / Σ p over every row, codes and 16-bit alike, against one max."""
    KVH, S, M = m_o.shape
    D = a_o.shape[3]
    nd = dk.shape[1]
    rot = R.shape[0] == D
    sc = np.empty(nd, np.float32)
    ar = np.empty(D, np.float32)
    ad = np.empty(D, np.float32)
    for h in range(KVH):
        for t in range(M):
            mx = -np.inf
            for s in range(S):
                if m_o[h, s, t] > mx:
                    mx = m_o[h, s, t]
            for j in range(nd):
                x = np.float32(0.0)
                for d in range(D):
                    x += q[h, t, d] * dk[h, j, d]
                sc[j] = x
                if x > mx:
                    mx = x
            l = np.float32(0.0)
            for d in range(D):
                ar[d] = 0.0
                ad[d] = 0.0
            for s in range(S):
                if m_o[h, s, t] > -np.inf:  # a task with no rows holds -inf
                    w = math.exp(m_o[h, s, t] - mx)
                    l += l_o[h, s, t] * w
                    for d in range(D):
                        ar[d] += a_o[h, s, t, d] * w
            for j in range(nd):
                p = math.exp(sc[j] - mx)
                l += p
                for d in range(D):
                    ad[d] += p * dv[h, j, d]
            for d in range(D):
                y = ad[d]
                if rot:
                    for e in range(D):
                        y += ar[e] * R[e, d]
                else:
                    y += ar[d]
                out[h, t, d] = y / l


merge_window = nb.njit(fastmath=_FM, nogil=True, cache=True)(_merge_window) if nb is not None else _merge_window


def _rotate(q, R, out):
    """out [KVH, M, D] = q [KVH, M, D] @ R^T: queries into the keys' rotated domain (one call per layer, rather
    than a torch matmul of a few rows)."""
    KVH, M, D = q.shape
    for h in range(KVH):
        for t in range(M):
            for e in range(D):
                x = np.float32(0.0)
                for d in range(D):
                    x += q[h, t, d] * R[e, d]
                out[h, t, e] = x


rotate = nb.njit(fastmath=_FM, nogil=True, cache=True)(_rotate) if nb is not None else _rotate


def merge_spans(m_o: np.ndarray, l_o: np.ndarray, a_o: np.ndarray):
    """Per-task partials -> (m, l) [KVH, M, 1] and acc [KVH, M, D] over all tasks."""
    m = m_o.max(1, keepdims=True)  # [KVH, 1, M]
    w = np.exp(m_o - m)  # tasks with no rows: m = -inf -> 0
    return (m[:, 0, :, None], (l_o * w).sum(1)[..., None], (a_o * w[..., None]).sum(1))


_WARMED: set[tuple] = set()


def warm_up_turbo(D: int, M: int, kbits: int, vbits: int, qjl: bool) -> threading.Thread | None:
    """Compile (or load from numba's disk cache) this shape's kernel on a background thread, with
    the argument types the backends pass, so a first decode step does not wait for it.  Once per
    shape and process (later calls: None)."""
    key = (D, M, kbits, vbits, qjl)
    if not enabled() or D % 8 or key in _WARMED:
        return None
    _WARMED.add(key)

    def run() -> None:
        try:
            widths = {3: (D // 4, D // 8)}
            tab = {3: (4096, 4)}

            def side(bits):
                ps = [np.zeros((1, 1, w), np.uint8) for w in widths.get(bits, (D * bits // 8,))]
                return np.zeros(tab.get(bits, (256, 8 // bits)), np.float32), ps, np.ones((1, 1), np.float32)

            ktab, kps, kn = side(kbits)
            vtab, vps, vn = side(vbits)
            extra = {}
            if qjl:
                extra = dict(
                    st=qjl_table(np.ones((1, M, D), np.float32)),
                    ks=np.zeros((1, 1, D // 8), np.uint8),
                    kr=np.ones((1, 1), np.float32),
                    qjl_scale=1.0,
                )
            turbo_spans(np.ones((1, M, D), np.float32), 1, kbits, vbits, ktab, kps, kn, vtab, vps, vn, **extra)
        except Exception as e:  # pragma: no cover - the first decode step compiles it instead
            log.warning("numba kernel warm-up (d=%d, m=%d, k%d v%d) failed: %s", D, M, kbits, vbits, e)

    t = threading.Thread(target=run, name="swiftlm-numba-warmup", daemon=True)
    t.start()
    return t


def warm_up_affine(D: int, M: int, bits: int, group: int) -> threading.Thread | None:
    """``warm_up_turbo`` for the affine (``kv_bits``) kernel, with the argument types of ``affine_spans``."""
    key = ("affine", D, M, bits, group)
    if not enabled() or D % group or key in _WARMED:
        return None
    _WARMED.add(key)

    def run() -> None:
        try:
            codes = np.zeros((1, 1, D * bits // 8), np.uint8)
            side = np.ones((1, 1, D // group), np.float32)
            affine_spans(np.ones((1, M, D), np.float32), codes, side, side, codes, side, side, 1, bits, group)
        except Exception as e:  # pragma: no cover - the first decode step compiles it instead
            log.warning("numba kernel warm-up (affine d=%d, m=%d, %d bits, group %d) failed: %s", D, M, bits, group, e)

    t = threading.Thread(target=run, name="swiftlm-numba-warmup", daemon=True)
    t.start()
    return t
