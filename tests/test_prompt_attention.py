"""Prompt chunks over compressed KV caches (``backends/torch/prompt_attention.py``): the codes decoded once per
chunk and one fused attention call, instead of the blockwise fp32 path of decode rows.

- Exact: the fused call receives the compressed rows decoded as the layout's specification says
  (``swiftlm.turboquant.packing.unpack``: centroid times norm, code times scale plus bias), then the layer's
  16-bit rows, in position order, for every TurboQuant preset without QJL and both ``kv_bits``.
- With fp32 models the output equals softmax attention over the decoded history to fp32 rounding, for every
  preset and both ``kv_bits``, odd head dims, chunks that cross the decode blocks, static caches whose chunk
  overflows the 16-bit buffer.
- Each chunk decodes every compressed row exactly once for keys and once for values (the prompt pass is linear in
  the prefix per chunk), and never goes through the blockwise path.
- bf16 caches (the CUDA dtype) stay within bf16 rounding of the fp32 reference.
- The Triton decoders (``cuda_ext.code_rows``) equal their references and the torch decode, contiguous and
  through code pages, on CPU tensors under ``TRITON_INTERPRET=1``.

The decode rows between chunks run the plain torch path here (numba off): they are not what is tested, and
compiling the numba kernels would take most of the file's time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_kv_compressed import reference_attention, shape  # noqa: E402
from tolerances import fp32_matmul_tol  # noqa: E402

from swiftlm.backends.torch import code_attention, cpu_kernels  # noqa: E402
from swiftlm.backends.torch import prompt_attention as pa  # noqa: E402
from swiftlm.backends.torch.compressed_cache import CompressedCache  # noqa: E402
from swiftlm.backends.torch.kv_quant import TurboCodec  # noqa: E402
from swiftlm.turboquant.packing import unpack  # noqa: E402
from swiftlm.turboquant.presets import affine, parse_turbo  # noqa: E402

CPU = torch.device("cpu")
FORMATS = [
    parse_turbo("k4v3", window=16),
    parse_turbo("k3v2", window=0),
    parse_turbo("k3qjl-v3", window=16),
    parse_turbo("k4v3", window=8, keep_layers=1),
    affine(4, 32),
    affine(8, 64),
]
CHUNKS = (40, 131, 16, 1, 259, 64, 17)  # prompt chunks, a decode row between them (the blockwise path)
SHAPES = [(3, 9, 64), (1, 2, 128), (2, 6, 96), (3, 9, 64), (1, 2, 128), (2, 6, 64)]  # (KV heads, heads, head dim)


@pytest.fixture(autouse=True)
def _torch_decode_rows(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)


def _feed(cache, a, g, chunks, check, qk_scale=(2.0, 3.0)) -> None:
    """Feed random rows in ``chunks`` through every layer, calling ``check`` on each attention output."""
    pos = 0
    for T in chunks:
        q = torch.randn(a.heads, T, a.head_dim, generator=g) * qk_scale[0]
        k = torch.randn(a.kv_heads, T, a.head_dim, generator=g) * qk_scale[1]
        v = torch.randn(a.kv_heads, T, a.head_dim, generator=g)
        for layer in range(a.layers):
            L = cache._write(layer, pos, k.to(cache.dense_dtype), v.to(cache.dense_dtype))
            out = cache._attend(L, q.to(cache.dtype), pos)
            check(cache, layer, q, pos, T, out)
            cache._compress(L)
        pos += T


def _spec_rows(cache, L) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed rows [0, n_code) of ``L`` decoded by the layout's specification (numpy), fp32: TurboQuant
    in the rotated domain (centroid times norm), ``kv_bits`` in natural coordinates (code times scale plus bias)."""
    n, D = L.n_code, cache.a.head_dim

    def codes(planes, bits):
        if bits == 8:  # kv_bits=8: one byte per code
            return planes[0][:, :n].long()
        return torch.from_numpy(unpack([p[:, :n].numpy() for p in planes], bits, D).astype(np.int64))

    if cache.fmt.kind == "turbo":
        k = cache.kc.centroids.float()[codes(L.kp, cache.kc.mse_bits)] * L.kn[:, :n].float().unsqueeze(-1)
        v = cache.vc.centroids.float()[codes(L.vp, cache.vc.mse_bits)] * L.vn[:, :n].float().unsqueeze(-1)
        return k, v
    G = cache.kc.group

    def affine_rows(planes, scale, bias):
        c = codes(planes, cache.kc.bits).float().view(*scale[:, :n].shape, G)
        return (c * scale[:, :n].float().unsqueeze(-1) + bias[:, :n].float().unsqueeze(-1)).flatten(2)

    return affine_rows(L.kp, L.kn, L.ks), affine_rows(L.vp, L.vn, L.vb)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not f.key_qjl], ids=lambda f: f"{f.name}-keep{f.keep_layers}")
def test_fused_call_attends_exactly_the_decoded_cache(fmt, monkeypatch):
    """Every chunk's one attention call: keys and values are the specification's decode of the compressed rows,
    then the 16-bit rows (rotated by the codecs' R for TurboQuant, the query too), bit for bit."""
    calls = []

    def capture(q, keys, values, start, rep, window=0):
        calls.append((q.clone(), keys.clone(), values.clone(), start, rep))
        return orig(q, keys, values, start, rep, window)

    orig = pa.chunk_attention
    monkeypatch.setattr(pa, "chunk_attention", capture)
    monkeypatch.setattr(pa, "DECODE_ROWS", 37)  # the torch decode in blocks, ending anywhere
    a = shape(layers=3, kv_heads=2, heads=4, d=64)  # keep_layers=1: the middle layer compresses
    cache = CompressedCache(a, fmt, torch.float32, CPU)
    seen = []

    def check(cache, layer, q, pos, T, out):
        L = cache.layers[layer]
        if T < pa.PROMPT_ROWS or not L.n_code:
            return
        cq, keys, values, start, rep = calls[-1]
        n = L.n_code
        assert (start, rep, keys.shape[1]) == (pos, 2, pos + T)
        k, v = _spec_rows(cache, L)
        assert torch.equal(keys[:, :n], k) and torch.equal(values[:, :n], v)
        dk, dv = L.dk[:, : L.n_dense].float(), L.dv[:, : L.n_dense].float()
        if fmt.kind == "turbo":
            dk, dv, q = dk @ cache.kc.R.T, dv @ cache.vc.R.T, q @ cache.kc.R.T
        assert torch.equal(keys[:, n:], dk) and torch.equal(values[:, n:], dv) and torch.equal(cq, q)
        seen.append(n)

    _feed(cache, a, torch.Generator().manual_seed(3), (200, 64, 1, 131, 48), check)
    assert len(seen) >= 3 * (3 - 2 * fmt.keep_layers) and seen[-1] > 3 * 37, seen


@pytest.mark.parametrize(
    "fmt,shp",
    [pytest.param(f, s, id=f"{f.name}-keep{f.keep_layers}-{s[0]}x{s[1]}x{s[2]}") for f, s in zip(FORMATS, SHAPES)],
)
def test_prompt_chunks_equal_attention_over_decoded_history(fmt, shp, monkeypatch):
    """fp32: within the rounding of 5 chained reductions of the reference; DECODE_ROWS shrunk so that the codes
    are decoded across many blocks, ending anywhere."""
    kv_heads, heads, d = shp
    monkeypatch.setattr(pa, "DECODE_ROWS", 37)
    a = shape(layers=3, kv_heads=kv_heads, heads=heads, d=d)  # keep_layers=1: the middle layer compresses
    cache = CompressedCache(a, fmt, torch.float32, CPU)
    worst = []

    def check(cache, layer, q, pos, T, out):
        ref = reference_attention(cache, layer, q, pos)
        tol = fp32_matmul_tol(max(pos + T, d), float(ref.abs().max()), 5)
        worst.append(float((out - ref).abs().max()) / tol)
        assert worst[-1] <= 1, (fmt.name, layer, pos, T, worst[-1])

    _feed(cache, a, torch.Generator().manual_seed(d + heads), CHUNKS, check)
    assert cache.layers[1].n_code > 37 * 3  # the codes crossed several decode blocks


def test_static_cache_chunk_larger_than_its_buffer(monkeypatch):
    """A static cache's chunk that overflows its 16-bit buffer is attended from the rows held aside."""
    a = shape(layers=1)
    fmt = parse_turbo("k4v3", window=8)
    cache = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16, capacity=700)

    def check(cache, layer, q, pos, T, out):
        assert cache.layers[0].pending is not None
        ref = reference_attention_pending(cache, q, pos)
        tol = fp32_matmul_tol(max(pos + T, a.head_dim), float(ref.abs().max()), 5)
        assert float((out - ref).abs().max()) <= tol

    _feed(cache, a, torch.Generator().manual_seed(2), (100, 200, 300), check)


def reference_attention_pending(cache, q, start):
    """``reference_attention`` over the static cache's held-aside rows (``_dense``) instead of its buffer."""
    L = cache.layers[0]
    dk, dv = cache._dense(L)
    saved = L.dk, L.dv, L.n_dense
    L.dk, L.dv, L.n_dense = dk, dv, dk.shape[1]
    try:
        return reference_attention(cache, 0, q, start)
    finally:
        L.dk, L.dv, L.n_dense = saved


def test_each_chunk_decodes_every_code_row_once(monkeypatch):
    """A prompt fed in chunks: each chunk decodes the compressed prefix once for keys and once for values (rows
    decoded = 2 x n_code per layer and chunk), never a block per query or position, and the blockwise path is
    not taken by any prompt chunk."""
    decoded = []
    orig = TurboCodec.unit_rows

    def counting(self, planes, s, e):
        decoded.append(e - s)
        return orig(self, planes, s, e)

    def refuse(fmt, kc, vc, L, qg, scale):
        raise AssertionError("a prompt chunk took the blockwise path")

    monkeypatch.setattr(TurboCodec, "unit_rows", counting)
    monkeypatch.setattr(code_attention, "code_blocks", refuse)
    a = shape(layers=1, kv_heads=2, heads=4, d=64)
    cache = CompressedCache(a, parse_turbo("k4v3", window=16), torch.float32, CPU)
    g = torch.Generator().manual_seed(4)
    pos, expect = 0, 0
    for _ in range(12):
        T = 64
        expect += 2 * cache.layers[0].n_code
        cache.update_attend(0, pos, *(torch.randn(h, T, 64, generator=g) for h in (4, 2, 2)))
        pos += T
    assert cache.layers[0].n_code > 600
    assert sum(decoded) == expect


def test_bf16_cache_within_bf16_rounding():
    """A bf16 model's cache (the CUDA dtype): queries, decoded keys and values, the 16-bit rows and the output are
    each rounded once to bf16 (relative error <= 2^-9), four roundings whose score errors the softmax passes on with
    a gain of a few: within 16 * 2^-9 = 2^-5 of the largest output (seen here: up to 5 * 2^-9)."""
    a = shape(layers=1, kv_heads=2, heads=4, d=64)
    g = torch.Generator().manual_seed(5)
    for fmt in (parse_turbo("k4v3", window=16), parse_turbo("k3qjl-v3", window=16), affine(8, 64)):
        cache = CompressedCache(a, fmt, torch.bfloat16, CPU, dense_dtype=torch.bfloat16)
        errs = []

        def check(cache, layer, q, pos, T, out):
            if T < pa.PROMPT_ROWS or not cache.layers[0].n_code:
                return
            ref = reference_attention(cache, layer, q.bfloat16().float(), pos)
            tol = 2**-5 * float(ref.abs().max())
            errs.append(float((out.float() - ref).abs().max()))
            assert errs[-1] <= tol, (fmt.name, pos, T, errs[-1], tol)

        _feed(cache, a, g, (200, 64, 300, 48), check, qk_scale=(1.0, 1.0))
        assert errs, fmt.name


KERNELS = textwrap.dedent("""
    import json, sys, torch
    from swiftlm.cuda_ext.code_rows import selfcheck
    from swiftlm.backends.torch.code_pages import CodePages
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.turboquant.presets import affine, parse_turbo
    from types import SimpleNamespace

    res = {"selfcheck": max(selfcheck("cpu", torch.float32), selfcheck("cpu", torch.float16))}
    a = SimpleNamespace(layers=1, kv_heads=2, heads=4, head_dim=64)
    fmts = {"k4v3": parse_turbo("k4v3", window=16), "k3v2": parse_turbo("k3v2", window=16),
            "k3qjl-v3": parse_turbo("k3qjl-v3", window=16), "kv4": affine(4, 32), "kv8": affine(8, 64)}
    for name, fmt in fmts.items():
        outs = {}
        for mode in ("torch", "kernel", "pages"):
            if mode == "pages" and fmt.kind != "turbo":
                continue
            pages = CodePages(a, fmt, 24, torch.device("cpu"), page_rows=32) if mode == "pages" else None
            if pages is not None:  # scattered pages: the table is read, not a run of rows
                pages.free = pages.free[::-1][::2] + pages.free[::-1][1::2]
            c = CompressedCache(a, fmt, torch.float32, torch.device("cpu"), dense_dtype=torch.float16,
                                capacity=700 if fmt.kind == "turbo" else None, pages=pages)
            c.use_triton = mode != "torch"
            g = torch.Generator().manual_seed(1)
            got, pos = [], 0
            with torch.inference_mode():
                for T in (100, 80, 40):  # codes end inside a 64-row block each time
                    q, k, v = (torch.randn(h, T, 64, generator=g) for h in (4, 2, 2))
                    got.append(c.update_attend(0, pos, q, k, v))
                    pos += T
            outs[mode] = torch.cat(got)
        base = outs["torch"]
        res[name] = {m: [bool(torch.equal(o, base)), float((o - base).abs().max()), float(base.abs().max())]
                     for m, o in outs.items() if m != "torch"}
        if "pages" in outs:
            res[name]["pages_vs_kernel"] = bool(torch.equal(outs["pages"], outs["kernel"]))
    print(json.dumps(res))
""")


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
)
def test_code_rows_kernels_interpreted():
    """The Triton decoders equal their references exactly (fp32 rows: fp32 centroids; fp16 rows: the decode
    kernels' fp16 lookups), and a cache decoding its prompt chunks through them equals the torch decode: bit for
    bit, except QJL keys, whose sign term is added to the decoded key (torch: to the unit vector before the norm
    multiplies it), a different rounding; code pages equal contiguous codes."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res.pop("selfcheck") == 0.0
    for name, modes in res.items():
        if "pages_vs_kernel" in modes:
            assert modes.pop("pages_vs_kernel"), (name, res)
        for mode, (equal, err, scale) in modes.items():
            if name == "k3qjl-v3":  # fp32 rounding of the sign term's two orders (a D-term sum, 4 reductions)
                assert err <= fp32_matmul_tol(600, scale, 4), (name, mode, err)
            else:
                assert equal, (name, mode, err)
