"""Fixed-shape decode step and its CUDA-graph replay.

``decode_static`` runs one decode token for one sequence whose KV cache has a fixed capacity,
with the position as a device tensor: every shape is static, so the whole step (embedding,
all layers, LM head) is captured once per (cache slot, length bucket) and replayed with a
single launch.  Attention reads the first ``L`` cache rows (the smallest bucket holding the
position) and masks rows past the position.  MoE layers route on the host, so MoE models
decode eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .model import MLP, SeqCache, Transformer, apply_rope

BUCKET_MIN = 256


def _attn_static(attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SeqCache, layer: int,
                 pos: torch.Tensor, L: int, arange: torch.Tensor) -> torch.Tensor:
    a = attn.a
    D, H, KVH = a.head_dim, a.heads, a.kv_heads
    q, k, v = F.linear(x, *attn.qkv).split(attn.splits, dim=-1)
    q, k, v = q.view(1, H, D), k.view(1, KVH, D), v.view(1, KVH, D)
    if a.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rope(q.transpose(0, 1), cos, sin)
    k = apply_rope(k.transpose(0, 1), cos, sin)
    kv.k[layer].index_copy_(1, pos, k)
    kv.v[layer].index_copy_(1, pos, v.transpose(0, 1))
    keys, values = kv.k[layer][:, :L], kv.v[layer][:, :L]
    scores = torch.matmul(q.reshape(KVH, H // KVH, D), keys.transpose(1, 2)) * (D ** -0.5)
    scores = scores.float().masked_fill(arange[:L] > pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values).reshape(H, 1, D)
    return attn.o_proj(out.transpose(0, 1).reshape(1, H * D))


def decode_static(model: Transformer, kv: SeqCache, token: torch.Tensor, pos: torch.Tensor, L: int,
                  arange: torch.Tensor) -> torch.Tensor:
    """Logits [V] for one token at position ``pos`` (device tensors of shape [1])."""
    x = model.embed_tokens(token)
    cos, sin = model.cos[pos], model.sin[pos]
    for i, blk in enumerate(model.layers):
        x = x + _attn_static(blk.self_attn, blk.input_layernorm(x), cos, sin, kv, i, pos, L, arange)
        x = x + blk.mlp(blk.post_attention_layernorm(x))
    x = model.norm(x)
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(x, w)[0]


def graphable(model: Transformer) -> bool:
    return all(isinstance(b.mlp, MLP) for b in model.layers)


def bucket_for(pos: int, capacity: int) -> int:
    L = BUCKET_MIN
    while L < pos + 1:
        L *= 2
    return min(L, capacity)


class GraphDecoder:
    """CUDA graphs of ``decode_static``, one per (cache slot, bucket), sharing one memory pool."""

    def __init__(self, model: Transformer, device: torch.device):
        self.model = model
        self.device = device
        self.arange = torch.arange(model.a.ctx, device=device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.captures = 0

    def eager(self, kv: SeqCache, token: int, pos: int) -> torch.Tensor:
        t = torch.tensor([token], device=self.device)
        p = torch.tensor([pos], device=self.device)
        return decode_static(self.model, kv, t, p, bucket_for(pos, kv.capacity), self.arange)

    def run(self, kv: SeqCache, token: int, pos: int) -> torch.Tensor:
        L = bucket_for(pos, kv.capacity)
        key = (id(kv), L)
        entry = self.graphs.get(key)
        if entry is None:
            tok = torch.tensor([token], device=self.device)
            p = torch.tensor([pos], device=self.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up (also computes this very step)
                decode_static(self.model, kv, tok, p, L, self.arange)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = decode_static(self.model, kv, tok, p, L, self.arange)
            self.graphs[key] = entry = (g, tok, p, out)
            self.captures += 1
        g, tok, p, out = entry
        tok.fill_(token)
        p.fill_(pos)
        g.replay()
        return out
