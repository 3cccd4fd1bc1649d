"""The per-sequence KV cache of the torch backend's native layers (``SeqCache``): per layer
[KVH, capacity, D] tensors that grow in blocks of ``GROW_ROWS`` rows, and sliding-window layers
that drop the rows no query can see any more."""

from __future__ import annotations

import os

import torch

from .kv_fp8 import FP8, KVScales, dequantize, quantize
from .model_config import Args
from .offload import layer_places

GROW_ROWS = 64  # a growing cache's capacity is a multiple of this


def window_trim_enabled() -> bool:
    """Sliding-window layers drop the KV rows no query can see any more (``SeqCache``).  The switch
    exists for the equivalence tests only (``SWIFTLM_WINDOW_KV_TRIM=0``: keep every row, as before)."""
    return os.environ.get("SWIFTLM_WINDOW_KV_TRIM", "1") != "0"


class WindowRowsDropped(RuntimeError):
    """A reader asked a sliding-window layer for KV rows it has dropped (``SeqCache``)."""


class SeqCache:
    """One sequence's KV cache: per layer [KVH, capacity, D] tensors.  A growing (CPU) cache starts
    at ``GROW_ROWS`` rows and grows to the rows needed plus a quarter, rounded up to ``GROW_ROWS``:
    it holds at most ~1.25x its rows plus one block (doubling from a fixed start holds several times
    the rows of a short sequence, and a server keeps many of those), for ~log1.25 growth copies.

    Sliding-window layers (``Args.window``) keep bounded memory: when such a layer runs out of rows
    (or holds more than a block over what it needs), the rows before ``start - window + 1`` (no query
    of this or any later chunk sees them) are dropped and the rest moved to the front of a buffer of
    ``need = window + T - 1`` rows plus half a block, rounded up to a block: a window layer holds at
    most ``window + T + 2.5 * GROW_ROWS`` rows for a chunk of T (``round_up(window + 32, 64)`` while
    decoding), whatever the sequence length.  ``_off[layer]`` is the absolute position of that
    layer's row 0 (``offset``); ``update`` returns rows [offset, start + T), so
    attention indexes a window layer by ``position - offset`` (the returned rows start at
    ``start + T - rows``: see ``chunk_attention``'s callers).  Rows are cached after rope, so
    dropping old ones needs no re-rotation.  Rollback (speculative verification, recompute) is by
    position and never goes before the start of the last chunk written, whose rows the trim keeps;
    a write that would need dropped rows raises instead of attending over the wrong keys, and so
    does reading ``k`` / ``v`` from outside once rows were dropped (a prompt-cache snapshot or a
    fork copy of rows [0, length) cannot be made then; those callers catch it and recompute)."""

    _off: list | None = None  # per layer: a window layer's first kept position; None: a full layer / no trim
    fp8: KVScales | None = None  # --kv-cache-dtype fp8: rows stored as e4m3 with these scales (kv_fp8.py)

    def __init__(
        self,
        a: Args,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = GROW_ROWS,
        fp8: KVScales | None = None,
    ):
        self.a, self.dtype, self.device = a, dtype, device
        self.capacity = min(capacity, a.ctx)
        shape = (a.kv_heads, self.capacity, a.head_dim)
        # zeros, not empty: the fixed-shape decode reads rows past the position (masked out,
        # but 0 * NaN garbage would still be NaN)
        places = layer_places(a, device, dtype)  # --gpu-layers: each layer's rows where the layer is
        if fp8 is not None:  # e4m3 rows; read back through dequantize (``_rows``)
            self.fp8, self._read_dtypes = fp8, [dt for _, dt in places]
            places = [(dev, FP8) for dev, _ in places]
        self._k = [torch.zeros(shape, dtype=dt, device=dev) for dev, dt in places]
        self._v = [torch.zeros(shape, dtype=dt, device=dev) for dev, dt in places]
        self.length = 0
        if any(getattr(a, "windows", ())) and window_trim_enabled():
            self._off = [0 if a.window(i) else None for i in range(a.layers)]

    # ``k`` / ``v``: every layer's rows by absolute position [0, length), for readers outside this
    # class (CUDA graphs, the prompt cache, forks).  Once a window layer dropped rows there is no such
    # list: reading it raises (the callers that copy rows from position 0 catch it and recompute).
    @property
    def k(self) -> list[torch.Tensor]:
        self._check_whole("k")
        return self._k

    @k.setter
    def k(self, value: list[torch.Tensor]) -> None:
        self._k = value

    @property
    def v(self) -> list[torch.Tensor]:
        self._check_whole("v")
        return self._v

    @v.setter
    def v(self, value: list[torch.Tensor]) -> None:
        self._v = value

    def _check_whole(self, name: str) -> None:
        if self.trimmed:
            raise WindowRowsDropped(
                f"SeqCache.{name}: sliding-window layers dropped the KV rows before position "
                f"{self.window_start}; rows from position 0 are no longer held"
            )

    @property
    def trimmed(self) -> bool:
        """Whether a sliding-window layer dropped rows (then ``k`` / ``v`` by position are gone)."""
        return self._off is not None and any(self._off)

    @property
    def window_start(self) -> int:
        """The lowest first-kept position over the trimmed window layers (0: nothing dropped)."""
        offs = [o for o in (self._off or ()) if o]
        return min(offs) if offs else 0

    def offset(self, layer: int) -> int:
        """The absolute position of ``layer``'s row 0 (0 unless a window layer dropped rows)."""
        return (self._off[layer] or 0) if self._off is not None else 0

    def _grow(self, need: int, full_only: bool = False) -> None:
        """Layers to at least ``need`` rows: all of them (a restore into a fresh cache), or with
        ``full_only`` the full-attention ones (a window layer that drops rows sizes itself)."""
        cap = -(-(need + need // 4) // GROW_ROWS) * GROW_ROWS
        cap = min(max(cap, need), self.a.ctx)
        for lst in (self._k, self._v):
            for i, t in enumerate(lst):
                if self._off is not None and self._off[i] is not None and (full_only or self._off[i] > 0):
                    continue
                if t.shape[1] >= cap:
                    continue
                n = torch.zeros((t.shape[0], cap, t.shape[2]), dtype=t.dtype, device=t.device)
                rows = min(self.length, t.shape[1])
                n[:, :rows] = t[:, :rows]
                lst[i] = n
        self.capacity = cap

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write positions [start, start + T) of ``layer``; its rows [offset(layer), start + T)."""
        if self._off is not None and self._off[layer] is not None:
            return self._update_window(layer, start, k, v)
        end = start + k.shape[1]
        if end > self._k[layer].shape[1]:
            self._grow(end, full_only=True)
        k, v = self._store(layer, k, v)
        self._k[layer][:, start:end] = k
        self._v[layer][:, start:end] = v
        if layer == self.a.layers - 1:
            self.length = end
        return self._rows(layer, end)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as stored: e4m3 through the layer's scales with --kv-cache-dtype fp8, else as given."""
        if self.fp8 is None:
            return k, v
        sk, sv = self._scales(layer)
        return quantize(k, sk), quantize(v, sv)

    def _scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        sk, sv = self.fp8.layer(layer)
        dev = self._k[layer].device
        return (sk, sv) if sk.device == dev else (sk.to(dev), sv.to(dev))

    def _rows(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, e) of ``layer``'s buffers, for attention (dequantised in the compute dtype under fp8)."""
        k, v = self._k[layer][:, :e], self._v[layer][:, :e]
        if self.fp8 is None:
            return k, v
        sk, sv = self._scales(layer)
        dt = self._read_dtypes[layer]
        return dequantize(k, sk, dt), dequantize(v, sv, dt)

    def _update_window(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        w = self.a.window(layer)
        end = start + k.shape[1]
        keep = max(0, start - w + 1)  # the first position a query of this chunk (or any later one) sees
        off = self._off[layer]
        if start == 0:  # the sequence from its start again (longrope's switch): nothing older is read
            off = 0
        elif keep < off:
            raise WindowRowsDropped(
                f"layer {layer} (sliding window {w}) dropped the KV rows before position {off}; "
                f"a write at position {start} needs them from {keep}"
            )
        need, have = end - keep, self._k[layer].shape[1]
        cap = max(min(-(-(need + GROW_ROWS // 2) // GROW_ROWS) * GROW_ROWS, self.a.ctx), need)
        # out of rows, or more than a block over the size needed (after a long prefill chunk or a restored
        # prompt: shrink; the block of hysteresis keeps chunks of varying length from reallocating each step)
        if end - off > have or (keep > off and have > cap + GROW_ROWS):
            # drop the rows before ``keep``: the rows [keep, start) move to the front of a buffer of the rows
            # needed plus at least half a block, so this happens once per half a block of tokens or fewer
            moved = start - keep
            for lst in (self._k, self._v):
                old = lst[layer]
                src = old[:, keep - off : start - off]
                if old.shape[1] == cap:  # in place (the ranges overlap: copy first)
                    old[:, :moved] = src.clone()
                else:
                    new = torch.zeros((old.shape[0], cap, old.shape[2]), dtype=old.dtype, device=old.device)
                    new[:, :moved] = src
                    lst[layer] = new
            off = keep
        self._off[layer] = off
        s, e = start - off, end - off
        k, v = self._store(layer, k, v)
        self._k[layer][:, s:e] = k
        self._v[layer][:, s:e] = v
        if layer == self.a.layers - 1:
            self.length = end
        return self._rows(layer, e)

    def layer_nbytes(self) -> list[int]:
        """Each layer's K and V storage in bytes."""
        return [sum(t.numel() * t.element_size() for t in (kk, vv)) for kk, vv in zip(self._k, self._v)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)
