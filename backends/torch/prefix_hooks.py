"""The hooks of ``runner.TorchModel`` that hand KV rows between sequences: forks sharing a prompt's rows
(``n`` / ``best_of``, shared_kv.py), the prompt cache's copies in and out, and the paged pool's block manager
(kv_pool.py, swiftlm/kv_blocks.py: which blocks a sequence holds, prefixes adopted from cached blocks)."""

from __future__ import annotations

from typing import Any

import torch

from .devices import bind_thread
from .kv_cache import SeqCache
from .kv_pool import PagedSeqCache
from .shared_kv import ForkedCache, share


class PrefixHooks:
    """Mixed into ``runner.TorchModel`` (which holds ``caches``, ``kv_formats``, ``kv_default``, ``pool``,
    ``kv_blocks``, ``module``, ``static``, ``device``, ``dtype``, ``_cache`` and ``_plain``: True for the plain
    single-process model, False for tensor / pipeline ranks, whose pools the engine's block decisions do not reach)."""

    # ---------------------------------------------------------------- fork hooks (n / best_of)
    @torch.inference_mode()
    def share_prefix(self, seq_id: int) -> tuple[Any, int] | None:
        """Make this sequence's KV rows [0, length) a read-only shared prefix (shared_kv.py) and
        rebase the sequence onto it (its own copy is dropped): (handle, positions) for ``fork_from``.
        None where forks cannot share here (the CUDA slot pool, compressed or offloaded caches,
        sliding windows, subclasses such as tensor / pipeline ranks): the engine then copies
        through ``snapshot_prefix`` / ``restore_prefix``."""
        c = self.caches.get(seq_id)
        a = self.module.a
        if (
            not self._plain()
            or self.static
            or type(c) is not SeqCache
            or c.fp8 is not None  # (forks copy an fp8 cache's e4m3 rows through the prompt-cache hooks)
            or not c.length
            or a.windows
            or a.offload is not None
        ):
            return None
        prefix = share(c)
        self.caches[seq_id] = ForkedCache(prefix, a, self.dtype, self.device)
        return prefix, c.length

    @torch.inference_mode()
    def fork_from(self, seq_id: int, handle: Any, n: int) -> None:
        """Start ``seq_id`` at position ``n`` over the shared prefix ``handle`` (no copy)."""
        self.caches[seq_id] = ForkedCache(handle, self.module.a, self.dtype, self.device, n)
        self.kv_formats[seq_id] = self.kv_default

    # ---------------------------------------------------------------- prompt cache hooks
    @torch.inference_mode()  # cache slots are inference tensors: copies in and out must be too
    def snapshot_prefix(self, seq_id: int) -> tuple[Any, int, int] | None:
        """The KV rows this sequence computed, as an immutable copy: (payload, bytes, positions)."""
        c = self.caches.get(seq_id)
        if isinstance(c, PagedSeqCache) and c.length:  # gathered out of its blocks
            n = c.length
            rows = [c.rows(i, n) for i in range(self.module.a.layers)]
            k, v = [r[0] for r in rows], [r[1] for r in rows]
            return (k, v), sum(t.numel() * t.element_size() for t in k + v), n
        if c is None or c.length == 0 or not isinstance(c, SeqCache):
            return None  # compressed caches are not kept by the prompt cache
        if c.trimmed:  # sliding-window layers dropped rows (kv_cache.SeqCache): no rows from position 0 to copy
            return None
        n = c.length
        if isinstance(c, ForkedCache):
            k, v = c.rows(n)
            return (k, v), sum(t.numel() * t.element_size() for t in k + v), n
        # a compact copy: the slot goes back to the pool, and a view of a grown CPU cache would keep
        # its whole buffer (grown past the rows counted) alive in the prompt cache
        k = [t[:, :n].clone() for t in c.k]
        v = [t[:, :n].clone() for t in c.v]
        nbytes = sum(t.numel() * t.element_size() for t in k + v)
        return (k, v), nbytes, n

    @torch.inference_mode()
    def restore_prefix(self, seq_id: int, payload: Any, n: int) -> None:
        """Start ``seq_id`` with a copy of the first ``n`` cached rows (never shared)."""
        bind_thread(self.device)
        k, v = payload
        c = self._cache(seq_id, 0)
        if isinstance(c, PagedSeqCache):
            if self.kv_blocks is not None and not self.kv_blocks.grow(seq_id, n):
                raise RuntimeError(f"no free KV blocks for {n} restored positions")
            c.sync()
            for layer in range(len(k)):
                c.write_rows(layer, 0, k[layer][:, :n], v[layer][:, :n])
            c.length = n
            return
        if not self.static and c.capacity < n:
            c._grow(n)
        for layer in range(len(k)):
            c.k[layer][:, :n].copy_(k[layer][:, :n])
            c.v[layer][:, :n].copy_(v[layer][:, :n])
        c.length = n

    # ---------------------------------------------------------------- paged KV hooks (kv_pool.py, swiftlm/kv_blocks.py)
    def kv_block_spec(self) -> tuple[int, int] | None:
        """(blocks, positions per block) of the paged pool whose blocks the engine's manager hands out,
        or None where sequences keep their own caches (CPU, eager CUDA models, pipeline ranks)."""
        p = self.pool
        # tensor / pipeline ranks (subclasses) keep fixed slot runs: the leader's block decisions (prefix
        # blocks above all) would have to reach every rank's pool
        if p is None or p.managed or not self._plain():
            return None
        return p.num_blocks, p.block_size

    def code_page_spec(self) -> tuple[int, int, Any] | None:
        """(pages, positions per page, format) of the TurboQuant code pool whose pages the engine's second
        manager hands out to requests of that format (the server's --turbo-kv default), or None."""
        p = getattr(self, "code_pages", None)
        if p is None or p.managed or not self._plain():
            return None
        return p.pages, p.page_rows, p.fmt

    def attach_code_pages(self, blocks: Any) -> None:
        """The engine's ``KVBlocks`` over the code pages decides each such sequence's pages from now on."""
        self.code_blocks = blocks
        self.code_pages.attach()

    def attach_kv_blocks(self, blocks: Any) -> None:
        """The engine's ``KVBlocks`` decides each sequence's blocks from now on."""
        self.kv_blocks = blocks
        self.pool.attach()

    def adopt_prefix(self, seq_id: int, n: int) -> None:
        """The manager gave ``seq_id`` cached blocks holding positions [0, n) (prefix caching): its cache starts there."""
        c = self._cache(seq_id, 0)
        c.sync()
        c.length = n
