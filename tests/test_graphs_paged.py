"""Batched static decode with the Triton decode-attention kernel reading the slot pool in place
(CUDA's default) against the gather + SDPA path: on CPU under TRITON_INTERPRET=1, in a
subprocess (the interpreter flag must be set before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import needs_torch

SCRIPT = textwrap.dedent("""
    import sys, torch
    from swiftlm.registry import resolve
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.backends.torch.graphs import SlotPool, decode_batch_static
    torch.manual_seed(0)
    tm = load_model(resolve(sys.argv[1]), None)
    m = tm.module
    a = m.a
    pool = SlotPool(a, 4, 96, torch.float32, torch.device("cpu"))
    for t in pool.k + pool.v:  # every slot filled with random history (position p of slot s)
        t.normal_()
    slots = torch.tensor([2, 0, 3, 4])          # 4 = the scratch slot: a padding row
    pos = torch.tensor([0, 37, 95, 0])           # lengths 1, 38, 96 (a full slot) and padding
    toks = torch.tensor([5, 17, 123, 0])
    ar = torch.arange(a.ctx)
    with torch.inference_mode():
        ref = decode_batch_static(m, pool, toks, slots, pos, 96, ar, 0)[:3]
        for splits in (1, 2, 4):
            got = decode_batch_static(m, pool, toks, slots, pos, 96, ar, splits)[:3]
            err = float((got - ref).abs().max())
            scale = float(ref.abs().max())
            # fp32 both ways; the kernel sums scores and values in another order (online softmax,
            # split-K): rounding of a few hundred terms, far below 1e-4 of the logits' scale
            assert err <= 1e-4 * scale, (splits, err, scale)
            print("splits", splits, "max err", err, "scale", scale)
""")


@needs_torch
def test_batched_decode_with_the_kernel_equals_gather_sdpa(tiny_llama):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("max err") == 3


@needs_torch
def test_packed_prefill_equals_per_prompt_forward(tiny_llama):
    """Several prompts' first chunks in one packed forward (CUDA's prefill of concurrent arrivals)
    give each prompt's last-token logits and KV rows as its own forward does: fp32 on CPU, the
    packed matmuls and the block-diagonal masked SDPA sum in another order, so within rounding."""
    import torch

    from swiftlm.backends.torch.graphs import SlotPool, prefill_packed_static
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.packed_attention import pack
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    tm = load_model(resolve(str(tiny_llama)), None)
    m, a = tm.module, tm.module.a
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, a.vocab, (n,), generator=g).tolist() for n in (5, 17, 2, 33)]
    pool = SlotPool(a, 4, 64, torch.float32, torch.device("cpu"))
    slots = [3, 0, 2, 1]
    toks, sl, pos, seg, last = pack(prompts, slots)
    with torch.inference_mode():
        got = prefill_packed_static(m, pool, *(torch.tensor(x) for x in (toks, sl, pos, seg, last)))
        for n, (p, s) in enumerate(zip(prompts, slots)):
            c = SeqCache(a, torch.float32, torch.device("cpu"))
            want = m(torch.tensor(p), c, 0)[-1]
            tol = 1e-4 * float(want.abs().max())  # fp32 rounding of sums over a few hundred terms
            assert float((got[n] - want).abs().max()) <= tol, n
            for layer in range(a.layers):
                kv_err = (pool.k[layer][s, :, : len(p)] - c.k[layer][:, : len(p)]).abs().max()
                assert float(kv_err) <= 1e-5 * float(c.k[layer].abs().max()) + 1e-6, (n, layer)


@needs_torch
def test_padded_packed_prefill_equals_unpadded(tiny_llama):
    """The graphed prefill's padding (prefill_graphs: a prompt of its own in the scratch slot, a
    fixed number of logit rows) changes nothing for the real prompts: their logits and KV rows equal
    the unpadded packed forward's within fp32 rounding (the padded matmuls have more rows), no other
    slot is written, and every bucket gives the same answer."""
    import torch

    from swiftlm.backends.torch.graphs import SlotPool, prefill_packed_static
    from swiftlm.backends.torch.packed_attention import pack
    from swiftlm.backends.torch.prefill_graphs import BUCKETS, MAX_PROMPTS, PackedGraphs, bucket, padded_inputs
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    tm = load_model(resolve(str(tiny_llama)), None)
    m, a = tm.module, tm.module.a

    class Eager:  # the GraphDecoder fields a prompt-only PackedGraphs reads, with graphs off (CPU)
        use_graph, device, model = False, torch.device("cpu"), m

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, a.vocab, (n,), generator=g).tolist() for n in (7, 1 + 2, 20)]
    slots = [2, 0, 3]
    toks, sl, pos, seg, last = pack(prompts, slots)
    assert bucket(len(toks)) == 32 and bucket(BUCKETS[-1] + 1) is None
    with torch.inference_mode():
        ref_pool = SlotPool(a, 5, 64, torch.float32, torch.device("cpu"))
        want = prefill_packed_static(m, ref_pool, *(torch.tensor(x) for x in (toks, sl, pos, seg, last)))
        for width in (None, 64, 128):  # None: the chunk's own bucket (32)
            pool = SlotPool(a, 5, 64, torch.float32, torch.device("cpu"))
            pg = PackedGraphs(Eager(), pool, enabled=True)
            assert pg.fits(len(toks), len(last)) and not pg.fits(len(toks), MAX_PROMPTS + 1)
            if width is None:
                got, none = pg.run(toks, sl, pos, seg, last)
                assert none.shape[0] == 0  # no decode rows
            else:  # a wider bucket than the chunk's own
                host, lh = padded_inputs(toks, sl, pos, seg, last, width, pool.scratch, pool.capacity)
                got = pg._fn(width, *host.unbind(0), lh)[: len(last)]
            assert got.shape == want.shape
            tol = 1e-5 * float(want.abs().max())  # fp32: the same sums, row blocks of another height
            assert float((got - want).abs().max()) <= tol, width
            for layer in range(a.layers):
                for s, p in zip(slots, prompts):
                    assert torch.allclose(
                        pool.k[layer][s, :, : len(p)], ref_pool.k[layer][s, :, : len(p)], atol=1e-6, rtol=1e-5
                    )
                    assert torch.allclose(
                        pool.v[layer][s, :, : len(p)], ref_pool.v[layer][s, :, : len(p)], atol=1e-6, rtol=1e-5
                    )
                assert not pool.k[layer][1].any() and not pool.k[layer][4].any()  # untouched slots
                assert pool.k[layer][pool.scratch].any()  # the padding went to the scratch row


@needs_torch
def test_mixed_step_equals_prefill_then_batched_decode(tiny_llama):
    """A step's decode rows and new prompts in one forward (mixed_step: CUDA's prompt steps) give the
    logits and KV rows of the two forwards it replaces (the packed prompts, then the batched decode
    over the slots): fp32 on CPU, the shared matmuls have more rows, so within rounding.  Through
    PackedGraphs' padded inputs (prompt bucket, decode rows padded to the pool with scratch rows)."""
    import torch

    from swiftlm.backends.torch.graphs import SlotPool, decode_batch_static, prefill_packed_static
    from swiftlm.backends.torch.packed_attention import pack
    from swiftlm.backends.torch.prefill_graphs import PackedGraphs
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    tm = load_model(resolve(str(tiny_llama)), None)
    m, a = tm.module, tm.module.a

    class Eager:  # the GraphDecoder fields PackedGraphs with decode rows reads, graphs off (CPU)
        use_graph, device, model = False, torch.device("cpu"), m

        def splits_for(self, L, B):
            return 0

    g = torch.Generator().manual_seed(2)
    old = [torch.randint(0, a.vocab, (n,), generator=g).tolist() for n in (9, 4, 13)]  # decoding already
    new = [torch.randint(0, a.vocab, (n,), generator=g).tolist() for n in (6, 11)]  # arriving now
    old_slots, new_slots = [4, 0, 2], [1, 5]
    nxt = torch.randint(0, a.vocab, (3,), generator=g).tolist()  # the decode rows' tokens
    with torch.inference_mode():
        pools = [SlotPool(a, 6, 64, torch.float32, torch.device("cpu")) for _ in range(2)]
        for pool in pools:  # the same history in both
            prefill_packed_static(m, pool, *(torch.tensor(x) for x in pack(old, old_slots)))
        want_p = prefill_packed_static(m, pools[0], *(torch.tensor(x) for x in pack(new, new_slots)))
        want_d = decode_batch_static(
            m,
            pools[0],
            torch.tensor(nxt),
            torch.tensor(old_slots),
            torch.tensor([len(p) for p in old]),
            64,
            torch.arange(64),
        )
        mg = PackedGraphs(Eager(), pools[1], rows=pools[1].n, enabled=True)
        assert mg.fits(17, 2, 3) and not mg.fits(17, 2, 7) and not mg.fits(17, 0, 3)
        got_p, got_d = mg.run(*pack(new, new_slots), nxt, old_slots, [len(p) for p in old])
        for got, want in ((got_p, want_p), (got_d, want_d)):
            assert got.shape == want.shape
            tol = 1e-5 * float(want.abs().max())  # fp32: the same sums over row blocks of another height
            assert float((got - want).abs().max()) <= tol
        for layer in range(a.layers):
            for s in old_slots + new_slots:
                assert torch.allclose(pools[1].k[layer][s], pools[0].k[layer][s], atol=1e-6, rtol=1e-5)
                assert torch.allclose(pools[1].v[layer][s], pools[0].v[layer][s], atol=1e-6, rtol=1e-5)
            assert not pools[1].k[layer][3].any()  # a slot nobody holds stays untouched


@needs_torch
def test_packed_graphs_replay_bookkeeping(tiny_llama, caplog):
    """The graph branch of PackedGraphs on the CPU, through a stand-in for ``GraphDecoder._capture`` (its
    "graph" runs the forward again into the captured output on replay): each instance keeps its graphs, by
    width, and none in the decoder's dict; start-up captures every bucket (prompt-only: those up to a slot's
    capacity; a wider one on first use); replays give the eager forward's logits; a capture that fails
    turns that instance off and drops its graphs."""
    import torch

    from swiftlm.backends.torch.graphs import SlotPool
    from swiftlm.backends.torch.packed_attention import pack
    from swiftlm.backends.torch.prefill_graphs import BUCKETS, PackedGraphs
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    tm = load_model(resolve(str(tiny_llama)), None)
    m, a = tm.module, tm.module.a

    class Replay:
        def __init__(self, fn, ins):
            self.fn, self.ins = fn, ins
            self.out = fn(*ins)

        def replay(self):
            got = self.fn(*self.ins)
            if got is not self.out:
                self.out.copy_(got)

    class Decoder:  # GraphDecoder's fields and capture, graphs "on"
        device, model = torch.device("cpu"), m

        def __init__(self, use_graph=True, fail_after=None):
            self.use_graph, self.fail_after, self.graphs, self.captures = use_graph, fail_after, {}, 0

        def splits_for(self, L, B):
            return 0

        def _capture(self, key, fn, ins):
            if self.captures == self.fail_after:
                raise RuntimeError("capture refused")
            r = Replay(fn, ins)
            entry = (r, ins, r.out)
            if key is not None:
                self.graphs[key] = entry
            self.captures += 1
            return entry

    g = torch.Generator().manual_seed(3)
    old = [torch.randint(0, a.vocab, (n,), generator=g).tolist() for n in (9, 4)]
    new = [torch.randint(0, a.vocab, (n,), generator=g).tolist() for n in (30, 33, 31)]  # 94 tokens: bucket 128
    old_slots, new_slots = [4, 0], [1, 5, 2]
    nxt = torch.randint(0, a.vocab, (2,), generator=g).tolist()
    with torch.inference_mode():
        dec = Decoder()
        pools = [SlotPool(a, 6, 64, torch.float32, torch.device("cpu")) for _ in range(2)]
        pg, mg = PackedGraphs(dec, pools[0], enabled=True), PackedGraphs(dec, pools[0], rows=6, enabled=True)
        pg.precapture()
        mg.precapture()
        assert not dec.graphs and dec.captures == 3 + len(BUCKETS)
        assert set(pg.graphs) == {w for w in BUCKETS if w <= 64} and set(mg.graphs) == set(BUCKETS)
        assert all(mg.graphs[w][2] is mg.out for w in BUCKETS)  # one shared logits buffer
        e_pg = PackedGraphs(Decoder(use_graph=False), pools[1], enabled=True)
        e_mg = PackedGraphs(Decoder(use_graph=False), pools[1], rows=6, enabled=True)
        for prompts, slots in ((old, old_slots), (new, new_slots)):  # precaptured bucket 16; 128 > capacity
            assert pg.fits(sum(map(len, prompts)), len(prompts)) and not pg.fits(sum(map(len, prompts)), 2, 1)
            got, none = pg.run(*pack(prompts, slots))
            want, _ = e_pg.run(*pack(prompts, slots))
            assert torch.equal(got, want) and got.shape[0] == len(prompts) and none.shape[0] == 0
        assert 128 in pg.graphs and not dec.graphs  # captured on first use
        step = (*pack([p[:5] for p in new], new_slots), nxt, old_slots, [len(p) for p in old])
        assert mg.fits(15, 3, 2) and not mg.fits(15, 3, 0)
        for got, want in zip(mg.run(*step), e_mg.run(*step)):
            assert torch.equal(got, want) and got.dtype == torch.float32
        for layer in range(a.layers):
            assert torch.equal(pools[0].k[layer][:6], pools[1].k[layer][:6])

        pg2 = PackedGraphs(Decoder(fail_after=2), pools[0], enabled=True)  # refuses the third bucket (64)
        pg2.precapture()
        assert not pg2.enabled and not pg2.graphs
        assert "capturing the prefill graphs failed; prompt chunks run eagerly" in caplog.text
