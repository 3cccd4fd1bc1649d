"""Prompt (prefix) reuse across requests: the policy, independent of any array library.

When a sequence ends, its backend hands over the KV state of the tokens it computed; a new
request whose prompt starts with those tokens reuses the longest cached prefix and prefills
only the rest.  Entries are immutable: a reuse *copies* the prefix into the new sequence's
own cache, so no mutable state is ever shared between requests.  The store is bounded in
bytes with least-recently-used eviction.  Multi-turn chats hit naturally: a finished turn's
entry holds prompt + generated tokens, which the next turn's prompt starts with.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Entry:
    tokens: tuple[int, ...]
    payload: Any  # the backend's KV snapshot (opaque here)
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 16):
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens  # shorter matches are not worth a copy
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, tokens: list[int], payload: Any, nbytes: int) -> None:
        if not self.enabled or len(tokens) < self.min_tokens or nbytes > self.max_bytes:
            return
        key = tuple(tokens)
        with self._lock:
            for k, e in list(self._entries.items()):  # an entry that is a prefix of this one is redundant
                if len(e.tokens) <= len(key) and key[: len(e.tokens)] == e.tokens:
                    self._drop(k)
            self._entries[self._next] = Entry(key, payload, nbytes)
            self._next += 1
            self.bytes += nbytes
            while self.bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Drop every entry and zero the counters."""
        with self._lock:
            self._entries.clear()
            self.bytes = self.hits = self.misses = self.tokens_reused = 0

    def _drop(self, k: int) -> None:
        e = self._entries.pop(k)
        self.bytes -= e.nbytes

    def lookup(self, tokens: list[int]) -> tuple[int, Any]:
        """(length of the longest cached prefix usable for ``tokens``, payload).  At least one
        prompt token is always left to compute, so the model produces logits."""
        best_k, best_n = None, 0
        limit = len(tokens) - 1
        with self._lock:
            for k, e in self._entries.items():
                n = _common_prefix(e.tokens, tokens, limit)
                if n > best_n:
                    best_k, best_n = k, n
            if best_k is None or best_n < self.min_tokens:
                self.misses += 1
                return 0, None
            self._entries.move_to_end(best_k)
            self.hits += 1
            self.tokens_reused += best_n
            return best_n, self._entries[best_k].payload

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
