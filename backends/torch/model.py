"""Decoder-only transformer layers for the llama family in plain torch (llama, mistral, qwen2, qwen3,
and the MoE variants qwen3_moe / qwen2_moe / mixtral), with this project's own KV cache.

Why our own model file and not transformers' modeling classes: a decode step here is a few
fused calls per layer on preallocated cache slices (no cache objects, masks or hooks rebuilt
per token), which is what makes small models fast on CPU and lets CUDA graphs capture a step.
Weights use HF names, so HF checkpoints load as they are.

This module holds the layers and the model; every step runs them through forward.py's ``dense``,
attention through attend.py's classes (``Transformer.hidden``: one prompt chunk, or packed prompts).
Around it: build.py (the load,
``build``), model_config.py (the config: ``Args``, the architectures, ``check_config``), rope.py (rope
tables), kv_cache.py (``SeqCache``), linear_rows.py (matmuls over a few rows, LoRA terms) and
decode_rows.py (``decode_batch``, the batched decode step).  archs.py and archs_moe.py subclass these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attend import CacheAttend, PackedAttend, PackedRows
from .attend import causal_mask as causal_mask  # (re-exported: imported from here elsewhere)
from .attend import chunk_attention as chunk_attention
from .forward import dense, final_norm, head_weight
from .kv_cache import SeqCache
from .linear_rows import linear_rows, lora_add, rows_linear
from .model_config import Args
from .quant_linear import cat_rows
from .rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(a.hidden, a.heads * a.head_dim, bias=a.attn_bias)
        self.k_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=a.attn_bias)
        self.v_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=a.attn_bias)
        self.o_proj = nn.Linear(a.heads * a.head_dim, a.hidden, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.eps)
            self.k_norm = RMSNorm(a.head_dim, a.eps)

    def fuse(self) -> None:
        """One [q; k; v] matmul instead of three (fewer, larger GEMVs per decode step)."""
        w = cat_rows([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) if self.a.attn_bias else None
        self.qkv = (w, b)
        self.splits = (
            self.a.heads * self.a.head_dim,
            self.a.kv_heads * self.a.head_dim,
            self.a.kv_heads * self.a.head_dim,
        )
        del self.q_proj, self.k_proj, self.v_proj


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, gelu: bool = False):
        super().__init__()
        self.act = (lambda t: F.gelu(t, approximate="tanh")) if gelu else F.silu
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse(self) -> None:
        """One [gate; up] matmul instead of two."""
        self.gate_up = cat_rows([self.gate_proj.weight, self.up_proj.weight])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up"):
            g, u = lora_add(self, x, rows_linear(x, self.gate_up)).chunk(2, dim=-1)
            return linear_rows(self.down_proj, self.act(g) * u)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts, stacked as [E, out, in] (filled from per-expert HF tensors)."""

    def __init__(self, a: Args):
        super().__init__()
        E, H, I = a.experts, a.hidden, a.moe_intermediate
        self.a = a
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, I, H))
        self.w_up = nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        if a.shared_intermediate:
            self.shared_expert = MLP(H, a.shared_intermediate)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        probs = F.softmax(self.gate(x).float(), dim=-1)
        w, idx = torch.topk(probs, a.top_k, dim=-1)
        if a.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        experts = idx.unique().tolist()
        for j, (wg, wu, wd) in enumerate(self.expert_weights(experts)):
            e = experts[j]
            rows, slot = (idx == e).nonzero(as_tuple=True)
            h = x[rows]
            y = F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
            out.index_add_(0, rows, y * w[rows, slot].unsqueeze(-1))
        if self.a.shared_intermediate:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def expert_weights(self, experts: list[int]) -> Any:
        """(gate, up, down) weights of each expert, in order (resident: views of the stacks)."""
        return [(self.w_gate[e], self.w_up[e], self.w_down[e]) for e in experts]


class Block(nn.Module):
    """One llama-family layer; its forward is forward.dense's loop body."""

    def __init__(self, a: Args):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)
        self.self_attn = Attention(a)
        self.mlp = MoE(a) if a.experts else MLP(a.hidden, a.intermediate, gelu=a.gemma)


class Transformer(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.a = a
        # Built on the meta device (build.py) the embedding has nothing to initialise, and normal_ on a meta tensor
        # imports torch._dynamo (seconds of CPU in every process that loads a model): pass the empty weight there.
        w = torch.empty(a.vocab, a.hidden)
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden, _weight=w if w.is_meta else None)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, a.eps)
        self.lm_head = None if a.tie else nn.Linear(a.hidden, a.vocab, bias=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def init_rope(self) -> None:
        # where the weights are (the embedding's, or a later pipeline stage's first layer's)
        self.cos, self.sin = rope_tables(self.a, next(self.parameters()).device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.a.gemma:  # Gemma scales embeddings by sqrt(hidden), in the model's dtype
            x = x * torch.tensor(self.a.hidden**0.5, dtype=x.dtype)
        return x

    def hidden(self, tokens: torch.Tensor, kv: Any, start: int, last_only: bool = False) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] (or of the last position only).  With a
        ``PackedAttend`` as ``kv``: several sequences at once, each from position 0."""
        x = self.embed(tokens)
        if isinstance(kv, PackedAttend):
            io: Any = PackedRows(self.a, kv)
            pos: Any = kv.positions
        else:
            io, pos = CacheAttend(self.a, kv, start), slice(start, start + tokens.shape[0])
        x = dense(self, x, self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1), io)
        return final_norm(self, x[-1:] if last_only else x)

    def forward(self, tokens: torch.Tensor, kv: SeqCache, start: int, last_only: bool = True) -> torch.Tensor:
        return self.head(self.hidden(tokens, kv, start, last_only))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of final-normed rows."""
        return rows_linear(x, head_weight(self))
