"""Which KV cache each sequence of ``runner.TorchModel`` gets: a block table in the paged pool (CUDA), a
compressed cache (TurboQuant / kv_bits; static on CUDA, its codes pages of the code pool in the server's
--turbo-kv format), or a cache of its own that grows (CPU, eager CUDA models)."""

from __future__ import annotations

from typing import Any

import torch

from swiftlm.backend import StepBatch
from swiftlm.turboquant.presets import KVFormat

from .affine_decode import static_ok
from .compressed_cache import CompressedCache
from .kv_cache import SeqCache
from .kv_pool import PagedSeqCache


class SeqCaches:
    """Mixed into ``runner.TorchModel`` (``caches``, ``kv_formats``, ``kv_default``, ``pool``, ``free_slots``,
    ``turbo_free``, ``code_pages``, ``kv_blocks``, ``code_blocks``, ``graphs``, ``static``, ``module``, ``info``,
    ``device``, ``dtype``, ``kv_fp8``: --kv-cache-dtype fp8's scales or None)."""

    kv_fp8: Any = None

    def _cache(self, seq_id: int, start: int) -> SeqCache:
        c = self.caches.get(seq_id)
        fmt = self.kv_formats.get(seq_id, self.kv_default)
        if c is None and fmt.compressed:
            c = self.caches[seq_id] = self._compressed(fmt)
        if c is None:
            if self.static:
                c = self.pool.take() if self.pool is not None else None
                if c is None:  # more sequences than slots (or no pool): a standalone fixed cache
                    c = (
                        self.free_slots.pop()
                        if self.free_slots
                        else SeqCache(
                            self.module.a,
                            self.dtype,
                            self.device,
                            capacity=self.info.context_length,
                            fp8=self.kv_fp8,
                        )
                    )
                elif self.kv_blocks is not None:  # the engine's block manager grows this list (kv_blocks.py)
                    c.blocks = self.kv_blocks.table(seq_id)
                c.length = 0
            else:
                # a fresh cache sized to this sequence, not a finished sequence's: reused caches' capacities
                # only ratchet up, so the KV allocated would grow over a long run
                c = SeqCache(self.module.a, self.dtype, self.device, fp8=self.kv_fp8)
            self.caches[seq_id] = c
        if isinstance(c, PagedSeqCache):
            c.sync()  # blocks the manager added since the last step -> the slot's table row
        elif isinstance(c, CompressedCache) and c.paged:
            if self.code_blocks is not None and not c.page_list:  # the manager's live list for this sequence
                c.set_pages(self.code_blocks.table(seq_id))
            c.sync_pages()  # pages added since the last step -> the cache's device table
        if c.length > start:  # recompute / rollback: later positions are simply overwritten
            c.length = start
        elif c.length < start:
            raise RuntimeError(f"sequence {seq_id}: KV cache holds {c.length} positions, step starts at {start}")
        return c

    def _triton_ok(self) -> bool:
        from swiftlm import cuda_ext

        return self.device.type == "cuda" and cuda_ext.enabled("cuda")

    def _static_turbo(self, fmt: KVFormat) -> bool:
        return fmt.kind == "turbo" and not fmt.keep_layers and self._triton_ok()

    def _static_ok(self, fmt: KVFormat) -> bool:
        """CUDA + TurboQuant or kv_bits: a static cache (storage for the whole context, allocated once and
        reused by later requests with the same format) so that decode steps replay one CUDA graph; the
        server's TurboQuant format: codes in pages of the shared pool instead, taken as the sequence grows."""
        return (
            self.graphs is not None and self._triton_ok() and (self._static_turbo(fmt) or static_ok(self.module.a, fmt))
        )

    def _compressed(self, fmt: KVFormat) -> CompressedCache:
        pooled = self.turbo_free.get(fmt)
        if pooled:
            c = pooled.pop()
            c.reset()
            return c
        # 16-bit rows: bf16 on the GPU (the model's dtype); fp16 on CPU, upcast when attended
        dense = self.dtype if self.dtype != torch.float32 else torch.float16
        triton_ok = self._triton_ok()
        static = self._static_ok(fmt)
        pages = self.code_pages if static and self.code_pages is not None and fmt == self.code_pages.fmt else None
        c = CompressedCache(
            self.module.a,
            fmt,
            self.dtype,
            self.device,
            dense_dtype=dense,
            capacity=self.info.context_length if static else None,
            pages=pages,
            stage=self.stage_budget,
        )
        c.use_triton = triton_ok
        if fmt.kind == "turbo":
            c.kc.use_triton = c.vc.use_triton = c.use_triton
        return c

    def _new_caches(self, batch: StepBatch, failed: dict[int, str]) -> StepBatch:
        """Compressed caches of the step's new sequences, made before the forward: one that does not fit in
        device memory (a static cache holds a whole context unless its codes are pages) fails its own request,
        not the step's other rows."""
        bad: dict[int, str] = {}
        for w in batch.seqs:
            if w.seq_id in self.caches:
                continue
            fmt = self.kv_formats.get(w.seq_id, self.kv_default)
            if not fmt.compressed:
                continue
            try:
                self._cache(w.seq_id, w.start_pos)
            except torch.OutOfMemoryError:
                self.caches.pop(w.seq_id, None)
                bad[w.seq_id] = (
                    f"not enough device memory for this request's {fmt.name} KV cache (a whole "
                    f"{self.info.context_length}-token context); requests in the server's --turbo-kv "
                    "format take pages of the code pool instead"
                )
        if not bad:
            return batch
        failed.update(bad)
        keep = [i for i, w in enumerate(batch.seqs) if w.seq_id not in bad]
        ids = batch.input_ids[keep] if batch.input_ids is not None else None
        return StepBatch([batch.seqs[i] for i in keep], batch.preempted, ids)
