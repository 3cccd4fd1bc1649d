"""How ``runner.TorchModel`` hands KV rows between sequences: forks sharing a prompt's rows (``n`` / ``best_of``,
shared_kv.py), the prompt cache's copies in and out, and prefixes adopted from the paged pool's cached blocks
(kv_pool.py, swiftlm/kv_blocks.py)."""

from __future__ import annotations

from typing import Any

import torch

from .devices import bind_thread
from .kv_cache import SeqCache
from .kv_pool import PagedSeqCache
from .seq_caches import SeqCaches
from .shared_kv import ForkedCache, share


class PrefixCopies:
    """KV rows handed between ``seqs``' sequences.  ``shareable``: forks may share a prompt's rows (the plain
    single-process model on growing caches; not the CUDA slot pool, nor tensor / pipeline ranks)."""

    def __init__(self, seqs: SeqCaches, shareable: bool):
        self.seqs, self.shareable = seqs, shareable
        self.a = seqs.a

    # ---------------------------------------------------------------- fork hooks (n / best_of)
    @torch.inference_mode()
    def share(self, seq_id: int) -> tuple[Any, int] | None:
        """Make this sequence's KV rows [0, length) a read-only shared prefix (shared_kv.py) and
        rebase the sequence onto it (its own copy is dropped): (handle, positions) for ``fork``.
        None where forks cannot share here (the CUDA slot pool, compressed or offloaded caches,
        sliding windows, tensor / pipeline ranks): the engine then copies through ``snapshot`` / ``restore``."""
        c = self.seqs.caches.get(seq_id)
        if (
            not self.shareable
            or type(c) is not SeqCache
            or c.fp8 is not None  # (forks copy an fp8 cache's e4m3 rows through the prompt-cache hooks)
            or not c.length
            or self.a.windows
            or self.a.offload is not None
        ):
            return None
        prefix = share(c)
        self.seqs.caches[seq_id] = ForkedCache(prefix, self.a, self.seqs.dtype, self.seqs.device)
        return prefix, c.length

    @torch.inference_mode()
    def fork(self, seq_id: int, handle: Any, n: int) -> None:
        """Start ``seq_id`` at position ``n`` over the shared prefix ``handle`` (no copy)."""
        self.seqs.caches[seq_id] = ForkedCache(handle, self.a, self.seqs.dtype, self.seqs.device, n)
        self.seqs.formats[seq_id] = self.seqs.kv_default

    # ---------------------------------------------------------------- prompt cache hooks
    @torch.inference_mode()  # cache slots are inference tensors: copies in and out must be too
    def snapshot(self, seq_id: int) -> tuple[Any, int, int] | None:
        """The KV rows this sequence computed, as an immutable copy: (payload, bytes, positions)."""
        c = self.seqs.caches.get(seq_id)
        if isinstance(c, PagedSeqCache) and c.length:  # gathered out of its blocks
            n = c.length
            rows = [c.rows(i, n) for i in range(self.a.layers)]
            k, v = [r[0] for r in rows], [r[1] for r in rows]
        elif c is None or c.length == 0 or not isinstance(c, SeqCache):
            return None  # compressed caches are not kept by the prompt cache
        elif c.trimmed:  # sliding-window layers dropped rows (kv_cache.SeqCache): no rows from position 0 to copy
            return None
        elif isinstance(c, ForkedCache):
            n = c.length
            k, v = c.rows(n)
        else:
            # a compact copy: the slot goes back to the pool, and a view of a grown CPU cache would keep
            # its whole buffer (grown past the rows counted) alive in the prompt cache
            n = c.length
            k = [t[:, :n].clone() for t in c.k]
            v = [t[:, :n].clone() for t in c.v]
        return (k, v), sum(t.numel() * t.element_size() for t in k + v), n

    @torch.inference_mode()
    def restore(self, seq_id: int, payload: Any, n: int) -> None:
        """Start ``seq_id`` with a copy of the first ``n`` cached rows (never shared)."""
        bind_thread(self.seqs.device)
        k, v = payload
        c = self.seqs.get(seq_id, 0)
        if isinstance(c, PagedSeqCache):
            blocks = self.seqs.kv_blocks
            if blocks is not None and not blocks.grow(seq_id, n):
                raise RuntimeError(f"no free KV blocks for {n} restored positions")
            c.sync()
            for layer in range(len(k)):
                c.write_rows(layer, 0, k[layer][:, :n], v[layer][:, :n])
            c.length = n
            return
        if not self.seqs.static and c.capacity < n:
            c._grow(n)
        for layer in range(len(k)):
            c.k[layer][:, :n].copy_(k[layer][:, :n])
            c.v[layer][:, :n].copy_(v[layer][:, :n])
        c.length = n

    def adopt(self, seq_id: int, n: int) -> None:
        """The manager gave ``seq_id`` cached blocks holding positions [0, n) (prefix caching): its cache starts there."""
        c = self.seqs.get(seq_id, 0)
        c.sync()
        c.length = n
