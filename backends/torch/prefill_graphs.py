"""Prompt chunks of up to ``BUCKETS[-1]`` tokens (the default step budget of 640 included) replayed
from CUDA graphs, alone or with a step's decode rows (``PackedGraphs``).

Run eagerly, a short prompt's forward is a few hundred kernel launches that take the host longer
than the device takes to run them, so each new stream would wait for the host before its first
token.  First chunks (position 0) of one or more prompts in pool
slots are packed as in ``graphs.prefill_packed_static`` and padded to a token bucket; one graph
per bucket, captured at start-up, replays the whole forward with one launch.

The padding is a prompt of its own: its tokens sit in the pool's scratch slot at positions
0, 1, ... and carry the segment id ``n`` (one past the real prompts), so the block-diagonal mask
keeps them out of every real prompt's attention and their KV writes land in the scratch row.
Logits come from ``MAX_PROMPTS`` rows (each real prompt's last token; unused entries read row 0
and are dropped).  The math per real token is the unpadded packed forward's; only the matmul
shapes differ (cuBLAS may pick another kernel for 64 rows than for 40: bf16 rounding).

With decode rows (``rows`` = the pool's size; ``mixed_step``) the step's decode rows ride in the same
forward after the padded prompt rows, padded to ``rows`` with scratch rows as the batched decode pads.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from .mixed_step import mixed_static
from .packed_attention import cu_seqlens, prefill_attention

BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768)
log = logging.getLogger(__name__)

MAX_PROMPTS = 64  # prompts per graphed chunk (their last rows go through the LM head)

# per graph kind (prompt chunks only; with a step's decode rows): its off switch (A/B runs) and the message of a
# start-up capture that failed
KINDS = {
    "prefill": ("SWIFTLM_PREFILL_GRAPHS", "capturing the prefill graphs failed; prompt chunks run eagerly"),
    "mixed": ("SWIFTLM_MIXED_STEP", "capturing the mixed prompt + decode graphs failed; such steps run two forwards"),
}


def bucket(tokens: int) -> int | None:
    """The smallest bucket holding ``tokens`` tokens, or None past the largest."""
    return next((b for b in BUCKETS if b >= tokens), None)


def padded_inputs(
    tokens: list[int],
    slots: list[int],
    pos: list[int],
    seg: list[int],
    last: list[int],
    width: int,
    scratch: int,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed chunk's rows padded to ``width`` tokens ([4, width]: tokens, slots, positions,
    segments) and, in one [2 * MAX_PROMPTS + 2] tensor, its ``last`` rows padded to MAX_PROMPTS then
    the cumulative lengths of its prompts and the padding (MAX_PROMPTS + 2 entries; zero-length
    sequences fill the rest)."""
    pad, n = width - len(tokens), len(last)
    host = torch.tensor(
        [tokens + [0] * pad, slots + [scratch] * pad, pos + [i % capacity for i in range(pad)], seg + [n] * pad]
    )
    lengths = [b - a for a, b in zip([-1] + last[:-1], last)]
    cu = cu_seqlens(lengths, width, MAX_PROMPTS + 2)
    return host, torch.cat([torch.tensor(last + [0] * (MAX_PROMPTS - n)), cu.long()])


class PackedGraphs:
    """One CUDA graph per token bucket of ``mixed_static`` over the packed, padded first prompt chunks and
    ``rows`` decode rows (``GraphDecoder``'s memory pool and capture; the graphs are kept here, in ``graphs``
    by width, not in the decoder's dict: they are bound to this instance's slot pool, and a check script may
    build one over another pool on the same decoder), or, where graphs are off (CPU, tests), the same padded
    forward run eagerly.

    ``rows`` = 0: prompt chunks only (the packed prefill; ``SWIFTLM_PREFILL_GRAPHS=0`` turns the graphs
    off: the eager packed path of before, for A/B runs).  ``rows`` = the pool's size: a step's decode rows
    too, padded to ``rows`` with scratch rows, every graph writing its logits into one shared buffer
    (``SWIFTLM_MIXED_STEP=0`` keeps the two forwards, for A/B runs)."""

    def __init__(self, decoder: Any, pool: Any, rows: int = 0, enabled: bool | None = None):
        self.decoder, self.pool = decoder, pool
        self.rows = rows  # decode rows per graph
        self.kind = "mixed" if rows else "prefill"
        env, self.failure_message = KINDS[self.kind]
        if enabled is None:
            enabled = os.environ.get(env, "1") != "0"
        self.enabled = enabled
        self.graphs: dict[int, tuple[Any, tuple, torch.Tensor]] = {}
        self.out: torch.Tensor | None = None  # with decode rows: the logits buffer every graph writes

    def fits(self, prompt_tokens: int, prompts: int, decode_rows: int = 0) -> bool:
        """A prompt-only instance takes no decode rows, one with decode rows 1 to ``rows``."""
        return (
            self.enabled
            and 0 < prompts <= MAX_PROMPTS
            and decode_rows <= self.rows
            and (decode_rows > 0) == (self.rows > 0)
            and bucket(prompt_tokens) is not None
        )

    def _inputs(
        self,
        p_tokens: list[int],
        p_slots: list[int],
        p_pos: list[int],
        p_seg: list[int],
        p_last: list[int],
        d_tokens: Sequence[int],
        d_slots: Sequence[int],
        d_pos: Sequence[int],
        width: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[4, width + rows] (tokens, slots, positions, segments: the padded prompt rows, then the decode
        rows padded with scratch rows) and the prompts' logit rows and cumulative lengths
        (``padded_inputs``)."""
        ph, tail = padded_inputs(p_tokens, p_slots, p_pos, p_seg, p_last, width, self.pool.scratch, self.pool.capacity)
        if not self.rows:
            return ph, tail
        pad = self.rows - len(d_tokens)
        dh = torch.tensor(
            [
                list(d_tokens) + [0] * pad,
                list(d_slots) + [self.pool.scratch] * pad,
                list(d_pos) + [0] * pad,
                [0] * self.rows,
            ]
        )
        return torch.cat([ph, dh], dim=1), tail

    def _fn(
        self, width: int, t: torch.Tensor, s: torch.Tensor, p: torch.Tensor, g: torch.Tensor, tail: torch.Tensor
    ) -> torch.Tensor:
        """Logits [MAX_PROMPTS + rows, V]: the prompts' logit rows, then the decode rows'."""
        last, cu = tail[:MAX_PROMPTS], tail[MAX_PROMPTS:].int()
        rows, splits = last, 0  # prompt-only: graphs.prefill_packed_static's call
        if self.rows:
            rows = torch.cat([last, width + torch.arange(self.rows, device=last.device)])
            splits = self.decoder.splits_for(self.pool.capacity, self.rows)
        with prefill_attention(self.decoder.device, width):
            return mixed_static(self.decoder.model, self.pool, t, s, p, g, rows, cu, width, width, splits, out=self.out)

    def run(
        self,
        p_tokens: list[int],
        p_slots: list[int],
        p_pos: list[int],
        p_seg: list[int],
        p_last: list[int],
        d_tokens: Sequence[int] = (),
        d_slots: Sequence[int] = (),
        d_pos: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the prompts' last-token logits [n, V], the decode rows' logits [B, V]); the caller checked
        ``fits``.  With decode rows float32 copies (the next replay rewrites the shared buffer); prompt-only,
        the forward's own rows in the model's dtype (B = 0)."""
        self.pool.flush()  # table rows changed since the last step (kv_pool)
        width = bucket(len(p_tokens))
        host, tail = self._inputs(p_tokens, p_slots, p_pos, p_seg, p_last, d_tokens, d_slots, d_pos, width)
        n, B = len(p_last), len(d_tokens)
        if not self.decoder.use_graph:
            logits = self._fn(width, *host.to(self.decoder.device).unbind(0), tail.to(self.decoder.device))
        else:
            from .staging import stager

            st = stager(self.decoder.device)
            dev = tuple(st.to_device(host).unbind(0)) + (st.to_device(tail),)
            entry = self.graphs.get(width)
            if entry is None:
                entry = self._capture(width, tuple(x.clone() for x in dev))
            g_, ins, logits = entry
            for dst, src in zip(ins, dev):
                dst.copy_(src)
            g_.replay()
        p_logits, d_logits = logits[:n], logits[MAX_PROMPTS : MAX_PROMPTS + B]
        if self.rows:  # copies: the next replay rewrites the shared buffer
            return p_logits.float(), d_logits.float()
        return p_logits, d_logits

    def _capture(self, width: int, ins: tuple) -> tuple:
        if self.rows and self.out is None:
            m = self.decoder.model
            w = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
            self.out = torch.empty((MAX_PROMPTS + self.rows, w.shape[0]), dtype=w.dtype, device=w.device)
        self.graphs[width] = entry = self.decoder._capture(None, functools.partial(self._fn, width), ins)
        return entry

    def precapture(self) -> None:
        """Every bucket's graph at start-up (padding-only rows into the scratch slot), so that no stream
        waits for a capture while serving (prompt-only: buckets wider than a slot on first use)."""
        if not (self.enabled and self.decoder.use_graph):
            return
        s, dev = self.pool.scratch, self.decoder.device
        try:
            for width in BUCKETS:
                if width in self.graphs or (not self.rows and width > self.pool.capacity):
                    continue
                host, tail = self._inputs([0], [s], [0], [0], [0], [], [], [], width)
                self._capture(width, tuple(x.to(dev) for x in host.unbind(0)) + (tail.to(dev),))
        except Exception:  # a capture this torch / driver refuses: prompt steps run as without these graphs
            log.exception(self.failure_message)
            self.enabled = False
            self.graphs.clear()
