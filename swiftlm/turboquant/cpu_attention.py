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
rotated domain and rotated back once by the caller (``cpu_merge``: the partials merged with the 16-bit rows);
affine (``kv_bits``) values in the original domain.  Both kernels take the tasks of any number of caches in one
call, each cache's arrays by address (``turbo_tasks``; ``turbo_batch``, ``affine_batch``): a CPU decode step of
several sequences attends each layer's compressed rows in one call (``backends/torch/cpu_code_batch.py``), and one
cache alone (``turbo_spans``, ``affine_spans``) is the same call with one sequence.  The building blocks they inline
(tile decode, exponential, softmax update, addresses) are ``cpu_tiles``'.

Layout (``swiftlm.turboquant.packing``; both backends' caches write the same bytes): row-major bit
planes [KVH, cap, D * width / 8] uint8, QJL sign bytes [KVH, cap, D / 8] (bit t of byte k is
coordinate 8k + t), the code tables of ``byte_lut``; norms and residual norms [KVH, >=n] as fp32 (MLX's copies of
the first n) or as the caches' fp16 storage itself, read as its uint16 bits (the torch backend; ``cpu_affine``'s
``_f32``), affine scales and biases alike.

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
from .cpu_threads import (  # noqa: F401 (the kernels' thread settings, used through this module too)
    _LOCK,
    MIN_SPAN,
    _launch_threads,
    parallel,
    splits,
    threads,
    use_threads,
)
from .cpu_tiles import (  # noqa: F401 (the building blocks, used through this module too)
    _FM,
    TILE,
    _affine_row,
    _at,
    _compile,
    _decode_tile,
    _exp_tile,
    _softmax_tile,
)

log = logging.getLogger(__name__)

try:  # optional (the torch extra installs it): without it the backends run their own paths
    import numba as nb
except ImportError:  # pragma: no cover - exercised where numba is absent
    nb = None


def enabled() -> bool:
    return nb is not None and os.environ.get("SWIFTLM_NUMBA", "1") != "0"


def plane_widths(D: int, bits: int) -> tuple[int, int]:
    """Bytes per row of a code's two bit planes (``packing``): 3 bits as a 2-bit and a 1-bit plane, other widths
    one plane (the second a placeholder, never read)."""
    return (D // 4, D // 8) if bits == 3 else (D * bits // 8, 1)


@functools.cache
def turbo_kernel(D: int, M: int, kbits: int, vbits: int, qjl: bool, par: bool):
    """Split-K attention over TurboQuant codes for M query heads per KV head (see module doc), for the tasks of
    any number of sequences' caches in one call (``par``: with numba's parallel loops over the tasks,
    ``parallel()``).  Each task is one span of rows of one KV head of one sequence; what it computes depends on
    its own rows and queries only, so a sequence gets the same bits alone or beside others.

    Arguments: qr [B, KVH, M, D] rotated, scaled queries of each sequence; st [B, KVH, D/8, 256, M]: Σ over the
    eight signs of a byte of (scaled S q) * sign, per sign byte position, byte value and query head (QJL; a
    placeholder otherwise); qjl_scale; ktab / vtab the key and value tables (``wide_table``); seqs [B, 16] int64:
    each sequence's storage by address (``SEQ_FIELDS``: key planes 0 / 1 [KVH, rows, bytes] uint8, key norms
    [KVH, rows], QJL sign bytes [KVH, rows, D/8] and residual norms [KVH, rows], value planes 0 / 1, value norms),
    then each array's ``rows``; nt: an array of the norms' type, fp32 or the uint16 bits of fp16 (read through
    ``_f32``); tasks [T, 4] int64: (sequence, KV head, first row, end row) (``turbo_tasks``); outputs m, l
    [T, M], acc [T, M, D]."""
    nsb = D // 8
    kw0, kw1 = plane_widths(D, kbits)
    vw0, vw1 = plane_widths(D, vbits)

    def kernel(qr, st, qjl_scale, ktab, vtab, seqs, nt, tasks, m_out, l_out, acc_out):
        KVH = qr.shape[1]
        for task in nb.prange(tasks.shape[0]):
            b, h, lo, hi = tasks[task, 0], tasks[task, 1], tasks[task, 2], tasks[task, 3]
            at = seqs[b]
            kp0 = nb.carray(_at(at[0], np.uint8), (KVH, at[8], kw0))
            kp1 = nb.carray(_at(at[1], np.uint8), (KVH, at[9], kw1))
            kn = nb.carray(_at(at[2], nt), (KVH, at[10]))
            ks = nb.carray(_at(at[3], np.uint8), (KVH, at[11], nsb))
            kr = nb.carray(_at(at[4], nt), (KVH, at[12]))
            vp0 = nb.carray(_at(at[5], np.uint8), (KVH, at[13], vw0))
            vp1 = nb.carray(_at(at[6], np.uint8), (KVH, at[14], vw1))
            vn = nb.carray(_at(at[7], nt), (KVH, at[15]))
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
            q, kp0h, kp1h, vp0h, vp1h = qr[b, h], kp0[h], kp1[h], vp0[h], vp1[h]
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
                            byte = ks[h, j, k]
                            for t in range(M):
                                sg[t] += st[b, h, k, byte, t]
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
            m_out[task] = m
            l_out[task] = l
            acc_out[task] = acc

    return _compile(kernel, f"turbo_d{D}_m{M}_k{kbits}{'q' if qjl else ''}_v{vbits}", par)


@functools.cache
def affine_kernel(D: int, M: int, bits: int, group: int, par: bool):
    """Split-K attention over affine codes (``kv_bits``) for the tasks of any number of sequences' caches in one
    call, as ``turbo_kernel`` (a sequence gets the same bits alone or beside others).  Each sequence's storage by
    address (``AFFINE_FIELDS``): codes [KVH, rows, D*bits/8] uint8 (4 bits: code 2k in the low nibble of byte k),
    scale / bias [KVH, rows, D/group] per row and group, fp32 or the uint16 bit patterns of fp16 (the torch cache's
    own storage: converted as read; ``nt`` an array of their type, numba compiles one kernel per type).
    score = Σ_g scale_g (q_g . code_g) + bias_g Σ q_g; values code * scale + bias.  Arguments: q [B, KVH, M, D]
    scaled; seqs [B, 12] int64; nt; tasks [T, 4] (``turbo_tasks``); outputs m, l [T, M], acc [T, M, D]."""
    G = D // group
    cw = D * bits // 8  # code bytes per row

    def kernel(q, seqs, nt, tasks, m_out, l_out, acc_out):
        KVH = q.shape[1]
        for task in nb.prange(tasks.shape[0]):
            b, h, lo, hi = tasks[task, 0], tasks[task, 1], tasks[task, 2], tasks[task, 3]
            at = seqs[b]
            kp = nb.carray(_at(at[0], np.uint8), (KVH, at[6], cw))
            kscale = nb.carray(_at(at[1], nt), (KVH, at[7], G))
            kbias = nb.carray(_at(at[2], nt), (KVH, at[8], G))
            vp = nb.carray(_at(at[3], np.uint8), (KVH, at[9], cw))
            vscale = nb.carray(_at(at[4], nt), (KVH, at[10], G))
            vbias = nb.carray(_at(at[5], nt), (KVH, at[11], G))
            m = np.full(M, -np.inf, dtype=np.float32)
            l = np.zeros(M, dtype=np.float32)
            acc = np.zeros((M, D), dtype=np.float32)
            bsum = np.zeros((M, G), dtype=np.float32)
            qs = np.zeros((M, G), dtype=np.float32)  # Σ q per group
            row = np.empty(D, dtype=np.float32)
            sc = np.empty((M, TILE), dtype=np.float32)
            E = np.zeros(TILE, dtype=np.int32)
            Ef = E.view(np.float32)
            qh, kph, vph = q[b, h], kp[h], vp[h]
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
            m_out[task] = m
            l_out[task] = l
            acc_out[task] = acc

    return _compile(kernel, f"affine_d{D}_m{M}_b{bits}_g{group}", par)


# ------------------------------------------------------------------------------ numpy-level calls
# placeholders of the right types where an input is unused (numba compiles one signature)
EMPTY5 = np.zeros((1, 1, 1, 1, 1), np.float32)
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


# the columns of a ``turbo_kernel`` sequence table: each array's address, then (from column 8) its rows
SEQ_FIELDS = ("kp0", "kp1", "kn", "ks", "kr", "vp0", "vp1", "vn")
# ... and of an ``affine_kernel`` one (from column 6: the rows)
AFFINE_FIELDS = ("kp", "kscale", "kbias", "vp", "vscale", "vbias")
# arrays of the norms' types, handed to the kernels as the type of what they read by address (numba compiles one
# kernel per type)
NORM_TYPES = {np.dtype(np.float32): np.zeros(1, np.float32), np.dtype(np.uint16): np.zeros(1, np.uint16)}


def turbo_tasks(ns, kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``turbo_kernel`` and ``affine_kernel`` tasks of sequences holding ns[b] compressed rows: each sequence's
    KV heads split into ``splits`` spans (head-major, spans of (n + S - 1) // S rows).  Returns tasks [T, 4]
    (sequence, KV head, first row, end row), first [B] (each sequence's first task) and S [B] (its tasks per KV
    head)."""
    rows: list[tuple[int, int, int, int]] = []
    first, per = [], []
    for b, n in enumerate(ns):
        S = splits(n, kv_heads)
        span = (n + S - 1) // S
        first.append(len(rows))
        per.append(S)
        rows += [(b, h, s * span, min(n, (s + 1) * span)) for h in range(kv_heads) for s in range(S)]
    return np.array(rows, np.int64).reshape(-1, 4), np.array(first, np.int64), np.array(per, np.int64)


def turbo_batch(qr, tasks, seqs, nt, kbits: int, vbits: int, ktab, vtab, st=None, qjl_scale: float = 0.0):
    """Run ``turbo_kernel`` once over ``tasks`` (``turbo_tasks``) of B sequences: qr [B, KVH, M, D] rotated,
    scaled queries; seqs [B, 16] their storage (``SEQ_FIELDS``: addresses, then rows); nt ``NORM_TYPES``' array of
    their norms' type; k/v tables (``byte_lut``); QJL keys: st [B, KVH, D/8, 256, M] (``qjl_table`` per sequence).
    Returns the per-task (m, l [T, M], acc [T, M, D])."""
    B, KVH, M, D = qr.shape
    T = tasks.shape[0]
    m_o = np.empty((T, M), np.float32)
    l_o = np.empty((T, M), np.float32)
    a_o = np.empty((T, M, D), np.float32)
    kernel = turbo_kernel(D, M, kbits, vbits, st is not None, parallel())
    kw, vw = wide_table(ktab), wide_table(vtab)
    with _LOCK:
        _launch_threads()
        kernel(qr, EMPTY5 if st is None else st, np.float32(qjl_scale), kw, vw, seqs, nt, tasks, m_o, l_o, a_o)
    return m_o, l_o, a_o


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
    """Run ``turbo_kernel`` over one cache's compressed rows [0, n): qr [KVH, M, D] rotated, scaled queries;
    k/v tables, plane lists [KVH, cap, bytes] and norms [KVH, >=n] (fp32, or fp16 as uint16 bits); QJL keys: st
    (``qjl_table``), ks sign bytes, kr residual norms.  numpy arrays (views of the caller's storage; one that is not
    C-contiguous is copied).  Returns the per-task (m, l, acc) [KVH, S, M], [KVH, S, M, D]."""
    KVH, M, D = qr.shape
    qjl = st is not None
    norms = [kn, vn, kr] if qjl else [kn, vn]
    if len({a.dtype for a in norms}) > 1 or norms[0].dtype not in NORM_TYPES:
        norms = [np.asarray(a, np.float32) for a in norms]
    kn, vn = norms[0], norms[1]
    kr = norms[2] if qjl else None
    ks = ks if qjl else None
    arrays = [*planes(kplanes), kn, ks, kr, *planes(vplanes), vn]
    arrays = [None if a is None else np.ascontiguousarray(a) for a in arrays]  # held until the kernel returns
    seqs = np.array(
        [[0 if a is None else a.ctypes.data for a in arrays] + [0 if a is None else a.shape[1] for a in arrays]],
        np.int64,
    )
    tasks, _, per = turbo_tasks([n], KVH)
    qr = np.ascontiguousarray(qr, np.float32)[None]
    st = np.ascontiguousarray(st, np.float32)[None] if qjl else None
    m_o, l_o, a_o = turbo_batch(qr, tasks, seqs, NORM_TYPES[kn.dtype], kbits, vbits, ktab, vtab, st, qjl_scale)
    S = int(per[0])
    return m_o.reshape(KVH, S, M), l_o.reshape(KVH, S, M), a_o.reshape(KVH, S, M, D)


def affine_batch(q, tasks, seqs, nt, bits: int, group: int):
    """Run ``affine_kernel`` once over ``tasks`` (``turbo_tasks``) of B sequences: q [B, KVH, M, D] scaled queries;
    seqs [B, 12] their storage (``AFFINE_FIELDS``: addresses, then rows); nt ``NORM_TYPES``' array of their scales'
    and biases' type.  Returns the per-task (m, l [T, M], acc [T, M, D])."""
    B, KVH, M, D = q.shape
    T = tasks.shape[0]
    m_o = np.empty((T, M), np.float32)
    l_o = np.empty((T, M), np.float32)
    a_o = np.empty((T, M, D), np.float32)
    kernel = affine_kernel(D, M, bits, group, parallel())
    with _LOCK:
        _launch_threads()
        kernel(q, seqs, nt, tasks, m_o, l_o, a_o)
    return m_o, l_o, a_o


def affine_spans(q, kp, kscale, kbias, vp, vscale, vbias, n: int, bits: int, group: int):
    """Run ``affine_kernel`` over one cache's rows [0, n) (``affine_batch`` with one sequence): q [KVH, M, D] fp32
    scaled queries; kp / vp codes [KVH, cap, D*bits/8] uint8; scales and biases [KVH, >=n, D/group], fp32 or fp16
    as uint16 bits (one type for the four; else fp32 copies).  numpy arrays (views of the caller's storage; one
    that is not C-contiguous is copied).  Returns the per-task (m, l, acc) like ``turbo_spans``."""
    KVH, M, D = q.shape
    sides = [kscale, kbias, vscale, vbias]
    if len({a.dtype for a in sides}) > 1 or sides[0].dtype not in NORM_TYPES:
        sides = [np.asarray(a, np.float32) for a in sides]
    arrays = [np.ascontiguousarray(a) for a in (kp, *sides[:2], vp, *sides[2:])]  # held until the kernel returns
    seqs = np.array([[a.ctypes.data for a in arrays] + [a.shape[1] for a in arrays]], np.int64)
    tasks, _, per = turbo_tasks([n], KVH)
    q = np.ascontiguousarray(q, np.float32)[None]
    m_o, l_o, a_o = affine_batch(q, tasks, seqs, NORM_TYPES[sides[0].dtype], bits, group)
    S = int(per[0])
    return m_o.reshape(KVH, S, M), l_o.reshape(KVH, S, M), a_o.reshape(KVH, S, M, D)


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
