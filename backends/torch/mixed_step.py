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

from .decode_rows import project_qkv
from .packed_attention import packed_causal
from .rope import apply_rope


def decode_attention(
    q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    splits: int,
    **scales: torch.Tensor,
) -> torch.Tensor:
    """[B, H, D] decode attention of rows over their pool slots (the Triton kernel on CUDA); ``scales``:
    an fp8 pool's ``k_scale`` / ``v_scale`` (``SlotPool.attend_kw``)."""
    from swiftlm import cuda_ext

    scale = q.shape[-1] ** -0.5
    if q.is_cuda and cuda_ext.enabled("cuda"):
        from swiftlm.cuda_ext.paged_attention import paged_decode_attention

        return paged_decode_attention(q, K, V, tables, lens, scale, num_splits=splits, **scales)
    from swiftlm.cuda_ext.paged_attention import paged_decode_attention_ref

    return paged_decode_attention_ref(q, K, V, tables, lens, scale, **scales)


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
    its slot's block for its position (``kv_pool``).
    Returns the logits of ``rows`` [len(rows), V] (into ``out`` when given)."""
    a = model.a
    H, D = a.heads, a.head_dim
    T = tokens.shape[0]
    B = T - n_prompt
    x = model.embed(tokens)
    cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)  # [T, 1, D]
    tables, lens = pool.table[slots[n_prompt:]], (pos[n_prompt:] + 1).int()
    where = pool.locate(slots, pos)  # each row's block and its row there (kv_pool)
    for i, blk in enumerate(model.layers):
        attn = blk.self_attn
        q, k, v = project_qkv(attn, blk.input_layernorm(x))  # [T, H, D], [T, KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        pool.write(i, slots, pos, k, v, where)
        k, v = pool.round_trip(i, k, v)  # fp8 pool: the prompt rows attend to the K/V as stored
        o = packed_causal(q[:n_prompt], k[:n_prompt], v[:n_prompt], seg[:n_prompt], pos[:n_prompt], cu, max_len)
        if B:
            o = torch.cat(
                [o, decode_attention(q[n_prompt:], pool.k[i], pool.v[i], tables, lens, splits, **pool.attend_kw(i))]
            )
        x = x + attn.o_proj(o.reshape(T, H * D))
        x = x + blk.mlp(blk.post_attention_layernorm(x))
    x = model.norm(x[rows])
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if out is None:
        return torch.nn.functional.linear(x, w)
    return torch.mm(x, w.t(), out=out)
