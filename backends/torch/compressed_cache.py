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

from . import code_attention, cpu_kernels
from .code_pages import CachePages, CodeLayer, put_rows
from .compressed_graph import GraphSteps
from .devices import STAGE_BYTES
from .kv_quant import AffineCodec, Encoded, TurboCodec, online_attention
from .prompt_attention import PROMPT_ROWS, prompt_attention

log = logging.getLogger(__name__)


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


class CompressedCache:
    """One sequence's KV cache in a compressed ``KVFormat`` (``kind`` turbo or affine).  Its parts: ``pages`` (a
    paged cache's ``CachePages``, else None) and ``graph`` (its Triton decode rows and graph steps)."""

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
        codes instead, taken as they are needed (``pages``: the list, and the same list on the device).
        ``stage``: the budget under which prompts are held in 16 bits until they end (None: every chunk compresses
        what left the window as it goes)."""
        self.a, self.fmt, self.dtype, self.device = a, fmt, dtype, device
        self.static = capacity is not None
        self.capacity = capacity
        self.dense_dtype = dense_dtype or dtype
        self._no_rows = None  # the empty 16-bit buffer of affine layers whose rows all went to codes (_compress)
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
        self.use_triton = False
        self.stage_budget = stage
        # bytes one staged position takes: 16-bit keys and values of every compressed layer
        elem = torch.empty((), dtype=self.dense_dtype).element_size()
        self._stage_row_bytes = 2 * a.kv_heads * a.head_dim * elem * sum(L.compressed for L in self.layers)
        self.code_pages = pages if self.static else None
        self.paged = self.code_pages is not None
        if self.paged and pages.fmt != fmt:
            raise ValueError(f"code pages of {pages.fmt.name} for a {fmt.name} cache")
        self.pages = CachePages(pages, capacity) if self.paged else None
        self.graph = GraphSteps(a, fmt, self.kc, self.vc, self.dense_dtype, capacity, self.pages)
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

    # ------------------------------------------------------------------ code pages (code_pages.CachePages)
    @property
    def ptab(self) -> torch.Tensor:
        """The page list on the device (fixed address: CUDA graphs read it)."""
        return self.pages.table

    def release_pages(self) -> None:
        if self.paged:
            self.pages.release()

    def _rows_at(self, at: int, n: int) -> torch.Tensor:
        return self.pages.rows_at(at, n)

    def _pages_arg(self, rows: int) -> tuple | None:
        """The kernels' ``pages`` argument for ``rows`` code rows at most (None: contiguous codes)."""
        return self.pages.arg(rows) if self.paged else None

    def _code_view(self, L: CodeLayer) -> CodeLayer:
        return self.pages.view(L) if self.paged else L

    def pages_bytes(self) -> int:
        """Bytes of the code pages this cache holds (0 for a cache with codes of its own)."""
        return self.pages.nbytes() if self.paged else 0

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
        dk, dv = self._buffer(cap), self._buffer(cap)
        if L.n_dense:
            dk[:, : L.n_dense] = L.dk[:, : L.n_dense]
            dv[:, : L.n_dense] = L.dv[:, : L.n_dense]
        L.dk, L.dv = dk, dv

    def _buffer(self, rows: int) -> torch.Tensor:
        """Zeroed 16-bit rows [KVH, rows, D]."""
        return torch.zeros((self.a.kv_heads, rows, self.a.head_dim), dtype=self.dense_dtype, device=self.device)

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
            put_rows(L, self.pages.rows_at(at, n), k, v)
            return
        have = 0 if L.kn is None else L.kn.shape[1]
        if at + n > have:
            if self.static:
                raise RuntimeError(f"static TurboQuant cache holds {have} positions; {at + n} needed")
            self._alloc_codes(L, k, v, code_capacity(at + n), keep=at)
        put_rows(L, slice(at, at + n), k, v)

    def _compress(self, L: CodeLayer) -> None:
        if not L.compressed or L.n_code + L.n_dense <= self.fmt.threshold:
            return
        if L.n_dense < self.window + (COMPRESS_BLOCK if self.window or self.fmt.kind == "turbo" else 1):
            return
        c = L.n_dense - self.window
        dk, dv = self._dense(L)
        # kv_bits on the CPU (a decode step compresses its own row, every layer): one compiled call writes the codes
        if self.paged or not cpu_kernels.encode_into(self, L, dk[:, :c], dv[:, :c], L.n_code):
            k = self.kc.encode(dk[:, :c])
            v = self.vc.encode(dv[:, :c])
            self._store(L, k, v, L.n_code, c)
        if self.fmt.kind == "affine" and c == L.n_dense and L.pending is None and L.stage is None:  # none left
            L.n_code += c
            L.n_dense = 0
            if not self.static and L.dk.shape[1]:  # as ``_place_dense`` leaves it for no rows (one shared, empty)
                if self._no_rows is None:
                    self._no_rows = self._buffer(0)
                L.dk = L.dv = self._no_rows
            return
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
                L.dk, L.dv = self._buffer(cap), self._buffer(cap)
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
    def _attend(self, L: CodeLayer, q: torch.Tensor, start: int) -> torch.Tensor:
        """q [H, T, D] -> out [T, H*D] over this layer's codes + dense rows."""
        a = self.a
        H, T, D = q.shape
        KVH, rep = a.kv_heads, H // a.kv_heads
        scale = D**-0.5
        if T == 1 and self.use_triton and L.n_code and (self.fmt.kind == "turbo" or self.graph.affine_kernel()):
            return self.graph.attend_row(L, q, *self._dense(L))
        if T >= PROMPT_ROWS:  # a prompt chunk: the codes decoded once, one fused attention call
            return prompt_attention(self, L, q, start)
        qg = q.float().reshape(KVH, rep * T, D)  # query heads grouped under their KV head
        L = self._code_view(L)
        if T == 1 and cpu_kernels.usable(self, L, rep):  # codes and 16-bit rows in two compiled calls
            out = cpu_kernels.decode_attention(self, L, qg, scale, *self._dense(L))
            return out.reshape(H, T, D).transpose(0, 1).reshape(T, H * D).to(q.dtype)

        def blocks() -> Iterator[tuple]:
            yield from code_attention.code_blocks(self.fmt, self.kc, self.vc, L, qg, scale)
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
        self.after_attend(L)
        return out

    def after_attend(self, L: CodeLayer) -> None:
        """What follows a step's attention in layer ``L``: compress what left the window (not while a prompt is
        staged); a static cache's rows must have fit its buffer."""
        if not L.staging:
            self._compress(L)
        if L.pending is not None:
            raise RuntimeError("static TurboQuant cache: 16-bit rows overflow the buffer")

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write (and compress) without attending: filling a cache for memory measurements."""
        self._compress(self._write(layer, start, k, v))

    # ------------------------------------------------------------------ graph steps (compressed_graph.GraphSteps)
    def attend_static(
        self,
        layer: int,
        q: torch.Tensor,
        n_code: torch.Tensor,
        valid: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode-row attention with every shape fixed (capturable): q [H, D]; the new row is
        already in the 16-bit buffer; ``n_code`` (device, [1]) compressed rows are read through the
        Triton kernel over the whole code storage, the buffer's rows through ``valid`` [rows].
        Affine caches: the new row is ``k``, ``v`` [KVH, 1, D], quantized into the codes at ``n_code``
        here and attended in 16 bits (``affine_decode.static_row``).  Returns [1, H*D]."""
        return self.graph.attend_static(self.layers[layer], q, n_code, valid, k, v)

    def graphable(self) -> bool:
        """Can this cache's decode rows replay a CUDA graph?  A prompt held in 16 bits is compressed first
        (``settle``): every graph path asks this before its first decode row."""
        self.settle()
        if self.fmt.kind == "affine":
            return self.static and self.graph.affine_kernel()
        return self.static and self.fmt.kind == "turbo" and all(L.compressed for L in self.layers)

    def after_graph_step(self, pos: int, compress: Any = None) -> None:
        """Host bookkeeping after a replayed decode step wrote position ``pos``.  ``compress``: a callable
        that runs ``compress_block`` (e.g. replays a CUDA graph of it), used when exactly COMPRESS_BLOCK
        rows of every layer leave the window (the steady state of one-row steps); otherwise each
        layer compresses eagerly."""
        self.graph.after_step(self.layers, compress, self._compress)
        self.length = pos + 1

    def compress_block(self, at: torch.Tensor) -> None:
        """Every layer: encode the first COMPRESS_BLOCK rows of the 16-bit buffer into the codes at positions
        ``at`` (device [1]) + 0.. and move the window's rows down in the buffer -- what ``_compress`` does when
        ``block_due``, with every shape fixed and no host sync (capturable).  Counters are the caller's."""
        self.graph.compress_block(self.layers, at)

    def rotations(self, scale: float) -> tuple:
        """(R^T, S^T or None) with the softmax scale folded in, fp32, for ``rotate_rows`` (made once)."""
        return self.graph.rotations(scale)

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
