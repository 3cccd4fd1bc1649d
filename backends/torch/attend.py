"""Attention as the forwards of forward.py reach it: one small class per KV format and path, each with
``attend(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H*D]`` that writes the rows' K/V where its
cache keeps them and attends over what the cache holds (and ``offload(a)``, called where ``--gpu-layers``
moves the activations to the CPU layers).

Eager paths (any device):
- ``CacheAttend``: one sequence's rows at positions [start, start + T) over its own cache: a ``SeqCache``
  (sliding windows included), or any cache with ``update_attend`` (compressed, paged, staged, forked).
- ``PackedRows``: several prompts packed in one row block (``PackedAttend``), each from position 0, no KV kept.
- ``RowsAttend``: B decode rows, each over its own cache (padded batched attention; shared prefixes; the
  numba CPU kernel; on the CPU compressed caches of one format, TurboQuant or kv_bits, batched, cpu_code_batch.py;
  other compressed caches row by row).

Static paths (every shape fixed, no host read: what the CUDA graphs capture):
- ``StaticAttend``: rows at device positions over a fixed-capacity ``SeqCache`` (decode, verify) or over a
  sequence's blocks of the slot pool gathered (paged verify): masked SDPA over the first ``L`` rows.
- ``PoolAttend``: B decode rows over the slot pool, by the Triton paged kernel or gather + SDPA.
- ``MixedAttend``: packed first prompt chunks plus decode rows over the slot pool (mixed_step.py).
- ``CompressedStaticAttend``: one decode row over a static TurboQuant or affine (``kv_bits``) cache.

The ``Core*`` classes are the same for archs.py / archs_moe.py, whose layers bring their own attention core
(soft caps, sinks, latent attention): ``core(layer)(q [H, T, D], keys, values, start, window) -> [T, H*Dv]``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from . import cpu_batch_attention, cpu_code_batch
from .kv_cache import SeqCache
from .offload import to_offload
from .packed_attention import packed_causal


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


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [H, T, D] at positions [start, start + T) over keys / values [KVH, start + T, D], causal: [T, H*D].
    One query row attends to everything so far: two small matmuls, cheaper on CPU than the fused kernel's
    setup for a single query row."""
    (H, T, D), KVH = q.shape, keys.shape[0]
    rep = H // KVH
    if T == 1:
        qg = q.reshape(KVH, rep, D)
        probs = torch.softmax((qg @ keys.transpose(1, 2) * D**-0.5).float(), dim=-1).to(values.dtype)
        return (probs @ values).reshape(1, H * D)
    if start == 0:
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), is_causal=True, enable_gqa=rep > 1
        )
    else:  # a prefill chunk after earlier positions: causal within the chunk, full to the past
        out = chunk_attention(q, keys, values, start, rep)
    return rows_out(out[0])


def heads_first(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[T, heads, D] -> [heads, T, D] (contiguous: the layout the caches and SDPA read)."""
    return tuple(t.transpose(0, 1).contiguous() for t in ts)


def rows_out(out: torch.Tensor) -> torch.Tensor:
    """[H, T, D] -> [T, H*D]."""
    return out.transpose(0, 1).reshape(out.shape[1], -1)


class Attend:
    def offload(self, a: Any) -> None:
        """The layers from here on run on the CPU (``--gpu-layers``): move what the step keeps there."""


class CacheAttend(Attend):
    """One sequence's rows at positions [start, start + T) over its own cache."""

    def __init__(self, a: Any, kv: Any, start: int):
        self.a, self.kv, self.start = a, kv, start

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a, kv, start, T = self.a, self.kv, self.start, q.shape[0]
        q, k = heads_first(q, k)
        v = v.transpose(0, 1)
        w = a.window(layer)
        if not isinstance(kv, SeqCache):  # a compressed cache attends over its own layout
            if w and start + T > w:
                raise NotImplementedError(
                    f"sliding_window={w} is not implemented for a compressed KV cache; "
                    "use the plain KV format for this model"
                )
            return kv.update_attend(layer, start, q, k, v)
        keys, values = kv.update(layer, start, k, v)  # [KVH, start+T-offset, D]
        if w and T == 1:  # sliding window: the last w keys
            keys, values = keys[:, -w:], values[:, -w:]
        if w and start + T > w and T > 1:
            # a window layer may have dropped its oldest rows (SeqCache): the keys are positions
            # [start + T - S, start + T), so the chunk starts at row S - T
            return rows_out(chunk_attention(q, keys, values, keys.shape[1] - T, a.heads // a.kv_heads, window=w)[0])
        return causal_attention(q, keys, values, start)


class PackedAttend:
    """Several independent sequences packed into one row block (no KV kept): causal within each sequence,
    nothing across them.  Goes where a cache goes (``Transformer.hidden``, which attends through
    ``PackedRows``)."""

    def __init__(self, lengths: list[int], device: torch.device):
        self.lengths = lengths
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])

    def update_attend(
        self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0
    ) -> torch.Tensor:
        """q [H, T, D], k / v [KVH, T, D] -> [T, H*D]: one causal attention per sequence (a block-diagonal mask
        over the whole pack would cost (sum T)^2 and leave SDPA's fused kernels for its slower masked fallback);
        where a sliding window cuts a sequence, one masked attention per sequence."""
        rep, masked = q.shape[0] // k.shape[0], window and max(self.lengths) > window
        outs = [
            chunk_attention(qs, ks, vs, 0, rep, window=window)[0]
            if masked
            else F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, enable_gqa=rep > 1)[0]
            for qs, ks, vs in zip(q.split(self.lengths, 1), k.split(self.lengths, 1), v.split(self.lengths, 1))
        ]
        return rows_out(torch.cat(outs, dim=1))


class PackedRows(Attend):
    """The attend object of a ``PackedAttend`` (with the model's sliding windows)."""

    def __init__(self, a: Any, packed: PackedAttend):
        self.a, self.packed = a, packed

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k = heads_first(q, k)
        return self.packed.update_attend(layer, 0, q, k, v.transpose(0, 1), window=self.a.window(layer))


def _prefix_groups(caches: list[Any]) -> list[tuple[Any, list[int]]]:
    """Rows whose caches share one prefix (shared_kv.ForkedCache): [(prefix, row indices)]."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for b, c in enumerate(caches):
        p = getattr(c, "prefix", None)
        if p is not None:
            groups.setdefault(id(p), (p, []))[1].append(b)
    return list(groups.values())


def _shared_prefix_attention(
    groups: list[tuple[Any, list[int]]], layer: int, q: torch.Tensor, own: torch.Tensor, Vp: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention of rows over (shared prefix | own rows): q [B, KVH, rep, D], ``own`` the masked
    float32 scores over the own rows [B, KVH, rep, L], ``Vp`` their values [B, KVH, L, D].  The queries
    of all the rows of one prefix go against it in one matmul (the prefix is read once); one softmax
    over the concatenated scores.  Rows without a prefix attend over their own rows only."""
    B, KVH, rep, D = q.shape
    out = torch.empty(B, KVH, rep, D, dtype=Vp.dtype, device=Vp.device)
    rest = sorted(set(range(B)) - {b for _, rows in groups for b in rows})
    if rest:
        r = torch.tensor(rest, device=q.device)
        out[r] = torch.matmul(torch.softmax(own[r], dim=-1).to(Vp.dtype), Vp[r])
    for prefix, rows in groups:
        g, r = len(rows), torch.tensor(rows, device=q.device)
        pk, pv = prefix.k[layer], prefix.v[layer]  # [KVH, P, D]
        P = pk.shape[1]
        qg = q[r].permute(1, 0, 2, 3).reshape(KVH, g * rep, D)
        pre = (torch.matmul(qg, pk.transpose(1, 2)) * scale).view(KVH, g, rep, P).permute(1, 0, 2, 3)
        probs = torch.softmax(torch.cat([pre.float(), own[r]], dim=-1), dim=-1).to(Vp.dtype)
        pp = probs[..., :P].permute(1, 0, 2, 3).reshape(KVH, g * rep, P)
        from_prefix = torch.matmul(pp, pv).view(KVH, g, rep, D).permute(1, 0, 2, 3)
        out[r] = from_prefix + torch.matmul(probs[..., P:], Vp[r])
    return out


class RowsAttend(Attend):
    """B decode rows, row b at ``positions[b]`` over ``caches[b]``: padded batched attention (one matmul pair
    for all rows, padding masked to -inf), shared prefixes read once (shared_kv.ForkedCache), on the CPU with
    plain fp32 caches the numba kernel (cpu_batch_attention.py), compressed caches of one format (TurboQuant or
    kv_bits) their batched kernels (cpu_code_batch.py), other compressed caches row by row.  ``finish()`` after the last layer."""

    def __init__(self, model: Any, caches: list[Any], positions: list[int]):
        a, device = model.a, model.cos.device  # (a pipeline stage may hold no embedding)
        self.a, self.caches, self.positions = a, caches, positions
        B = len(positions)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        self.scale = a.head_dim**-0.5
        self.plain = all(isinstance(c, SeqCache) for c in caches)
        self.groups = _prefix_groups(caches) if self.plain and not a.windows and a.offload is None else []
        if self.groups:  # forked caches (shared_kv.py): the own segments start at their prefix's end
            base = [getattr(c, "base", 0) if getattr(c, "prefix", None) is not None else 0 for c in caches]
            pos = pos - torch.tensor(base, dtype=torch.long, device=device)
        lmax = int(pos.max()) + 1 if self.groups else max(positions) + 1
        self.pad_mask = torch.arange(lmax, device=device).view(1, lmax) > pos.view(B, 1)  # True: padding
        # CPU, plain fp32 caches: each layer's attention for all rows in one numba call (cpu_batch_attention.py)
        self.fast = (
            cpu_batch_attention.StepAddresses(caches, positions)
            if self.plain and not self.groups and cpu_batch_attention.usable(model, caches, SeqCache)
            else None
        )
        # CPU, compressed caches of one format: each layer's code attention for all rows in one call (cpu_code_batch.py)
        self.codes = (
            None
            if self.plain or not cpu_code_batch.usable(model, caches)
            else cpu_code_batch.CodeRows(model, caches, positions)
        )

    def offload(self, a: Any) -> None:
        (self.pad_mask,) = to_offload(a, self.pad_mask)

    def finish(self) -> None:
        if self.fast is not None:
            self.fast.finish()

    def _row(self, cache: Any, layer: int, pos: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        """One sequence's decode-row attention (q [H, D], k/v [KVH, D]) -> [1, H*D]."""
        if not isinstance(cache, SeqCache):
            return cache.update_attend(layer, pos, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        return CacheAttend(self.a, cache, pos).attend(layer, q[None], k[None], v[None])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a, caches, positions, groups = self.a, self.caches, self.positions, self.groups
        B, H, KVH, D = len(positions), a.heads, a.kv_heads, a.head_dim
        if self.fast is not None:
            return cpu_batch_attention.attend(self.fast, layer, q, k, v, self.scale)
        if self.codes is not None:
            return self.codes.attend(layer, q, k, v)
        if not self.plain:  # compressed caches (possibly mixed with plain ones): attention per row
            return torch.cat([self._row(caches[b], layer, positions[b], q[b], k[b], v[b]) for b in range(B)])
        ks, vs = [], []
        w = a.window(layer)
        for b in range(B):
            up = caches[b].update_own if groups and getattr(caches[b], "prefix", None) is not None else caches[b].update
            keys, values = up(layer, positions[b], k[b].unsqueeze(1), v[b].unsqueeze(1))
            if w:  # sliding window: the last w keys (a window layer may hold fewer rows than pos + 1)
                keys, values = keys[:, -w:], values[:, -w:]
            ks.append(keys.transpose(0, 1))  # [len_b, KVH, D]
            vs.append(values.transpose(0, 1))
        # padded batched attention: padding is masked to -inf, so each row's softmax and weighted sum are
        # those of its own length
        K = torch.nn.utils.rnn.pad_sequence(ks, batch_first=True).permute(0, 2, 3, 1)  # [B, KVH, D, Lmax]
        Vp = torch.nn.utils.rnn.pad_sequence(vs, batch_first=True).transpose(1, 2)  # [B, KVH, Lmax, D]
        rep = H // KVH
        scores = torch.matmul(q.view(B, KVH, rep, D), K) * self.scale  # [B, KVH, rep, Lmax]
        hide = self.pad_mask
        if w:  # each row's own window rows: padding past min(pos + 1, w)
            n = torch.tensor([t.shape[0] for t in ks], dtype=torch.long, device=scores.device)
            hide = torch.arange(K.shape[-1], device=scores.device).view(1, -1) >= n.view(B, 1)
        scores = scores.float().masked_fill(hide.view(B, 1, 1, -1), float("-inf"))
        if groups:
            return _shared_prefix_attention(groups, layer, q.view(B, KVH, rep, D), scores, Vp, self.scale).reshape(
                B, H * D
            )
        probs = torch.softmax(scores, dim=-1).to(Vp.dtype)
        return torch.matmul(probs, Vp).reshape(B, H * D)


# --- static shapes (the CUDA-graph steps) ---------------------------------------------------------------------


class StaticAttend(Attend):
    """Rows at device ``positions`` [T], attending over the first ``L`` rows of their sequence under ``valid``
    [1, 1, T, L]: ``rows(layer, positions, k [KVH, T, D], v [T, KVH, D])`` writes the rows' K/V and returns the
    layer's keys and values [KVH, L, D] (the cache's layout is its business)."""

    def __init__(self, rows: Callable, positions: torch.Tensor, valid: torch.Tensor):
        self.rows, self.positions, self.valid = rows, positions, valid

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        H, KVH = q.shape[1], k.shape[1]
        keys, values = self.rows(layer, self.positions, k.transpose(0, 1), v)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=self.valid,
            enable_gqa=H != KVH,
        )
        return rows_out(out[0])

    @staticmethod
    def seq(kv: SeqCache, L: int) -> Callable:
        """``rows`` of a fixed-capacity ``SeqCache``: written in place at the positions (e4m3 under fp8)."""

        def rows(i: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            k, v = kv._store(i, k, v.transpose(0, 1))
            kv.k[i].index_copy_(1, positions, k)
            kv.v[i].index_copy_(1, positions, v)
            return kv._rows(i, L)

        return rows

    @staticmethod
    def pool(pool: Any, where: tuple, idx: torch.Tensor, L: int) -> Callable:
        """``rows`` of a sequence in the slot pool: written through its table (``where``: kv_pool's
        ``locate``), its blocks ``idx`` gathered (dequantised from an fp8 pool)."""

        def rows(i: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            pool.write(i, None, None, k.transpose(0, 1), v, where)
            return pool.gather(i, idx, L)

        return rows


class PoolAttend(Attend):
    """B decode rows over the slot pool (row b: slot ``slots[b]``, position ``pos[b]``): K/V written to block
    ``table[slot, pos // block_size]``, attention by the Triton paged kernel (``splits`` > 0: each slot read
    in place up to its own length, split-K over ``splits`` ranges) or the blocks holding the first ``L``
    positions gathered for SDPA."""

    def __init__(self, pool: Any, slots: torch.Tensor, pos: torch.Tensor, L: int, splits: int):
        from swiftlm.cuda_ext.paged_attention import paged_decode_attention, paged_decode_attention_sdpa

        self.fn = paged_decode_attention if splits else paged_decode_attention_sdpa
        self.pool, self.slots, self.pos, self.splits = pool, slots, pos, splits
        self.where = pool.locate(slots, pos)
        self.tables, self.lens = pool.table[slots][:, : -(-L // pool.block_size)], (pos + 1).int()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p, (B, H, D) = self.pool, q.shape
        p.write(layer, self.slots, self.pos, k, v, self.where)
        out = self.fn(
            q, p.k[layer], p.v[layer], self.tables, self.lens, D**-0.5, num_splits=self.splits, **p.attend_kw(layer)
        )
        return out.reshape(B, H * D)


class MixedAttend(Attend):
    """Rows [0, n_prompt): first prompt chunks packed in order (``seg``, ``cu``, ``max_len``: packed_attention's
    ``packed_causal``, over their own new K/V as the pool stores them); rows [n_prompt, T): one decode token each
    over its pool slot (the Triton paged kernel on CUDA, its plain-torch reference elsewhere).  Every row's K/V is
    written first, to its slot's block."""

    def __init__(self, pool: Any, slots: Any, pos: Any, seg: Any, cu: Any, max_len: int, n_prompt: int, splits: int):
        self.pool, self.slots, self.pos, self.seg, self.cu = pool, slots, pos, seg, cu
        self.max_len, self.n, self.splits = max_len, n_prompt, splits
        self.decode = pos.shape[0] > n_prompt
        self.tables, self.lens = pool.table[slots[n_prompt:]], (pos[n_prompt:] + 1).int()
        self.where = pool.locate(slots, pos)  # each row's block and its row there (kv_pool)
        from swiftlm import cuda_ext
        from swiftlm.cuda_ext.paged_attention import paged_decode_attention, paged_decode_attention_ref

        kernel = pos.is_cuda and cuda_ext.enabled("cuda")
        self.fn = partial(paged_decode_attention, num_splits=splits) if kernel else paged_decode_attention_ref

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p, n, (T, H, D) = self.pool, self.n, q.shape
        p.write(layer, self.slots, self.pos, k, v, self.where)
        k, v = p.round_trip(layer, k, v)  # fp8 pool: the prompt rows attend to the K/V as stored
        o = packed_causal(q[:n], k[:n], v[:n], self.seg[:n], self.pos[:n], self.cu, self.max_len)
        if self.decode:
            kw = p.attend_kw(layer)
            o = torch.cat([o, self.fn(q[n:], p.k[layer], p.v[layer], self.tables, self.lens, D**-0.5, **kw)])
        return o.reshape(T, H * D)


class CompressedStaticAttend(Attend):
    """One decode row over a static compressed cache (``CompressedCache(capacity=...)``), shapes fixed.
    TurboQuant: the new row into the 16-bit buffer at ``n_dense``, attention over ``n_code`` compressed rows
    through the Triton kernel and the buffer's rows under ``valid``; affine (``kv_bits``): the new row
    quantized into the codes at ``n_code`` by the cache (``affine_decode.static_row``)."""

    def __init__(self, kv: Any, n_dense: torch.Tensor, n_code: torch.Tensor, valid: torch.Tensor | None):
        self.kv, self.n_dense, self.n_code, self.valid = kv, n_dense, n_code, valid

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv, (_, KVH, D) = self.kv, k.shape
        k, v = k.view(KVH, 1, D), v.view(KVH, 1, D)
        if kv.fmt.kind == "affine":
            return kv.attend_static(layer, q[0], self.n_code, None, k=k, v=v)
        L = kv.layers[layer]
        L.dk.index_copy_(1, self.n_dense, k.to(L.dk.dtype))
        L.dv.index_copy_(1, self.n_dense, v.to(L.dv.dtype))
        return kv.attend_static(layer, q[0], self.n_code, self.valid)


# --- archs.py / archs_moe.py: the layer's own attention core ----------------------------------------------------


class CoreCacheAttend(Attend):
    """``CacheAttend`` for a layer with its own core: one sequence's rows over its ``SeqCache``."""

    def __init__(self, a: Any, core: Callable, kv: SeqCache, start: int):
        self.a, self.core, self.kv, self.start = a, core, kv, start

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.kv.update(layer, self.start, k.transpose(0, 1), v.transpose(0, 1))
        return self.core(layer)(q.transpose(0, 1), keys, values, self.start, self.a.window(layer))


class CorePackedAttend(Attend):
    """``PackedAttend`` for a layer with its own core: each packed prompt from position 0, no KV kept."""

    def __init__(self, a: Any, core: Callable, lengths: list[int]):
        self.a, self.core, self.lengths = a, core, lengths

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        core, w = self.core(layer), self.a.window(layer)
        return torch.cat(
            [
                core(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), 0, w)
                for qs, ks, vs in zip(q.split(self.lengths), k.split(self.lengths), v.split(self.lengths))
            ]
        )


class CoreRowsAttend(Attend):
    """``RowsAttend`` for a layer with its own core: B decode rows, each over its own ``SeqCache``."""

    def __init__(self, a: Any, core: Callable, caches: list[SeqCache], positions: list[int]):
        self.a, self.core, self.caches, self.positions = a, core, caches, positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        core, w = self.core(layer), self.a.window(layer)
        return torch.cat(
            [
                core(q[b].unsqueeze(1), *c.update(layer, p, k[b].unsqueeze(1), v[b].unsqueeze(1)), p, w)
                for b, (c, p) in enumerate(zip(self.caches, self.positions))
            ]
        )
