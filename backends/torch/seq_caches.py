"""Which KV cache each sequence of ``runner.TorchModel`` gets: a block table in the paged pool (CUDA), a
compressed cache (TurboQuant / kv_bits; static on CUDA, its codes pages of the code pool in the server's
--turbo-kv format), or a cache of its own that grows (CPU, eager CUDA models); where a finished sequence's
storage goes; which LoRA adapter a step's rows run."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from swiftlm.backend import SeqWork, StepBatch
from swiftlm.turboquant.presets import KVFormat

from .affine_decode import static_ok
from .code_pages import CodePages
from .compressed_cache import CompressedCache, StageBudget
from .kv_cache import GROW_ROWS, SeqCache
from .kv_pool import PagedSeqCache, SlotPool


def triton_ok(device: torch.device) -> bool:
    from swiftlm import cuda_ext

    return device.type == "cuda" and cuda_ext.enabled("cuda")


def static_turbo(fmt: KVFormat, device: torch.device) -> bool:
    """A TurboQuant format whose static caches may keep their codes in pages of one pool (``code_pages.py``)."""
    return fmt.kind == "turbo" and not fmt.keep_layers and triton_ok(device)


def warm_up_waves(fmt: KVFormat, device: torch.device, rows: int) -> list[list[int]]:
    """The start-up warm-up's requests (swiftlm/warm_up.py) for a graphed server of KV format ``fmt`` with ``rows``
    sequences at most: a TurboQuant format's static caches compile their prompt and decode kernels and capture a CUDA
    graph per batch size of compressed decode rows on first use.  First a short prompt, which decodes alone beside
    the chunks of a prompt of several chunks (that prompt attends its compressed prefix; Triton compiles a kernel
    apart for one row, so one decode row beside a prompt chunk is a path of its own); then prompts past the window,
    one per batch size up to 16 (larger batches are captured when they first occur).  Other formats on CUDA: the first
    wave only.  A prompt longer than a chunk runs its chunks eagerly (prompt graphs replay single-chunk prompts), and
    the first such step of a server took 3.4-3.9 s on an H200 whether or not Triton's cache was warm (8B shape; a
    16-bit server's first 4,000-token prompt, a TurboQuant server's warm-up); [] on the CPU."""
    long = 1300  # a prompt of several chunks
    if not static_turbo(fmt, device):
        return [[192, long]] if device.type == "cuda" else []
    short = fmt.window + 64
    return [[short, long], [short + 24 * i for i in range(min(rows, 16))]]


class SeqCaches:
    """The running sequences' KV caches (``caches``) and formats (``formats``: decided at admission), made on
    first use, and the storage of finished sequences kept for reuse (``free_slots``: standalone fixed caches;
    ``turbo_free``: static compressed caches per format).  ``caches`` and ``formats`` are the model's own dicts
    (a pipeline stage reads them too)."""

    kv_blocks: Any = None  # swiftlm.kv_blocks.KVBlocks: the engine's block manager (attach_kv_blocks)
    code_blocks: Any = None  # the engine's manager of the code pages (attach_code_pages)
    stage_budget: StageBudget | None = None  # prompts of compressed caches held in 16 bits (load_model)
    code_pages: CodePages | None = None  # the server's TurboQuant format: codes of its static caches in pages

    def __init__(
        self,
        a: Any,
        device: torch.device,
        dtype: torch.dtype,
        context: int,
        kv_default: KVFormat,
        caches: dict[int, Any],
        formats: dict[int, KVFormat],
        *,
        static: bool = False,
        pool: SlotPool | None = None,
        graphed: bool = False,
        fp8: Any = None,
    ):
        """``static``: fixed-capacity caches (CUDA), from ``pool`` when it has a slot; ``graphed``: decode steps
        replay CUDA graphs (compressed caches are then static where their kernels allow); ``fp8``: --kv-cache-dtype
        fp8's scales (kv_fp8.KVScales) or None."""
        self.a, self.device, self.dtype, self.context = a, device, dtype, context
        self.kv_default, self.caches, self.formats = kv_default, caches, formats
        self.static, self.pool, self.graphed, self.fp8 = static, pool, graphed, fp8
        self.free_slots: list[SeqCache] = []
        self.turbo_free: dict[KVFormat, list[CompressedCache]] = {}

    def admit(self, seqs: Iterable[SeqWork]) -> None:
        """New sequences' formats, from their requests (the server's default where they name none)."""
        for w in seqs:
            if w.seq_id not in self.caches:
                self.formats[w.seq_id] = self.kv_default if w.kv_format is None else w.kv_format

    def fmt(self, seq_id: int) -> KVFormat:
        return self.formats.get(seq_id, self.kv_default)

    def get(self, seq_id: int, start: int) -> Any:
        """The sequence's cache (made on first use), holding positions [0, start) for a step that starts there."""
        c = self.caches.get(seq_id)
        fmt = self.fmt(seq_id)
        if c is None and fmt.compressed:
            c = self.caches[seq_id] = self.compressed(fmt)
        if c is None:
            if self.static:
                c = self.pool.take() if self.pool is not None else None
                if c is None:  # more sequences than slots (or no pool): a standalone fixed cache
                    c = self.free_slots.pop() if self.free_slots else self.plain(self.context)
                elif self.kv_blocks is not None:  # the engine's block manager grows this list (kv_blocks.py)
                    c.blocks = self.kv_blocks.table(seq_id)
                c.length = 0
            else:
                # a fresh cache sized to this sequence, not a finished sequence's: reused caches' capacities
                # only ratchet up, so the KV allocated would grow over a long run
                c = self.plain()
            self.caches[seq_id] = c
        if isinstance(c, PagedSeqCache):
            c.sync()  # blocks the manager added since the last step -> the slot's table row
        elif isinstance(c, CompressedCache) and c.paged:
            if self.code_blocks is not None and not c.pages.list:  # the manager's live list for this sequence
                c.pages.set(self.code_blocks.table(seq_id))
            c.pages.sync()  # pages added since the last step -> the cache's device table
        if c.length > start:  # recompute / rollback: later positions are simply overwritten
            c.length = start
        elif c.length < start:
            raise RuntimeError(f"sequence {seq_id}: KV cache holds {c.length} positions, step starts at {start}")
        return c

    def plain(self, capacity: int = GROW_ROWS) -> SeqCache:
        return SeqCache(self.a, self.dtype, self.device, capacity=capacity, fp8=self.fp8)

    def static_ok(self, fmt: KVFormat) -> bool:
        """CUDA + TurboQuant or kv_bits: a static cache (storage for the whole context, allocated once and
        reused by later requests with the same format) so that decode steps replay one CUDA graph; the
        server's TurboQuant format: codes in pages of the shared pool instead, taken as the sequence grows."""
        return self.graphed and triton_ok(self.device) and (static_turbo(fmt, self.device) or static_ok(self.a, fmt))

    def compressed(self, fmt: KVFormat) -> CompressedCache:
        pooled = self.turbo_free.get(fmt)
        if pooled:
            c = pooled.pop()
            c.reset()
            return c
        static = self.static_ok(fmt)
        pages = self.code_pages if static and self.code_pages is not None and fmt == self.code_pages.fmt else None
        c = CompressedCache(
            self.a,
            fmt,
            self.dtype,
            self.device,
            # 16-bit rows: bf16 on the GPU (the model's dtype); fp16 on CPU, upcast when attended
            dense_dtype=self.dtype if self.dtype != torch.float32 else torch.float16,
            capacity=self.context if static else None,
            pages=pages,
            stage=self.stage_budget,
        )
        c.use_triton = triton_ok(self.device)
        if fmt.kind == "turbo":
            c.kc.use_triton = c.vc.use_triton = c.use_triton
        return c

    def make_compressed(self, batch: StepBatch, failed: dict[int, str]) -> StepBatch:
        """Compressed caches of the step's new sequences, made before the forward: one that does not fit in
        device memory (a static cache holds a whole context unless its codes are pages) fails its own request,
        not the step's other rows."""
        bad: dict[int, str] = {}
        for w in batch.seqs:
            fmt = self.fmt(w.seq_id)
            if w.seq_id in self.caches or not fmt.compressed:
                continue
            try:
                self.get(w.seq_id, w.start_pos)
            except torch.OutOfMemoryError:
                self.caches.pop(w.seq_id, None)
                bad[w.seq_id] = (
                    f"not enough device memory for this request's {fmt.name} KV cache (a whole "
                    f"{self.context}-token context); requests in the server's --turbo-kv "
                    "format take pages of the code pool instead"
                )
        failed.update(bad)
        return without(batch, bad)

    def free(self, seq_ids: Sequence[int]) -> None:
        """Finished sequences: their blocks and pages back to the managers, their storage back for reuse."""
        for s in seq_ids:
            c = self.caches.pop(s, None)
            self.formats.pop(s, None)
            if self.kv_blocks is not None:
                self.kv_blocks.free(s)
            if self.code_blocks is not None:
                self.code_blocks.free(s)
            if isinstance(c, CompressedCache):
                c.drop_stage()
                if c.static:
                    c.release_pages()  # now, not when the cache is reused
                    self.turbo_free.setdefault(c.fmt, []).append(c)
            elif isinstance(c, PagedSeqCache):
                self.pool.give_back(c)
            elif c is not None and self.static and isinstance(c, SeqCache):
                self.free_slots.append(c)


def without(batch: StepBatch, drop: dict[int, Any]) -> StepBatch:
    """``batch`` less the sequences in ``drop`` (their on-device input ids too)."""
    if not drop:
        return batch
    keep = [i for i, w in enumerate(batch.seqs) if w.seq_id not in drop]
    ids = batch.input_ids[keep] if batch.input_ids is not None else None
    return StepBatch([batch.seqs[i] for i in keep], batch.preempted, ids)


def adapter_rows(batch: StepBatch, lora: Any) -> tuple[StepBatch, dict[int, int], dict[int, str]]:
    """Each sequence's LoRA adapter index in ``lora`` (lora.LoraSet or None), from ``params.adapter``; sequences
    naming an adapter not served fail (and leave the batch) instead of running on the base."""
    aid: dict[int, int] = {}
    failed: dict[int, str] = {}
    for w in batch.seqs:
        name = getattr(w.params, "adapter", None)
        try:
            aid[w.seq_id] = lora.index(name) if lora is not None else (0 if not name else -1)
        except KeyError:
            aid[w.seq_id] = -1
        if aid[w.seq_id] < 0:
            failed[w.seq_id] = f"LoRA adapter {name!r} is not loaded on this model"
    return without(batch, failed), aid, failed
