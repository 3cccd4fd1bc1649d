"""What ``runner.TorchModel``'s KV memory holds: the running sequences' bytes against a 16-bit cache's
(``/health``'s compression ratio) and the storage allocated (``memory()``: pools, pooled and live caches)."""

from __future__ import annotations

from typing import Any

import torch

from .compressed_cache import CompressedCache
from .devices import device_memory
from .kv_pool import PagedSeqCache, SlotPool
from .seq_caches import SeqCaches
from .shared_kv import ForkedCache, prefixes


class KVAccounting:
    """The figures of ``seqs``' caches and of the paged ``pool`` (None: none).  ``row_bytes``: one position's KV
    bytes as stored (ModelInfo.kv_bytes_per_token); ``weight_bytes``: the weights' (ModelInfo.weight_bytes)."""

    def __init__(self, seqs: SeqCaches, pool: SlotPool | None, row_bytes: int, weight_bytes: int):
        self.seqs, self.pool, self.row_bytes, self.weight_bytes = seqs, pool, row_bytes, weight_bytes
        a = seqs.a
        self.row16 = 2 * a.layers * a.kv_heads * a.head_dim * 2  # one position in a 16-bit cache

    def kv_stats(self) -> dict[str, int]:
        """KV storage the running sequences hold now, and what a 16-bit cache would need for them."""
        held = fp16 = 0
        caches = list(self.seqs.caches.values())
        blocks = self.seqs.kv_blocks
        if blocks is not None:  # the paged pool: the blocks held (shared prefix blocks once), from the manager
            held = blocks.used() * self.pool.block_bytes
            fp16 = held * self.row16 // max(1, self.row_bytes)
        for c in caches:
            if blocks is not None and isinstance(c, PagedSeqCache):
                continue
            if isinstance(c, CompressedCache):
                held += c.nbytes()
                fp16 += c.length * self.row16
            else:  # a fork's shared prompt rows are counted once, below
                rows = c.own if isinstance(c, ForkedCache) else c.length
                # a trimmed window layer holds fewer rows than positions: count its storage
                held += c.nbytes() if getattr(c, "trimmed", False) else rows * self.row_bytes
                fp16 += rows * self.row16
        for p in prefixes(caches):
            held += p.length * self.row_bytes
            fp16 += p.length * self.row16
        return {"bytes": held, "fp16_bytes": fp16}

    def reset_peak_memory(self) -> None:
        if self.seqs.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.seqs.device)

    def memory(self, packed_weights: int = 0) -> dict[str, Any]:
        """Measured memory.  CUDA: the caching allocator's figures (active = allocated, peak = max
        allocated, cache = reserved but unallocated).  CPU, where torch keeps no allocator counts:
        this process's resident memory (active = RSS, peak = peak RSS) and the bytes glibc malloc
        holds free (cache).  Plus the weights (``packed_weights``: cpu_packed.py's second copy) and the KV
        storage allocated now (slot pool, live and pooled caches), counted from the tensors."""
        caches = list(self.seqs.caches.values())
        # (code pages: counted once, with the pool)
        kv = sum(c.nbytes() - getattr(c, "pages_bytes", int)() for c in caches if getattr(c, "slot", None) is None)
        kv += sum(p.nbytes() for p in prefixes(caches))  # forks' shared prompt rows, once
        kv += sum(c.nbytes() for c in list(self.seqs.free_slots))
        kv += sum(c.nbytes() for cs in list(self.seqs.turbo_free.values()) for c in list(cs))
        for pool in (self.pool, self.seqs.code_pages):
            kv += pool.nbytes() if pool is not None else 0
        out = device_memory(self.seqs.device)
        out.update(weights=self.weight_bytes, kv_allocated=kv, packed_weights=packed_weights)
        return out
