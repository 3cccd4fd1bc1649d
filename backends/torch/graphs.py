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
                 pos: torch.Tensor, L: int, valid: torch.Tensor) -> torch.Tensor:
    a = attn.a
    D, H, KVH = a.head_dim, a.heads, a.kv_heads
    qkv = F.linear(x, *attn.qkv)
    q, k, v = qkv.split(attn.splits, dim=-1)
    if a.qk_norm:
        q = attn.q_norm(q.view(H, D)).view(1, H * D)
        k = attn.k_norm(k.view(KVH, D)).view(1, KVH * D)
    # q and k are rotated together: one pass of rope kernels instead of two
    qk = apply_rope(torch.cat([q, k], dim=-1).view(H + KVH, 1, D), cos, sin)
    q, k = qk[:H], qk[H:]
    kv.k[layer].index_copy_(1, pos, k)
    kv.v[layer].index_copy_(1, pos, v.view(KVH, 1, D))
    keys, values = kv.k[layer][:, :L], kv.v[layer][:, :L]
    out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=valid, enable_gqa=H != KVH)  # [1, H, 1, D]
    return attn.o_proj(out.reshape(1, H * D))


def decode_static(model: Transformer, kv: SeqCache, token: torch.Tensor, pos: torch.Tensor, L: int,
                  arange: torch.Tensor) -> torch.Tensor:
    """Logits [V] for one token at position ``pos`` (device tensors of shape [1])."""
    x = model.embed(token)
    cos, sin = model.cos[pos], model.sin[pos]
    valid = (arange[:L] <= pos).view(1, 1, 1, L)  # rows this token may attend to; shared by all layers
    for i, blk in enumerate(model.layers):
        x = x + _attn_static(blk.self_attn, blk.input_layernorm(x), cos, sin, kv, i, pos, L, valid)
        x = x + blk.mlp(blk.post_attention_layernorm(x))
    x = model.norm(x)
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(x, w)[0]


def decode_static_fused(model: Transformer, kv: SeqCache, token: torch.Tensor, pos: torch.Tensor, L: int,
                        arange: torch.Tensor) -> torch.Tensor:
    """``decode_static`` with the Triton kernels of ``swiftlm.cuda_ext`` for the elementwise
    stages (rope + KV write, residual add + RMSNorm, SiLU * up); dense, non-qk-norm models."""
    from swiftlm.cuda_ext.decode_kernels import add_rmsnorm, rope_kv_write, silu_mul

    a = model.a
    H, KVH, D = a.heads, a.kv_heads, a.head_dim
    x = model.embed_tokens(token)
    cos, sin = model.cos[pos], model.sin[pos]
    valid = (arange[:L] <= pos).view(1, 1, 1, L)
    blocks = list(model.layers)
    h = blocks[0].input_layernorm(x)
    for i, blk in enumerate(blocks):
        attn = blk.self_attn
        q = rope_kv_write(F.linear(h, *attn.qkv), cos, sin, pos, kv.k[i], kv.v[i], H, KVH, D)
        o = F.scaled_dot_product_attention(q.view(1, H, 1, D), kv.k[i][:, :L].unsqueeze(0),
                                           kv.v[i][:, :L].unsqueeze(0), attn_mask=valid, enable_gqa=H != KVH)
        o = attn.o_proj(o.reshape(1, H * D))
        h = add_rmsnorm(x, o, blk.post_attention_layernorm.weight, a.eps)
        d = blk.mlp.down_proj(silu_mul(F.linear(h, blk.mlp.gate_up)))
        nxt = blocks[i + 1].input_layernorm if i + 1 < len(blocks) else model.norm
        h = add_rmsnorm(x, d, nxt.weight, a.eps)
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(h, w)[0]


def graphable(model: Transformer) -> bool:
    return all(isinstance(b.mlp, MLP) for b in model.layers)


def bucket_for(pos: int, capacity: int) -> int:
    L = BUCKET_MIN
    while L < pos + 1:
        L *= 2
    return min(L, capacity)


class GraphDecoder:
    """CUDA graphs of ``decode_static``, one per (cache slot, bucket), sharing one memory pool."""

    def __init__(self, model: Transformer, device: torch.device, use_graph: bool = True,
                 fused: bool | None = None):
        from swiftlm.cuda_ext import enabled

        self.model = model
        self.device = device
        self.use_graph = use_graph and device.type == "cuda"
        if fused is None:
            fused = enabled(device.type) and not model.a.qk_norm and not model.a.gemma
        self.fn = decode_static_fused if fused else decode_static
        self.arange = torch.arange(model.a.ctx, device=device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.captures = 0

    def eager(self, kv: SeqCache, token: int, pos: int) -> torch.Tensor:
        t = torch.tensor([token], device=self.device)
        p = torch.tensor([pos], device=self.device)
        return self.fn(self.model, kv, t, p, bucket_for(pos, kv.capacity), self.arange)

    def run(self, kv: SeqCache, token: int, pos: int) -> torch.Tensor:
        if not self.use_graph:
            return self.eager(kv, token, pos)
        L = bucket_for(pos, kv.capacity)
        key = (id(kv), L)
        entry = self.graphs.get(key)
        if entry is None:
            tok = torch.tensor([token], device=self.device)
            p = torch.tensor([pos], device=self.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up (also computes this very step)
                self.fn(self.model, kv, tok, p, L, self.arange)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.fn(self.model, kv, tok, p, L, self.arange)
            self.graphs[key] = entry = (g, tok, p, out)
            self.captures += 1
        g, tok, p, out = entry
        tok.fill_(token)
        p.fill_(pos)
        g.replay()
        return out
