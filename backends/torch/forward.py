"""The forward of each architecture family of the torch backend, written once.  Every step (a prompt chunk,
packed prompts, batched decode rows, a mixed step, speculative verification, a pipeline stage, the CUDA-graph
steps) runs one of these functions and differs only in how attention reads and writes K/V, reached through the
attend object it hands in (attend.py: one small class per KV format and path, ``attend(layer, q, k, v) ->
[T, H*D]`` writing the rows' K/V into its cache and attending over it).

- ``dense``: the llama-family layer of model.py (q/k norms, biases, sliding windows and the MoE MLPs are the
  layer's and the attend object's business).  ``lin``: ``EAGER`` (``rows_linear``, tuned for a few rows on the
  CPU; LoRA terms through ``lora_add``) or ``GRAPHED`` (``F.linear`` and the modules' own calls, as the
  CUDA-graph steps have always captured them).  ``--gpu-layers`` moves the activations once, at the first CPU layer.
- ``fused``: the same layer with its elementwise stages as Triton kernels (fused_decode.py).  Its shape differs
  for a reason, not by choice of attention: rope is applied by the kernel that writes the K/V row (so its attend
  objects take the QKV rows, ``attend_qkv``), and each residual add is fused with the next norm (so the loop
  carries the normed rows).  Through ``dense`` it would lose the fusions it exists for.
- ``blocks``: archs.py / archs_moe.py's layers (Gemma 2/3, Phi-3, OLMo 2, SmolLM3, GPT-OSS, DeepSeek MLA), blocks
  of their own norms and attention math taking ``(x, rope, attend)``; attend.py's ``Core*`` classes apply the
  layer's attention core over the same caches.

CUDA graphs capture ``dense`` and ``fused`` as they are: no data-dependent Python branch and no host read in
them or in the attend objects of the graph steps.  Imports only leaf helpers, so every model and step module
may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .linear_rows import linear, lora_add, out_proj, rows_linear
from .offload import from_offload, to_offload
from .rope import apply_rope
from .tp_allreduce import out_proj_add_rmsnorm


def project_qkv(attn: Any, x: torch.Tensor, mm: Any = linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, H, D], k and v [n, KVH, D] for n rows (fused QKV matmul, then q/k norms if any)."""
    a, n = attn.a, x.shape[0]
    q, k, v = lora_add(attn, x, mm(x, *attn.qkv)).split(attn.splits, dim=-1)
    q, k, v = q.view(n, a.heads, a.head_dim), k.view(n, a.kv_heads, a.head_dim), v.view(n, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def mlp_rows(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP with its [gate; up] fused (model.MLP.fuse) through ``rows_linear``; any other MLP (experts,
    an unfused one) as its module computes it."""
    if not hasattr(mlp, "gate_up"):
        return mlp(x)
    g, u = lora_add(mlp, x, rows_linear(x, mlp.gate_up)).chunk(2, dim=-1)
    return out_proj(mlp.down_proj, mlp.act(g) * u)


class Linears:
    """How ``dense`` runs its matmuls: the QKV projection's (``mm``), the output projection and the MLP."""

    def __init__(self, mm: Callable, out: Callable, mlp: Callable):
        self.mm, self.out, self.mlp = mm, out, mlp


EAGER = Linears(rows_linear, out_proj, mlp_rows)
GRAPHED = Linears(linear, lambda lin, x: lin(x), lambda mlp, x: mlp(x))


def token_ids(tokens: Any, device: torch.device) -> torch.Tensor:
    """A decode step's token ids (a list, or last step's ids on the device) as a long tensor."""
    return tokens.long() if torch.is_tensor(tokens) else torch.tensor(tokens, dtype=torch.long, device=device)


def head_weight(model: Any) -> torch.Tensor:
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


def dense(model: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, io: Any, lin: Linears = EAGER) -> Any:
    """The llama-family layers over rows ``x`` [T, hidden] whose rope rows are ``cos`` / ``sin`` [T, 1, D]:
    the residual stream after the last layer (before the final norm).  ``io.attend(layer, q [T, H, D],
    k [T, KVH, D], v [T, KVH, D]) -> [T, H*D]``; at the first CPU-offloaded layer ``io.offload(a)`` moves
    whatever it keeps per step."""
    a = model.a
    for i, blk in enumerate(model.layers):
        if a.offload is not None and i == a.offload[0]:
            x, cos, sin = to_offload(a, x, cos, sin)
            io.offload(a)
        attn = blk.self_attn
        q, k, v = project_qkv(attn, blk.input_layernorm(x), lin.mm)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = x + lin.out(attn.o_proj, io.attend(i, q, k, v))
        x = x + lin.mlp(blk.mlp, blk.post_attention_layernorm(x))
    return x


def final_norm(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The final norm of ``dense``'s output (back on the main device first where layers were offloaded)."""
    if model.a.offload is not None:
        x = from_offload(x, model.norm.weight)
    return model.norm(x)


# --- the fused layer (fused_decode.py's steps) --------------------------------------------------------------


def _qk_normed(attn: Any, qkv: torch.Tensor, H: int, KVH: int, D: int) -> torch.Tensor:
    """Qwen3-style per-head q/k RMSNorm applied to a fused QKV row block [B, (H+2KVH)*D]."""
    B = qkv.shape[0]
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q = attn.q_norm(q.reshape(B, H, D)).reshape(B, H * D)
    k = attn.k_norm(k.reshape(B, KVH, D)).reshape(B, KVH * D)
    return torch.cat([q, k, v], dim=-1)


def fused_qkv(attn: Any, h: torch.Tensor, qk_norm: bool) -> tuple[torch.Tensor, int, int, int]:
    """The fused QKV rows of ``h`` (q/k normed for Qwen3-style layers) and this rank's (H, KVH, D) (tensor
    parallel splits the heads)."""
    D = attn.a.head_dim
    H, KVH = attn.splits[0] // D, attn.splits[1] // D
    qkv = rows_linear(h, *attn.qkv).contiguous()  # (CPU: rows_linear's (W @ x^T)^T is a transposed view)
    return (_qk_normed(attn, qkv, H, KVH, D) if qk_norm else qkv), H, KVH, D


def after_attention(model: Any, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Layer ``i`` after its attention output ``o`` (rows, before o_proj): o_proj, residual add + norm, the MLP,
    residual add + the next layer's input norm (the final norm after the last layer).  ``x`` (the residual
    stream) is updated in place; returns the normed rows the next layer (or the LM head) reads."""
    from swiftlm.cuda_ext.decode_kernels import silu_mul

    blocks, eps = model.layers, model.a.eps
    blk = blocks[i]
    h = out_proj_add_rmsnorm(blk.self_attn.o_proj, o, x, blk.post_attention_layernorm.weight, eps)
    g = silu_mul(rows_linear(h, blk.mlp.gate_up).contiguous())
    nxt = blocks[i + 1].input_layernorm if i + 1 < len(blocks) else model.norm
    return out_proj_add_rmsnorm(blk.mlp.down_proj, g, x, nxt.weight, eps)


def fused(model: Any, x: torch.Tensor, io: Any) -> torch.Tensor:
    """The llama-family layers with fused elementwise kernels over rows ``x`` [B, hidden] (updated in place):
    the final-normed rows.  ``io.attend_qkv(layer, qkv [B, (H+2KVH)*D], H, KVH, D) -> [B, H*D]`` applies rope
    as it writes the K/V rows (one kernel) and attends."""
    h = model.layers[0].input_layernorm(x)
    for i, blk in enumerate(model.layers):
        qkv, H, KVH, D = fused_qkv(blk.self_attn, h, model.a.qk_norm)
        h = after_attention(model, i, x, io.attend_qkv(i, qkv, H, KVH, D))
    return h


# --- archs.py / archs_moe.py ----------------------------------------------------------------------------------


def blocks(model: Any, x: torch.Tensor, ropes: Sequence[Any], attend: Callable) -> torch.Tensor:
    """The layers of archs.py / archs_moe.py: layer ``i`` with its rope rows ``ropes[i]`` (None: no rotary
    embedding) and ``attend(layer, q, k, v) -> [T, H*Dv]``.  The residual stream after the last layer."""
    for i, layer in enumerate(model.layers):
        x = layer(x, ropes[i], attend)
    return x


def logits_graphed(model: Any, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Final norm and LM head as the CUDA-graph steps run them (``F.linear``; into ``out`` when given)."""
    x = model.norm(x)
    if out is None:
        return F.linear(x, head_weight(model))
    return torch.mm(x, head_weight(model).t(), out=out)
