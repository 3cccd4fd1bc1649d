"""Where a sequence's KV lives and what of it is reused, decided on the engine thread when the
sequence is taken in and admitted: the model's paged KV pool (``kv_blocks.KVBlocks``, torch on CUDA)
and its TurboQuant code pages, which requests take pool blocks, and the prompt cache -- full pool
blocks shared by prefix caching, or the backend's prefix snapshots (``prefix_cache.PrefixCache``).
Owned by ``engine.Engine``; engine-thread only."""

from __future__ import annotations

import logging
from typing import Any

from .intake import Live
from .kv_blocks import KVBlocks
from .outputs import Out
from .prefix_cache import PrefixCache
from .scheduler import Scheduler

log = logging.getLogger("swiftlm.engine")  # the engine's logger: these records sit with the engine's own


class KVAdmission:
    """``live``: the engine's live requests by id; ``outs``: the engine's outputs of this step (a cache
    hit tells the caller how many prompt tokens it reused)."""

    def __init__(
        self,
        model: Any,
        scheduler: Scheduler,
        ctx_size: int,
        prompt_cache_bytes: int,
        live: dict[int, Live],
        outs: list[Out],
    ):
        self.model, self.scheduler, self.ctx_size = model, scheduler, ctx_size
        self.live, self.outs = live, outs
        self.code_format: Any = None  # the KV format whose codes are paged (code pages), if any
        self.kv_blocks = self.attach_pool(prompt_cache_bytes > 0)
        # prompt reuse needs the backend's snapshot/restore hooks (optional: ModelHooks.can_snapshot_prefix)
        can_cache = model.can_snapshot_prefix and self.kv_blocks is None
        self.prefix_cache = PrefixCache(prompt_cache_bytes if can_cache else 0)

    def attach_pool(self, prefix_caching: bool) -> KVBlocks | None:
        """The block manager of the model's paged KV pool, or None; a second one for its TurboQuant code
        pages.  Run at start (and by tests that give an idle engine's model a pool: with one, the
        prompt cache is its blocks)."""
        spec = self.model.kv_block_spec()
        blocks = None
        if spec is not None:
            blocks = KVBlocks(spec[0], spec[1], prefix_caching=prefix_caching)
            self.model.attach_kv_blocks(blocks)
            self.scheduler.blocks = blocks
            self.prefix_cache = PrefixCache(0)
        self.scheduler.max_positions = self.ctx_size
        code_spec = self.model.code_page_spec()
        if code_spec is not None:  # TurboQuant codes in pages: a second manager, no prefix caching (16-bit rows)
            codes = KVBlocks(code_spec[0], code_spec[1], prefix_caching=False)
            self.model.attach_code_pages(codes)
            self.scheduler.code_blocks, self.code_format = codes, code_spec[2]
        self.kv_blocks = blocks
        return blocks

    def mark_paged(self, live: Live) -> None:
        """A request whose KV is compressed (TurboQuant / kv_bits) takes no pool blocks: code pages when its
        format is the one the model pages (the server's --turbo-kv default), else a cache of its own."""
        if not self.scheduler.managed:
            return
        fmt = live.seq.kv_format
        if fmt.compressed:
            live.seq.paged = False
            live.seq.codes = fmt == self.code_format

    def eligible(self, live: Live) -> bool:
        """Whether the request reuses (and feeds) the prompt cache."""
        enabled = self.prefix_cache.enabled or (self.kv_blocks is not None and self.kv_blocks.prefix_caching)
        return (
            enabled
            and not live.seq.kv_format.compressed  # the prompt cache holds 16-bit rows
            and live.seq.media is None
            and not live.seq.params.adapter
        )  # LoRA: own KV

    def restore(self, live: Live) -> None:
        """A prompt-cache hit of a sequence about to run (``prefix_pending``): its KV restored now."""
        seq = live.seq
        live.prefix_pending = False
        if self.kv_blocks is not None:
            self._adopt_blocks(live)
            return
        if seq.num_computed or seq.output_tokens:  # preempted and resumed: recomputed, not restored
            return
        n, payload = self.prefix_cache.lookup(seq.prompt_tokens)
        if not n:
            return
        try:
            self.model.restore_prefix(seq.seq_id, payload, n)
            seq.num_computed = live.cached_tokens = n
            self.outs.append(Out(seq.seq_id, cached_tokens=n))
        except Exception:  # a cache failure costs a full prefill, never the request
            log.exception("prompt cache restore failed; prefilling in full")
            self.model.free([seq.seq_id])

    def _adopt_blocks(self, live: Live) -> None:
        """Prefix caching on the paged pool: the sequence starts with the cached full blocks of its
        prompt (a preempted one: of its prompt and output), shared, not copied."""
        seq, blocks = live.seq, self.kv_blocks
        if seq.num_computed or blocks.has(seq.seq_id) and blocks.table(seq.seq_id):
            return
        ids = blocks.match(seq.tokens(0, seq.prefill_target + 1))
        if not ids:
            return
        blocks.adopt(seq.seq_id, ids)
        n = len(ids) * blocks.block_size
        try:
            self.model.adopt_prefix(seq.seq_id, n)
        except Exception:  # a cache failure costs a full prefill, never the request
            log.exception("adopting cached KV blocks failed; prefilling in full")
            self.model.free([seq.seq_id])
            return
        seq.num_computed = n
        if not seq.output_tokens:
            live.cached_tokens = n
            self.outs.append(Out(seq.seq_id, cached_tokens=n))

    def commit(self, live: Live) -> None:
        """After a step (paged pool): the sequence's newly full blocks become matchable (prefix caching)."""
        if live.commit_blocks is None:
            live.commit_blocks = self.eligible(live)
        if live.commit_blocks:
            seq = live.seq
            self.kv_blocks.commit(seq.seq_id, seq.num_computed, seq.tokens)

    def save(self, live: Live, reason: str) -> None:
        """A sequence ends: its KV into the prompt cache (the backend's snapshot), unless it failed."""
        seq = live.seq
        if not self.prefix_cache.enabled or reason == "error" or seq.media is not None or seq.params.adapter:
            return
        try:
            snap = self.model.snapshot_prefix(seq.seq_id)
            if snap is not None:
                payload, nbytes, n = snap
                self.prefix_cache.insert(seq.all_tokens[:n], payload, nbytes)
        except Exception:  # pragma: no cover - caching must never fail a request
            log.exception("prompt cache snapshot failed")
