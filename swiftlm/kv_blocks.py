"""Block allocator for a paged KV cache, with prefix caching on full blocks (no arrays here).

KV memory is ``num_blocks`` blocks of ``block_size`` positions.  Each sequence owns a *block
table*: block ids in position order, position ``p`` living in ``table[p // block_size]`` at row
``p % block_size``.  A block is in exactly one state:

* **used**: referenced by one or more tables (refcount >= 1);
* **free**: refcount 0 and no registered key (on the FIFO free list);
* **cached**: refcount 0 but still registered under a prefix key, so ``match()`` can hand it to a
  new sequence; cached blocks are reclaimed least-recently-released first when the free list runs dry.

Prefix keys form a hash chain: block ``i``'s key is ``(parent, tokens of block i)`` where
``parent`` is ``("root", salt)`` for block 0 and otherwise the *chain id* of block ``i - 1``'s key:
an int issued once per registration and never reused.  Keys therefore stay O(block_size) to hash
and compare exactly (no collisions), and once a registration is evicted nothing registered under
its chain id can be reached again, even when its block id is reused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence

_Key = tuple[Hashable, tuple[int, ...]]
_STOPPED = -1  # a sequence whose chain cannot be continued (it adopted an unregistered block)


class _Seq:
    """One sequence's table and how far its chain of full blocks has been registered."""

    __slots__ = ("table", "n_reg", "parent")

    def __init__(self) -> None:
        self.table: list[int] = []
        self.n_reg = 0  # leading blocks of ``table`` whose keys are known (registered or duplicate)
        self.parent: int | None = None  # chain id for the next key; None: the salt root


class KVBlocks:
    """Reference-counted KV blocks, per-sequence block tables, and the prefix (hash-chain) cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        """``num_blocks`` blocks of ``block_size`` positions; ``prefix_caching`` keeps released
        full blocks matchable until they are needed again."""
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"KVBlocks needs num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest-released first
        self._key_of: list[_Key | None] = [None] * num_blocks
        self._cid_of = [0] * num_blocks  # chain id of the block's registered key
        self._by_key: dict[_Key, int] = {}
        self._next_cid = 1
        self._seqs: dict[int, _Seq] = {}

    # ---- accounting ---------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        """Blocks needed to hold ``n_tokens`` positions (0 for ``n_tokens <= 0``)."""
        return 0 if n_tokens <= 0 else -(-n_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's live block table: the same list object for as long as the sequence is
        known (an unknown sequence gets an empty table registered)."""
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._seqs[seq_id] = _Seq()
        return st.table

    def has(self, seq_id: int) -> bool:
        """Whether the sequence has a registered table (holding blocks or not)."""
        return seq_id in self._seqs

    def free_count(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    def cached_count(self) -> int:
        """Unreferenced blocks that still hold a registered key."""
        return len(self._cached)

    def available(self) -> int:
        """Blocks ``grow()`` can still hand out (free plus cached)."""
        return len(self._free) + len(self._cached)

    def used(self) -> int:
        """Blocks referenced by at least one table."""
        return self.num_blocks - len(self._free) - len(self._cached)

    def need(self, seq_id: int, n_tokens: int) -> int:
        """Extra blocks the sequence needs for its table to cover positions ``[0, n_tokens)``."""
        st = self._seqs.get(seq_id)
        return max(0, self.blocks_for(n_tokens) - (len(st.table) if st is not None else 0))

    # ---- allocation ---------------------------------------------------------------------------
    def _evict_oldest(self) -> int:
        """Reclaim the least-recently-released cached block: drop its key, return its id."""
        b, _ = self._cached.popitem(last=False)
        self._unregister(b)
        self.evictions += 1
        return b

    def _unregister(self, b: int) -> None:
        key = self._key_of[b]
        if key is not None:
            del self._by_key[key]
            self._key_of[b] = None

    def grow(self, seq_id: int, n_tokens: int) -> bool:
        """Append blocks so the table covers ``[0, n_tokens)``: free blocks first, then the oldest
        cached ones.  Returns False, changing nothing, when not enough blocks are available."""
        st = self._seqs.get(seq_id)
        have = len(st.table) if st is not None else 0
        n = self.blocks_for(n_tokens) - have
        if n <= 0:
            return True
        if n > len(self._free) + len(self._cached):
            return False
        if st is None:
            st = self._seqs[seq_id] = _Seq()
        table, ref, free = st.table, self._ref, self._free
        for _ in range(n):
            b = free.popleft() if free else self._evict_oldest()
            ref[b] = 1
            table.append(b)
        return True

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references, tail block first (so a chain's head is the most
        recently released and is evicted last).  Unknown sequences are ignored."""
        st = self._seqs.pop(seq_id, None)
        if st is None:
            return
        ref, keep = self._ref, self.prefix_caching
        for b in reversed(st.table):
            ref[b] -= 1
            if ref[b] == 0:
                if keep and self._key_of[b] is not None:
                    self._cached[b] = None
                else:
                    self._unregister(b)
                    self._free.append(b)

    # ---- prefix caching -----------------------------------------------------------------------
    def match(self, tokens: Sequence[int], salt: Hashable = None) -> list[int]:
        """Blocks of the longest registered chain equal to ``tokens``' leading full blocks, at most
        ``(len(tokens) - 1) // block_size`` of them (at least one token is left to compute).  Takes
        no references; call ``adopt()`` with the result."""
        self.prefix_queries += len(tokens)
        if not self.prefix_caching:
            return []
        bs, out = self.block_size, []
        parent: Hashable = ("root", salt)
        for i in range((len(tokens) - 1) // bs):
            b = self._by_key.get((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if b is None:
                break
            out.append(b)
            parent = self._cid_of[b]
        self.prefix_hits += len(out) * bs
        return out

    def adopt(self, seq_id: int, blocks: list[int]) -> None:
        """Start the sequence's table with ``blocks`` (usually from ``match()``), taking a reference
        on each; cached blocks leave the LRU.  Their keys count as registered for this sequence, so
        ``commit()`` continues the chain after them."""
        st = self._seqs.get(seq_id)
        if st is not None and st.table:
            raise ValueError(f"sequence {seq_id} already holds {len(st.table)} blocks")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"adopt: duplicate block ids in {blocks}")
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"adopt: block {b} out of range [0, {self.num_blocks})")
            if self._ref[b] == 0 and b not in self._cached:
                raise ValueError(f"adopt: block {b} is free (not cached, not used)")
        if st is None:
            st = self._seqs[seq_id] = _Seq()
        for b in blocks:
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
        st.table.extend(blocks)
        st.n_reg = len(blocks)
        if blocks:
            known = all(self._key_of[b] is not None for b in blocks)
            st.parent = self._cid_of[blocks[-1]] if known else _STOPPED

    def commit(
        self, seq_id: int, n_computed: int, tokens: Callable[[int, int], Sequence[int]], salt: Hashable = None
    ) -> None:
        """Register the keys of the sequence's full blocks within ``[0, n_computed)`` not registered
        yet; ``tokens(start, end)`` gives the sequence's token ids for ``[start, end)``.  A key that
        is already registered (to another block) keeps its block; the chain continues through it."""
        st = self._seqs.get(seq_id)
        if st is None or not self.prefix_caching or st.parent == _STOPPED:
            return
        n_full = n_computed // self.block_size
        if n_full <= st.n_reg:
            return
        if n_full > len(st.table):
            raise ValueError(
                f"commit: sequence {seq_id} computed {n_computed} positions but its table "
                f"covers {len(st.table) * self.block_size}"
            )
        bs, start = self.block_size, st.n_reg
        toks = tokens(start * bs, n_full * bs)
        if len(toks) != (n_full - start) * bs:
            raise ValueError(f"commit: tokens({start * bs}, {n_full * bs}) returned {len(toks)} ids")
        cid = st.parent
        root: Hashable = ("root", salt)
        by_key, key_of, cid_of = self._by_key, self._key_of, self._cid_of
        for i in range(start, n_full):
            j = (i - start) * bs
            key = (root if cid is None else cid, tuple(toks[j : j + bs]))
            b = st.table[i]
            owner = by_key.get(key)
            if owner is None:
                if key_of[b] is not None:  # shared block registered under another chain: cannot re-key it
                    st.parent, st.n_reg = _STOPPED, n_full
                    return
                by_key[key] = b
                key_of[b] = key
                cid_of[b] = self._next_cid
                self._next_cid += 1
                owner = b
            cid = cid_of[owner]
        st.parent, st.n_reg = cid, n_full

    def reset_prefix_cache(self) -> int:
        """Evict every cached block now (they go to the free list); returns how many.  Registered
        blocks still in use stay registered."""
        n = len(self._cached)
        while self._cached:
            self._free.append(self._evict_oldest())
        return n

    # ---- introspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Sizes and counters, for metrics."""
        return {
            "block_size": self.block_size,
            "blocks_total": self.num_blocks,
            "blocks_used": self.used(),
            "blocks_free": len(self._free),
            "blocks_cached": len(self._cached),
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "evictions": self.evictions,
        }

    def check(self) -> None:
        """Assert the internal invariants (O(num_blocks); for tests)."""
        counts = [0] * self.num_blocks
        for sid, st in self._seqs.items():
            assert 0 <= st.n_reg <= len(st.table), f"seq {sid}: n_reg {st.n_reg} > {len(st.table)} blocks"
            for b in st.table:
                assert 0 <= b < self.num_blocks, f"seq {sid}: block {b} out of range"
                counts[b] += 1
        assert counts == self._ref, "refcounts differ from the number of tables holding each block"
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, f"blocks both free and cached: {sorted(free & cached)}"
        for b in range(self.num_blocks):
            if self._ref[b]:
                assert b not in free and b not in cached, f"used block {b} is free or cached"
            else:
                assert b in free or b in cached, f"unreferenced block {b} is neither free nor cached"
            if b in free:
                assert self._key_of[b] is None, f"free block {b} holds a key"
            if b in cached:
                assert self._key_of[b] is not None, f"cached block {b} holds no key"
            key = self._key_of[b]
            if key is not None:
                assert self._by_key.get(key) == b, f"block {b}'s key maps to {self._by_key.get(key)}"
        assert self.used() + len(free) + len(cached) == self.num_blocks, "used + free + cached != total"
        for key, b in self._by_key.items():
            assert self._key_of[b] == key, f"registered key points at block {b}, whose key differs"
        cids = [self._cid_of[b] for b in self._by_key.values()]
        assert len(set(cids)) == len(cids), "two registered blocks share a chain id"
