"""The paged / slotted decode attention kernel (cuda_ext/paged_attention.py) against its plain-torch
reference: on CPU tensors under TRITON_INTERPRET=1 (CI), and on a CUDA GPU where one exists.

Like tests/test_cuda_ext.py, the kernels run in a subprocess (the interpreter is chosen when
Triton compiles a function, so it must be set before the module is imported): one subprocess per
device runs every check (``run_checks``) and prints a JSON report; the tests read their part of it.

Tolerances (absolute, against the reference's fp32 softmax over the same stored K/V values):
- float32: 2e-6 * max|v| (the same arithmetic in another order: exp2 of pre-scaled scores, tiled
  online softmax, split merge);
- float16 / bfloat16: eps(dtype) * max|v| + 1e-6.  q, K and V are the same 16-bit values in both,
  and the dot products accumulate in fp32; the kernel rounds the softmax weights p to the 16-bit
  type for the tensor-core p @ V (relative error <= eps/2 each, so <= eps/2 * max|v| on the output)
  and both round the output once (<= eps/2 * |out| <= eps/2 * max|v|).
"""

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
HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- the checks
def _tol(dtype, vmax: float) -> float:
    import torch

    if dtype == torch.float32:
        return 2e-6 * vmax
    return torch.finfo(dtype).eps * vmax + 1e-6


def _make(
    device, dtype, *, B, KVH, rep, D, lens, layout="paged", BS=16, shuffle=True, noncontig=None, q_view=False, seed=0
):
    """Random caches, tables, lengths and q for one check.  layout "paged": a pool of
    [num_blocks, KVH, BS, D] blocks, each sequence owning ceil(max_len / BS) of them (in pool
    order or shuffled); "slot": one block per sequence, [S + 1, KVH, cap, D] with cap = BS, slot
    ids shuffled, padding rows (len 0) on the scratch slot S.  noncontig: "pad" (rows of a wider
    tensor), "bhkd" (storage [num_blocks, BS, KVH, D] viewed as [num_blocks, KVH, BS, D])."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    max_len = max(max(lens), 1)
    if layout == "slot":
        MB, NB = 1, B + 1
    else:
        MB = -(-max_len // BS)
        NB = B * MB + 3  # a few blocks nobody owns
    H = KVH * rep

    def cache():
        if noncontig == "pad":
            full = torch.randn(NB, KVH, BS, D + 24, generator=g).to(dtype)
            return full[..., 3 : 3 + D].to(device)  # strides of the wide tensor, offset storage
        if noncontig == "bhkd":
            return torch.randn(NB, BS, KVH, D, generator=g).to(dtype).to(device).transpose(1, 2)
        return torch.randn(NB, KVH, BS, D, generator=g).to(dtype).to(device)

    kc, vc = cache(), cache()
    if layout == "slot":
        slots = torch.randperm(B, generator=g)
        slots = torch.where(torch.tensor(lens) == 0, torch.full_like(slots, B), slots)
        bt = slots.view(B, 1)
    else:
        ids = torch.randperm(NB, generator=g) if shuffle else torch.arange(NB)
        bt = ids[: B * MB].view(B, MB)
    bt = bt.to(device=device, dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    if q_view:  # q as the head view of a fused [B, (H + 2 KVH) * D] projection row
        q = torch.randn(B, (H + 2 * KVH) * D, generator=g).to(dtype).to(device)[:, : H * D].view(B, H, D)
    else:
        q = torch.randn(B, H, D, generator=g).to(dtype).to(device)
    return q, kc, vc, bt, sl


def _attn_check(device, dtype, *, num_splits=None, block_n=None, use_dot=None, **kw):
    """Kernel vs reference on fresh inputs; ``out`` is a NaN-poisoned strided view of a wider buffer:
    every element of the view must be written, nothing next to it touched."""
    import torch

    from swiftlm.cuda_ext.paged_attention import paged_decode_attention, paged_decode_attention_ref

    q, kc, vc, bt, sl = _make(device, dtype, **kw)
    B, H, D = q.shape
    scale = D**-0.5
    buf = torch.full((B, H, D + 8), float("nan"), dtype=dtype, device=device)
    out = buf[..., :D]
    got = paged_decode_attention(
        q, kc, vc, bt, sl, scale, num_splits=num_splits, out=out, block_n=block_n, use_dot=use_dot
    )
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, scale)
    assert got.data_ptr() == out.data_ptr()
    written = bool(torch.isfinite(out).all())
    untouched = bool(torch.isnan(buf[..., D:]).all())
    zero_rows = bool((out[sl == 0] == 0).all())
    err = float((got.float() - ref.float()).abs().max())
    return dict(
        err=err,
        tol=_tol(dtype, float(vc.float().abs().max())),
        written=written,
        untouched=untouched,
        zero_rows=zero_rows,
    )


def _splits_check(device, *, splits=(1, 2, 3, 5, 8, 16), **kw):
    """fp32: every num_splits gives the one-split result within fp32 rounding."""
    import torch

    from swiftlm.cuda_ext.paged_attention import paged_decode_attention

    q, kc, vc, bt, sl = _make(device, torch.float32, **kw)
    D = q.shape[-1]
    outs = [paged_decode_attention(q, kc, vc, bt, sl, D**-0.5, num_splits=n) for n in splits]
    err = max(float((o - outs[0]).abs().max()) for o in outs[1:])
    return dict(
        err=err,
        tol=2e-6 * float(vc.abs().max()),
        written=all(bool(torch.isfinite(o).all()) for o in outs),
        untouched=True,
        zero_rows=all(bool((o[sl == 0] == 0).all()) for o in outs),
    )


def _write_kv_check(device, layout):
    """write_kv against a per-row loop of plain indexing: bit-exact."""
    import torch

    from swiftlm.cuda_ext.paged_attention import write_kv

    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device="cpu").manual_seed(7)
        B, KVH, D, BS = 5, 2, 64, (16 if layout == "paged" else 40)
        lens = [1, 16, 17, 40, 33]
        q, kc, vc, bt, sl = _make(device, dtype, B=B, KVH=KVH, rep=1, D=D, lens=lens, layout=layout, BS=BS, seed=3)
        pos = (sl - 1).clamp(min=0).to(torch.int64 if layout == "paged" else torch.int32)
        k = torch.randn(B, KVH, D, generator=g).to(device)  # fp32: write_kv converts to the cache dtype
        v = torch.randn(B, KVH, D, generator=g).to(device)
        k2, v2 = kc.clone(), vc.clone()
        write_kv(kc, vc, bt, pos, k, v)
        for b in range(B):
            p = int(pos[b])
            blk = int(bt[b, p // BS])
            k2[blk, :, p % BS] = k[b].to(dtype)
            v2[blk, :, p % BS] = v[b].to(dtype)
        res[str(dtype)] = bool(torch.equal(kc, k2) and torch.equal(vc, v2))
    return res


def _sdpa_check(device):
    """The capturable torch fallback against the reference (fp32)."""
    import torch

    from swiftlm.cuda_ext.paged_attention import paged_decode_attention_ref, paged_decode_attention_sdpa

    q, kc, vc, bt, sl = _make(device, torch.float32, B=4, KVH=2, rep=4, D=64, lens=[1, 48, 0, 30], seed=11)
    a = paged_decode_attention_sdpa(q, kc, vc, bt, sl, 0.125)
    r = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.125)
    return dict(
        err=float((a - r).abs().max()),
        tol=1e-5,
        written=bool(torch.isfinite(a).all()),
        untouched=True,
        zero_rows=bool((a[sl == 0] == 0).all()),
    )


def _graph_check(device):
    """CUDA only: capture one call (fixed B, max_blocks, num_splits), replay it with other tables and
    lengths written into the same input tensors; compare each replay with the reference."""
    import torch

    from swiftlm.cuda_ext.paged_attention import paged_decode_attention, paged_decode_attention_ref

    worst = 0.0
    q, kc, vc, bt, sl = _make(device, torch.bfloat16, B=6, KVH=2, rep=4, D=128, lens=[300, 1, 0, 64, 129, 257])
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            paged_decode_attention(q, kc, vc, bt, sl, 128**-0.5, num_splits=8)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, kc, vc, bt, sl, 128**-0.5, num_splits=8)
    for seed, lens in [(1, [1, 2, 3, 4, 5, 300]), (2, [0, 0, 17, 300, 16, 32]), (3, [299, 300, 1, 0, 100, 200])]:
        q2, kc2, vc2, bt2, sl2 = _make(device, torch.bfloat16, B=6, KVH=2, rep=4, D=128, lens=lens, seed=seed)
        for dst, src in ((q, q2), (kc, kc2), (vc, vc2), (bt, bt2), (sl, sl2)):
            dst.copy_(src)
        graph.replay()
        ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 128**-0.5)
        worst = max(worst, float((out.float() - ref.float()).abs().max()))
    return dict(
        err=worst, tol=_tol(torch.bfloat16, float(vc.float().abs().max())), written=True, untouched=True, zero_rows=True
    )


def _cases():
    import torch

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    mixed = [1, 16, 37, 0, 64, 5]  # length 1, an exact multiple of the block (16, 64), a padding row
    cases = {}
    # dtypes x GQA groups (rep 1 / 2 / 4 / 8) x head_dim 64 / 128, paged blocks of 16, shuffled tables
    for dt in (f32, f16, bf16):
        for rep, D in ((1, 64), (2, 128), (4, 64), (8, 128)):
            cases[f"paged/{str(dt)[6:]}/rep{rep}/D{D}"] = dict(
                dtype=dt, B=6, KVH=2, rep=rep, D=D, lens=mixed, num_splits=3
            )
    # the slot layout: one block = a sequence's whole capacity ([S + 1, KVH, cap, D]); cap 128 is
    # a multiple of the tile (one block id per tile), cap 80 is not (a block id per position)
    for cap in (128, 80):
        for dt in (f32, bf16):
            cases[f"slot/cap{cap}/{str(dt)[6:]}"] = dict(
                dtype=dt, B=5, KVH=2, rep=4, D=64, lens=[1, cap, 0, 33, 64], layout="slot", BS=cap, num_splits=2
            )
    cases["slot/cap128/f16/rep3/D128"] = dict(
        dtype=f16, B=3, KVH=3, rep=3, D=128, lens=[128, 2, 100], layout="slot", BS=128, num_splits=4
    )
    # split counts: 1 (kernel writes out directly), several, more splits than a sequence has tiles
    for ns in (1, 2, 4, 16):
        cases[f"splits{ns}/bf16"] = dict(dtype=bf16, B=4, KVH=2, rep=4, D=64, lens=[200, 1, 0, 129], num_splits=ns)
    cases["splits/default"] = dict(dtype=f16, B=2, KVH=2, rep=2, D=64, lens=[150, 20], num_splits=None)
    # blocks in pool order vs shuffled; a block-size-64 pool (tiles inside one block)
    cases["paged/in-order"] = dict(dtype=f32, B=3, KVH=2, rep=2, D=64, lens=[40, 48, 1], shuffle=False, num_splits=2)
    cases["paged/bs64"] = dict(dtype=bf16, B=3, KVH=2, rep=4, D=64, lens=[130, 64, 0], BS=64, num_splits=2)
    cases["paged/bs16/tile16"] = dict(dtype=f32, B=3, KVH=2, rep=4, D=64, lens=[50, 16, 3], block_n=16, num_splits=2)
    # non-contiguous caches (views) and q
    cases["noncontig/pad/f32"] = dict(
        dtype=f32, B=3, KVH=2, rep=4, D=64, lens=[33, 1, 48], noncontig="pad", num_splits=2
    )
    cases["noncontig/bhkd/bf16"] = dict(
        dtype=bf16, B=3, KVH=2, rep=2, D=128, lens=[33, 0, 48], noncontig="bhkd", num_splits=3
    )
    cases["noncontig/slot-pad/f16"] = dict(
        dtype=f16,
        B=3,
        KVH=2,
        rep=4,
        D=64,
        lens=[64, 7, 0],
        layout="slot",
        BS=64,
        noncontig="pad",
        q_view=True,
        num_splits=2,
    )
    # the broadcast-multiply-sum inner product (use_dot=False; tl.dot is the default) for rep 4 and 1
    cases["path/rep4-bcast/f16"] = dict(
        dtype=f16, B=3, KVH=2, rep=4, D=64, lens=[70, 1, 0], use_dot=False, num_splits=2
    )
    cases["path/rep1-bcast/bf16"] = dict(
        dtype=bf16, B=3, KVH=2, rep=1, D=128, lens=[70, 1, 0], use_dot=False, num_splits=2
    )
    cases["path/rep1-bcast/f32"] = dict(dtype=f32, B=2, KVH=2, rep=1, D=64, lens=[70, 16], use_dot=False, num_splits=1)
    return cases


def run_checks(device: str) -> dict:
    """Every check on ``device``; {name: result dict, or {"error": message}}."""
    import torch

    results: dict = {}

    def run(name, fn, *a, **kw):
        try:
            results[name] = fn(*a, **kw)
        except Exception as exc:  # reported per check, so one failure does not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}

    for i, (name, kw) in enumerate(_cases().items()):
        kw = dict(kw)
        run("attn/" + name, _attn_check, device, kw.pop("dtype"), seed=100 + i, **kw)
    run("splits-equal/paged", _splits_check, device, B=4, KVH=2, rep=4, D=64, lens=[256, 1, 0, 97], seed=5)
    run(
        "splits-equal/slot",
        _splits_check,
        device,
        B=3,
        KVH=2,
        rep=2,
        D=128,
        lens=[200, 0, 65],
        layout="slot",
        BS=200,
        splits=(1, 3, 7),
        seed=6,
    )
    for layout in ("paged", "slot"):
        run(f"write_kv/{layout}", _write_kv_check, device, layout)
    run("sdpa-fallback", _sdpa_check, device)
    if device == "cuda":
        run("cuda-graph", _graph_check, device)
    del torch
    return results


# ----------------------------------------------------------------------------- the tests
_CACHE: dict[str, dict] = {}


def _results(device: str) -> dict:
    if device not in _CACHE:
        env = dict(os.environ)
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        code = (
            f"import json, sys; sys.path.insert(0, {HERE!r}); import test_paged_attention as t; "
            f"print(json.dumps(t.run_checks({device!r})))"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        _CACHE[device] = json.loads(r.stdout.strip().splitlines()[-1])
    return _CACHE[device]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine"),
    ),
]


def _assert_attn(results: dict, prefix: str) -> None:
    picked = {k: v for k, v in results.items() if k.startswith(prefix)}
    assert picked, prefix
    bad = {}
    for name, r in picked.items():
        if "error" in r or not (r["err"] <= r["tol"] and r["written"] and r["untouched"] and r["zero_rows"]):
            bad[name] = r
    assert not bad, bad


@pytest.mark.parametrize("device", DEVICES)
def test_dtypes_gqa_head_dims(device):
    """fp32 / fp16 / bf16 x rep 1, 2, 4, 8 x head_dim 64, 128; paged blocks of 16, shuffled; a batch of
    lengths 1, 16, 37, 0, 64, 5; 3 splits; out (a NaN-poisoned view) fully written, zero padding rows."""
    _assert_attn(_results(device), "attn/paged/")


@pytest.mark.parametrize("device", DEVICES)
def test_slot_layout(device):
    """One block per sequence ([S + 1, KVH, cap, D], shuffled slots, padding rows on the scratch slot)."""
    _assert_attn(_results(device), "attn/slot/")


@pytest.mark.parametrize("device", DEVICES)
def test_split_counts(device):
    res = _results(device)
    _assert_attn(res, "attn/splits")
    _assert_attn(res, "splits-equal/")  # fp32: any split count = one split, within fp32 rounding


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_paths(device):
    """Non-contiguous caches and q, and both inner-product paths (tl.dot / broadcast-sum) for rep 1 and 4."""
    res = _results(device)
    _assert_attn(res, "attn/noncontig/")
    _assert_attn(res, "attn/path/")


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_exact(device):
    res = _results(device)
    for layout in ("paged", "slot"):
        r = res[f"write_kv/{layout}"]
        assert "error" not in r and all(r.values()), (layout, r)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_fallback(device):
    _assert_attn(_results(device), "sdpa-fallback")


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_cuda_graph_capture():
    """The whole call captured once and replayed with new tables / lengths (no host syncs inside)."""
    _assert_attn(_results("cuda"), "cuda-graph")


def test_default_splits():
    from swiftlm.cuda_ext.paged_attention import default_splits

    assert default_splits(32768, 1, 8) == 32  # bs1, long context: fill the GPU
    assert default_splits(1024, 1, 8) == 16
    assert default_splits(64, 1, 8) == 1  # short: one split, no combine launch
    assert default_splits(32768, 128, 8) == 1  # the batch alone fills the GPU
    assert default_splits(4096, 64, 8) == 1
    assert default_splits(4096, 32, 8) == 2
    for args in [(1, 1, 1), (0, 3, 8), (10**6, 1, 1), (5000, 7, 3)]:
        n = default_splits(*args)
        assert 1 <= n <= 64 and n & (n - 1) == 0, (args, n)
