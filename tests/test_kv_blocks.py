"""KVBlocks: paged-KV block accounting, refcounts, and prefix caching on full-block hash chains."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from swiftlm.kv_blocks import KVBlocks


def toks_of(tokens: Sequence[int]):
    """A ``tokens(start, end)`` callback over a fixed token list."""
    return lambda a, b: tokens[a:b]


def run_seq(kv: KVBlocks, sid: int, tokens: list[int], salt=None) -> list[int]:
    """Match, adopt, grow to cover ``tokens`` and commit them all, like a finished prefill."""
    kv.adopt(sid, kv.match(tokens, salt))
    assert kv.grow(sid, len(tokens))
    kv.commit(sid, len(tokens), toks_of(tokens), salt)
    return list(kv.table(sid))


def test_accounting_grow_and_free():
    kv = KVBlocks(8, 4)
    assert [kv.blocks_for(n) for n in (-3, 0, 1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2, 2, 3]
    assert not kv.has(1) and kv.need(1, 9) == 3
    t = kv.table(1)
    assert kv.has(1) and t == []
    assert kv.grow(1, 9)
    assert kv.table(1) is t and t == [0, 1, 2]
    assert kv.need(1, 12) == 0 and kv.need(1, 13) == 1 and kv.grow(1, 12) and t == [0, 1, 2]
    assert kv.grow(1, 13) and t == [0, 1, 2, 3]
    assert kv.grow(2, 1) and kv.table(2) == [4]
    assert (kv.used(), kv.free_count(), kv.cached_count(), kv.available()) == (5, 3, 0, 3)
    kv.check()
    kv.free(1)
    kv.free(99)  # unknown: no-op
    assert not kv.has(1) and kv.table(1) is not t
    assert (kv.used(), kv.free_count(), kv.cached_count()) == (1, 7, 0)  # nothing committed: all free
    assert kv.stats() == {
        "block_size": 4,
        "blocks_total": 8,
        "blocks_used": 1,
        "blocks_free": 7,
        "blocks_cached": 0,
        "prefix_queries": 0,
        "prefix_hits": 0,
        "evictions": 0,
    }
    kv.check()


def test_grow_failure_changes_nothing():
    kv = KVBlocks(4, 2)
    run_seq(kv, 1, [1, 2, 3, 4])
    kv.free(1)  # 2 cached
    assert kv.grow(2, 2) and kv.table(2) == [2]
    before = (kv.stats(), list(kv.table(2)))
    assert kv.need(2, 10) == 4 and kv.available() == 3
    assert not kv.grow(2, 10)
    assert not kv.grow(3, 7)
    assert (kv.stats(), list(kv.table(2))) == before and not kv.has(3)
    assert kv.match([1, 2, 3, 4, 5]) != []  # the cached chain survived the failed grow
    kv.check()


def test_two_sequences_share_a_prefix():
    kv = KVBlocks(10, 4)
    prompt = list(range(10))
    a = run_seq(kv, 1, prompt)
    assert a == [0, 1, 2]
    m = kv.match(prompt + [50, 51])
    assert m == [0, 1]
    kv.adopt(2, m)
    assert kv.grow(2, 12) and kv.table(2) == [0, 1, 3]
    kv.adopt(3, kv.match(prompt))  # (10 - 1) // 4 = 2 blocks
    assert kv.table(3) == [0, 1]
    assert kv._ref[:4] == [3, 3, 1, 1]
    assert kv.used() == 4
    kv.check()
    kv.free(1)
    assert kv._ref[:4] == [2, 2, 0, 1] and kv.free_count() == 7  # block 2 was only partly filled
    kv.free(2)
    kv.free(3)
    assert kv.used() == 0 and kv.cached_count() == 2 and kv.free_count() == 8
    kv.check()
    with pytest.raises(ValueError):
        kv.adopt(4, [5])  # a free block
    kv.adopt(4, [0])
    with pytest.raises(ValueError):
        kv.adopt(4, [1])  # already holds blocks
    with pytest.raises(ValueError):
        kv.adopt(5, [1, 1])
    kv.check()


def test_match_is_exact_and_capped():
    kv = KVBlocks(16, 4)
    seq = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    assert run_seq(kv, 1, seq) == [0, 1, 2, 3]
    assert kv.match(seq) == [0, 1, 2]
    assert kv.match(seq[:12]) == [0, 1]  # (12 - 1) // 4: one token always left to compute
    assert kv.match(seq[:13] + [7, 7, 7]) == [0, 1, 2]  # block 3 (1 token) never registered
    assert kv.match(seq[:9]) == [0, 1]
    assert kv.match(seq[:8]) == [0]
    assert kv.match(seq[:4]) == [] and kv.match([]) == []
    assert kv.match(seq[4:]) == []  # chains start at the root
    s = kv.stats()
    assert s["prefix_queries"] == 13 + 13 + 12 + 16 + 9 + 8 + 4 + 0 + 9  # run_seq matched once (0 hits)
    assert s["prefix_hits"] == 4 * (3 + 2 + 3 + 2 + 1)


def test_salt_and_partial_mismatch():
    kv = KVBlocks(16, 4)
    seq = list(range(13))
    run_seq(kv, 1, seq, salt="lora-a")
    assert kv.match(seq) == [] and kv.match(seq, salt="lora-b") == []
    assert kv.match(seq, salt="lora-a") == [0, 1, 2]
    changed = list(seq)
    changed[6] = 99  # inside block 1
    assert kv.match(changed, salt="lora-a") == [0]
    changed = list(seq)
    changed[11] = 99  # last token of block 2
    assert kv.match(changed, salt="lora-a") == [0, 1]


def test_lru_evicts_chain_tails_first():
    kv = KVBlocks(6, 2)
    a = [1, 2, 3, 4, 5, 6]
    b = [9, 8, 7, 6]
    assert run_seq(kv, 1, a) == [0, 1, 2]
    assert run_seq(kv, 2, b) == [3, 4]
    kv.free(1)  # released first: evicted first, tail first (2, 1, 0)
    kv.free(2)  # then 4, 3
    assert kv.cached_count() == 5 and kv.free_count() == 1
    assert kv.grow(3, 4) and kv.table(3) == [5, 2]  # free block first, then the oldest cached
    assert kv.evictions == 1
    assert kv.match(a + [0]) == [0, 1]  # the head of the chain still matches
    assert kv.grow(3, 6) and kv.table(3) == [5, 2, 1]
    assert kv.match(a + [0]) == [0] and kv.match(b + [0]) == [3, 4]
    assert kv.grow(4, 2) and kv.table(4) == [0]
    assert kv.match(a + [0]) == [] and kv.match(b + [0]) == [3, 4]
    assert kv.evictions == 3
    kv.check()
    assert kv.reset_prefix_cache() == 2
    assert kv.match(b + [0]) == [] and kv.cached_count() == 0 and kv.free_count() == 2
    assert kv.evictions == 5
    kv.check()


def test_evicted_parent_block_reuse_cannot_resurrect_child():
    kv = KVBlocks(3, 2)
    assert run_seq(kv, 1, [1, 2, 3, 4]) == [0, 1]
    kv.free(1)
    kv.adopt(2, [1])  # hold the child block (key: (chain id of block 0, (3, 4)))
    assert kv.grow(3, 2) and kv.table(3) == [2]
    assert kv.grow(4, 2) and kv.table(4) == [0]  # evicts the parent, block 0
    kv.commit(4, 2, toks_of([1, 2]))  # the same tokens registered again: a new chain id
    kv.free(2)
    assert kv.cached_count() == 1  # block 1 still holds its (now unreachable) key
    assert kv.match([1, 2, 3, 4, 0]) == [0]
    kv.free(4)
    kv.free(3)
    kv.check()
    kv2 = KVBlocks(2, 2)
    run_seq(kv2, 1, [1, 2, 3, 4])
    kv2.free(1)
    kv2.adopt(2, [1])
    assert kv2.grow(3, 2) and kv2.table(3) == [0]
    kv2.commit(3, 2, toks_of([7, 8]))  # block 0 reused for other tokens
    kv2.free(2)
    kv2.free(3)
    assert kv2.match([7, 8, 3, 4, 0]) == [0]  # not [0, 1] through the old child key
    assert kv2.match([1, 2, 3, 4, 0]) == []
    kv2.check()


def test_commit_is_incremental_and_continues_after_adopt():
    kv = KVBlocks(8, 4)
    prompt = list(range(20, 31))  # 11 tokens
    calls: list[tuple[int, int]] = []

    def tokens(a: int, b: int) -> list[int]:
        calls.append((a, b))
        return prompt[a:b]

    assert kv.grow(1, 11)
    kv.commit(1, 3, tokens)
    kv.commit(1, 5, tokens)
    kv.commit(1, 5, tokens)
    kv.commit(1, 7, tokens)
    assert calls == [(0, 4)]
    kv.commit(1, 11, tokens)
    kv.commit(1, 11, tokens)
    assert calls == [(0, 4), (4, 8)] and len(kv._by_key) == 2
    with pytest.raises(ValueError):
        kv.commit(1, 13, tokens)  # beyond the table
    kv.check()
    kv.free(1)
    longer = prompt + [1, 2, 3, 4, 5, 6]  # 17 tokens
    kv.adopt(2, kv.match(longer))
    assert kv.table(2) == [0, 1]
    assert kv.grow(2, 17)
    kv.commit(2, 17, toks_of(longer))
    assert kv.match(longer + [0]) == [0, 1, 3, 4]  # the chain continued from the adopted blocks
    assert len(kv._by_key) == 4
    kv.check()


def test_duplicate_key_keeps_first_block():
    kv = KVBlocks(8, 2)
    p = [5, 6, 7, 8]
    assert kv.grow(1, 4) and kv.grow(2, 6)  # both prefill the same prompt without matching
    kv.commit(1, 4, toks_of(p))
    kv.commit(2, 6, toks_of(p + [9, 9]))
    assert kv.table(2) == [2, 3, 4]
    assert kv.match(p + [9, 9, 0]) == [0, 1, 4]  # block 4 chained through sequence 1's keys
    kv.free(2)
    assert kv.free_count() == 5 and kv.cached_count() == 1  # blocks 2, 3 were never registered
    kv.check()


def test_prefix_caching_off():
    kv = KVBlocks(4, 2, prefix_caching=False)
    assert run_seq(kv, 1, [1, 2, 3, 4, 5]) == [0, 1, 2]
    kv.free(1)
    assert kv.free_count() == 4 and kv.cached_count() == 0
    assert kv.match([1, 2, 3, 4, 5]) == []
    assert kv.stats()["prefix_queries"] == 10 and kv.stats()["prefix_hits"] == 0
    assert kv.reset_prefix_cache() == 0
    kv.check()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_against_a_model(seed: int):
    rng = random.Random(seed)
    bs, nblocks = 2, 24
    kv = KVBlocks(nblocks, bs)
    docs = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    content: dict[int, list[int | None]] = {}  # what the "KV memory" of each block holds
    seqs: dict[int, dict] = {}  # sid -> {"tokens", "n", "salt"}
    next_sid = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.2 or not seqs:  # admit a new sequence
            toks = list(rng.choice(docs)[: rng.randrange(13)]) + [rng.randrange(3) for _ in range(rng.randrange(6))]
            if not toks:
                toks = [0]
            salt = rng.choice([None, "x"])
            m = kv.match(toks, salt)
            assert len(m) <= (len(toks) - 1) // bs
            for i, b in enumerate(m):  # matched blocks really hold these tokens
                assert content[b] == toks[i * bs : (i + 1) * bs]
            sid, next_sid = next_sid, next_sid + 1
            kv.adopt(sid, m)
            seqs[sid] = {"tokens": toks, "n": len(m) * bs, "salt": salt}
        elif op < 0.85:  # one scheduler step: compute a few more positions
            sid = rng.choice(list(seqs))
            s = seqs[sid]
            target = s["n"] + rng.randrange(1, 5)
            while len(s["tokens"]) < target:
                s["tokens"].append(rng.randrange(3))
            before = (kv.stats(), len(kv.table(sid)))
            if not kv.grow(sid, target):
                assert kv.need(sid, target) > kv.available()
                assert (kv.stats(), len(kv.table(sid))) == before
                victim = rng.choice(list(seqs))  # preempt
                kv.free(victim)
                del seqs[victim]
            else:
                table = kv.table(sid)
                for p in range(s["n"], target):
                    b = table[p // bs]
                    assert sum(kv.table(o).count(b) for o in seqs) == 1, "wrote into a shared block"
                    row = content.setdefault(b, [None] * bs)
                    if p % bs == 0:
                        row[:] = [None] * bs
                    row[p % bs] = s["tokens"][p]
                s["n"] = target
                kv.commit(sid, target, toks_of(s["tokens"]), s["salt"])
        elif op < 0.99:
            sid = rng.choice(list(seqs))
            kv.free(sid)
            del seqs[sid]
        else:
            kv.reset_prefix_cache()
        kv.check()
        live = {b for sid in seqs for b in kv.table(sid)}
        assert kv.available() == nblocks - len(live)
        assert kv.used() == len(live)
    assert kv.prefix_hits > 0 and kv.evictions > 0
