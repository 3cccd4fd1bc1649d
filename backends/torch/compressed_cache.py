"""Compressed per-sequence KV caches for the torch backend: TurboQuant and affine ``kv_bits``.

Layout per compressed layer (positions are absolute; nothing is renumbered):

- positions ``[0, n_code)``: codes.  TurboQuant: packed key/value bit planes, fp16 norms (plus QJL
  sign bits and fp16 residual norms for QJL keys), allocated in steps of CODE_CAPACITY_STEP rows.
  Affine: packed 4/8-bit codes with fp16 scale and bias per group.
- positions ``[n_code, n_code + n_dense)``: 16-bit rows (the recent window and rows not yet
  compressed), in a buffer of ``dense_capacity`` rows.

A step writes its new rows to the dense part, attends (queries see the compressed rows through
their codes, one block at a time, and the dense rows exactly; a prompt chunk decodes the codes once
and attends through one fused call, ``prompt_attention.py``), and then, once the sequence holds
more than ``threshold`` positions and the dense part reaches ``window + COMPRESS_BLOCK`` rows,
compresses all but the last ``window`` dense rows.  Rolling back to an earlier position (speculative
decoding, recompute after preemption) just lowers the counters.  TurboQuant attention rotates the
query once, scores it against centroids times norms, sums values in the rotated domain and rotates
that sum back once; on CUDA a single decode row goes through the Triton kernel over packed codes.
Layers listed by ``keep_layers`` stay entirely 16-bit.  Affine caches have no window (like MLX's
QuantizedKVCache, every row is quantized as it arrives); on CUDA their decode rows go through the
kernels of ``cuda_ext/affine_kv_kernels.py`` (``affine_decode.py``), and a static affine cache's graph
step quantizes its row into the codes inside the graph.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from swiftlm.turboquant.presets import COMPRESS_BLOCK, KVFormat, code_capacity, dense_capacity

from . import cpu_kernels
from .code_pages import CodeLayer, PagedCodes, put_rows
from .compressed_graph import GraphSteps
from .devices import STAGE_BYTES
from .kv_quant import AffineCodec, Encoded, TurboCodec, online_attention
from .prompt_attention import PROMPT_ROWS, prompt_attention

log = logging.getLogger(__name__)


DECODE_ROWS = 2048  # compressed rows decoded at a time by the plain-torch attention (per KV head)
SCORE_BUDGET = 1 << 21  # fp32 scores [KVH, queries, rows] held at a time: rows per chunk = this / (KVH * queries)


class StageBudget:
    """The 16-bit memory that prompts of compressed caches may hold while they prefill (staging), shared by one
    model's caches.  A prompt chunk of a cache with no codes yet keeps its rows in 16 bits and attends them through
    the 16-bit prompt path; the rows are compressed once, when the prompt ends (``CompressedCache.settle``: its
    first decode row, or a graph step).  A chunk that would take the budget past ``limit`` bytes compresses the
    rows held so far and goes on the compressed way (the codes decoded once per chunk, ``prompt_attention``)."""

    def __init__(self, limit: int = STAGE_BYTES):
        self.limit = int(limit)
        self.held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> bytes

    def grant(self, cache: Any, nbytes: int) -> bool:
        others = sum(b for c, b in self.held.items() if c is not cache)
        if others + nbytes > self.limit:
            return False
        self.held[cache] = nbytes
        return True

    def release(self, cache: Any) -> None:
        self.held.pop(cache, None)

    def in_use(self) -> int:
        return sum(self.held.values())


class CompressedCache(PagedCodes, GraphSteps):
    """One sequence's KV cache in a compressed ``KVFormat`` (``kind`` turbo or affine)."""

    def __init__(
        self,
        a: Any,
        fmt: KVFormat,
        dtype: torch.dtype,
        device: torch.device,
        dense_dtype: torch.dtype | None = None,
        capacity: int | None = None,
        pages: Any = None,
        stage: StageBudget | None = None,
    ):
        """``capacity``: a *static* cache (CUDA graphs): codes for ``capacity`` positions and a fixed
        16-bit buffer of window + COMPRESS_BLOCK + threshold rows are allocated once and never move;
        a step's rows that overflow the buffer are held aside until compression makes room.
        ``pages`` (a static TurboQuant cache): a ``code_pages.CodePages`` pool of ``fmt`` whose pages hold the
        codes instead, taken as they are needed (``page_list``; ``ptab``: the same list on the device).
        ``stage``: the budget under which prompts are held in 16 bits until they end (None: every chunk compresses
        what left the window as it goes)."""
        self.a, self.fmt, self.dtype, self.device = a, fmt, dtype, device
        self.static = capacity is not None
        self.capacity = capacity
        self.dense_dtype = dense_dtype or dtype
        d = a.head_dim
        if fmt.kind == "turbo":
            self.kc = TurboCodec(d, fmt.key_code_bits, fmt.seed * 2 + 1, device, qjl=fmt.key_qjl)
            self.vc = TurboCodec(d, fmt.value_bits, fmt.seed * 2 + 2, device)
            self.layers = [CodeLayer(fmt.layer_compressed(i, a.layers)) for i in range(a.layers)]
        elif fmt.kind == "affine":
            self.kc = self.vc = AffineCodec(d, fmt.key_bits, fmt.group_size)
            self.layers = [CodeLayer(True) for _ in range(a.layers)]
        else:
            raise ValueError(f"not a compressed KV format: {fmt.name}")
        self.window = fmt.window if fmt.kind == "turbo" else 0
        self.length = 0
        self.slot = None  # never part of the CUDA slot pool (graphs read plain caches only)
        self._rot = None  # (R^T * scale, S^T * scale) fp32, made on first use by _kernel_row
        self.use_triton = False
        self.stage_budget = stage
        # bytes one staged position takes: 16-bit keys and values of every compressed layer
        elem = torch.empty((), dtype=self.dense_dtype).element_size()
        self._stage_row_bytes = 2 * a.kv_heads * a.head_dim * elem * sum(L.compressed for L in self.layers)
        self.code_pages = pages if self.static else None
        self.paged = self.code_pages is not None
        self.page_list: list[int] = []  # the pages holding code rows, in position order (paged caches)
        self._pages_synced = 0
        self._rows_key: tuple | None = None
        self._rows_val: Any = None
        if self.paged:
            if pages.fmt != fmt:
                raise ValueError(f"code pages of {pages.fmt.name} for a {fmt.name} cache")
            self.ptab = pages.table(capacity)
        if self.static:
            if fmt.kind == "affine" and fmt.threshold:  # graph steps quantize every row as it arrives
                raise ValueError("a static affine cache needs threshold 0")
            self.dense_rows = self.window + COMPRESS_BLOCK + fmt.threshold
            KVH, d = a.kv_heads, a.head_dim
            for L in self.layers:
                rows = self.dense_rows if L.compressed else capacity
                # keys and values in one allocation: every cache's value buffer then sits at the same offset
                # from its key buffer, which the batched graph step's rope kernel relies on
                L.dk, L.dv = torch.zeros((2, KVH, rows, d), dtype=self.dense_dtype, device=device).unbind(0)
                if L.compressed and self.paged:  # the pool's tensors, shared by every cache of the format
                    kp, vp, L.kn, L.vn, L.ks, L.kr = pages.layers[self.layers.index(L)]
                    L.kp, L.vp = list(kp), list(vp)
                elif L.compressed:
                    probe_k = self.kc.encode(torch.zeros(KVH, 1, d, device=device))
                    probe_v = self.vc.encode(torch.zeros(KVH, 1, d, device=device))
                    self._alloc_codes(L, probe_k, probe_v, capacity)

    def reset(self) -> None:
        """Empty the cache for reuse (a static cache keeps its storage, so its CUDA graph stays valid)."""
        for L in self.layers:
            L.n_code = L.n_dense = 0
            L.pending = None
        self.drop_stage()
        self.length = 0
        self.release_pages()

    # ------------------------------------------------------------------ storage
    def _dense_cap(self, L: CodeLayer, need: int) -> int:
        if L.compressed and self.fmt.kind == "affine":  # no window: only the step's own rows
            return -(-need // COMPRESS_BLOCK) * COMPRESS_BLOCK
        return dense_capacity(self.fmt, need)

    def _ensure_dense(self, L: CodeLayer, need: int) -> None:
        have = 0 if L.dk is None else L.dk.shape[1]
        if need <= have:
            return
        cap = self._dense_cap(L, need)
        shape = (self.a.kv_heads, cap, self.a.head_dim)
        dk = torch.zeros(shape, dtype=self.dense_dtype, device=self.device)
        dv = torch.zeros(shape, dtype=self.dense_dtype, device=self.device)
        if L.n_dense:
            dk[:, : L.n_dense] = L.dk[:, : L.n_dense]
            dv[:, : L.n_dense] = L.dv[:, : L.n_dense]
        L.dk, L.dv = dk, dv

    def _alloc_codes(self, L: CodeLayer, k: Encoded, v: Encoded, cap: int, keep: int = 0) -> None:
        """(Re)allocate code storage for ``cap`` positions, keeping the first ``keep`` rows."""

        def grow(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
            t = torch.zeros((new.shape[0], cap, *new.shape[2:]), dtype=new.dtype, device=self.device)
            if old is not None and keep:
                t[:, :keep] = old[:, :keep]
            return t

        L.kp = [grow(o, p) for o, p in zip(L.kp or [None] * len(k.planes), k.planes)]
        L.vp = [grow(o, p) for o, p in zip(L.vp or [None] * len(v.planes), v.planes)]
        L.kn, L.vn = grow(L.kn, k.norms), grow(L.vn, v.norms)
        if k.signs is not None:
            L.ks = grow(L.ks, k.signs)
        if k.rnorms is not None:
            L.kr = grow(L.kr, k.rnorms)
        if v.signs is not None:
            L.vb = grow(L.vb, v.signs)

    def _store(self, L: CodeLayer, k: Encoded, v: Encoded, at: int, n: int) -> None:
        """Write n encoded rows (tensors [KVH, n, ...]) at code position ``at``."""
        if self.paged:
            put_rows(L, self._rows_at(at, n), k, v)
            return
        have = 0 if L.kn is None else L.kn.shape[1]
        if at + n > have:
            if self.static:
                raise RuntimeError(f"static TurboQuant cache holds {have} positions; {at + n} needed")
            self._alloc_codes(L, k, v, code_capacity(at + n), keep=at)
        for dst, src in zip(L.kp, k.planes):
            dst[:, at : at + n] = src
        for dst, src in zip(L.vp, v.planes):
            dst[:, at : at + n] = src
        L.kn[:, at : at + n] = k.norms
        L.vn[:, at : at + n] = v.norms
        if k.signs is not None:
            L.ks[:, at : at + n] = k.signs
        if k.rnorms is not None:
            L.kr[:, at : at + n] = k.rnorms
        if v.signs is not None:
            L.vb[:, at : at + n] = v.signs

    def _compress(self, L: CodeLayer) -> None:
        if not L.compressed or L.n_code + L.n_dense <= self.fmt.threshold:
            return
        if L.n_dense < self.window + (COMPRESS_BLOCK if self.window or self.fmt.kind == "turbo" else 1):
            return
        c = L.n_dense - self.window
        dk, dv = self._dense(L)
        k = self.kc.encode(dk[:, :c])
        v = self.vc.encode(dv[:, :c])
        self._store(L, k, v, L.n_code, c)
        rest_k, rest_v = dk[:, c : L.n_dense].clone(), dv[:, c : L.n_dense].clone()
        L.n_code += c
        L.n_dense -= c
        L.pending = L.stage = None
        self._place_dense(L, rest_k, rest_v)

    def _place_dense(self, L: CodeLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows k, v [KVH, n, D] become the layer's 16-bit rows, at the start of its buffer."""
        n = k.shape[1]
        if not self.static:  # a large prefill chunk or a staged prompt grew it: give the memory back
            cap = self._dense_cap(L, n)
            if L.dk is None or cap < L.dk.shape[1] or n > L.dk.shape[1]:
                L.dk = torch.zeros((self.a.kv_heads, cap, self.a.head_dim), dtype=self.dense_dtype, device=self.device)
                L.dv = torch.zeros_like(L.dk)
        L.dk[:, :n] = k  # a static buffer in place: its address is part of a CUDA graph
        L.dv[:, :n] = v

    # ------------------------------------------------------------------ staging (a prompt held in 16 bits)
    def _stage_ok(self, L: CodeLayer, start: int, T: int) -> bool:
        """Hold this prompt chunk's rows in 16 bits (staging) instead of compressing as it goes?"""
        if self.stage_budget is None or not L.compressed or T < PROMPT_ROWS or L.n_code or L.pending is not None:
            return False
        if not L.staging and L.n_dense:  # 16-bit rows from decode steps: this is no prompt from its start
            return False
        rows = start + T
        cap = L.stage[0].shape[1] if L.stage is not None else 0
        if rows > cap:  # the buffers grow geometrically: what they will hold after this chunk
            rows = max(rows, min(2 * cap, self.capacity or 2 * cap))
        return self.stage_budget.grant(self, rows * self._stage_row_bytes)

    def _stage_write(self, L: CodeLayer, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> CodeLayer:
        n, T = L.n_dense, k.shape[1]
        cap = L.stage[0].shape[1] if L.stage is not None else 0
        if n + T > cap:
            new = max(n + T, min(2 * cap, self.capacity or 2 * cap))
            shape = (self.a.kv_heads, new, self.a.head_dim)
            sk = torch.empty(shape, dtype=self.dense_dtype, device=self.device)
            sv = torch.empty(shape, dtype=self.dense_dtype, device=self.device)
            if n:
                ok, ov = self._dense(L)
                sk[:, :n], sv[:, :n] = ok, ov
            L.stage = (sk, sv)
        L.stage[0][:, n : n + T] = k
        L.stage[1][:, n : n + T] = v
        L.n_dense += T
        L.staging = True
        if layer == self.a.layers - 1:
            self.length = start + T
        return L

    def _settle_layer(self, L: CodeLayer) -> None:
        if not L.staging:
            return
        L.staging = False
        self._compress(L)  # all but the window into codes, the window into the buffer
        if L.stage is not None:  # too few rows to compress: they move to the buffer as they are
            sk, sv = L.stage
            L.stage = None
            self._place_dense(L, sk[:, : L.n_dense], sv[:, : L.n_dense])

    def settle(self) -> None:
        """Compress a prompt held in 16 bits (staging), as the chunks would have done one by one; before the
        sequence's first decode row, which reads codes plus the window."""
        if any(L.staging for L in self.layers):
            for L in self.layers:
                self._settle_layer(L)
        if self.stage_budget is not None:
            self.stage_budget.release(self)

    def drop_stage(self) -> None:
        """Forget staged rows without compressing them (the sequence ended or the cache is reused)."""
        for L in self.layers:
            L.stage, L.staging = None, False
        if self.stage_budget is not None:
            self.stage_budget.release(self)

    def _dense(self, L: CodeLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """The 16-bit rows [KVH, n_dense, D] (buffer, or buffer + rows held aside)."""
        if L.pending is not None:
            return L.pending
        if L.stage is not None:
            return L.stage[0][:, : L.n_dense], L.stage[1][:, : L.n_dense]
        return L.dk[:, : L.n_dense], L.dv[:, : L.n_dense]

    # ------------------------------------------------------------------ attention
    def _code_blocks(self, L: CodeLayer, qg: torch.Tensor, scale: float) -> Iterator[tuple]:
        """Score/value chunks over the compressed rows (qg: [KVH, M, D] fp32 queries).

        A chunk holds as many rows as SCORE_BUDGET allows (a decode step: the whole history in one
        chunk); its scores are computed DECODE_ROWS rows at a time, each block's codes decoded into a
        reused buffer by one table gather (``TurboCodec.unit_rows``) and multiplied with all queries
        at once.  Its values are never returned decoded: the chunk yields a function that, given the
        chunk's probabilities, sums the values block by block in the same way (TurboQuant: in the
        rotated domain, norms folded into the probabilities; affine: codes times probabilities scaled
        per group, plus the biases weighted by the probabilities)."""
        n = L.n_code
        if not n:
            return
        KVH, M, D = qg.shape
        chunk = max(64, SCORE_BUDGET // (KVH * M))
        blk = min(chunk, DECODE_ROWS)
        turbo = self.fmt.kind == "turbo"
        if turbo:
            q_rot = qg @ self.kc.R.T  # rotate the query once per step
            sq = qg @ self.kc.S_rows.T if self.kc.qjl else None
        else:
            groups = self.kc.d // self.kc.group
            qs = qg.view(KVH, M, groups, -1).sum(-1)  # Σ q per group: what each key's bias adds
            if self.kc.order is not None:  # the order of ``code_rows``
                qg = qg[..., self.kc.order.to(qg.device)]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            sc = torch.empty((KVH, M, e - s), dtype=torch.float32, device=qg.device)
            for b in range(s, e, blk):
                be = min(e, b + blk)
                out = sc[:, :, b - s : be - s]
                if turbo:
                    out.copy_(torch.bmm(q_rot, self.kc.unit_rows(L.kp, b, be).transpose(1, 2)))
                    if sq is not None:
                        qjl = torch.bmm(sq, self.kc.sign_rows(L.ks, b, be).transpose(1, 2))
                        out.addcmul_(qjl, L.kr[:, b:be].float().unsqueeze(1), value=self.kc.qjl_scale)
                else:
                    self._affine_scores(L, qg, qs, b, be, out)
            if turbo:
                sc.mul_((L.kn[:, s:e].float() * scale).unsqueeze(1))
            else:
                sc.mul_(scale)
            yield sc, self._value_sum(L, s, e, blk), None, 1 if turbo else 0

    def _affine_scores(
        self, L: CodeLayer, qg: torch.Tensor, qs: torch.Tensor, b: int, be: int, out: torch.Tensor
    ) -> None:
        """q . (code * scale + bias) per group = scale * (q . code) + bias * Σ q, for rows [b, be)."""
        codes = self.kc.code_rows(L.kp, b, be)  # [KVH, n, D] fp32 integer codes
        gs = self.kc.group
        for g in range(self.kc.d // gs):
            part = torch.bmm(qg[..., g * gs : (g + 1) * gs], codes[..., g * gs : (g + 1) * gs].transpose(1, 2))
            part.mul_(L.kn[:, b:be, g].float().unsqueeze(1))
            part.add_(qs[:, :, g : g + 1] * L.ks[:, b:be, g].float().unsqueeze(1))
            if g:
                out.add_(part)
            else:
                out.copy_(part)

    def _value_sum(self, L: CodeLayer, s: int, e: int, blk: int):
        """Σ_j p_j v_j over compressed rows [s, e) for probabilities p [KVH, M, e - s]."""

        def turbo(p: torch.Tensor) -> torch.Tensor:
            p = p * L.vn[:, s:e].float().unsqueeze(1)  # norms into the weights: values stay unit centroids
            acc = None
            for b in range(s, e, blk):
                be = min(e, b + blk)
                vu = self.vc.unit_rows(L.vp, b, be)
                pb = p[:, :, b - s : be - s]
                acc = torch.bmm(pb, vu) if acc is None else acc.baddbmm_(pb, vu)
            return acc

        def affine(p: torch.Tensor) -> torch.Tensor:
            gs, groups = self.vc.group, self.vc.d // self.vc.group
            acc = None
            for b in range(s, e, blk):
                be = min(e, b + blk)
                codes = self.vc.code_rows(L.vp, b, be)
                pb = p[:, :, b - s : be - s]
                scale, bias = L.vn[:, b:be].float(), L.vb[:, b:be].float()  # [KVH, n, groups]
                parts = [torch.bmm(pb * scale[:, None, :, g], codes[..., g * gs : (g + 1) * gs]) for g in range(groups)]
                part = torch.cat(parts, -1) if groups > 1 else parts[0]
                base = torch.bmm(pb, bias)  # [KVH, M, groups]
                part = (part.view(*part.shape[:2], groups, gs) + base.unsqueeze(-1)).view(part.shape)
                acc = part if acc is None else acc.add_(part)
            return acc if self.vc.inverse is None else acc[..., self.vc.inverse.to(acc.device)]

        return turbo if self.fmt.kind == "turbo" else affine

    def _attend(self, L: CodeLayer, q: torch.Tensor, start: int) -> torch.Tensor:
        """q [H, T, D] -> out [T, H*D] over this layer's codes + dense rows."""
        a = self.a
        H, T, D = q.shape
        KVH, rep = a.kv_heads, H // a.kv_heads
        scale = D**-0.5
        if T == 1 and self.use_triton and L.n_code and (self.fmt.kind == "turbo" or self._affine_kernel()):
            return self._attend_triton(L, q, scale)
        if T >= PROMPT_ROWS:  # a prompt chunk: the codes decoded once, one fused attention call
            return prompt_attention(self, L, q, start)
        qg = q.float().reshape(KVH, rep * T, D)  # query heads grouped under their KV head
        L = self._code_view(L)
        if T == 1 and cpu_kernels.usable(self, L, rep):  # codes and 16-bit rows in two compiled calls
            out = cpu_kernels.decode_attention(self, L, qg, scale, *self._dense(L))
            return out.reshape(H, T, D).transpose(0, 1).reshape(T, H * D).to(q.dtype)

        def blocks() -> Iterator[tuple]:
            yield from self._code_blocks(L, qg, scale)
            nd = L.n_dense
            dk, dv = self._dense(L)
            keys, vals = dk.float(), dv.float()
            mask = None
            if T > 1:  # causal inside the step's own rows: dense row j is position n_code + j
                pos_q = torch.arange(start, start + T, device=q.device).repeat(rep)
                pos_k = torch.arange(L.n_code, L.n_code + nd, device=q.device)
                mask = (pos_k[None, :] <= pos_q[:, None]).unsqueeze(0)
            yield (qg @ keys.transpose(1, 2)) * scale, vals, mask, 0

        acc, l = online_attention(blocks())
        out = acc.get(0, 0)
        if 1 in acc:
            out = out + acc[1] @ self.vc.R  # the rotated-domain sum, rotated back once
        out = out / l
        return out.reshape(H, T, D).transpose(0, 1).reshape(T, H * D).to(q.dtype)

    def truncate(self, L: CodeLayer, start: int) -> None:
        held = L.n_code + L.n_dense
        L.pending = None
        if start < held:  # rollback / recompute: later positions are dropped
            if start >= L.n_code:
                L.n_dense = start - L.n_code
            else:
                L.n_code, L.n_dense = start, 0
        elif start > held:
            raise RuntimeError(f"KV cache holds {held} positions, step starts at {start}")

    def _write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> CodeLayer:
        L = self.layers[layer]
        T = k.shape[1]
        self.truncate(L, start)
        if self._stage_ok(L, start, T):
            return self._stage_write(L, layer, start, k, v)
        if L.staging:  # the prompt ended (a decode or verify step), or the budget is spent: compress it now
            self._settle_layer(L)
            if layer == self.a.layers - 1 and self.stage_budget is not None:
                self.stage_budget.release(self)
        if self.static and L.n_dense + T > L.dk.shape[1]:  # hold this step's rows aside (see __init__)
            L.pending = (
                torch.cat([L.dk[:, : L.n_dense], k.to(self.dense_dtype)], 1),
                torch.cat([L.dv[:, : L.n_dense], v.to(self.dense_dtype)], 1),
            )
            L.n_dense += T
            if layer == self.a.layers - 1:
                self.length = start + T
            return L
        self._ensure_dense(L, L.n_dense + T)
        L.dk[:, L.n_dense : L.n_dense + T] = k
        L.dv[:, L.n_dense : L.n_dense + T] = v
        L.n_dense += T
        if layer == self.a.layers - 1:
            self.length = start + T
        return L

    def update_attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v [KVH, T, D] at positions [start, start+T), attend q [H, T, D] to everything up
        to each query's position, compress what left the window.  Returns [T, H*D]."""
        L = self._write(layer, start, k, v)
        out = self._attend(L, q, start)
        if not L.staging:
            self._compress(L)
        if L.pending is not None:
            raise RuntimeError("static TurboQuant cache: 16-bit rows overflow the buffer")
        return out

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write (and compress) without attending: filling a cache for memory measurements."""
        self._compress(self._write(layer, start, k, v))

    # ------------------------------------------------------------------ accounting
    def tensors(self) -> list[torch.Tensor]:
        """The storage this cache allocated (a paged cache: its 16-bit buffers; the pool is shared)."""
        out = []
        for L in self.layers:
            codes = () if self.paged else (L.kn, L.vn, L.ks, L.kr, L.vb, *(L.kp or []), *(L.vp or []))
            for t in (L.dk, L.dv, *(L.stage or ()), *codes):
                if t is not None:
                    out.append(t)
        return out

    def nbytes(self) -> int:
        """Bytes of storage this cache holds (codes, norms, signs, 16-bit part: everything; a paged cache: its
        buffers and the pages it holds)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors()}
        return sum(storages.values()) + self.pages_bytes()

    def counts(self) -> tuple[int, int]:
        """(compressed, 16-bit) positions of the first compressed layer."""
        for L in self.layers:
            if L.compressed:
                return L.n_code, L.n_dense
        return 0, self.layers[0].n_dense if self.layers else 0
