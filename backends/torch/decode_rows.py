"""The batched decode step of the llama-family layer (``decode_batch``): one token for each of B
sequences in one pass, the matmuls on [B, hidden] rows (weights read once per step), attention per
sequence over its own cache (attend.RowsAttend: compressed caches and shared prefixes,
shared_kv.ForkedCache, included)."""

from __future__ import annotations

import torch

from .attend import RowsAttend
from .forward import dense, final_norm, head_weight, token_ids
from .kv_cache import SeqCache
from .linear_rows import rows_linear
from .model import Transformer


def decode_batch(
    model: Transformer,
    caches: list[SeqCache],
    tokens: list[int] | None,
    positions: list[int],
    x: torch.Tensor | None = None,
    head: bool = True,
) -> torch.Tensor:
    """One decode token for each of B sequences in one pass: the matmuls (QKV, output,
    MLP / experts, LM head) run on [B, hidden] rows, so the weights are read once per step
    instead of once per sequence; attention runs per sequence over its own cache.
    Returns logits [B, V].  A pipeline stage (pipeline.py) passes the previous stage's
    activations ``x`` instead of ``tokens``, and ``head=False`` for the pre-norm activations."""
    if getattr(model, "decode_rows", None) is not None:  # archs.py's layers (soft caps, post-norms, ...)
        return model.decode_rows(caches, tokens, positions, x=x, head=head)
    dev = model.cos.device  # a pipeline stage may hold no embedding
    if x is None:
        x = model.embed(token_ids(tokens, dev))
    pos = torch.tensor(positions, dtype=torch.long, device=dev)
    io = RowsAttend(model, caches, positions)
    x = dense(model, x, model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1), io)
    io.finish()
    return rows_linear(final_norm(model, x), head_weight(model)) if head else x
