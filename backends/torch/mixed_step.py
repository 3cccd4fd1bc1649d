"""Decode rows and first prompt chunks of one engine step in one forward, replayed from CUDA graphs.

A step that admits new prompts while other streams decode ran two forwards: the decode rows'
batched graph and the packed prompt chunk's graph (``prefill_graphs``), each reading every weight
once.  On the 8B shape that is ~7 ms of HBM time paid twice (engine step log, docs/engine.md).  Here
the prompt rows (packed, padded to a token bucket as in ``prefill_graphs``) and the decode rows
(padded to the pool's size with scratch rows, as the batched decode pads) go through the matmuls
together; attention is split: the prompts' by the variable-length flash kernel over their own new
K/V (``packed_attention``), the decode rows' by the paged decode kernel over their slots
(``cuda_ext.paged_attention``; its plain-torch reference off CUDA).  One graph per token bucket,
captured at start-up, every one writing its logits into one shared buffer.
``SWIFTLM_MIXED_STEP=0`` keeps the two forwards (A/B runs).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .decode_rows import project_qkv
from .packed_attention import packed_causal
from .prefill_graphs import BUCKETS, MAX_PROMPTS, bucket, padded_inputs
from .rope import apply_rope

log = logging.getLogger(__name__)


def decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                     splits: int) -> torch.Tensor:
    """[B, H, D] decode attention of rows over their pool slots (the Triton kernel on CUDA)."""
    from swiftlm import cuda_ext

    scale = q.shape[-1] ** -0.5
    if q.is_cuda and cuda_ext.enabled("cuda"):
        from swiftlm.cuda_ext.paged_attention import paged_decode_attention

        return paged_decode_attention(q, K, V, tables, lens, scale, num_splits=splits)
    from swiftlm.cuda_ext.paged_attention import paged_decode_attention_ref

    return paged_decode_attention_ref(q, K, V, tables, lens, scale)


def mixed_static(model: Any, pool: Any, tokens: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                 seg: torch.Tensor, rows: torch.Tensor, cu: torch.Tensor | None, max_len: int, n_prompt: int,
                 splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [0, n_prompt) are prompt chunks starting at position 0, packed in order (``seg``, ``cu``,
    ``max_len`` as in ``graphs.prefill_packed_static``, which is this forward with no decode rows);
    rows [n_prompt, T) decode one token each at ``pos`` in pool slot ``slots``.  Every row's K/V is written to its slot and position first.
    Returns the logits of ``rows`` [len(rows), V] (into ``out`` when given)."""
    a = model.a
    H, D = a.heads, a.head_dim
    T = tokens.shape[0]
    B = T - n_prompt
    x = model.embed(tokens)
    cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)  # [T, 1, D]
    tables, lens = slots[n_prompt:].view(B, 1).int(), (pos[n_prompt:] + 1).int()
    for i, blk in enumerate(model.layers):
        attn = blk.self_attn
        q, k, v = project_qkv(attn, blk.input_layernorm(x))  # [T, H, D], [T, KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        pool.k[i][slots, :, pos] = k
        pool.v[i][slots, :, pos] = v
        o = packed_causal(q[:n_prompt], k[:n_prompt], v[:n_prompt], seg[:n_prompt], pos[:n_prompt], cu, max_len)
        if B:
            o = torch.cat([o, decode_attention(q[n_prompt:], pool.k[i], pool.v[i], tables, lens, splits)])
        x = x + attn.o_proj(o.reshape(T, H * D))
        x = x + blk.mlp(blk.post_attention_layernorm(x))
    x = model.norm(x[rows])
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if out is None:
        return torch.nn.functional.linear(x, w)
    return torch.mm(x, w.t(), out=out)


class MixedGraphs:
    """One graph of ``mixed_static`` per token bucket, the decode rows padded to the pool's size
    (``GraphDecoder``'s memory pool and capture), or eager where graphs are off (CPU, tests)."""

    def __init__(self, decoder: Any, pool: Any, enabled: bool | None = None):
        self.decoder, self.pool = decoder, pool
        if enabled is None:
            enabled = os.environ.get("SWIFTLM_MIXED_STEP", "1") != "0"
        self.enabled = enabled
        self.rows = pool.n  # decode rows per graph
        self.graphs: dict[int, tuple[Any, tuple, torch.Tensor]] = {}
        self.out: torch.Tensor | None = None  # the logits buffer every graph writes

    def fits(self, prompt_tokens: int, prompts: int, decode_rows: int) -> bool:
        return (self.enabled and 0 < prompts <= MAX_PROMPTS and 0 < decode_rows <= self.rows
                and bucket(prompt_tokens) is not None)

    def _inputs(self, p_tokens: list[int], p_slots: list[int], p_pos: list[int], p_seg: list[int],
                p_last: list[int], d_tokens: list[int], d_slots: list[int], d_pos: list[int],
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[4, width + rows] (tokens, slots, positions, segments: the padded prompt rows, then the decode
        rows padded with scratch rows) and the prompts' logit rows and cumulative lengths
        (``prefill_graphs.padded_inputs``)."""
        ph, tail = padded_inputs(p_tokens, p_slots, p_pos, p_seg, p_last, width, self.pool.scratch,
                                 self.pool.capacity)
        pad = self.rows - len(d_tokens)
        dh = torch.tensor([d_tokens + [0] * pad, d_slots + [self.pool.scratch] * pad, d_pos + [0] * pad,
                           [0] * self.rows])
        return torch.cat([ph, dh], dim=1), tail

    def _fn(self, width: int, t: torch.Tensor, s: torch.Tensor, p: torch.Tensor, g: torch.Tensor,
            tail: torch.Tensor) -> torch.Tensor:
        from .packed_attention import prefill_attention

        last, cu = tail[:MAX_PROMPTS], tail[MAX_PROMPTS:].int()
        rows = torch.cat([last, width + torch.arange(self.rows, device=last.device)])
        splits = self.decoder.splits_for(self.pool.capacity, self.rows)
        with prefill_attention(self.decoder.device, width):
            return mixed_static(self.decoder.model, self.pool, t, s, p, g, rows, cu, width, width, splits,
                                out=self.out)

    def run(self, p_tokens: list[int], p_slots: list[int], p_pos: list[int], p_seg: list[int], p_last: list[int],
            d_tokens: list[int], d_slots: list[int], d_pos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the prompts' last-token logits [n, V], the decode rows' logits [B, V]), float32; the caller
        checked ``fits``."""
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
        # copies: the next replay rewrites the shared buffer
        return logits[:n].float(), logits[MAX_PROMPTS:MAX_PROMPTS + B].float()

    def _capture(self, width: int, ins: tuple) -> tuple:
        if self.out is None:
            m = self.decoder.model
            w = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
            self.out = torch.empty((MAX_PROMPTS + self.rows, w.shape[0]), dtype=w.dtype, device=w.device)
        entry = self.decoder._capture(("mixed", width), lambda *xs: self._fn(width, *xs), ins)
        self.graphs[width] = entry
        return entry

    def precapture(self) -> None:
        """Every bucket's graph at start-up (padding-only rows into the scratch slot)."""
        if not (self.enabled and self.decoder.use_graph):
            return
        s = self.pool.scratch
        try:
            for width in BUCKETS:
                if width in self.graphs:
                    continue
                host, tail = self._inputs([0], [s], [0], [0], [0], [0], [s], [0], width)
                self._capture(width, tuple(x.to(self.decoder.device) for x in host.unbind(0))
                              + (tail.to(self.decoder.device),))
        except Exception:  # a capture this torch / driver refuses: prompt steps keep two forwards
            log.exception("capturing the mixed prompt + decode graphs failed; such steps run two forwards")
            self.enabled = False
            self.graphs.clear()
