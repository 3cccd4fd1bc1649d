"""The TurboQuant split kernel over *paged* codes (``tq_decode_attention(..., pages=...)``): a sequence's
code rows live in pages of a shared pool, in any order, found through its page table.  The kernel reads
the same tiles in the same order as over the sequence's rows stored contiguously, so the results must be
equal bit for bit: on CPU tensors under TRITON_INTERPRET=1 (CI) and on the GPU where one exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, needs_torch

pytestmark = [
    needs_torch,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
    ),
]

CODE = """
import json, os, torch
from swiftlm.cuda_ext import turboquant_kernels as tk
from swiftlm.cuda_ext.tq_codes import _PLANES
dev = "{device}"
g = torch.Generator().manual_seed(7)
out = []

def pool_of(rows_per_seq, page, n_pages, width, dtype, scale=None):
    '''A pool [KVH, (n_pages + 1) * page, width] of garbage, and per sequence its rows written into pages
    taken in a shuffled order: (pool, tables [B, max pages] int32, contiguous [B] of [KVH, N, width]).'''
    KVH = 2
    total = (n_pages + 1) * page
    mk = (lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)) if dtype is torch.uint8 else \\
        (lambda *s: (torch.rand(*s, generator=g) + 0.5).to(dtype))
    pool = mk(KVH, total, width)
    order = torch.randperm(n_pages, generator=g).tolist()
    tables, seqs, used = [], [], 0
    maxp = max(-(-n // page) for n in rows_per_seq) + 1
    for n in rows_per_seq:
        rows = mk(KVH, n, width)
        np_ = -(-n // page)
        pages = order[used:used + np_]
        used += np_
        for i, p in enumerate(pages):
            k = min(page, n - i * page)
            pool[:, p * page:p * page + k] = rows[:, i * page:i * page + k]
        tables.append(pages + [n_pages] * (maxp - np_))  # unused entries: the scratch page
        seqs.append(rows)
    return pool, torch.tensor(tables, dtype=torch.int32), seqs

for D, Ns, kb, vb, rep, f16, trans, page, qjl in [
        (128, [77, 300], 3, 2, 4, True, 1, 64, False),     # odd lengths, a page boundary inside the second
        (64, [128, 1], 4, 3, 1, True, 0, 128, False),       # exactly two pages; a one-row sequence
        (128, [200, 130], 4, 3, 4, True, 1, 128, False),
        (64, [100, 65], 3, 2, 2, False, 0, 64, True)]:      # fp32 dots, QJL keys
    KVH, B = 2, len(Ns)
    n_pages = sum(-(-n // page) for n in Ns) + 2
    kw = lambda b: [D * w // 8 for w in _PLANES[b] if w]
    state = torch.random.get_rng_state()
    kpl = [pool_of(Ns, page, n_pages, w, torch.uint8) for w in kw(kb)]
    vpl = [pool_of(Ns, page, n_pages, w, torch.uint8) for w in kw(vb)]
    # norms: 2-D [KVH, rows]; the same page order as the planes (one table per sequence serves every tensor)
    def same_pages(width, dtype, like):
        pool = (torch.rand(KVH, (n_pages + 1) * page, width, generator=g) + 0.5).to(dtype) if dtype != torch.uint8 \\
            else torch.randint(0, 256, (KVH, (n_pages + 1) * page, width), generator=g, dtype=torch.uint8)
        seqs = []
        for b, n in enumerate(Ns):
            rows = pool[:, :n].clone() * 0
            for i, p in enumerate(like[b][:-(-n // page)].tolist()):
                k = min(page, n - i * page)
                rows[:, i * page:i * page + k] = pool[:, p * page:p * page + k]
            seqs.append(rows)
        return pool, seqs
    table = kpl[0][1]
    # every tensor must follow the same table: rebuild the other planes on the first one's pages
    def follow(pl):
        pool, _, _ = pl
        seqs = []
        for b, n in enumerate(Ns):
            rows = torch.zeros(KVH, n, pool.shape[2], dtype=pool.dtype)
            for i, p in enumerate(table[b][:-(-n // page)].tolist()):
                k = min(page, n - i * page)
                rows[:, i * page:i * page + k] = pool[:, p * page:p * page + k]
            seqs.append(rows)
        return pool, seqs
    kp = [follow(x) for x in kpl]
    vp = [follow(x) for x in vpl]
    kn_pool, kn_seq = same_pages(1, torch.float16, table)
    vn_pool, vn_seq = same_pages(1, torch.float16, table)
    kn_pool, vn_pool = kn_pool[..., 0], vn_pool[..., 0]
    kn_seq, vn_seq = [x[..., 0] for x in kn_seq], [x[..., 0] for x in vn_seq]
    if qjl:
        ks_pool, ks_seq = same_pages(D // 8, torch.uint8, table)
        kr_pool, kr_seq = same_pages(1, torch.float16, table)
        kr_pool, kr_seq = kr_pool[..., 0], [x[..., 0] for x in kr_seq]
    kc, vc = (torch.sort(torch.randn(2 ** b, generator=g)).values for b in (kb, vb))
    q = torch.randn(B, KVH * rep, D, generator=g) * 0.3
    sq = torch.randn(B, KVH * rep, D, generator=g) * 0.3
    d = lambda t: t.to(dev)
    tk._TUNE.clear(); tk._TUNE.update({{"TRANS": trans}})
    res = dict(case=[D, Ns, kb, vb, rep, f16, trans, page, qjl], exact=[], batch_exact=[], finite=True)
    S = 3
    singles = []
    for b, n in enumerate(Ns):
        qj = (d(sq[b]), d(ks_seq[b]), d(kr_seq[b]), 0.1) if qjl else None
        qjp = (d(sq[b]), d(ks_pool), d(kr_pool), 0.1) if qjl else None
        ref = tk._split_pass(d(q[b]), [d(x[1][b]) for x in kp], d(kn_seq[b]), d(kc), kb, [d(x[1][b]) for x in vp],
                             d(vn_seq[b]), d(vc), vb, None, rep, qj, None, f16, S)
        got = tk._split_pass(d(q[b]), [d(x[0]) for x in kp], d(kn_pool), d(kc), kb, [d(x[0]) for x in vp],
                             d(vn_pool), d(vc), vb, None, rep, qjp, None, f16, S, pages=(d(table[b]), page, n))
        res["exact"].append(all(torch.equal(x, y) for x, y in zip(ref, got)))
        res["finite"] &= bool(torch.isfinite(ref[2]).all())
        # device row count (a CUDA graph's): storage sized for the longest sequence
        n_dev = d(torch.tensor([n], dtype=torch.int32))
        got2 = tk._split_pass(d(q[b]), [d(x[0]) for x in kp], d(kn_pool), d(kc), kb, [d(x[0]) for x in vp],
                              d(vn_pool), d(vc), vb, None, rep, qjp, n_dev, f16, S,
                              pages=(d(table[b]), page, max(Ns)))
        ref2 = tk._split_pass(d(q[b]), [d(x[1][b]) for x in kp], d(kn_seq[b]), d(kc), kb, [d(x[1][b]) for x in vp],
                              d(vn_seq[b]), d(vc), vb, None, rep, qj, n_dev, f16, S)
        res["exact"].append(all(torch.equal(x, y) for x, y in zip(ref2, got2)))
        singles.append(got2)
    if not qjl:
        # several sequences in one launch (the batched graph step): each reads its own table row
        # pool tensors shared (offsets 0); column 8: sequence b's table at b * its row length from sequence 0's
        offs = torch.zeros(B, 9, dtype=torch.int64)
        offs[:, 8] = torch.arange(B) * table.shape[1]
        offs = d(offs)
        n_dev = d(torch.tensor(Ns, dtype=torch.int32))
        got = tk._split_pass(d(q.reshape(B * KVH * rep, D)), [d(x[0]) for x in kp], d(kn_pool), d(kc), kb,
                             [d(x[0]) for x in vp], d(vn_pool), d(vc), vb, None, rep, None, n_dev, f16, S,
                             batch=(offs, KVH), pages=(d(table)[0], page, max(Ns)))
        H = KVH * rep
        for b in range(B):
            res["batch_exact"].append(all(torch.equal(x[b * H:(b + 1) * H], y) for x, y in zip(got, singles[b])))
    out.append(res)
tk._TUNE.clear()
print(json.dumps(out))
"""


def _check(device: str, interpret: bool) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else dict(os.environ)
    r = subprocess.run(
        [sys.executable, "-c", CODE.format(device=device)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(cases) == 4
    for c in cases:
        assert c["finite"], c
        assert c["exact"] and all(c["exact"]), c
        if not c["case"][-1]:  # no QJL: the batched launch too
            assert len(c["batch_exact"]) == len(c["case"][1]) and all(c["batch_exact"]), c


def test_paged_split_pass_equals_contiguous_interpreted():
    _check("cpu", interpret=True)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_paged_split_pass_equals_contiguous_on_gpu():
    _check("cuda", interpret=False)
