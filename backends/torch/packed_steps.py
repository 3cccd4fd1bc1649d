"""The packed prompt steps of ``runner.TorchModel`` on CUDA: first prompt chunks (position 0) of several
requests in one forward (``graphs.prefill_packed_static``, replayed from a graph per token bucket by
``prefill_graphs``), and a step's decode rows together with them (``mixed_step``)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from swiftlm.backend import SeqWork, StepBatch

from .graphs import prefill_packed_static
from .packed_attention import cu_seqlens, pack, prefill_attention
from .staging import stager


class PromptChunks:
    """A step's first prompt chunks that a packed forward takes (``PackedSteps._packable``) and their caches,
    each worked out on first use and once per step: the mixed path reads them, then, where it declines, the
    prompt-only path."""

    def __init__(self, model: PackedSteps, batch: StepBatch, aid: dict[int, int] | None):
        self._model, self._batch, self._aid = model, batch, aid

    @functools.cached_property
    def seqs(self) -> list[SeqWork]:
        return self._model._packable(self._batch, self._aid)

    @functools.cached_property
    def caches(self) -> list[Any]:
        return [self._model._cache(w.seq_id, 0) for w in self.seqs]


class PackedSteps:
    """Mixed into ``runner.TorchModel`` (which holds ``pool``, ``device``, ``module``, ``kv_formats``,
    ``kv_default``, ``prefill_graphs``, ``mixed_graphs`` and ``_cache``)."""

    def _packable(self, batch: StepBatch, aid: dict[int, int] | None) -> list[SeqWork]:
        """The step's first prompt chunks (start 0) that a packed forward takes: no media, no adapter, no
        compressed cache."""
        return [
            w
            for w in batch.seqs
            if w.start_pos == 0
            and len(w.tokens) > 1
            and w.media is None
            and not (aid or {}).get(w.seq_id)  # adapter prompts: eager, per sequence
            and not self.kv_formats.get(w.seq_id, self.kv_default).compressed
        ]

    def _mixed(
        self, batch: StepBatch, decode: list[SeqWork], aid: dict[int, int], chunks: PromptChunks | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """On CUDA, the decode rows and the first prompt chunks of a step in one forward (``mixed_step``)
        when all of them hold pool slots and fit its graphs: (decode logits [B, V], {prompt seq id:
        logits}); None otherwise (two forwards, as before).  ``chunks``: the step's ``PromptChunks``, shared
        with ``_prefill_packed``."""
        mg = getattr(self, "mixed_graphs", None)
        if mg is None or self.pool is None or any(aid.get(w.seq_id) for w in decode):
            return None
        chunks = chunks if chunks is not None else PromptChunks(self, batch, aid)
        work = chunks.seqs
        if not mg.fits(sum(len(w.tokens) for w in work), len(work), len(decode)):
            return None
        dcaches = [self._cache(w.seq_id, w.start_pos) for w in decode]
        pcaches = chunks.caches
        if any(getattr(c, "slot", None) is None for c in dcaches + pcaches):
            return None
        p_logits, d_logits = mg.run(
            *pack([w.tokens for w in work], [c.slot for c in pcaches]),
            [w.tokens[0] for w in decode],
            [c.slot for c in dcaches],
            [w.start_pos for w in decode],
        )
        for w, c in zip(work, pcaches):
            c.length = len(w.tokens)
        for w, c in zip(decode, dcaches):
            c.length = w.start_pos + 1
        return d_logits, {w.seq_id: p_logits[n] for n, w in enumerate(work)}

    @torch.inference_mode()
    def _prefill_packed(
        self, batch: StepBatch, aid: dict[int, int] | None = None, chunks: PromptChunks | None = None
    ) -> dict[int, torch.Tensor]:
        """On CUDA, the first chunks (start 0) of prompts with plain pool-slot caches run as one packed
        forward (``graphs.prefill_packed_static``): replayed from a graph (``prefill_graphs``) when
        they fit its largest bucket, one prompt alone too; else eagerly, for two or more.  Their
        last-row logits.  ``chunks``: the step's ``PromptChunks``, shared with ``_mixed``."""
        if self.pool is None:
            return {}
        chunks = chunks if chunks is not None else PromptChunks(self, batch, aid)
        work = chunks.seqs
        pg = getattr(self, "prefill_graphs", None)  # (pipeline ranks build no graphs)
        graphed = pg is not None and pg.fits(sum(len(w.tokens) for w in work), len(work))
        if len(work) < (1 if graphed else 2):
            return {}
        caches = chunks.caches
        keep = [(w, c) for w, c in zip(work, caches) if getattr(c, "slot", None) is not None]
        if len(keep) < (1 if graphed else 2):
            return {}
        toks, slots, pos, seg, last = pack([w.tokens for w, _ in keep], [c.slot for _, c in keep])
        if graphed and len(keep) == len(work):
            logits, _ = pg.run(toks, slots, pos, seg, last)
        else:
            self.pool.flush()
            host = torch.tensor([toks, slots, pos, seg])
            t, s_, p, g = stager(self.device).to_device(host).unbind(0)
            last_t = stager(self.device).to_device(torch.tensor(last))
            lengths = [len(w.tokens) for w, _ in keep]
            cu = stager(self.device).to_device(cu_seqlens(lengths))
            with prefill_attention(self.device, len(toks)):
                logits = prefill_packed_static(self.module, self.pool, t, s_, p, g, last_t, cu, max(lengths))
        for w, c in keep:
            c.length = len(w.tokens)
        return {w.seq_id: logits[n] for n, (w, _) in enumerate(keep)}
