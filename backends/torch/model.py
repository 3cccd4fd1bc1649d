"""Decoder-only transformer layers for the llama family in plain torch (llama, mistral, qwen2, qwen3,
and the MoE variants qwen3_moe / qwen2_moe / mixtral), with this project's own KV cache.

Why our own model file and not transformers' modeling classes: a decode step here is a few
fused calls per layer on preallocated cache slices (no cache objects, masks or hooks rebuilt
per token), which is what makes small models fast on CPU and lets CUDA graphs capture a step.
Weights use HF names, so HF checkpoints load as they are.

This module holds the layers and the forward over a prompt chunk; around it: build.py (the load,
``build``), model_config.py (the config: ``Args``, the architectures, ``check_config``), rope.py (rope
tables), kv_cache.py (``SeqCache``), linear_rows.py (matmuls over a few rows, LoRA terms) and
decode_rows.py (``decode_batch``, the batched decode step).  archs.py and archs_moe.py subclass these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import SeqCache
from .linear_rows import linear_rows, lora_add, rows_linear
from .model_config import Args
from .offload import from_offload, to_offload
from .quant_linear import cat_rows
from .rope import apply_rope, rope_tables


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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SeqCache, layer: int, start: int
    ) -> torch.Tensor:
        a = self.a
        T = x.shape[0]
        q, k, v = lora_add(self, x, rows_linear(x, *self.qkv)).split(self.splits, dim=-1)
        q = q.view(T, a.heads, a.head_dim)
        k = k.view(T, a.kv_heads, a.head_dim)
        v = v.view(T, a.kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)  # [H, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin)
        w = a.window(layer)
        if isinstance(kv, PackedAttend):
            return linear_rows(self.o_proj, kv.update_attend(layer, start, q, k, v.transpose(0, 1), window=w))
        if not isinstance(kv, SeqCache):  # a compressed cache attends over its own layout
            if w and start + T > w:
                raise NotImplementedError(
                    f"sliding_window={w} is not implemented for a compressed KV cache; "
                    "use the plain KV format for this model"
                )
            return linear_rows(self.o_proj, kv.update_attend(layer, start, q, k, v.transpose(0, 1)))
        keys, values = kv.update(layer, start, k, v.transpose(0, 1))  # [KVH, start+T-offset, D]
        rep = a.heads // a.kv_heads
        if w and T == 1:  # sliding window: the last w keys
            keys, values = keys[:, -w:], values[:, -w:]
        if w and start + T > w and T > 1:
            # a window layer may have dropped its oldest rows (SeqCache): the keys are positions
            # [start + T - S, start + T), so the chunk starts at row S - T
            out = chunk_attention(q, keys, values, keys.shape[1] - T, rep, window=w)
        elif T == 1:
            # One query row attends to everything so far: two small matmuls, cheaper on CPU than
            # the fused kernel's setup for a single query row.
            qg = q.reshape(a.kv_heads, rep, a.head_dim)
            scores = torch.matmul(qg, keys.transpose(1, 2)) * (a.head_dim**-0.5)  # [KVH, rep, S]
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            out = torch.matmul(probs, values).reshape(a.heads, 1, a.head_dim)
            return linear_rows(self.o_proj, out.transpose(0, 1).reshape(1, a.heads * a.head_dim))
        elif start == 0:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), is_causal=True, enable_gqa=rep > 1
            )
        else:  # a prefill chunk after earlier positions: causal within the chunk, full to the past
            out = chunk_attention(q, keys, values, start, rep)
        return linear_rows(self.o_proj, out[0].transpose(0, 1).reshape(T, a.heads * a.head_dim))


def chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, rep: int, window: int = 0
) -> torch.Tensor:
    """Attention of a prompt chunk at positions [start, start + T) over keys [0, start + T): causal
    within the chunk, full to the past.  On CUDA through a lower-right causal bias, which SDPA runs in
    its flash kernel; an explicit [T, S] mask would send every chunk of a long prompt to SDPA's slow
    masked kernel.  Returns [1, H, T, D].
    ``window``: each query sees only the last ``window`` keys up to itself (sliding-window attention)."""
    T, S = q.shape[1], keys.shape[1]
    if q.is_cuda and not window:
        from torch.nn.attention.bias import causal_lower_right

        mask: Any = causal_lower_right(T, S)
    else:
        mask = causal_mask(T, S, start, window, q.device)
    return F.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=rep > 1
    )


def causal_mask(T: int, S: int, start: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, S] bool, True where query ``start + i`` may see key ``j``: ``j <= start + i``, and where a window
    applies (``window`` > 0) ``start + i - window < j``."""
    ones = torch.ones(T, S, dtype=torch.bool, device=device)
    causal = ones.tril(diagonal=start)
    return causal & ones.triu(diagonal=start - window + 1) if window else causal


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
    def __init__(self, a: Args):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)
        self.self_attn = Attention(a)
        self.mlp = MoE(a) if a.experts else MLP(a.hidden, a.intermediate, gelu=a.gemma)

    def forward(self, x, cos, sin, kv, layer, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class PackedAttend:
    """Attention for several independent sequences packed into one row block (no KV kept):
    causal within each sequence, nothing across them.  Goes where a cache goes
    (``Attention.forward`` calls ``update_attend`` on anything that is not a ``SeqCache``)."""

    def __init__(self, lengths: list[int], device: torch.device):
        self.lengths = lengths
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])

    def update_attend(
        self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0
    ) -> torch.Tensor:
        if window and max(self.lengths) > window:  # sliding window: one masked attention per sequence
            outs = [
                chunk_attention(qs, ks, vs, 0, q.shape[0] // k.shape[0], window=window)[0]
                for qs, ks, vs in zip(q.split(self.lengths, 1), k.split(self.lengths, 1), v.split(self.lengths, 1))
            ]
            return torch.cat(outs, dim=1).transpose(0, 1).reshape(q.shape[1], -1)
        # one causal attention per sequence (a block-diagonal mask over the whole pack would cost
        # (sum T)^2 and leave SDPA's fused kernels for its slower masked fallback)
        gqa = q.shape[0] != k.shape[0]
        outs = [
            F.scaled_dot_product_attention(
                qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True, enable_gqa=gqa
            )[0]
            for qs, ks, vs in zip(q.split(self.lengths, 1), k.split(self.lengths, 1), v.split(self.lengths, 1))
        ]
        out = torch.cat(outs, dim=1)  # [H, T, D]
        return out.transpose(0, 1).reshape(q.shape[1], -1)


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
        self.cos, self.sin = rope_tables(self.a, self.embed_tokens.weight.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.a.gemma:  # Gemma scales embeddings by sqrt(hidden), in the model's dtype
            x = x * torch.tensor(self.a.hidden**0.5, dtype=x.dtype)
        return x

    def hidden(self, tokens: torch.Tensor, kv: Any, start: int, last_only: bool = False) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] (or of the last position only).  With a
        ``PackedAttend`` as ``kv``: several sequences at once, each from position 0."""
        x = self.embed(tokens)
        T = tokens.shape[0]
        if isinstance(kv, PackedAttend):
            cos, sin = self.cos[kv.positions], self.sin[kv.positions]
        else:
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        for i, layer in enumerate(self.layers):
            if self.a.offload is not None and i == self.a.offload[0]:
                x, cos, sin = to_offload(self.a, x, cos, sin)
            x = layer(x, cos, sin, kv, i, start)
        if last_only:
            x = x[-1:]
        if self.a.offload is not None:
            x = from_offload(x, self.norm.weight)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, kv: SeqCache, start: int, last_only: bool = True) -> torch.Tensor:
        x = self.hidden(tokens, kv, start, last_only)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return rows_linear(x, w)
