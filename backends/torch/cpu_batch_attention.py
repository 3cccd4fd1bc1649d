"""Batched decode attention over plain fp32 per-sequence caches on the CPU, compiled with numba.

``decode_batch`` attends B decode rows, each over its own ``SeqCache``.  The torch path writes each
row's new key / value with a Python call per row and layer, copies every row's whole history into a
padded [B, KVH, Lmax, D] batch (``pad_sequence``), then runs a masked batched matmul, softmax and
matmul: at many streams that is a large share of a CPU decode step, most of it per-op overhead and
the copy, not arithmetic.  This kernel does the whole layer's attention in one
call: one task per (sequence, KV head) writes the new row into the sequence's cache in place, scores
the query heads of that KV head against its rows, takes the softmax and sums the values, reading
each cache where it lies (its tensors are passed by address: the rows have different lengths and
capacities, so they are not one array).  The caller grows every cache to its new length once per
step, before the first layer, so the addresses hold for the whole step.

Used when every row's cache is a plain fp32 ``SeqCache`` without sliding-window trimming, shared
prefixes or offloaded layers (``usable``); numba absent or ``SWIFTLM_NUMBA=0``: the torch path.
"""

from __future__ import annotations

import numpy as np

from .cpu_kernels import _FM, _LOCK, _launch_threads, enabled, nb, start_pool

if nb is not None:
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def _f32_at(typingctx, addr):
        """An int64 address as a float32 pointer (for ``nb.carray``)."""
        if not isinstance(addr, types.Integer):
            return None
        ptr = types.CPointer(types.float32)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(addr), codegen

    @nb.njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
    def _attend(q, k_new, v_new, k_at, v_at, cap, pos, scale, out):
        """q [B, H, D], k_new / v_new [B, KVH, D]; k_at / v_at [B] the addresses of each sequence's
        layer tensors [KVH, cap[b], D] (C-contiguous fp32); pos [B] the new row's position.  Writes
        row pos[b] of each cache, then out [B, H, D] = softmax(q k^T * scale) v over rows [0, pos]."""
        B, H, D = q.shape
        KVH = k_new.shape[1]
        M = H // KVH
        for task in nb.prange(B * KVH):
            b = task // KVH
            g = task - b * KVH
            n = pos[b] + 1
            K = nb.carray(_f32_at(k_at[b]), (KVH, cap[b], D))
            V = nb.carray(_f32_at(v_at[b]), (KVH, cap[b], D))
            for d in range(D):
                K[g, n - 1, d] = k_new[b, g, d]
                V[g, n - 1, d] = v_new[b, g, d]
            qs = np.empty((M, D), np.float32)
            for r in range(M):
                for d in range(D):
                    qs[r, d] = q[b, g * M + r, d] * scale
            sc = np.empty((M, n), np.float32)
            for j in range(n):
                for r in range(M):
                    s = np.float32(0.0)
                    for d in range(D):
                        s += qs[r, d] * K[g, j, d]
                    sc[r, j] = s
            acc = np.zeros((M, D), np.float32)
            for r in range(M):
                mx = sc[r, 0]
                for j in range(1, n):
                    if sc[r, j] > mx:
                        mx = sc[r, j]
                tot = np.float32(0.0)
                for j in range(n):
                    p = np.exp(sc[r, j] - mx)
                    sc[r, j] = p
                    tot += p
                inv = np.float32(1.0) / tot
                for j in range(n):
                    p = sc[r, j] * inv
                    for d in range(D):
                        acc[r, d] += p * V[g, j, d]
                for d in range(D):
                    out[b, g * M + r, d] = acc[r, d]


def usable(model, caches, SeqCache) -> bool:
    """Every row a plain fp32 CPU ``SeqCache`` (no window trimming, no shared prefix), no sliding
    windows or offloaded layers in the model, numba present and enabled."""
    a = model.a
    if not enabled() or a.windows or a.offload is not None or model.cos.device.type != "cpu":
        return False
    import torch

    for c in caches:
        if type(c) is not SeqCache or c._off is not None or c._k[0].dtype != torch.float32:
            return False
    return True


class StepAddresses:
    """Per step: every cache grown to hold its new row, then each layer's K / V addresses [B]."""

    def __init__(self, caches, positions: list[int]):
        for c, p in zip(caches, positions):
            if p + 1 > c._k[0].shape[1]:
                c._grow(p + 1, full_only=True)
        self.caches = caches
        self.pos = np.array(positions, np.int64)

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer ``i``'s K and V addresses and capacities (rows), one per sequence."""
        ks = [c._k[i] for c in self.caches]
        k = np.array([t.data_ptr() for t in ks], np.int64)
        v = np.array([c._v[i].data_ptr() for c in self.caches], np.int64)
        return k, v, np.array([t.shape[1] for t in ks], np.int64)

    def finish(self) -> None:
        for c, p in zip(self.caches, self.pos.tolist()):
            c.length = p + 1


def attend(step: StepAddresses, i: int, q, k, v, scale: float):
    """Layer ``i``'s decode attention for q [B, H, D], new rows k / v [B, KVH, D] -> [B, H * D]."""
    import torch

    B, H, D = q.shape
    out = torch.empty(B, H, D, dtype=torch.float32)
    k_at, v_at, cap = step.layer(i)
    start_pool()
    with _LOCK:
        _launch_threads()
        _attend(
            q.float().contiguous().numpy(),
            k.float().contiguous().numpy(),
            v.float().contiguous().numpy(),
            k_at,
            v_at,
            cap,
            step.pos,
            np.float32(scale),
            out.numpy(),
        )
    return out.view(B, H * D)
