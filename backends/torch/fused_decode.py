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

Each step is forward.fused with this module's attend object of its cache: ``SeqRows``, ``PoolRows``,
``CompressedRows`` (TurboQuant or affine) or ``CompressedBatchRows``; rope comes with the K/V row's write.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from .forward import fused, head_weight
from .kv_cache import SeqCache
from .linear_rows import rows_linear
from .model import Transformer
from .turbo_batch import batch_row_attention, batch_tables, buffer_as_pool

BATCHED_TURBO = os.environ.get("SWIFTLM_TQ_BATCHED", "1") != "0"  # turbo_batch.py's kernels for same-format batches


def fusable(model: Any) -> bool:
    """The fused steps cover this model's layers (llama family, not Gemma)."""
    return isinstance(model, Transformer) and getattr(model.a, "ext", None) is None and not model.a.gemma


def _rope_write(model: Any, qkv: Any, pos: Any, slot: Any, K: Any, V: Any, *hkd: int, **kw: Any) -> torch.Tensor:
    """``cuda_ext.decode_kernels.rope_kv_write_rows`` with the model's rope tables: q [B, H, D] out, K/V written."""
    from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows

    return rope_kv_write_rows(qkv, model.cos, model.sin, pos, slot, K, V, *hkd, **kw)


class SeqRows:
    """One sequence's own cache as a one-slot pool: attention by the Triton decode kernel (``splits`` > 0,
    read up to ``pos``) or SDPA over the first ``L`` rows with a mask."""

    def __init__(self, model: Any, kv: SeqCache, pos: torch.Tensor, L: int, arange: torch.Tensor, splits: int):
        self.model, self.kv, self.pos, self.L, self.splits = model, kv, pos, L, splits
        self.slot = pos.new_zeros(1)
        if splits:
            self.table, self.lens = self.slot.view(1, 1).int(), (pos + 1).int()
        else:
            self.valid = (arange[:L] <= pos).view(1, 1, 1, L)

    def attend_qkv(self, i: int, qkv: torch.Tensor, H: int, KVH: int, D: int) -> torch.Tensor:
        K, V = self.kv.k[i].unsqueeze(0), self.kv.v[i].unsqueeze(0)
        q = _rope_write(self.model, qkv, self.pos, self.slot, K, V, H, KVH, D)
        if self.splits:
            from swiftlm.cuda_ext.paged_attention import paged_decode_attention

            o = paged_decode_attention(q, K, V, self.table, self.lens, D**-0.5, num_splits=self.splits)  # [1, H, D]
        else:
            L = self.L
            o = F.scaled_dot_product_attention(
                q.view(1, H, 1, D), K[:, :, :L], V[:, :, :L], attn_mask=self.valid, enable_gqa=H != KVH
            )
        return o.reshape(1, H * D)


class PoolRows:
    """B decode rows over the slot pool: attention by the Triton paged kernel (``splits`` > 0) or gather + SDPA."""

    def __init__(self, model: Any, pool: Any, slots: torch.Tensor, pos: torch.Tensor, L: int, splits: int):
        from swiftlm.cuda_ext.paged_attention import paged_decode_attention, paged_decode_attention_sdpa

        self.fn = paged_decode_attention if splits else paged_decode_attention_sdpa
        self.model, self.pool, self.pos, self.splits = model, pool, pos, splits
        self.blk_ids, self.rows = pool.locate(slots, pos)  # each row's block and its row there (kv_pool)
        self.tables, self.lens = pool.table[slots][:, : -(-L // pool.block_size)], (pos + 1).int()

    def attend_qkv(self, i: int, qkv: torch.Tensor, H: int, KVH: int, D: int) -> torch.Tensor:
        K, V = self.pool.k[i], self.pool.v[i]  # [blocks, KVH, block_size, D]
        fp8 = self.pool.attend_kw(i)  # an fp8 pool's scales (kv_fp8.py), else {}
        q = _rope_write(self.model, qkv, self.pos, self.blk_ids, K, V, H, KVH, D, self.rows, **fp8)  # [B, H, D]
        out = self.fn(q, K, V, self.tables, self.lens, D**-0.5, num_splits=self.splits, **fp8)  # [B, H, D]
        return out.reshape(qkv.shape[0], H * D)


class CompressedRows:
    """One decode row over a static compressed cache (every shape fixed; pos / n_dense / n_code device [1]):
    rope of the row's q and k with its K/V row written where the cache takes it, then the cache's attention
    (``attend_static``).  TurboQuant: into the 16-bit buffer at ``n_dense`` (``valid`` masks the buffer);
    affine ``kv_bits``: into a one-row buffer that ``attend_static`` quantizes into the codes at ``n_code``."""

    def __init__(self, model: Any, kv: Any, pos: Any, n_dense: Any, n_code: Any, valid: Any, slot: Any = None):
        self.model, self.kv, self.pos, self.n_code, self.valid = model, kv, pos, n_code, valid
        if kv.fmt.kind == "affine":
            a = kv.a
            self.row = torch.empty((2, 1, a.kv_heads, 1, a.head_dim), dtype=kv.dense_dtype, device=pos.device)
        else:
            self.slot = n_dense - pos if slot is None else slot  # (one subtraction per step, not per layer)

    def attend_qkv(self, i: int, qkv: torch.Tensor, H: int, KVH: int, D: int) -> torch.Tensor:
        kv, m, pos = self.kv, self.model, self.pos
        if kv.fmt.kind == "affine":
            row = self.row  # the rope kernel writes the new k, v rows into a "pool" whose row stride is 0
            K, V = row[0].expand(1, KVH, 2, D), row[1].expand(1, KVH, 2, D)
            q = _rope_write(m, qkv, pos, pos.new_zeros(1), K, V, H, KVH, D)
            return kv.attend_static(i, q[0], self.n_code, None, k=row[0, 0], v=row[1, 0])
        L = kv.layers[i]
        q = _rope_write(m, qkv, pos, self.slot, buffer_as_pool(L.dk), buffer_as_pool(L.dv), H, KVH, D)
        return kv.attend_static(i, q[0], self.n_code, self.valid)


class CompressedBatchRows:
    """B decode rows, each over its own static compressed cache (TurboQuant or affine, mixed): one format for
    all rows runs each kernel once for the batch (turbo_batch.py: through ``tables``, a ``SetTables`` loaded with
    these caches, else tables made for this set), otherwise each row its cache's kernels."""

    def __init__(
        self, model: Any, kvs: list, pos: Any, n_dense: Any, n_code: Any, arange: torch.Tensor, tables: Any = None
    ):
        self.model, self.kvs, self.pos, self.n_dense, self.n_code = model, kvs, pos, n_dense, n_code
        self.arange, self.tables = arange, tables
        self._rows: list | None = None

    def rows(self) -> list:
        """Each row's own ``CompressedRows`` (made on first use: the batched path needs none)."""
        if self._rows is None:
            kvs, pos, nd, nc = self.kvs, self.pos, self.n_dense, self.n_code
            self._rows = [
                CompressedRows(
                    self.model,
                    kv,
                    pos[b : b + 1],
                    nd[b : b + 1],
                    nc[b : b + 1],
                    self.arange[: kv.dense_rows] <= nd[b] if kv.fmt.kind == "turbo" else None,
                )
                for b, kv in enumerate(kvs)
            ]
        return self._rows

    def attend_qkv(self, i: int, qkv: torch.Tensor, H: int, KVH: int, D: int) -> torch.Tensor:
        m, pos, nd, nc = self.model, self.pos, self.n_dense, self.n_code
        if self.tables is not None:  # any set of caches, from the tables' base cache
            st = self.tables
            return batch_row_attention(m, st.base, i, qkv, pos, nd, nc, H, KVH, D, st.layers[i])
        tables = batch_tables(self.kvs, i) if BATCHED_TURBO else None
        if tables is not None:  # one format for all rows: each kernel once for the batch (turbo_batch.py)
            return batch_row_attention(m, self.kvs[0], i, qkv, pos, nd, nc, H, KVH, D, tables)
        return torch.cat([r.attend_qkv(i, qkv[b : b + 1], H, KVH, D) for b, r in enumerate(self.rows())])


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
    h = fused(model, model.embed(token), SeqRows(model, kv, pos, L, arange, splits))
    return rows_linear(h, head_weight(model))[0]


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
    h = fused(model, model.embed(tokens).contiguous(), PoolRows(model, pool, slots, pos, L, splits))
    return rows_linear(h, head_weight(model))


def decode_compressed_batch_static_fused(
    model: Transformer,
    kvs: list,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    arange: torch.Tensor,
    tables: Any = None,
) -> torch.Tensor:
    """B decode rows, each over its own static compressed cache (TurboQuant or affine, mixed), in one
    pass with fixed shapes (one CUDA graph per batch size where ``tables``, a ``turbo_batch.SetTables``, addresses
    the caches; else one per set of caches): the matmuls run on [B, hidden] rows, so the weights are read once per
    step, and each row's attention is its cache's kernels (``CompressedBatchRows``).  tokens, pos, n_dense, n_code:
    device [B].  Logits [B, V]."""
    io = CompressedBatchRows(model, kvs, pos, n_dense, n_code, arange, tables)
    return rows_linear(fused(model, model.embed(tokens).contiguous(), io), head_weight(model))


def decode_turbo_static_fused(
    model: Transformer,
    kv: Any,
    token: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    arange: torch.Tensor,
) -> torch.Tensor:
    """``graphs.decode_turbo_static`` with the fused kernels: one sequence over a static compressed cache
    (``CompressedCache(capacity=...)``; TurboQuant, or affine ``kv_bits``).  Per layer: the QKV rows, rope + the
    new K/V row written into the layer's 16-bit buffer at row ``n_dense`` in one kernel (affine: into a one-row
    buffer the cache quantizes), the cache's attention (``attend_static``: the packed-code kernel and its
    combine pass with the buffer), then the fused tail of the 16-bit step.  Logits [V]."""
    valid = arange[: kv.dense_rows] <= n_dense  # the rows held plus the one written now
    h = fused(model, model.embed(token), CompressedRows(model, kv, pos, n_dense, n_code, valid))
    return rows_linear(h, head_weight(model))[0]
