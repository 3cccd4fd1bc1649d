"""Prompt chunks of up to ``BUCKETS[-1]`` tokens (the default step budget of 640 included) replayed
from CUDA graphs.

A short prompt is ~2 ms of device work on an H100 behind ~7 ms of eager launches (388 kernels
for the 1B shape; docs/engine.md "One stream's time to first token"), so each new stream waited
for the host before its first token.  First chunks (position 0) of one or more prompts in pool
slots are packed as in ``graphs.prefill_packed_static`` and padded to a token bucket; one graph
per bucket, captured at start-up, replays the whole forward with one launch.

The padding is a prompt of its own: its tokens sit in the pool's scratch slot at positions
0, 1, ... and carry the segment id ``n`` (one past the real prompts), so the block-diagonal mask
keeps them out of every real prompt's attention and their KV writes land in the scratch row.
Logits come from ``MAX_PROMPTS`` rows (each real prompt's last token; unused entries read row 0
and are dropped).  The math per real token is the unpadded packed forward's; only the matmul
shapes differ (cuBLAS may pick another kernel for 64 rows than for 40: bf16 rounding).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .graphs import prefill_packed_static
from .packed_attention import cu_seqlens

BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768)
log = logging.getLogger(__name__)

MAX_PROMPTS = 64  # prompts per graphed chunk (their last rows go through the LM head)


def bucket(tokens: int) -> int | None:
    """The smallest bucket holding ``tokens`` tokens, or None past the largest."""
    return next((b for b in BUCKETS if b >= tokens), None)


def padded_inputs(tokens: list[int], slots: list[int], pos: list[int], seg: list[int], last: list[int],
                  width: int, scratch: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed chunk's rows padded to ``width`` tokens ([4, width]: tokens, slots, positions,
    segments) and, in one [2 * MAX_PROMPTS + 2] tensor, its ``last`` rows padded to MAX_PROMPTS then
    the cumulative lengths of its prompts and the padding (MAX_PROMPTS + 2 entries; zero-length
    sequences fill the rest)."""
    pad, n = width - len(tokens), len(last)
    host = torch.tensor([tokens + [0] * pad, slots + [scratch] * pad, pos + [i % capacity for i in range(pad)],
                         seg + [n] * pad])
    lengths = [b - a for a, b in zip([-1] + last[:-1], last)]
    cu = cu_seqlens(lengths, width, MAX_PROMPTS + 2)
    return host, torch.cat([torch.tensor(last + [0] * (MAX_PROMPTS - n)), cu.long()])


class PrefillGraphs:
    """One CUDA graph of the packed prefill per token bucket (``GraphDecoder``'s memory pool and
    capture), or, where graphs are off (CPU, tests), the same padded forward run eagerly.
    ``SWIFTLM_PREFILL_GRAPHS=0`` turns the graphs off (the eager packed path of before, for A/B runs)."""

    def __init__(self, decoder: Any, pool: Any, enabled: bool | None = None):
        self.decoder, self.pool = decoder, pool
        if enabled is None:
            enabled = os.environ.get("SWIFTLM_PREFILL_GRAPHS", "1") != "0"
        self.enabled = enabled
        self.graphs: dict[int, tuple[Any, tuple, torch.Tensor]] = {}

    def fits(self, tokens: int, prompts: int) -> bool:
        return self.enabled and prompts <= MAX_PROMPTS and bucket(tokens) is not None

    def _fn(self, t: torch.Tensor, s: torch.Tensor, p: torch.Tensor, g: torch.Tensor, tail: torch.Tensor) -> Any:
        from .packed_attention import prefill_attention

        last, cu = tail[:MAX_PROMPTS], tail[MAX_PROMPTS:].int()
        with prefill_attention(self.decoder.device, t.shape[0]):
            return prefill_packed_static(self.decoder.model, self.pool, t, s, p, g, last, cu, t.shape[0])

    def run(self, tokens: list[int], slots: list[int], pos: list[int], seg: list[int],
            last: list[int]) -> torch.Tensor:
        """Logits [len(last), V] of each prompt's last token (the caller checked ``fits``)."""
        width = bucket(len(tokens))
        host, last_h = padded_inputs(tokens, slots, pos, seg, last, width, self.pool.scratch, self.pool.capacity)
        n = len(last)
        if not self.decoder.use_graph:
            t, s, p, g = host.to(self.decoder.device).unbind(0)
            return self._fn(t, s, p, g, last_h.to(self.decoder.device))[:n]
        from .staging import stager

        st = stager(self.decoder.device)
        dev, dev_last = st.to_device(host), st.to_device(last_h)
        entry = self.graphs.get(width)
        if entry is None:
            ins = tuple(x.clone() for x in dev.unbind(0)) + (dev_last.clone(),)
            entry = self.decoder._capture(("prefill", width), self._fn, ins)
            self.graphs[width] = entry
        g_, ins, out = entry
        for dst, src in zip(ins, tuple(dev.unbind(0)) + (dev_last,)):
            dst.copy_(src)
        g_.replay()
        return out[:n]

    def precapture(self) -> None:
        """Every bucket's graph at start-up (a padding-only chunk into the scratch slot), so that no
        stream waits for a capture while serving."""
        if not (self.enabled and self.decoder.use_graph):
            return
        s = self.pool.scratch
        try:
            for width in BUCKETS:
                if width > self.pool.capacity or width in self.graphs:
                    continue
                host, last_h = padded_inputs([0], [s], [0], [0], [0], width, s, self.pool.capacity)
                ins = tuple(x.to(self.decoder.device) for x in host.unbind(0)) + (last_h.to(self.decoder.device),)
                self.graphs[width] = self.decoder._capture(("prefill", width), self._fn, ins)
        except Exception:  # a capture this torch / driver refuses: prompt chunks stay eager
            log.exception("capturing the prefill graphs failed; prompt chunks run eagerly")
            self.enabled = False
            self.graphs.clear()
