"""Decode rows and first prompt chunks of one engine step in one forward, replayed from CUDA graphs.

Run as two forwards, a step that admits new prompts while other streams decode would replay the decode
rows' batched graph and the packed prompt chunk's graph (``prefill_graphs``), each reading every weight
once: on a large model the step pays the weights' memory traffic twice.  Here
the prompt rows (packed, padded to a token bucket as in ``prefill_graphs``) and the decode rows
(padded to the pool's size with scratch rows, as the batched decode pads) go through the matmuls
together; attention is split: the prompts' by the variable-length flash kernel over their own new
K/V (``packed_attention``), the decode rows' by the paged decode kernel over their slots
(``cuda_ext.paged_attention``; its plain-torch reference off CUDA).  One graph per token bucket,
captured at start-up, every one writing its logits into one shared buffer (``prefill_graphs.PackedGraphs``
with ``rows`` = the pool's size; the prompt-only graphs are the same forward with no decode rows).
``SWIFTLM_MIXED_STEP=0`` keeps the two forwards (A/B runs).
"""

from __future__ import annotations

from typing import Any

import torch

from .attend import MixedAttend
from .forward import GRAPHED, dense, logits_graphed


def mixed_static(
    model: Any,
    pool: Any,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    seg: torch.Tensor,
    rows: torch.Tensor,
    cu: torch.Tensor | None,
    max_len: int,
    n_prompt: int,
    splits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [0, n_prompt) are prompt chunks starting at position 0, packed in order (``seg``, ``cu``,
    ``max_len`` as in ``graphs.prefill_packed_static``, which is this forward with no decode rows);
    rows [n_prompt, T) decode one token each at ``pos`` in pool slot ``slots``.  Every row's K/V is written first, to
    its slot's block for its position (``kv_pool``; attend.MixedAttend).
    Returns the logits of ``rows`` [len(rows), V] (into ``out`` when given)."""
    io = MixedAttend(pool, slots, pos, seg, cu, max_len, n_prompt, splits)
    x = dense(model, model.embed(tokens), model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1), io, GRAPHED)
    return logits_graphed(model, x[rows], out)
