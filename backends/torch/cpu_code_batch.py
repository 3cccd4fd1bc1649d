"""Batched decode attention over compressed per-sequence caches on the CPU (TurboQuant and affine ``kv_bits``).

A CPU decode step of B sequences whose caches are ``CompressedCache`` of one format attends each layer for all rows
at once (``CodeRows``, reached from ``attend.RowsAttend``): each row's new K/V is written as
``CompressedCache.update_attend`` writes it (``_write``: the 16-bit buffer), then one call of the format's code
kernel covers every (sequence, KV head, span) task over each cache's codes where they lie and one call merges them
with each cache's 16-bit rows (``cpu_kernels.code_rows``), then rows that left the window are compressed
(``_compress``; ``kv_bits``: the step's own row, straight into the codes), as ``update_attend`` does.  Row by row,
that was one kernel call, one merge call and their Python glue per sequence and layer.  A cache's own single-row
decode goes through the same ``code_rows`` with one row, and each task and each merge reads its own sequence only,
so a row gets the same bits batched or alone.  A layer of a row that holds no codes yet (a prompt shorter than the
window, a layer kept 16-bit) attends through the cache's own path (``_attend``).

Used when every row's cache is a dynamic (not static, not paged) ``CompressedCache`` on the CPU, of one format
(TurboQuant, or affine of one width and group) and one 16-bit type, and numba is enabled (``usable``); otherwise
``RowsAttend`` goes row by row.
"""

from __future__ import annotations

from typing import Any

import torch

from . import cpu_kernels

CALLS = [0]  # layers attended through the batched path (tests read it)


def usable(model: Any, caches: list[Any]) -> bool:
    """Every row a dynamic ``CompressedCache`` (TurboQuant or affine) on the CPU, all of one format and 16-bit type,
    in a model without sliding windows or offloaded layers, numba enabled."""
    a = model.a
    if not caches or not cpu_kernels.enabled() or a.windows or a.offload is not None or a.heads // a.kv_heads > 32:
        return False
    c0 = caches[0]
    for c in caches:
        fmt = getattr(c, "fmt", None)
        if fmt is None or fmt.kind not in ("turbo", "affine") or c.device.type != "cpu" or c.static or c.use_triton:
            return False
        if fmt != c0.fmt or c.dense_dtype != c0.dense_dtype or c.kc.d % 8:
            return False
    return True  # then a layer's rows go through the kernels where they hold codes (what cpu_kernels.usable adds)


class CodeRows:
    """B decode rows, row b at ``positions[b]`` over ``caches[b]`` (``usable``): ``attend`` per layer."""

    def __init__(self, model: Any, caches: list[Any], positions: list[int]):
        a = model.a
        self.caches, self.positions = caches, positions
        self.kv_heads, self.rep = a.kv_heads, a.heads // a.kv_heads
        self.scale = a.head_dim**-0.5

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], new rows k / v [B, KVH, D] -> [B, H * D]: what ``update_attend`` gives each row."""
        caches, positions = self.caches, self.positions
        B, H, D = q.shape
        rows, fast, outs = [], [], [None] * B
        for b, (c, pos) in enumerate(zip(caches, positions)):
            L = c._write(layer, pos, k[b].unsqueeze(1), v[b].unsqueeze(1))
            if L.n_code:
                rows.append((c, L, *c._dense(L)))
                fast.append(b)
            else:  # no codes in this layer yet: the cache's own path
                outs[b] = c._attend(L, q[b].unsqueeze(1), pos)
        if fast:
            CALLS[0] += 1
            qg = q if len(fast) == B else q[fast]
            got = cpu_kernels.code_rows(rows, qg.float().reshape(len(fast), self.kv_heads, self.rep, D), self.scale)
            got = got.view(len(fast), H * D).to(q.dtype)
            if len(fast) == B:
                outs = [got]
            else:
                for i, b in enumerate(fast):
                    outs[b] = got[i : i + 1]
        for c in caches:
            c.after_attend(c.layers[layer])
        return outs[0] if len(outs) == 1 else torch.cat(outs)
