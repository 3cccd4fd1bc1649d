"""Copy-on-write KV for forked sequences (``n`` / ``best_of``) on the growing (CPU) cache path.

A request with n choices prefills its prompt once (the engine's fork groups, ``swiftlm/fork.py``).
Then the prompt's KV rows become one read-only ``SharedPrefix``, and every choice -- the one that
prefilled included -- gets a ``ForkedCache``: a pointer to that prefix plus its own segment for the
positions it generates.  Nothing ever writes into the prefix: a write below it (a rollback, which
the engine never asks of a fork) first copies the prefix into the cache's own rows.  The prefix is
freed with the last cache that points at it (plain reference counting).

Attention over prefix + own segment:

- ``decode_batch`` (decode_rows.py), the batched decode step, runs the queries of all the rows that share
  one prefix against it as ONE matmul (the prefix is read once per step, not once per fork), then the
  own segments padded as before; one softmax over the concatenated scores, so the result is the
  plain attention's up to the summation order of the weighted sum.
- every other path (a lone decode row, a verification block, a prefill chunk) calls ``update``,
  which returns the concatenated keys and values: exactly the rows a plain cache would hold.
"""

from __future__ import annotations

from typing import Any

import torch

from .kv_cache import GROW_ROWS, SeqCache


class SharedPrefix:
    """KV rows [0, length) of a prompt, per layer [KVH, length, D]: read-only, shared by forks."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v = k, v
        self.length = k[0].shape[1] if k else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class ForkedCache(SeqCache):
    """A ``SeqCache`` whose positions [0, base) live in a ``SharedPrefix`` and positions >= base in
    its own growing segment (``k``/``v`` here hold the own segment only).  ``length`` counts all
    positions, as for a plain cache."""

    def __init__(self, prefix: SharedPrefix, a: Any, dtype: torch.dtype, device: torch.device, n: int | None = None):
        n = prefix.length if n is None else n
        if n < prefix.length:  # a shorter view of the prefix (views keep the storage shared)
            prefix = SharedPrefix([t[:, :n] for t in prefix.k], [t[:, :n] for t in prefix.v])
        self.a, self.dtype, self.device = a, dtype, device
        self.prefix: SharedPrefix | None = prefix
        self.base = n
        self.capacity = GROW_ROWS  # of the own segment
        shape = (a.kv_heads, self.capacity, a.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(a.layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(a.layers)]
        self.own = 0

    # ``length``: all positions (prefix + own); setting it below the prefix unshares first
    @property
    def length(self) -> int:  # type: ignore[override]
        return self.base + self.own

    @length.setter
    def length(self, value: int) -> None:
        if value < self.base:
            self._unshare()
        self.own = value - self.base

    def _unshare(self) -> None:
        """Become a plain cache: the prefix rows copied in front of the own rows."""
        if self.prefix is None:
            return
        n, base = self.own, self.base
        cap = -(-(base + n + GROW_ROWS) // GROW_ROWS) * GROW_ROWS
        for lst, pre in ((self.k, self.prefix.k), (self.v, self.prefix.v)):
            for i, t in enumerate(lst):
                new = torch.zeros((t.shape[0], cap, t.shape[2]), dtype=t.dtype, device=t.device)
                new[:, :base] = pre[i]
                new[:, base : base + n] = t[:, :n]
                lst[i] = new
        self.prefix, self.base, self.capacity, self.own = None, 0, cap, base + n

    def _grow(self, need: int) -> None:  # need: rows of the own segment
        cap = -(-(need + need // 4) // GROW_ROWS) * GROW_ROWS
        cap = min(max(cap, need), max(need, self.a.ctx - self.base))
        for lst in (self.k, self.v):
            for i, t in enumerate(lst):
                n = torch.zeros((t.shape[0], cap, t.shape[2]), dtype=t.dtype, device=t.device)
                n[:, : self.own] = t[:, : self.own]
                lst[i] = n
        self.capacity = cap

    def update_own(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write rows at absolute positions [start, start + T) (>= base); the own segment's rows so far."""
        if start < self.base:
            self._unshare()
        s = start - self.base
        end = s + k.shape[1]
        if end > self.capacity:
            self._grow(end)
        self.k[layer][:, s:end] = k
        self.v[layer][:, s:end] = v
        if layer == self.a.layers - 1:
            self.own = end
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """As ``SeqCache.update``: all keys and values [0, start + T) (the prefix concatenated)."""
        keys, values = self.update_own(layer, start, k, v)
        if self.prefix is None:
            return keys, values
        return torch.cat([self.prefix.k[layer], keys], 1), torch.cat([self.prefix.v[layer], values], 1)

    def rows(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Compact copies of positions [0, n), per layer (a prompt-cache snapshot)."""
        ks, vs = [], []
        for layer in range(len(self.k)):
            pk = self.prefix.k[layer] if self.prefix is not None else self.k[layer][:, :0]
            pv = self.prefix.v[layer] if self.prefix is not None else self.v[layer][:, :0]
            ks.append(torch.cat([pk, self.k[layer][:, : self.own]], 1)[:, :n].clone())
            vs.append(torch.cat([pv, self.v[layer][:, : self.own]], 1)[:, :n].clone())
        return ks, vs

    def nbytes(self) -> int:
        """The own segment's storage (the prefix is counted once, by whoever counts the prefixes)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def share(cache: SeqCache) -> SharedPrefix:
    """A compact, read-only copy of the cache's rows [0, length)."""
    n = cache.length
    return SharedPrefix([t[:, :n].clone() for t in cache.k], [t[:, :n].clone() for t in cache.v])


def prefixes(caches: list[Any]) -> list[SharedPrefix]:
    """The distinct shared prefixes the caches point at (for counting bytes once)."""
    seen: dict[int, SharedPrefix] = {}
    for c in caches:
        p = getattr(c, "prefix", None) if isinstance(c, ForkedCache) else None
        if p is not None:
            seen.setdefault(id(p), p)
    return list(seen.values())
