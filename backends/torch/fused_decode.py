"""Decode steps whose elementwise stages are the Triton kernels of ``swiftlm.cuda_ext.decode_kernels``:
rope + KV write in one kernel, the residual add + RMSNorm in one, SiLU * up in one.  A layer is then
~9 kernels (3 of them GEMMs and one attention) instead of ~25, which is most of a small model's step
on the GPU (each kernel pays a launch and a tail even inside a CUDA graph) and of the graph's
host-side launch cost.

``decode_static_fused``: one sequence, its own cache (``graphs.decode_static``'s fixed shapes).
``decode_batch_static_fused``: B sequences in a slot pool (``graphs.decode_batch_static``'s).
Both are for the llama-family layer of ``model.py`` without Gemma's scaling and GeGLU (``fusable``);
q/k norms (Qwen3) run as torch ops between the QKV matmul and the rope kernel.  They compute what the
unfused functions compute, rounded in other places (fp32 inside each kernel instead of one rounding
to the model's dtype per torch op): ``tests/test_fused_decode.py`` bounds the difference.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from .kv_cache import SeqCache
from .linear_rows import rows_linear
from .model import Transformer
from .tp_allreduce import out_proj_add_rmsnorm
from .turbo_batch import batch_row_attention, batch_tables, buffer_as_pool

BATCHED_TURBO = os.environ.get("SWIFTLM_TQ_BATCHED", "1") != "0"  # turbo_batch.py's kernels for same-format batches


def fusable(model: Any) -> bool:
    """The fused steps cover this model's layers (llama family, not Gemma)."""
    return isinstance(model, Transformer) and getattr(model.a, "ext", None) is None and not model.a.gemma


def _qk_normed(attn: Any, qkv: torch.Tensor, H: int, KVH: int, D: int) -> torch.Tensor:
    """Qwen3-style per-head q/k RMSNorm applied to a fused QKV row block [B, (H+2KVH)*D]."""
    B = qkv.shape[0]
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q = attn.q_norm(q.reshape(B, H, D)).reshape(B, H * D)
    k = attn.k_norm(k.reshape(B, KVH, D)).reshape(B, KVH * D)
    return torch.cat([q, k, v], dim=-1)


def _heads(attn: Any) -> tuple[int, int, int]:
    """(H, KVH, D) of this rank's share of the layer (tensor parallel splits the heads)."""
    D = attn.a.head_dim
    return attn.splits[0] // D, attn.splits[1] // D, D


def _qkv(attn: Any, h: torch.Tensor, qk_norm: bool) -> tuple[torch.Tensor, int, int, int]:
    """The fused QKV rows of ``h`` (q/k normed for Qwen3-style layers) and this rank's (H, KVH, D)."""
    H, KVH, D = _heads(attn)
    qkv = rows_linear(h, *attn.qkv).contiguous()  # (CPU: rows_linear's (W @ x^T)^T is a transposed view)
    return (_qk_normed(attn, qkv, H, KVH, D) if qk_norm else qkv), H, KVH, D


def _after_attention(model: Transformer, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
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


def decode_static_fused(
    model: Transformer,
    kv: SeqCache,
    token: torch.Tensor,
    pos: torch.Tensor,
    L: int,
    arange: torch.Tensor,
    splits: int = 0,
) -> torch.Tensor:
    """``graphs.decode_static`` with the fused kernels (one sequence, its own cache).  Attention by the
    Triton decode kernel (``splits`` > 0: the cache is a one-slot pool read up to ``pos``) or SDPA over the
    first ``L`` rows with a mask.  Logits [V]."""
    from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows

    x = model.embed(token)
    slot = pos.new_zeros(1)  # the sequence's own cache is a one-slot pool
    if splits:
        from swiftlm.cuda_ext.paged_attention import paged_decode_attention

        table, lens = slot.view(1, 1).int(), (pos + 1).int()
    else:
        valid = (arange[:L] <= pos).view(1, 1, 1, L)
    h = model.layers[0].input_layernorm(x)
    for i, blk in enumerate(model.layers):
        qkv, H, KVH, D = _qkv(blk.self_attn, h, model.a.qk_norm)
        K, V = kv.k[i].unsqueeze(0), kv.v[i].unsqueeze(0)
        q = rope_kv_write_rows(qkv, model.cos, model.sin, pos, slot, K, V, H, KVH, D)
        if splits:
            o = paged_decode_attention(q, K, V, table, lens, D**-0.5, num_splits=splits)  # [1, H, D]
        else:
            o = F.scaled_dot_product_attention(
                q.view(1, H, 1, D), K[:, :, :L], V[:, :, :L], attn_mask=valid, enable_gqa=H != KVH
            )
        h = _after_attention(model, i, x, o.reshape(1, H * D))
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return rows_linear(h, w)[0]


def decode_batch_static_fused(
    model: Transformer,
    pool: Any,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    L: int,
    arange: torch.Tensor,
    splits: int = 0,
) -> torch.Tensor:
    """``graphs.decode_batch_static`` with the fused kernels: B decode rows over a slot pool, attention
    by the Triton paged kernel (``splits`` > 0) or gather + SDPA.  Logits [B, V]."""
    from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows

    B = tokens.shape[0]
    x = model.embed(tokens).contiguous()
    from swiftlm.cuda_ext.paged_attention import paged_decode_attention, paged_decode_attention_sdpa

    attend = paged_decode_attention if splits else paged_decode_attention_sdpa
    blk_ids, rows = pool.locate(slots, pos)  # each row's block and its row there (kv_pool)
    tables, lens = pool.table[slots][:, : -(-L // pool.block_size)], (pos + 1).int()
    h = model.layers[0].input_layernorm(x)
    for i, blk in enumerate(model.layers):
        qkv, H, KVH, D = _qkv(blk.self_attn, h, model.a.qk_norm)
        K, V = pool.k[i], pool.v[i]  # [blocks, KVH, block_size, D]
        fp8 = pool.attend_kw(i)  # an fp8 pool's scales (kv_fp8.py), else {}
        q = rope_kv_write_rows(qkv, model.cos, model.sin, pos, blk_ids, K, V, H, KVH, D, rows, **fp8)  # [B, H, D]
        out = attend(q, K, V, tables, lens, D**-0.5, num_splits=splits, **fp8)  # [B, H, D]
        h = _after_attention(model, i, x, out.reshape(B, H * D))
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return rows_linear(h, w)


def _compressed_row_attention(
    model: Transformer,
    kv: Any,
    i: int,
    qkv: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    valid: torch.Tensor | None,
    H: int,
    KVH: int,
    D: int,
    slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """Layer ``i`` of one decode row over a static compressed cache (every shape fixed): rope of the
    row's q and k (qkv [1, (H+2KVH)*D], pos / n_dense / n_code device [1]) with its K/V row written
    where the cache takes it, then the cache's attention (``attend_static``).  TurboQuant: into the
    16-bit buffer at ``n_dense`` (``valid`` masks the buffer); affine ``kv_bits``: into a one-row buffer
    that ``attend_static`` quantizes into the codes at ``n_code``.  ``slot``: ``n_dense - pos`` when the
    caller has it (one subtraction per step, not per layer).  Returns [1, H*D]."""
    from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows

    L = kv.layers[i]
    if kv.fmt.kind == "affine":
        row = torch.empty((2, 1, KVH, 1, D), dtype=kv.dense_dtype, device=qkv.device)
        K, V = row[0].expand(1, KVH, 2, D), row[1].expand(1, KVH, 2, D)  # row stride 0: the one row
        q = rope_kv_write_rows(qkv, model.cos, model.sin, pos, pos.new_zeros(1), K, V, H, KVH, D)
        return kv.attend_static(i, q[0], n_code, None, k=row[0, 0], v=row[1, 0])
    slot = n_dense - pos if slot is None else slot
    q = rope_kv_write_rows(qkv, model.cos, model.sin, pos, slot, buffer_as_pool(L.dk), buffer_as_pool(L.dv), H, KVH, D)
    return kv.attend_static(i, q[0], n_code, valid)


def decode_compressed_batch_static_fused(
    model: Transformer,
    kvs: list,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    arange: torch.Tensor,
) -> torch.Tensor:
    """B decode rows, each over its own static compressed cache (TurboQuant or affine, mixed), in one
    pass with fixed shapes (one CUDA graph per set of caches): the matmuls run on [B, hidden] rows, so
    the weights are read once per step, and each row's attention is its cache's kernels
    (``_compressed_row_attention``).  tokens, pos, n_dense, n_code: device [B].  Logits [B, V]."""
    x = model.embed(tokens).contiguous()
    valid = [arange[: kv.dense_rows] <= n_dense[b] if kv.fmt.kind == "turbo" else None for b, kv in enumerate(kvs)]
    h = model.layers[0].input_layernorm(x)
    for i, blk in enumerate(model.layers):
        qkv, H, KVH, D = _qkv(blk.self_attn, h, model.a.qk_norm)
        tables = batch_tables(kvs, i) if BATCHED_TURBO else None
        if tables is not None:  # one format for all rows: each kernel once for the batch (turbo_batch.py)
            o = batch_row_attention(model, kvs, i, qkv, pos, n_dense, n_code, H, KVH, D, tables)
        else:
            o = torch.cat(
                [
                    _compressed_row_attention(
                        model,
                        kv,
                        i,
                        qkv[b : b + 1],
                        pos[b : b + 1],
                        n_dense[b : b + 1],
                        n_code[b : b + 1],
                        valid[b],
                        H,
                        KVH,
                        D,
                    )
                    for b, kv in enumerate(kvs)
                ]
            )
        h = _after_attention(model, i, x, o)
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return rows_linear(h, w)


def decode_turbo_static_fused(
    model: Transformer,
    kv: Any,
    token: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    arange: torch.Tensor,
) -> torch.Tensor:
    """``graphs.decode_turbo_static`` with the fused kernels: one sequence over a static TurboQuant cache
    (``CompressedCache(capacity=...)``).  Per layer: the QKV rows (``rows_linear``), rope + the new K/V
    row written into the layer's 16-bit buffer at row ``n_dense`` in one kernel, the cache's attention
    (``attend_static``: the packed-code kernel and its combine pass with the buffer), then the fused
    tail of the 16-bit step.  Logits [V]."""
    x = model.embed(token)
    valid = arange[: kv.dense_rows] <= n_dense  # the rows held plus the one written now
    slot = n_dense - pos
    h = model.layers[0].input_layernorm(x)
    for i, blk in enumerate(model.layers):
        qkv, H, KVH, D = _qkv(blk.self_attn, h, model.a.qk_norm)
        h = _after_attention(
            model, i, x, _compressed_row_attention(model, kv, i, qkv, pos, n_dense, n_code, valid, H, KVH, D, slot)
        )
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return rows_linear(h, w)[0]
