"""The last step of a CPU decode row over a compressed cache (numpy + numba): the code kernels' per-task partials
(``cpu_attention``: each task's max, denominator and unnormalised value sum over its span of compressed rows) merged
with the row's 16-bit rows (the window and rows not yet compressed) into the attention output, in one compiled pass
per KV head (``_merge_head``: one max over every row, codes and 16-bit alike).  ``merge_kernel`` merges the partials
of B sequences' caches (one cache: B = 1) in one call, reading each cache's 16-bit rows where they lie (by address,
fp32 or the bits of fp16), one task per (sequence, KV head).  ``rotate`` turns queries into the keys' rotated domain (TurboQuant).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .cpu_attention import _FM, _compile, nb

if nb is not None:
    from .cpu_affine import _f32
    from .cpu_attention import _at

    @nb.njit(inline="always", fastmath=_FM)
    def _merge_head(m_o, l_o, a_o, first, S, q, dk, dv, nd, RT, out, sc, ar, ad):
        """One KV head: its tasks' partials (rows first .. first + S of m_o / l_o [T, M], a_o [T, M, D]), q [M, D]
        the scaled queries in natural coordinates, dk / dv [>= nd, D] its 16-bit rows (fp32, or fp16 as uint16
        bits), RT [D, D] the values' rotation transposed (R^T, C-contiguous: its rows are read) when a_o is in the
        rotated domain (TurboQuant), else [0, 0].  out [M, D] = (a @ R + Σ p v) / Σ p over every row, against one
        max.  sc [>= nd], ar, ad [D]: scratch."""
        M, D = q.shape
        rot = RT.shape[0] == D
        for t in range(M):
            mx = -np.inf
            for s in range(first, first + S):
                if m_o[s, t] > mx:
                    mx = m_o[s, t]
            for j in range(nd):
                x = np.float32(0.0)
                for d in range(D):
                    x += q[t, d] * _f32(dk[j, d])
                sc[j] = x
                if x > mx:
                    mx = x
            l = np.float32(0.0)
            for d in range(D):
                ar[d] = 0.0
                ad[d] = 0.0
            for s in range(first, first + S):
                if m_o[s, t] > -np.inf:  # a task with no rows holds -inf
                    w = math.exp(m_o[s, t] - mx)
                    l += l_o[s, t] * w
                    for d in range(D):
                        ar[d] += a_o[s, t, d] * w
            for j in range(nd):
                p = math.exp(sc[j] - mx)
                l += p
                for d in range(D):
                    ad[d] += p * _f32(dv[j, d])
            for d in range(D):
                y = ad[d]
                if rot:
                    for e in range(D):
                        y += ar[e] * RT[d, e]
                else:
                    y += ar[d]
                out[t, d] = y / l


@functools.cache
def merge_kernel(par: bool):
    """The decode rows of B sequences' caches in one call, one task per (sequence, KV head) (``par``: numba's
    parallel loops, ``cpu_attention.parallel``).  Arguments: m_o / l_o [T, M], a_o [T, M, D] the tasks' partials
    (``cpu_attention.turbo_batch`` / ``affine_batch``); first / S [B] (``turbo_tasks``); q [B, KVH, M, D] the scaled queries; dense
    [B, 4] int64: each sequence's 16-bit keys and values by address ([KVH, rows, D], C-contiguous) and their rows;
    nd [B] the 16-bit rows attended; dt an array of their type (fp32, or uint16: fp16 bits); RT; out [B, KVH, M, D]."""

    def kernel(m_o, l_o, a_o, first, S, q, dense, nd, dt, RT, out):
        B, KVH, M, D = q.shape
        for task in nb.prange(B * KVH):
            b, h = task // KVH, task % KVH
            dk = nb.carray(_at(dense[b, 0], dt), (KVH, dense[b, 2], D))
            dv = nb.carray(_at(dense[b, 1], dt), (KVH, dense[b, 3], D))
            sc = np.empty(max(nd[b], 1), np.float32)
            ar = np.empty(D, np.float32)
            ad = np.empty(D, np.float32)
            o = first[b] + h * S[b]
            _merge_head(m_o, l_o, a_o, o, S[b], q[b, h], dk[h], dv[h], nd[b], RT, out[b, h], sc, ar, ad)

    return _compile(kernel, "merge_rows", par)


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
