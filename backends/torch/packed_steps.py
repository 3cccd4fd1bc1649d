"""The packed prompt steps of ``runner.TorchModel`` on CUDA: first prompt chunks (position 0) of several
requests in one forward (``graphs.prefill_packed_static``, replayed from a graph per token bucket by
``prefill_graphs``), a step's decode rows together with them (``mixed_step``), and prompt rests after a cached
prefix as rows of the batched decode graph; the capture of those graphs at start-up."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from swiftlm.backend import SeqWork, StepBatch

from .graphs import prefill_packed_static
from .kv_pool import PagedSeqCache, SlotPool
from .model import PackedAttend
from .packed_attention import cu_seqlens, pack, prefill_attention
from .prefill_graphs import PackedGraphs
from .seq_caches import SeqCaches
from .staging import stager

log = logging.getLogger(__name__)

# a short prompt chunk past position 0 (the rest of a prompt whose first blocks came from the prefix cache) runs
# as rows of the batched decode graph when its rows x positions stay under this (each row reads its prefix)
LATE_CHUNK_ROW_POSITIONS = 1 << 17
LATE_CHUNK_ROWS = 32  # rows such a step may have (batched decode graphs are captured up to this or --parallel)
EMBED_PACK_TOKENS = 4096  # tokens per packed embedding forward


def packed_hidden_states(module: Any, prompts: list[list[int]], device: torch.device) -> list[Any]:
    """Each prompt's final-norm hidden states [T, hidden] as float32 numpy (embeddings).  Prompts are packed into
    forwards of up to EMBED_PACK_TOKENS tokens (one GEMM per weight for the pack; attention causal within each
    prompt and blind across them), so a vector differs from the prompt's solo run only by summation order."""
    out: list[Any] = []
    i = 0
    while i < len(prompts):
        j, n = i, 0
        while j < len(prompts) and (j == i or n + len(prompts[j]) <= EMBED_PACK_TOKENS):
            n += len(prompts[j])
            j += 1
        group = prompts[i:j]
        ids = torch.tensor([t for p in group for t in p], dtype=torch.long, device=device)
        h = module.hidden(ids, PackedAttend([len(p) for p in group], device), 0).float().cpu()
        out.extend(x.numpy() for x in h.split([len(p) for p in group]))
        i = j
    return out


class PromptChunks:
    """A step's first prompt chunks that a packed forward takes (``PackedSteps.packable``) and their caches,
    each worked out on first use and once per step: the mixed path reads them, then, where it declines, the
    prompt-only path."""

    def __init__(self, steps: PackedSteps, batch: StepBatch, aid: dict[int, int] | None):
        self._steps, self._batch, self._aid = steps, batch, aid

    @functools.cached_property
    def seqs(self) -> list[SeqWork]:
        return self._steps.packable(self._batch, self._aid)

    @functools.cached_property
    def caches(self) -> list[Any]:
        return [self._steps.seqs.get(w.seq_id, 0) for w in self.seqs]


class PackedSteps:
    """Prompt chunks of several sequences of ``seqs`` in one forward of ``module`` over the paged ``pool``:
    replayed from ``prefill_graphs`` (first chunks) or ``mixed_graphs`` (first chunks with the step's decode
    rows) where they fit, None where the model has no such graphs."""

    def __init__(
        self,
        seqs: SeqCaches,
        module: Any,
        pool: SlotPool | None,
        prefill_graphs: PackedGraphs | None = None,
        mixed_graphs: PackedGraphs | None = None,
    ):
        self.seqs, self.module, self.pool, self.device = seqs, module, pool, seqs.device
        self.prefill_graphs, self.mixed_graphs = prefill_graphs, mixed_graphs

    def packable(self, batch: StepBatch, aid: dict[int, int] | None) -> list[SeqWork]:
        """The step's first prompt chunks (start 0) that a packed forward takes: no media, no adapter, no
        compressed cache."""
        return [
            w
            for w in batch.seqs
            if w.start_pos == 0
            and len(w.tokens) > 1
            and w.media is None
            and not (aid or {}).get(w.seq_id)  # adapter prompts: eager, per sequence
            and not self.seqs.fmt(w.seq_id).compressed
        ]

    def mixed(
        self, batch: StepBatch, decode: list[SeqWork], aid: dict[int, int], chunks: PromptChunks | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """On CUDA, the decode rows and the first prompt chunks of a step in one forward (``mixed_step``)
        when all of them hold pool slots and fit its graphs: (decode logits [B, V], {prompt seq id:
        logits}); None otherwise (two forwards, as before).  ``chunks``: the step's ``PromptChunks``, shared
        with ``prefill``."""
        mg = self.mixed_graphs
        if mg is None or self.pool is None or any(aid.get(w.seq_id) for w in decode):
            return None
        chunks = chunks if chunks is not None else PromptChunks(self, batch, aid)
        work = chunks.seqs
        if not mg.fits(sum(len(w.tokens) for w in work), len(work), len(decode)):
            return None
        dcaches = [self.seqs.get(w.seq_id, w.start_pos) for w in decode]
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
    def prefill(
        self, batch: StepBatch, aid: dict[int, int] | None = None, chunks: PromptChunks | None = None
    ) -> dict[int, torch.Tensor]:
        """On CUDA, the first chunks (start 0) of prompts with plain pool-slot caches run as one packed
        forward (``graphs.prefill_packed_static``): replayed from a graph (``prefill_graphs``) when
        they fit its largest bucket, one prompt alone too; else eagerly, for two or more.  Their
        last-row logits.  ``chunks``: the step's ``PromptChunks``, shared with ``mixed``."""
        if self.pool is None:
            return {}
        chunks = chunks if chunks is not None else PromptChunks(self, batch, aid)
        work = chunks.seqs
        pg = self.prefill_graphs
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

    def late_chunks(self, batch: StepBatch, aid: dict[int, int], graphs: Any) -> dict[int, torch.Tensor]:
        """Short prompt chunks past position 0 on the paged pool (the rest of a prompt after its cached prefix
        blocks) as rows of one batched decode replay of ``graphs``: each token a row at its own position in its
        sequence's slot; every row's K/V is written before any row attends, and a row attends up to its own
        position, so the chunk is causal.  Instead of an eager forward per chunk, which is bound by its kernel
        launches.  Their last rows' logits."""
        g = graphs
        if g is None or self.pool is None or (g.use_graph and not g.paged_attention):  # (no graph per length)
            return {}
        slots: list[int] = []
        toks: list[int] = []
        pos: list[int] = []
        ends: list[tuple[Any, int, Any]] = []
        for w in batch.seqs:
            T, s0 = len(w.tokens), w.start_pos
            if (
                T < 2
                or s0 == 0
                or w.media is not None
                or aid.get(w.seq_id)
                or len(slots) + T > max(self.pool.n, LATE_CHUNK_ROWS)
                or T * (s0 + T) > LATE_CHUNK_ROW_POSITIONS
                or self.seqs.fmt(w.seq_id).compressed
            ):
                continue
            c = self.seqs.get(w.seq_id, s0)
            if not isinstance(c, PagedSeqCache):
                continue
            slots += [c.slot] * T
            toks += list(w.tokens)
            pos += range(s0, s0 + T)
            ends.append((w, len(slots) - 1, c))
        if not ends:
            return {}
        logits = g.run_batch(self.pool, slots, toks, pos)
        for w, _last, c in ends:
            c.length = w.start_pos + len(w.tokens)
        return {w.seq_id: logits[last] for w, last, _ in ends}

    def capture(self, graphs: Any) -> dict[str, Any]:
        """Capture every CUDA graph at start-up: ``graphs``' batched decode at each batch size (a lone row: size 1;
        short prompt rests: LATE_CHUNK_ROWS), the prompt buckets and the mixed steps.  Their count, seconds and
        bytes."""
        torch.cuda.synchronize()
        m0, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        with torch.inference_mode():
            graphs.precapture(self.pool, max(self.pool.n, LATE_CHUNK_ROWS))
            self.prefill_graphs.precapture()
            self.mixed_graphs.precapture()
        torch.cuda.synchronize()
        cap = {
            "graphs": graphs.captures,
            "seconds": round(time.perf_counter() - t0, 3),
            "bytes": torch.cuda.memory_reserved() - m0,
        }
        log.info(
            "captured %d CUDA graphs (batched decode, prompt buckets, mixed steps) in %.2f s (%.0f MB)",
            cap["graphs"],
            cap["seconds"],
            cap["bytes"] / 2**20,
        )
        return cap
