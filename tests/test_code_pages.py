"""Static TurboQuant caches whose codes are pages of a shared pool (``code_pages.CodePages``) against the same
caches holding whole-context codes of their own: prompts in two chunks (the first long enough to be compressed,
so the second attends to codes already written, and leaves 20 rows beyond the window), then 13 decode steps one
cache at a time (``run_turbo``) and two at a time (``run_compressed_batch``, the batched kernels); at the 12th
both caches compress a block through ``compress_block`` (the graphed path), and the 13th attends to the codes
that wrote (the longer sequence's codes span two 64-row pages).  The pages are handed out in a shuffled order, so
a sequence's codes are scattered over the pool.  One at a time, the paged caches get their tokens as tensors (what
an overlapped step passes), the others as ints.  Same kernels, same tiles, same order: the logits must be equal
bit for bit.  CPU tensors under TRITON_INTERPRET=1.

The decode steps are nearly all of the time (~1.3 s a step under the interpreter, the four caches of both modes):
the test ran 16 once, three more after the 13th that read the same pages, the last block written among them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import needs_torch
from tiny_fused import TINY_FUSED_MODEL

pytestmark = [
    needs_torch,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
    ),
]

SCRIPT = TINY_FUSED_MODEL + textwrap.dedent("""
    import json, random, sys, torch
    from swiftlm.backends.torch import turbo_batch
    from swiftlm.backends.torch.graphs import GraphDecoder
    from swiftlm.backends.torch.code_pages import CodePages
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.turboquant.presets import parse_turbo
    gd = GraphDecoder(model, torch.device("cpu"))
    # the graphed path's compression (compress_block at fixed shapes) rather than the eager one
    orig = CompressedCache.after_graph_step
    blocks = [0]

    def compress_block(cache, n):
        blocks[0] += 1
        cache.compress_block(torch.tensor([n]))

    CompressedCache.after_graph_step = lambda self, pos, compress=None: orig(
        self, pos, lambda n: compress_block(self, n))
    fmt = parse_turbo(sys.argv[1], window=8)
    pool = CodePages(model.a, fmt, 10, torch.device("cpu"), page_rows=64)
    random.Random(3).shuffle(pool.free)
    free0 = sorted(pool.free)
    starts = [84, 60]
    toks = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()

    def caches(paged):
        out = []
        for s in starts:
            c = CompressedCache(model.a, fmt, torch.float32, torch.device("cpu"), capacity=192,
                                pages=pool if paged else None)
            c.use_triton = c.kc.use_triton = c.vc.use_triton = True
            with torch.inference_mode():
                model(torch.tensor(toks[s:2 * s - 20]), c, 0)            # first chunk: compressed
                model(torch.tensor(toks[2 * s - 20:2 * s]), c, s - 20)   # second: attends to codes
            out.append(c)
        return out

    res = {}
    for mode in ("solo", "batch"):
        logits, counts = {}, {}
        for paged in (False, True):
            cs = caches(paged)
            pos, got = list(starts), []
            with torch.inference_mode():
                for step in range(13):
                    ids = [toks[p] for p in pos]
                    if mode == "batch":
                        got.append(gd.run_compressed_batch(cs, ids, pos))
                    else:
                        # paged: the token as the device tensor an overlapped step hands over
                        ids = [torch.tensor(t) if paged else t for t in ids]
                        got.append(torch.stack([gd.run_turbo(c, t, p) for c, t, p in zip(cs, ids, pos)]))
                    pos = [p + 1 for p in pos]
            logits[paged] = torch.stack(got)
            counts[paged] = [c.counts()[0] for c in cs]
            if paged:
                res[mode + "_pages"] = [[len(c.pages.list), c.counts()[0]] for c in cs]
                res[mode + "_scattered"] = any(c.pages.list != sorted(c.pages.list) or
                                               c.pages.list[-1] - c.pages.list[0] != len(c.pages.list) - 1 for c in cs)
                res[mode + "_bytes"] = [c.pages_bytes() for c in cs]
                for c in cs:
                    c.reset()
                res[mode + "_returned"] = sorted(pool.free) == free0
        res[mode + "_blocks"], blocks[0] = blocks[0], 0
        res[mode + "_equal"] = bool(torch.equal(logits[False], logits[True]))
        res[mode + "_counts"] = [counts[False], counts[True]]
        res[mode + "_finite"] = bool(torch.isfinite(logits[True]).all())
    res["batched_calls"] = turbo_batch.CALLS
    res["page_bytes"] = [pool.page_bytes, CodePages.page_bytes_for(model.a, fmt, 64)]
    print(json.dumps(res))
""")


@pytest.mark.parametrize("preset", ["k4v3", "k3qjl-v3"])
def test_paged_codes_equal_whole_context_codes(preset):
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, preset], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["batched_calls"] > 0, res  # the batched kernels ran
    for mode in ("solo", "batch"):
        assert res[mode + "_finite"], res
        assert res[mode + "_equal"], res
        assert res[mode + "_blocks"] == 4, res  # each cache, paged and not, compressed one block in the graphed path
        assert res[mode + "_counts"][0] == res[mode + "_counts"][1], res
        for pages, n_code in res[mode + "_pages"]:
            assert pages >= 1, res
            assert pages == -(-n_code // 64), res  # pages as the codes need them, no more
        assert res[mode + "_returned"], res  # reset gives every page back
        assert res[mode + "_bytes"] == [p * res["page_bytes"][0] for p, _ in res[mode + "_pages"]], res
    assert any(res[m + "_scattered"] for m in ("solo", "batch")), res  # the pages were not one run
    assert res["page_bytes"][0] == res["page_bytes"][1], res  # the sizing formula is the pool's
