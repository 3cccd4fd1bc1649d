"""Fixed-shape decode step and its CUDA-graph replay.

``decode_static`` runs one decode token for one sequence whose KV cache has a fixed capacity,
with the position as a device tensor: every shape is static, so the whole step (embedding,
all layers, LM head) is captured once per (cache slot, length bucket) and replayed with a
single launch.  Attention reads the first ``L`` cache rows (the smallest bucket holding the
position) and masks rows past the position.  MoE layers route on the host, so MoE models
decode eagerly.  Each step is forward.dense with its cache's attend object (attend.py).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from .attend import CompressedStaticAttend, PoolAttend, StaticAttend
from .forward import GRAPHED, dense, logits_graphed
from .fused_decode import (
    BATCHED_TURBO,
    decode_batch_static_fused,
    decode_compressed_batch_static_fused,
    decode_static_fused,
    decode_turbo_static_fused,
    fusable,
)
from .kv_cache import SeqCache
from .kv_pool import PagedSeqCache, SlotPool
from .model import MLP, Transformer
from .staging import stager
from .turbo_batch import SetTables

COMPRESSED_BATCH_GRAPHS = 8  # graphs kept for sets of compressed caches decoding together (formats mixed)
SET_TABLES = os.environ.get("SWIFTLM_TQ_SET_TABLES", "1") != "0"  # 0: a graph per set of caches (the A/B switch)

BUCKET_MIN = 256


def decode_static(
    model: Transformer, kv: SeqCache, token: torch.Tensor, pos: torch.Tensor, L: int, arange: torch.Tensor
) -> torch.Tensor:
    """Logits [V] for one token at position ``pos`` (device tensors of shape [1]): ``verify_static`` of one row."""
    return verify_static(model, kv, token, pos, L, arange)[0]


def _verify(
    model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, L: int, arange: torch.Tensor, rows: Any
) -> Any:
    """The verify forward: ``rows`` as ``attend.StaticAttend``'s (writes the block's K/V, returns the layer's
    first ``L`` keys and values); causal within the block, full to the earlier rows."""
    T = tokens.shape[0]
    positions = pos + arange[:T]
    valid = (arange[:L].view(1, L) <= positions.view(T, 1)).view(1, 1, T, L)
    io = StaticAttend(rows, positions, valid)
    x = dense(
        model, model.embed(tokens), model.cos[positions].unsqueeze(1), model.sin[positions].unsqueeze(1), io, GRAPHED
    )
    return logits_graphed(model, x)


def verify_static(
    model: Transformer, kv: SeqCache, tokens: torch.Tensor, pos: torch.Tensor, L: int, arange: torch.Tensor
) -> torch.Tensor:
    """Logits [T, V] for ``T`` tokens at positions ``pos .. pos+T-1`` (speculative verification):
    causal within the block, full to the earlier rows; static shapes, so it graphs like decode."""
    return _verify(model, tokens, pos, L, arange, StaticAttend.seq(kv, L))


def verify_paged(
    model: Transformer,
    pool: SlotPool,
    slot: torch.Tensor,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    L: int,
    arange: torch.Tensor,
) -> torch.Tensor:
    """``verify_static`` over a sequence in the paged pool (its table row ``slot``, a device tensor [1]):
    the block's K/V written through the table, attention over the blocks holding positions [0, L)
    gathered.  Static shapes (T, L), so it graphs per (T, L).  Logits [T, V]."""
    T = tokens.shape[0]
    where = pool.locate(slot.expand(T), pos + arange[:T])
    idx = pool.table[slot][0, : -(-L // pool.block_size)].long()  # (a 0-d tensor index would read it on the host)
    return _verify(model, tokens, pos, L, arange, StaticAttend.pool(pool, where, idx, L))


def decode_batch_static(
    model: Transformer,
    pool: SlotPool,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    L: int,
    arange: torch.Tensor,
    splits: int = 0,
) -> torch.Tensor:
    """One decode token for each of B sequences whose caches are rows ``slots`` of the shared
    slot tensors: every matmul and the attention run batched, shapes are static (B, L), so a
    step is one graph replay.  With ``splits`` > 0 attention is the Triton decode kernel
    (``cuda_ext.paged_attention``: each slot read in place up to its own length, split-K over
    ``splits`` ranges); otherwise the blocks holding every row's first L positions are gathered for SDPA.
    Each row's K/V go to block ``table[slot, pos // block_size]`` (``kv_pool``).  Logits [B, V]."""
    io = PoolAttend(pool, slots, pos, L, splits)
    x = dense(model, model.embed(tokens), model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1), io, GRAPHED)
    return logits_graphed(model, x)


def prefill_packed_static(
    model: Transformer,
    pool: SlotPool,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    seg: torch.Tensor,
    last: torch.Tensor,
    cu: torch.Tensor | None = None,
    max_len: int = 0,
) -> torch.Tensor:
    """The first chunks of several prompts in one forward: their T tokens packed in one row
    ([T] ``tokens``, each token's pool ``slots``, position ``pos`` and prompt index ``seg``, the
    prompts in order).  The matmuls run once over all T rows; attention is causal within each prompt
    and blind across prompts (``packed_attention.packed_causal``: the variable-length flash kernel
    given ``cu``, the prompts' int32 cumulative lengths, and ``max_len``; else a block-diagonal mask),
    K/V go to each token's slot and position in one indexed write per layer.  Chunks here start at
    position 0, so no earlier KV is read.  Returns the logits [n, V] of the rows ``last`` (each
    prompt's final token)."""
    from .mixed_step import mixed_static  # (the same forward with no decode rows)

    return mixed_static(model, pool, tokens, slots, pos, seg, last, cu, max_len, tokens.shape[0], 0)


def decode_turbo_static(
    model: Transformer,
    kv: Any,
    token: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    arange: torch.Tensor,
) -> torch.Tensor:
    """One decode token over a static TurboQuant cache (``CompressedCache(capacity=...)``): the new
    row goes into the 16-bit buffer at ``n_dense`` and attention reads ``n_code`` compressed rows
    through the Triton kernel; all shapes are fixed, so the step is one graph per cache.  Logits [V]."""
    io = CompressedStaticAttend(kv, n_dense, n_code, arange[: kv.dense_rows] <= n_dense)  # (valid: rows held + new)
    x = dense(model, model.embed(token), model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1), io, GRAPHED)
    return logits_graphed(model, x)[0]


def graphable(model: Transformer) -> bool:
    return all(isinstance(b.mlp, MLP) for b in model.layers)


def _put_token(t: torch.Tensor, token: int | torch.Tensor) -> torch.Tensor:
    """A token id into the one-element device tensor ``t``: a device tensor is copied there (no host sync)."""
    if torch.is_tensor(token):
        t.copy_(token.reshape(1))
    else:
        t.fill_(token)
    return t


def bucket_for(pos: int, capacity: int) -> int:
    L = BUCKET_MIN
    while L < pos + 1:
        L *= 2
    return min(L, capacity)


class GraphDecoder:
    """CUDA graphs of ``decode_static``, one per (cache slot, bucket), sharing one memory pool."""

    def __init__(self, model: Transformer, device: torch.device, use_graph: bool = True, fused: bool | None = None):
        from swiftlm.cuda_ext import enabled

        self.model = model
        self.device = device
        self.use_graph = use_graph and device.type == "cuda"
        if fused is None:  # SWIFTLM_FUSED_DECODE=0: the unfused steps (for A/B runs)
            fused = enabled(device.type) and fusable(model) and os.environ.get("SWIFTLM_FUSED_DECODE", "1") != "0"
        self.fused = fused
        self.batch_fn = decode_batch_static_fused if fused else decode_batch_static
        # batched decode attention reads the slots in place (Triton) instead of gathering them
        self.paged_attention = enabled(device.type) and os.environ.get("SWIFTLM_PAGED_ATTENTION", "1") != "0"
        self.arange = torch.arange(model.a.ctx, device=device)
        self.graphs: dict[Any, tuple[Any, tuple, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.captures = 0
        self.set_tables: dict[tuple, SetTables] = {}  # (format, batch size, paged) -> the tables its graph reads

    def precapture(self, pool: SlotPool, rows: int = 0) -> None:
        """Capture the batched decode graphs at start-up, so that no stream waits for a capture while
        serving: a lone row's per length bucket, then every batch size 2, 4, ... up to the pool's size or ``rows``
        (the Triton-kernel path needs one graph per batch size)."""
        if not (self.use_graph and self.paged_attention):
            return
        L = BUCKET_MIN  # a lone row: one graph per length bucket (run_batch)
        while True:
            self.run_batch(pool, [pool.scratch], [0], [min(L, pool.capacity) - 1])
            if L >= pool.capacity:
                break
            L *= 2
        Bp, most = 2, max(pool.n, rows)
        while most > 1:
            n = min(Bp, most)
            self.run_batch(pool, [pool.scratch] * n, [0] * n, [0] * n)  # scratch rows only
            if Bp >= most:
                break
            Bp *= 2

    def splits_for(self, L: int, B: int) -> int:
        """Split-K ranges of the Triton decode-attention kernel for a batch of B rows of up to L
        positions (0: gather + SDPA, where the kernel is off)."""
        if not self.paged_attention:
            return 0
        from swiftlm.cuda_ext.paged_attention import default_splits

        return default_splits(L, B, self.model.a.kv_heads)

    def eager(self, kv: SeqCache, token: Any, pos: int) -> torch.Tensor:
        t = token.reshape(1).long() if torch.is_tensor(token) else torch.tensor([token], device=self.device)
        p = torch.tensor([pos], device=self.device)
        return self.fn(self.model, kv, t, p, bucket_for(pos, kv.capacity), self.arange)

    def fn(
        self, model: Transformer, kv: SeqCache, t: torch.Tensor, p: torch.Tensor, L: int, arange: torch.Tensor
    ) -> torch.Tensor:
        """One sequence's decode step: fused (attention by the Triton decode kernel where it is on) or not."""
        if self.fused and kv.fp8 is None:  # (an fp8 SeqCache: the unfused step quantises its row)
            return decode_static_fused(model, kv, t, p, L, arange, self.splits_for(L, 1))
        return decode_static(model, kv, t, p, L, arange)

    def _capture(self, key: Any, fn: Any, inputs: tuple) -> tuple:
        """Run ``fn(*inputs)`` once on a side stream (warm-up; also this step's result), then
        capture it into a graph that replays on the same input tensors, kept in ``graphs`` under
        ``key`` (None: only returned, for a caller that keeps its own, as ``prefill_graphs`` does)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn(*inputs)
        entry = (g, inputs, out)
        if key is not None:
            self.graphs[key] = entry
        self.captures += 1
        return entry

    def verify(self, kv: SeqCache, tokens: list[int], pos: int) -> torch.Tensor:
        """Logits [len(tokens), V] at positions pos.. (graphed per cache, bucket and length): ``verify_static``,
        or ``verify_paged`` for a paged-pool sequence (graphed per pool; its table row is an input)."""
        T, m = len(tokens), self.model
        L = bucket_for(pos + T - 1, kv.capacity)
        paged = isinstance(kv, PagedSeqCache)
        if paged:
            kv.sync()
            kv.pool.flush()
            key: tuple = ("verify-paged", id(kv.pool), L, T)

            def fn(s: torch.Tensor, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
                return verify_paged(m, kv.pool, s, t, p, L, self.arange)
        else:
            key = ("verify", id(kv), L, T)

            def fn(s: torch.Tensor, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:  # (s: the paged path's)
                return verify_static(m, kv, t, p, L, self.arange)

        host = (torch.tensor([kv.slot if paged else 0]), torch.tensor(tokens), torch.tensor([pos]))
        if not self.use_graph:
            return fn(*(t.to(self.device) for t in host))
        entry = self.graphs.get(key) or self._capture(key, fn, tuple(t.to(self.device) for t in host))
        g, ins, out = entry
        for dst, src in zip(ins, host):
            dst.copy_(src, non_blocking=True)
        g.replay()
        return out

    def run_batch(self, pool: SlotPool, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Batched decode over pool slots; the batch is padded to a power of two (scratch slot)
        so that a few graphs per length bucket serve any number of streams.  Logits [B, V]."""
        pool.flush()  # table rows changed since the last step (new blocks, new sequences)
        B = len(slots)
        Bp = 1
        while Bp < B:
            Bp *= 2
        # the Triton kernel reads each sequence up to its own length: one graph per batch size serves every
        # length; a lone row (one stream) gets a graph per length bucket, with the split-K ranges of that
        # length rather than of the whole context (the splits share out the rows the sequence holds, not
        # ranges of the whole context that are mostly empty)
        L = pool.capacity if self.paged_attention and Bp > 1 else bucket_for(max(positions), pool.capacity)
        pad = Bp - B
        on_dev = torch.is_tensor(tokens)  # overlapped decode: last step's ids, never read back
        host = torch.tensor(
            [([0] * Bp) if on_dev else (tokens + [0] * pad), slots + [pool.scratch] * pad, positions + [0] * pad]
        )
        splits = self.splits_for(L, Bp)
        if not self.use_graph:
            t, s_, p = host.to(self.device).unbind(0)
            if on_dev:
                t = t.clone()
                t[:B] = tokens
            return self.batch_fn(self.model, pool, t, s_, p, L, self.arange, splits)[:B].float()
        key = ("batch", Bp, L)
        entry = self.graphs.get(key)
        if entry is None:
            t, s_, p = (x.clone() for x in host.to(self.device).unbind(0))
            # float32 logits out of the graph: a cast in the sampler would re-take the GIL inside the op
            # and queue behind the HTTP loop
            entry = self._capture(
                key,
                lambda a, b, c: self.batch_fn(self.model, pool, a, b, c, L, self.arange, splits).float(),
                (t, s_, p),
            )
        g, (t, s_, p), out = entry
        dev = stager(self.device).to_device(host)  # page-locked: queued, no wait on the running step
        t.copy_(dev[0])
        if on_dev:
            t[:B].copy_(tokens)
        s_.copy_(dev[1])
        p.copy_(dev[2])
        g.replay()
        return out[:B]

    def run_turbo(self, kv: Any, token: int | torch.Tensor, pos: int) -> torch.Tensor:
        """A decode step over a static TurboQuant cache: one graph per cache (its storage never
        moves), replayed with the token, position and row counts filled in; compression of rows
        leaving the window runs eagerly between replays (once per 32 tokens).  Static affine
        (``kv_bits``) caches go the same way: their attend object quantizes the row in the graph.
        ``token``: an int, or the device tensor an overlapped step sampled (copied on the device: reading it on
        the host would wait for the step before, and the next step could not be launched while it runs)."""
        for L in kv.layers:
            kv.truncate(L, pos)
        L0 = kv.layers[0]
        host = (pos, L0.n_dense, L0.n_code)
        step = decode_turbo_static_fused if self.fused else decode_turbo_static  # (turbo and affine caches)
        if not self.use_graph:
            t = _put_token(torch.empty(1, dtype=torch.long, device=self.device), token)
            p, nd, nc = (torch.tensor([x], device=self.device) for x in host)
            out = step(self.model, kv, t, p, nd, nc, self.arange)
        else:
            key = ("turbo", id(kv))
            entry = self.graphs.get(key)
            ins = entry[1] if entry else tuple(torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(4))
            _put_token(ins[0], token)
            for t, x in zip(ins[1:], host):
                t.fill_(x)
            if entry is None:  # the warm-up's output is not kept and a capture runs nothing: replay below
                entry = self._capture(key, lambda t, p, nd, nc: step(self.model, kv, t, p, nd, nc, self.arange), ins)
            entry[0].replay()
            out = entry[2]
        kv.after_graph_step(pos, functools.partial(self._compress_turbo, kv) if self.use_graph else None)
        return out

    def _compress_turbo(self, kv: Any, n_code: int) -> None:
        """``kv.compress_block`` at code position ``n_code`` from a CUDA graph (one per cache; its first
        use runs it eagerly and captures it): one replay instead of ~20 launches per layer every 32 tokens."""
        key = ("turbo-compress", id(kv))
        entry = self.graphs.get(key)
        if entry is None:
            at = torch.tensor([n_code], device=self.device)
            self._capture(key, kv.compress_block, (at,))  # the warm-up run is this block's compression
            return
        g, (at,), _ = entry
        at.fill_(n_code)
        g.replay()

    def run_compressed_batch(self, kvs: list, tokens: Any, positions: list[int]) -> torch.Tensor:
        """B decode rows over B static compressed caches (``graphable()``; the fused step only), replayed with the
        tokens, positions and row counts.  Caches of one TurboQuant format go through ``turbo_batch.SetTables``: one
        graph per (format, batch size) serves every set of caches, its tables pointed at this step's caches before
        the replay.  Other sets (formats mixed, affine caches) get a graph per set of caches (they are pooled and
        reused across requests, so sets recur; the oldest of more than COMPRESSED_BATCH_GRAPHS is dropped).
        Logits [B, V]."""
        for kv, p in zip(kvs, positions):
            for L in kv.layers:
                kv.truncate(L, p)
        B = len(kvs)
        on_dev = torch.is_tensor(tokens)
        host = torch.tensor(
            [
                [0] * B if on_dev else list(tokens),
                list(positions),
                [kv.layers[0].n_dense for kv in kvs],
                [kv.layers[0].n_code for kv in kvs],
            ]
        )
        fn = decode_compressed_batch_static_fused
        tables = self._set_tables(kvs)
        if not self.use_graph:
            t, p, nd, nc = host.to(self.device).unbind(0)
            if on_dev:
                t = tokens.reshape(B).long()
            out = fn(self.model, kvs, t, p, nd, nc, self.arange, tables)
        else:
            key = (
                ("compressed-set", kvs[0].fmt, B) if tables is not None else ("compressed-batch",) + tuple(map(id, kvs))
            )
            entry = self.graphs.get(key)
            if entry is None:
                if tables is None:
                    olds = [k for k in self.graphs if k[0] == "compressed-batch"]
                    for k in olds[: max(0, len(olds) + 1 - COMPRESSED_BATCH_GRAPHS)]:
                        del self.graphs[k]
                ins = tuple(x.clone() for x in host.to(self.device).unbind(0))
                entry = self._capture(
                    key, lambda t, p, nd, nc: fn(self.model, kvs, t, p, nd, nc, self.arange, tables), ins
                )
            g, (t, p, nd, nc), out = entry
            dev = stager(self.device).to_device(host)
            for dst, src in zip((t, p, nd, nc), dev.unbind(0)):
                dst.copy_(src)
            if on_dev:
                t.copy_(tokens.reshape(B))
            g.replay()
        for kv, p_ in zip(kvs, positions):
            kv.after_graph_step(p_, functools.partial(self._compress_turbo, kv) if self.use_graph else None)
        return out

    def _set_tables(self, kvs: list) -> SetTables | None:
        """The ``SetTables`` of these caches' format and number, loaded with them (made on first use, addressed from
        the first set's first cache), or None where the batched kernels cannot take the set."""
        if len(kvs) < 2 or not SET_TABLES or not BATCHED_TURBO or kvs[0].fmt.kind != "turbo":
            return None
        key = (kvs[0].fmt, len(kvs), kvs[0].paged)
        st = self.set_tables.get(key) or SetTables(kvs[0], len(kvs), self.device)
        if not st.load(kvs, stager(self.device).to_device):
            return None
        self.set_tables[key] = st  # (kept once a set loaded: its base can address others)
        return st

    def run(self, kv: SeqCache, token: int, pos: int) -> torch.Tensor:
        if not self.use_graph:
            return self.eager(kv, token, pos)
        L = bucket_for(pos, kv.capacity)
        key = (id(kv), L)
        entry = self.graphs.get(key)
        if entry is None:
            tok = (
                token.reshape(1).long().clone() if torch.is_tensor(token) else torch.tensor([token], device=self.device)
            )
            p = torch.tensor([pos], device=self.device)
            entry = self._capture(key, lambda t, q: self.fn(self.model, kv, t, q, L, self.arange), (tok, p))
        g, (tok, p), out = entry
        if torch.is_tensor(token):
            tok.copy_(token.reshape(1))
        else:
            tok.fill_(token)
        p.fill_(pos)
        g.replay()
        return out
