"""What ``runner.TorchModel``'s KV memory holds: the running sequences' bytes against a 16-bit cache's
(``/health``'s compression ratio) and the storage allocated (``memory()``: pools, pooled and live caches)."""

from __future__ import annotations

from typing import Any

import torch

from .compressed_cache import CompressedCache
from .devices import device_memory
from .kv_pool import PagedSeqCache
from .shared_kv import ForkedCache, prefixes


class KVAccounting:
    """Mixed into ``runner.TorchModel`` (``caches``, ``kv_blocks``, ``pool``, ``code_pages``, ``free_slots``,
    ``turbo_free``, ``module``, ``info``, ``device``)."""

    def kv_stats(self) -> dict[str, int]:
        """KV storage the running sequences hold now, and what a 16-bit cache would need for them."""
        held = fp16 = 0
        per_tok16 = 2 * self.module.a.layers * self.module.a.kv_heads * self.module.a.head_dim * 2
        caches = list(self.caches.values())
        blocks = self.kv_blocks
        if blocks is not None:  # the paged pool: the blocks held (shared prefix blocks once), from the manager
            held = blocks.used() * self.pool.block_bytes
            fp16 = held * per_tok16 // max(1, self.info.kv_bytes_per_token)
        for c in caches:
            if blocks is not None and isinstance(c, PagedSeqCache):
                continue
            if isinstance(c, CompressedCache):
                held += c.nbytes()
                fp16 += c.length * per_tok16
            else:  # a fork's shared prompt rows are counted once, below
                rows = c.own if isinstance(c, ForkedCache) else c.length
                # a trimmed window layer holds fewer rows than positions: count its storage
                held += c.nbytes() if getattr(c, "trimmed", False) else rows * self.info.kv_bytes_per_token
                fp16 += rows * per_tok16
        for p in prefixes(caches):
            held += p.length * self.info.kv_bytes_per_token
            fp16 += p.length * per_tok16
        return {"bytes": held, "fp16_bytes": fp16}

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory(self) -> dict[str, Any]:
        """Measured memory.  CUDA: the caching allocator's figures (active = allocated, peak = max
        allocated, cache = reserved but unallocated).  CPU, where torch keeps no allocator counts:
        this process's resident memory (active = RSS, peak = peak RSS) and the bytes glibc malloc
        holds free (cache).  Plus the weights and the KV storage allocated now (slot pool, live
        and pooled caches), counted from the tensors."""
        caches = list(self.caches.values())
        # (code pages: counted once, with the pool)
        kv = sum(c.nbytes() - getattr(c, "pages_bytes", int)() for c in caches if getattr(c, "slot", None) is None)
        kv += sum(p.nbytes() for p in prefixes(caches))  # forks' shared prompt rows, once
        kv += sum(c.nbytes() for c in list(self.free_slots))
        kv += sum(c.nbytes() for cs in list(self.turbo_free.values()) for c in list(cs))
        if self.pool is not None:
            kv += self.pool.nbytes()
        if self.code_pages is not None:
            kv += self.code_pages.nbytes()
        out = device_memory(self.device)
        out.update(
            weights=self.info.weight_bytes, kv_allocated=kv, packed_weights=getattr(self, "packed_weight_bytes", 0)
        )  # cpu_packed.py's second copy
        return out
