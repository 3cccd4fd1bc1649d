"""Several sequences with static compressed caches decoding together (``GraphDecoder.run_compressed_batch``:
the weights read once for all rows, each row's attention by its cache's kernels) against the same
sequences decoding one at a time (``run_turbo``), on CPU tensors under TRITON_INTERPRET=1 in a subprocess
(the flag must be set before triton is imported; the step runs eagerly there, graphed on a GPU).
A TurboQuant k4v3 cache (window 8, so rows are compressed during the run), a k3v2 one and a kv_bits=8
one, at different lengths, decode 12 tokens (crossing compressions).  fp32 both ways: the batched matmuls
differ from the one-row ones by summation order only, so the logits agree within
``transformer_logits_tol`` and the caches hold the same number of compressed rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import needs_torch
from tiny_fused import TINY_FUSED_MODEL
from tolerances import transformer_logits_tol

pytestmark = [
    needs_torch,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
    ),
]

SCRIPT = TINY_FUSED_MODEL + textwrap.dedent("""
    import json, sys, torch
    from swiftlm.backends.torch import turbo_batch
    from swiftlm.backends.torch.graphs import GraphDecoder
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.turboquant.presets import affine, parse_turbo
    gd = GraphDecoder(model, torch.device("cpu"))
    assert gd.fused
    which = sys.argv[1] if len(sys.argv) > 1 else "mixed"
    if which == "mixed":  # each row's own kernels
        fmts = [parse_turbo("k4v3", window=8), parse_turbo("k3v2", window=8), affine(8, 32)]
        starts = [45, 30, 20]
    elif which == "sets":  # three k4v3 caches decoding two at a time, the pair changing every 4 steps
        fmts = [parse_turbo("k4v3", window=8)] * 3
        starts = [45, 30, 38]
    else:  # one TurboQuant format: the batched kernels of turbo_batch.py
        fmts = [parse_turbo(which, window=8)] * 2
        starts = [45, 30]
    steps = 12
    # the rows of each step: every cache in turn, or pairs (0, 1), then (2, 1) (the tables' base, cache 0, not among
    # them), then (1, 0) (the base second)
    sets = [[0, 1]] * 4 + [[2, 1]] * 4 + [[1, 0]] * 4 if which == "sets" else [list(range(len(fmts)))] * steps
    toks = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist()

    def caches():
        out = []
        for f, s in zip(fmts, starts):
            c = CompressedCache(model.a, f, torch.float32, torch.device("cpu"), capacity=128)
            c.use_triton = True
            if f.kind == "turbo":
                c.kc.use_triton = c.vc.use_triton = True
            with torch.inference_mode():
                model(torch.tensor(toks[s:2 * s]), c, 0)
            assert c.graphable()
            out.append(c)
        return out

    batch, solo = caches(), caches()
    worst, scale, argmax = 0.0, 0.0, True
    pos = list(starts)
    with torch.inference_mode():
        for rows in sets:
            ids = [toks[pos[r]] for r in rows]
            at = [pos[r] for r in rows]
            a = gd.run_compressed_batch([batch[r] for r in rows], ids, at)
            b = torch.stack([gd.run_turbo(solo[r], t, p) for r, t, p in zip(rows, ids, at)])
            worst = max(worst, float((a - b).abs().max()))
            scale = max(scale, float(b.abs().max()))
            argmax &= bool((a.argmax(-1) == b.argmax(-1)).all())
            for r in rows:
                pos[r] += 1
    counts = [[c.counts()[0] for c in batch], [c.counts()[0] for c in solo]]
    bases = [st.base is batch[0] for st in gd.set_tables.values()]
    print(json.dumps(dict(err=worst, scale=scale, argmax=argmax, counts=counts, starts=starts, steps=steps,
                          lengths=[c.length for c in batch], want=pos, batched_calls=turbo_batch.CALLS,
                          loads=turbo_batch.LOADS, bases=bases)))
""")


@pytest.mark.parametrize("which", ["mixed", "k3qjl-v3", "sets"])
def test_compressed_batch_equals_solo_steps(which):
    """``mixed``: a k4v3, a k3v2 and a kv_bits=8 cache (each row's own kernels); ``k3qjl-v3``: two caches of one
    format, decoded by the batched kernels (``turbo_batch``: row offsets into the tables' base cache's tensors,
    one launch per kernel for both rows), which must then have run.  ``sets``: the same for three k4v3 caches
    decoding two at a time, the pair changing every 4 steps, through one ``SetTables`` (the step a CUDA graph
    captures once per batch size) addressed from the first pair's first cache, also while that cache is not in
    the pair."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, which], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])

    class A:  # transformer_logits_tol reads our Args' field names
        hidden, heads, head_dim, intermediate, layers, vocab = 128, 4, 32, 256, 2, 512
        moe_intermediate = shared_intermediate = 0

    assert res["lengths"] == res["want"], res
    assert (res["batched_calls"] > 0) == (which != "mixed"), res
    # one SetTables per (format, batch size), based on the first cache; loaded once per change of the pair
    assert res["bases"] == ([] if which == "mixed" else [True]), res
    assert res["loads"] == {"mixed": 0, "sets": 3}.get(which, 1), res
    assert res["counts"][0] == res["counts"][1], res  # the same rows compressed both ways
    assert all(n > 0 for n in res["counts"][0]), res  # and every cache holds compressed rows
    assert res["err"] <= transformer_logits_tol(A(), res["scale"], context=128), res
    assert res["argmax"], res
