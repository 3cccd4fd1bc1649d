"""The CUDA KV memory of the torch backend: one paged pool of fixed-size blocks, addressed through block tables.

Every layer's K (and V) is one tensor ``[num_blocks + 1, KVH, block_size, D]``; the last block is scratch
(padding rows of the fixed-shape graphs write there).  Each running sequence holds a *table row*
(its ``slot``, at most ``n`` at once: ``--parallel``) listing its blocks in position order::

    position p of the sequence in slot s  ->  block table[s, p // block_size], row p % block_size

``table`` is a device int32 tensor ``[n + 1, max_blocks]`` whose address never changes (the CUDA graphs
read it); entries past a sequence's blocks, and the whole scratch row ``n``, name the scratch block.  The
host keeps the same table and copies the rows that changed before a step that reads them (``flush``).

Which blocks a sequence gets is the core's decision (``swiftlm.kv_blocks.KVBlocks``: the engine grows a
sequence's table before a step that writes past it, preempts when blocks run out, shares full blocks
between requests with the same prefix).  Without that manager (tests that build a pool by hand) slot ``s``
owns blocks ``[s * max_blocks, (s + 1) * max_blocks)``: the old fixed-slot layout.

With ``--kv-cache-dtype fp8`` (``fp8``: a ``kv_fp8.KVScales``) the blocks hold float8 e4m3 rows, half the
bytes of a 16-bit block: ``write`` quantises with the layer's per-KV-head scales, every reader dequantises
(``attend_kw`` hands the scales to the paged decode kernels, ``gather`` / ``round_trip`` serve the paths
that attend with SDPA).

``PagedSeqCache`` is one sequence's view for the eager paths (chunks past position 0, LoRA rows, MoE or
non-graphed models, speculative verification off the graphs, prompt-cache copies): it writes its rows
into its blocks and attends over them (``update_attend``, the compressed caches' interface).
"""

from __future__ import annotations

from typing import Any

import torch

from .attend import causal_attention
from .kv_fp8 import FP8, KVScales, dequantize, quantize


class SlotPool:
    """Paged KV memory for up to ``n`` sequences of up to ``capacity`` positions each.

    ``block_size``: positions per block (default: ``capacity``, one block per sequence); ``num_blocks``:
    blocks in the pool (default ``n * max_blocks``: every sequence can reach ``capacity`` at once)."""

    def __init__(
        self,
        a: Any,
        n: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int | None = None,
        num_blocks: int | None = None,
        fp8: KVScales | None = None,
    ):
        self.a, self.n = a, n
        self.dtype = dtype  # the compute dtype (what readers get back)
        self.fp8 = fp8.to(device) if fp8 is not None else None
        # per layer [KVH] float32 scales (device tensors whose addresses never change: the graphs read them)
        self.k_scale = list(self.fp8.k.unbind(0)) if self.fp8 is not None else None
        self.v_scale = list(self.fp8.v.unbind(0)) if self.fp8 is not None else None
        store = FP8 if fp8 is not None else dtype
        # how a read widens e4m3 rows: scales all 1.0 -> a cast; scales exact in the compute dtype -> a cast and a
        # multiply there (the same values as float32 * scale rounded once: e4m3 * a bf16 scale is exact in
        # float32); else through float32 (decided once: a per-call check would read the device)
        self._deq = "f32"
        if self.fp8 is not None:
            both = torch.cat([self.fp8.k, self.fp8.v])
            if bool((both == 1).all()):
                self._deq = "unit"
            elif bool((both.to(dtype).float() == both).all()):
                self._deq = "cast"
                self._k_dt = [s.to(dtype) for s in self.k_scale]
                self._v_dt = [s.to(dtype) for s in self.v_scale]
        self.block_size = bs = max(1, min(int(block_size or capacity), capacity))
        self.max_blocks = -(-capacity // bs)
        self.capacity = self.max_blocks * bs  # positions a table row can address
        self.num_blocks = int(num_blocks) if num_blocks else n * self.max_blocks
        self.scratch_block = self.num_blocks
        shape = (self.num_blocks + 1, a.kv_heads, bs, a.head_dim)
        # zeros, not empty: attention reads whole tiles (masked, but 0 * NaN garbage would still be NaN)
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(a.layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(a.layers)]
        self.device = device
        self.host = torch.full((n + 1, self.max_blocks), self.scratch_block, dtype=torch.int32)
        if self.num_blocks >= n * self.max_blocks:  # no block manager yet: slot s owns its own run of blocks
            self.host[:n] = torch.arange(n * self.max_blocks, dtype=torch.int32).view(n, self.max_blocks)
        self.table = self.host.to(device)
        self._dirty: tuple[int, int] | None = None  # host rows [lo, hi) newer than the device's
        self.free = list(range(n - 1, -1, -1))
        self.scratch = n
        self._views: dict[int, PagedSeqCache] = {}
        self.managed = False  # a KVBlocks manager decides the blocks (attach)

    @property
    def block_bytes(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * t[0].numel() * t.element_size()

    def attach(self) -> None:
        """From now on the block manager fills the table rows (``set_row``): every row starts empty."""
        self.managed = True
        self.host.fill_(self.scratch_block)
        self._mark(0, self.n)
        for c in self._views.values():
            c.blocks, c.synced = [], 0

    def take(self) -> PagedSeqCache | None:
        """A free slot's cache (the same object each time the slot is reused)."""
        if not self.free:
            return None
        i = self.free.pop()
        c = self._views.get(i)
        if c is None:
            c = self._views[i] = PagedSeqCache(self, i)
        c.length = 0
        if self.managed:
            c.blocks, c.synced = [], 0
        return c

    def give_back(self, c: PagedSeqCache) -> None:
        if self.managed:
            self.set_row(c.slot, [])
            c.blocks, c.synced = [], 0
        self.free.append(c.slot)

    def set_row(self, slot: int, blocks: list[int]) -> None:
        """Slot ``slot``'s table row: ``blocks`` then scratch (host now, the device at the next ``flush``)."""
        row = self.host[slot]
        n = len(blocks)
        if n:
            row[:n] = torch.tensor(blocks, dtype=torch.int32)
        row[n:] = self.scratch_block
        self._mark(slot, slot + 1)

    def _mark(self, lo: int, hi: int) -> None:
        d = self._dirty
        self._dirty = (lo, hi) if d is None else (min(d[0], lo), max(d[1], hi))

    def flush(self) -> None:
        """Queue the copy of the changed table rows to the device (before a step that reads them)."""
        if self._dirty is None:
            return
        lo, hi = self._dirty
        self._dirty = None
        if self.device.type == "cuda":
            from .staging import stager

            self.table[lo:hi].copy_(stager(self.device).to_device(self.host[lo:hi]))
        else:
            self.table[lo:hi].copy_(self.host[lo:hi])

    def locate(self, slots: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row) of each (slot, position) pair (device tensors; no host sync: capturable)."""
        bs = self.block_size
        return self.table[slots, pos // bs].long(), pos % bs

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        where: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """k, v [T, KVH, D] into each row's (slot, position); ``where``: ``locate``'s result, if known."""
        blk, off = where if where is not None else self.locate(slots, pos)
        if self.fp8 is not None:
            k, v = self.quantize(layer, k, v)
        self.k[layer][blk, :, off] = k
        self.v[layer][blk, :, off] = v

    # ---- --kv-cache-dtype fp8 (every helper is the identity / empty for a 16-bit pool)
    def quantize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., KVH, D] as the pool stores them (e4m3 through the layer's scales under fp8)."""
        if self.fp8 is None:
            return k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)
        return quantize(k, self.k_scale[layer].view(-1, 1)), quantize(v, self.v_scale[layer].view(-1, 1))

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., KVH, D] as a reader of the pool gets them back (unchanged for a 16-bit pool): prompt
        rows that attend to their own fresh K/V see the same values as those that read them from blocks."""
        if self.fp8 is None:
            return k, v
        qk, qv = self.quantize(layer, k, v)
        return self.dequantize(layer, qk, qv, k.dtype, -2)

    def dequantize(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None, head_dim: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows back in ``dtype`` (the pool's compute dtype); ``head_dim``: the KV-head axis of k, v."""
        if self.fp8 is None:
            return k, v
        dt = dtype or self.dtype
        if dt == self.dtype and self._deq == "unit":
            return k.to(dt), v.to(dt)
        shape = [1] * k.dim()
        shape[head_dim] = -1
        if dt == self.dtype and self._deq == "cast":
            return k.to(dt) * self._k_dt[layer].view(shape), v.to(dt) * self._v_dt[layer].view(shape)
        return (
            dequantize(k, self.k_scale[layer].view(shape), dt),
            dequantize(v, self.v_scale[layer].view(shape), dt),
        )

    def gather(self, layer: int, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, n) of the blocks ``idx`` (a sequence's, in order): K, V [KVH, n, D] in the compute dtype."""
        KVH, D = self.a.kv_heads, self.a.head_dim
        k = self.k[layer][idx].transpose(0, 1).reshape(KVH, -1, D)[:, :n]
        v = self.v[layer][idx].transpose(0, 1).reshape(KVH, -1, D)[:, :n]
        return self.dequantize(layer, k, v)

    def attend_kw(self, layer: int) -> dict[str, torch.Tensor]:
        """Keyword arguments of ``cuda_ext.paged_attention``'s functions for this layer's blocks."""
        if self.fp8 is None:
            return {}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PagedSeqCache:
    """One sequence's KV in a ``SlotPool``: its slot (table row) and its block list (the manager's live
    list, or the slot's own run of blocks).  ``length``: positions written."""

    trimmed = False
    window_start = 0

    def __init__(self, pool: SlotPool, slot: int):
        self.pool, self.slot = pool, slot
        self.a, self.dtype, self.device = pool.a, pool.dtype, pool.k[0].device
        self.capacity = pool.capacity
        self.length = 0
        self.blocks = [] if pool.managed else list(range(slot * pool.max_blocks, (slot + 1) * pool.max_blocks))
        self.synced = len(self.blocks)

    @property
    def blocks(self) -> list[int]:
        return self._blocks

    @blocks.setter
    def blocks(self, value: list[int]) -> None:  # another sequence's list: the cached plan is not its
        self._blocks, self._plan_key = value, None

    def sync(self) -> None:
        """Copy new entries of the block list into the slot's table row (host side; ``pool.flush`` sends them)."""
        if len(self.blocks) != self.synced:
            self.pool.set_row(self.slot, self.blocks)
            self.synced = len(self.blocks)

    def offset(self, layer: int) -> int:
        return 0

    def _plan(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block, row) of positions [start, end) and the blocks holding [0, end), as device tensors: worked
        out once per chunk (every layer writes and reads the same places), sent in one page-locked copy."""
        key = (start, end, len(self.blocks))
        if self._plan_key == key:
            return self._plan_val
        bs = self.pool.block_size
        if end > len(self.blocks) * bs:
            raise RuntimeError(
                f"KV blocks for positions [{start}, {end}) are not allocated ({len(self.blocks)} blocks of {bs})"
            )
        T, nb = end - start, -(-end // bs)
        p = torch.arange(start, end)
        held = torch.tensor(self.blocks[:nb], dtype=torch.long)
        host = torch.cat([held[p // bs], p % bs, held])
        if self.device.type == "cuda":
            from .staging import stager

            dev = stager(self.device).to_device(host)
        else:
            dev = host
        self._plan_key, self._plan_val = key, (dev[:T], dev[T : 2 * T], dev[2 * T :])
        return self._plan_val

    _plan_key: tuple | None = None
    _plan_val: Any = None

    def _gather(self, t: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
        """Positions [0, n) of one layer's K or V through the block list ``idx``: [KVH, n, D], one copy."""
        g = torch.index_select(t.transpose(0, 1), 1, idx)  # [KVH, nb, bs, D]
        return g.view(g.shape[0], -1, g.shape[3])[:, :n]

    def rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V for positions [0, n), gathered: [KVH, n, D] each (copies), as stored
        (e4m3 under fp8: a prompt-cache copy keeps its bytes, and ``write_rows`` takes them back as they are)."""
        bs = self.pool.block_size
        idx = torch.tensor(self.blocks[: -(-n // bs)], dtype=torch.long, device=self.device)
        return self._gather(self.pool.k[layer], idx, n), self._gather(self.pool.v[layer], idx, n)

    def write_rows(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [KVH, T, D] at positions [start, start + T)."""
        blk, off, _ = self._plan(start, start + k.shape[1])
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)
        if kt.dtype != self.pool.k[layer].dtype:  # stored rows (a prompt-cache copy) go back as they are
            kt, vt = self.pool.quantize(layer, kt, vt)
        self.pool.k[layer][blk, :, off] = kt
        self.pool.v[layer][blk, :, off] = vt

    def update_attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v [KVH, T, D] at positions [start, start + T); attend q [H, T, D] causally to every
        position up to each query's.  Returns [T, H * D]."""
        end = start + k.shape[1]
        self.write_rows(layer, start, k, v)
        idx = self._plan(start, end)[2]
        keys, values = self._gather(self.pool.k[layer], idx, end), self._gather(self.pool.v[layer], idx, end)
        out = causal_attention(q, *self.pool.dequantize(layer, keys, values), start)
        if layer == self.a.layers - 1:
            self.length = end
        return out

    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes if self.pool.managed else 0
