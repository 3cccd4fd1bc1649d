"""Compressed KV caches in the torch backend (TurboQuant presets and affine kv_bits).

The cache's attention (query rotated once, scored against centroids from packed codes, values
summed in the rotated domain, 16-bit window exact) must equal plain attention over the history the
codes stand for (each compressed row decoded), to fp32 rounding.  Storage must equal the layout's
byte formula.  Rollback must restore the state that the accepted tokens alone would give."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tolerances import FP64_EPS, fp32_matmul_tol  # noqa: E402

from swiftlm.backends.torch.compressed_cache import CompressedCache  # noqa: E402
from swiftlm.backends.torch.kv_quant import AffineCodec, TurboCodec, pack, unpack  # noqa: E402
from swiftlm.turboquant import TurboQuantMSE, TurboQuantProd  # noqa: E402
from swiftlm.turboquant.packing import pack as np_pack  # noqa: E402
from swiftlm.turboquant.presets import (  # noqa: E402
    KVFormat,
    admitted_format,
    affine,
    parse_turbo,
    turbo_layout_bytes,
)

CPU = torch.device("cpu")


def shape(layers=3, kv_heads=2, heads=4, d=64):
    return SimpleNamespace(layers=layers, kv_heads=kv_heads, heads=heads, head_dim=d)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_pack_matches_numpy_layout(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(5, 7, 64))
    ours = pack(torch.from_numpy(codes), bits)
    ref = np_pack(codes.astype(np.uint8), bits)
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert np.array_equal(a.numpy(), b)
    assert torch.equal(unpack(ours, bits, 64), torch.from_numpy(codes))


@pytest.mark.parametrize(
    "d,bits,qjl", [(64, 4, False), (64, 3, False), (128, 2, False), (96, 3, False), (64, 4, True), (128, 3, True)]
)
def test_torch_codec_equals_numpy_reference(d, bits, qjl):
    """Same rotation, codebook and planes as swiftlm.turboquant (float64 here, so codes are
    identical; norms are fp16 in both)."""
    x = np.random.default_rng(d + bits).standard_normal((200, d))
    codec = TurboCodec(d, bits, 7, CPU, qjl=qjl, dtype=torch.float64)
    enc = codec.encode(torch.from_numpy(x))
    ref = TurboQuantProd(d, bits, 7) if qjl else TurboQuantMSE(d, bits, 7)
    renc = ref.encode(x)
    mse = renc.mse if qjl else renc
    for a, b in zip(enc.planes, mse.planes):
        assert np.array_equal(a.numpy(), b)
    assert np.array_equal(enc.norms.numpy(), mse.norms)
    if qjl:
        assert np.array_equal(enc.signs.numpy(), renc.signs)
        # fp16 residual norms of float64 values summed in two orders: a value within rounding of
        # a half-ulp may round to the neighbouring fp16 number, one ulp = at most 2^-10 relative
        assert np.allclose(
            enc.rnorms.numpy().astype(np.float64), renc.residual_norms.astype(np.float64), rtol=2**-10, atol=0
        )
        # the effective key vector reproduces the unbiased inner-product estimator (up to that
        # one fp16 ulp of the residual norm, which scales the QJL term: 1e-3 > 2^-10)
        q = np.random.default_rng(1).standard_normal(d)
        est = codec.decode(enc).numpy() @ q
        assert np.allclose(est, ref.inner(q, renc), rtol=1e-3, atol=1e-3)
    else:
        # the same codes and fp16 norms, decoded in float64 by torch and numpy (rotation: d-term sums)
        want = ref.decode(renc)
        assert np.abs(codec.decode(enc).numpy() - want).max() <= fp32_matmul_tol(d, np.abs(want).max(), eps=FP64_EPS)


def reference_attention(cache: CompressedCache, layer: int, q: torch.Tensor, start: int) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over the decoded history, causal within [start, start+T)."""
    L = cache.layers[layer]
    a = cache.a
    ks, vs = [], []
    if L.n_code:
        n = L.n_code
        if cache.fmt.kind == "affine":
            ks.append(cache.kc.decode_planes([p[:, :n] for p in L.kp], L.kn[:, :n], L.ks[:, :n]))
            vs.append(cache.vc.decode_planes([p[:, :n] for p in L.vp], L.vn[:, :n], L.vb[:, :n]))
        else:
            from swiftlm.backends.torch.kv_quant import Encoded

            ks.append(
                cache.kc.decode(
                    Encoded(
                        [p[:, :n] for p in L.kp],
                        L.kn[:, :n],
                        L.ks[:, :n] if L.ks is not None else None,
                        L.kr[:, :n] if L.kr is not None else None,
                    )
                )
            )
            vs.append(cache.vc.decode(Encoded([p[:, :n] for p in L.vp], L.vn[:, :n])))
    dk, dv = cache._dense(L)  # the buffer, or the rows held aside / staged
    ks.append(dk.float())
    vs.append(dv.float())
    K, V = torch.cat(ks, 1).float(), torch.cat(vs, 1).float()
    H, T, D = q.shape
    rep = H // a.kv_heads
    K, V = K.repeat_interleave(rep, 0), V.repeat_interleave(rep, 0)
    s = q.float() @ K.transpose(1, 2) * D**-0.5
    S = K.shape[1]
    mask = torch.arange(S)[None, :] <= torch.arange(start, start + T)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ V).transpose(0, 1).reshape(T, H * D)


@pytest.fixture
def reference_hook(monkeypatch):
    """Instrument CompressedCache._attend: compute the reference on exactly the state it attends to
    (the cache compresses rows only after attending)."""
    orig = CompressedCache._attend

    def wrapped(self, L, q, start):
        out = orig(self, L, q, start)
        self.ref_out = reference_attention(self, self.layers.index(L), q, start).to(out.dtype)
        return out

    monkeypatch.setattr(CompressedCache, "_attend", wrapped)


@pytest.mark.parametrize(
    "fmt",
    [
        parse_turbo("k4v3", window=16),
        parse_turbo("k3qjl-v3", window=16),
        parse_turbo("k3v2", window=0),
        parse_turbo("k4v3", window=8, keep_layers=1),
        parse_turbo("k2v4", window=8, threshold=100),
        affine(4, 32),
        affine(8, 64),
    ],
    ids=lambda f: f"{f.name}-w{f.window}-t{f.threshold}-keep{f.keep_layers}",
)
def test_cache_attention_equals_attention_over_decoded_history(fmt, reference_hook):
    a = shape()
    cache = CompressedCache(a, fmt, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    pos = 0
    # prefill chunks, then decode rows: crosses the window, compression blocks and code capacity
    for T in [70, 33, 1, 1, 5] + [1] * 40 + [300, 700, 1]:
        q = torch.randn(a.heads, T, a.head_dim, generator=g)
        k = torch.randn(a.kv_heads, T, a.head_dim, generator=g)
        v = torch.randn(a.kv_heads, T, a.head_dim, generator=g)
        for layer in range(a.layers):
            out = cache.update_attend(layer, pos, q, k, v)
            # fp32 sums in a different order (blockwise online softmax over codes vs one softmax
            # over decoded rows): at most 5 chained reductions (query rotation, Q.K^T, softmax
            # sum, P.V, rotation back) over the pos + T rows or the head dim
            tol = fp32_matmul_tol(max(pos + T, a.head_dim), float(cache.ref_out.abs().max()), 5)
            assert float((out - cache.ref_out).abs().max()) <= tol, (T, layer, float((out - cache.ref_out).abs().max()))
        pos += T
    assert cache.length == pos
    n_code, n_dense = cache.counts()
    if fmt.kind == "turbo":
        assert n_code > 0 and fmt.window <= n_dense < fmt.window + 32
        if fmt.keep_layers:
            assert cache.layers[0].n_code == 0 and cache.layers[0].n_dense == pos
    else:
        assert n_dense == 0 and n_code == pos


def test_rollback_equals_feeding_only_accepted_rows():
    a = shape(layers=2)
    fmt = parse_turbo("k4v3", window=16)
    g = torch.Generator().manual_seed(1)
    rows = [
        (
            torch.randn(a.heads, 1, 64, generator=g),
            torch.randn(a.kv_heads, 1, 64, generator=g),
            torch.randn(a.kv_heads, 1, 64, generator=g),
        )
        for _ in range(90)
    ]
    cat = lambda i, j, n: torch.cat([r[n] for r in rows[i:j]], 1)  # noqa: E731

    def feed(c, i, j, at):
        for layer in range(a.layers):
            out = c.update_attend(layer, at, cat(i, j, 0), cat(i, j, 1), cat(i, j, 2))
        return out

    x = CompressedCache(a, fmt, torch.float32, CPU)
    y = CompressedCache(a, fmt, torch.float32, CPU)
    feed(x, 0, 60, 0)
    feed(y, 0, 60, 0)
    feed(x, 60, 65, 60)  # a verify block of 5 ...
    out_x = feed(x, 62, 63, 62)  # ... of which 2 were accepted: continue at 62
    feed(y, 60, 62, 60)
    out_y = feed(y, 62, 63, 62)
    # the same rows held (the codes of rows 0-43 from the same call, the rest 16-bit copies) and
    # the same attention call: bit-equal, not merely close
    assert torch.equal(out_x, out_y)
    assert x.length == y.length == 63


@pytest.mark.slow
def test_storage_equals_layout_formula_and_8k_ratio():
    """8K positions, SmolLM2's KV heads (3 KV heads, d = 64), 16-bit rows: the tensors the cache holds add up to
    the layout's formula, and k4v3 is <= 0.30x the 16-bit cache.  Three layers, not SmolLM2's 30: every layer
    holds the same rows in the same layout, so the bytes and the ratio scale with the layer count exactly."""
    L = 3
    a = shape(layers=L, kv_heads=3, heads=9, d=64)
    for name in ("k4v3", "k3qjl-v3", "k3v2"):
        fmt = parse_turbo(name)
        c = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16)
        pos = 0
        for T in [512] * 16:
            kv = torch.randn(a.kv_heads, T, 64)
            for layer in range(a.layers):
                c.append(layer, pos, kv, kv)
            pos += T
        n_code, n_dense = c.counts()
        f = turbo_layout_bytes(fmt, n_code=n_code, n_dense=n_dense, layers=L, kv_heads=3, head_dim=64)
        assert c.nbytes() == f["codes_allocated"] + f["dense_allocated"] + f["uncompressed_layers"]
        fp16 = 2 * L * 3 * 64 * 2 * 8192
        if name == "k4v3":
            assert n_dense == fmt.window
            assert c.nbytes() / fp16 <= 0.30


def test_request_format_and_validation():
    from swiftlm.errors import InvalidRequest
    from swiftlm.sampling import SamplingParams

    default = parse_turbo("k4v3", window=64)

    def request_format(params, default):  # parsed once by validate(), completed once at admission
        return admitted_format(params.validate().kv_request, default)

    assert request_format(SamplingParams(), default) == default
    assert SamplingParams().validate().kv_request is None
    assert request_format(SamplingParams(turbo_kv="off"), default) == KVFormat()
    assert request_format(SamplingParams(turbo_kv="k3v2"), default).name == "k3v2"
    assert request_format(SamplingParams(turbo_kv="k3v2"), default).window == 64
    assert request_format(SamplingParams(turbo_kv="k3qjl-v3"), default) == parse_turbo("k3qjl-v3", window=64)
    assert request_format(SamplingParams(kv_bits=8), KVFormat()).kind == "affine"
    assert request_format(SamplingParams(kv_bits=4, kv_group_size=32), default) == affine(4, 32)
    assert request_format(SamplingParams(kv_bits=8, turbo_kv="off"), default) == affine(8, 64)
    for bad, field in [
        ({"kv_bits": 3}, "kv_bits"),
        ({"kv_bits": 16}, "kv_bits"),
        ({"kv_group_size": 48}, "kv_group_size"),
        ({"turbo_kv": "k5v3"}, "turbo_kv"),
        ({"turbo_kv": "q4"}, "turbo_kv"),
        ({"turbo_kv": 4}, "turbo_kv"),
        ({"turbo_kv": "k4v3", "kv_bits": 4}, "kv_bits"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**bad).validate()
        assert e.value.param == field


@pytest.fixture(scope="module")
def turbo_llm():
    from swiftlm import LLM

    llm = LLM(backend="torch", parallel=4, turbo_kv="k4v3", turbo_kv_window=16)
    yield llm
    llm.close()


PROMPTS = [
    "Write a long story about a cat who learns to fly. Once upon a time",
    "The capital of France is Paris. Tell me more about Paris and its long history",
    "List the planets of the solar system in order from the sun, with one fact each:",
]


def test_smollm2_turbo_batched_equals_solo(turbo_llm):
    """Three sequences decoding together (on the CPU each layer's compressed rows of all three in one kernel call,
    cpu_code_batch.py) give the tokens each gets alone; 48 tokens past a 16-token window cross several
    compressions (EOS ignored: two of the prompts end within 12 tokens, before their first)."""
    from swiftlm import SamplingParams
    from swiftlm.backends.torch import cpu_code_batch, cpu_kernels

    p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    calls = cpu_code_batch.CALLS[0]
    together = [o.token_ids for o in turbo_llm.generate(PROMPTS, p)]
    assert cpu_code_batch.CALLS[0] > calls or not cpu_kernels.enabled()
    alone = [turbo_llm.generate([q], p)[0].token_ids for q in PROMPTS]
    assert together == alone
    assert turbo_llm.engine.kv_stats()["default_format"] == "k4v3"


def test_smollm2_prompt_is_compressed_beyond_the_window(turbo_llm):
    """A real prompt through the backend is held in 16 bits while it prefills (staging); its first decode row
    compresses all but the window (+ < one block) into codes, and the cache then holds fewer bytes than 16-bit
    rows (quality: scripts/eval_turboquant_quality.py)."""
    from swiftlm.backends.torch.compressed_cache import StageBudget

    m = turbo_llm.engine.model
    assert m.seqs.stage_budget is None  # --turbo-kv-prompt-memory auto: off on CPUs
    m.seqs.stage_budget = budget = StageBudget()
    try:
        ids = turbo_llm.tokenizer.encode(PROMPTS[0] * 6)
        m.kv_formats[901] = parse_turbo("k4v3", window=16)
        nxt = int(m.logits(901, ids, 0).argmax())
        c = m.caches[901]
        assert c.counts() == (0, len(ids)) and budget.in_use() > 0
        m.logits(901, [nxt], len(ids))
    finally:
        m.seqs.stage_budget = None
    n_code, n_dense = c.counts()
    held = len(ids) + 1
    assert n_code + n_dense == held and n_code >= held - 16 - 31 and 16 <= n_dense < 48
    assert budget.in_use() == 0
    stats = m.kv_stats()
    assert stats["bytes"] < stats["fp16_bytes"]
    m.free([901])


CODE_FORMATS = [
    parse_turbo("k4v3", window=0),
    parse_turbo("k3qjl-v3", window=0),
    parse_turbo("k3v2", window=0),
    parse_turbo("k2v4", window=0),
    parse_turbo("k1v1", window=0),
    parse_turbo("k2qjl-v2", window=0),
    parse_turbo("k1qjl-v3", window=0),
    affine(4, 64),
    affine(8, 64),
    affine(4, 32),
    affine(8, 32),
]


def _code_attention_cases():
    """(format, kv heads, query heads, head dim, compiled): every format at three shapes; the head size 96 (Phi-3's)
    with its numba kernels for one format of each kernel family (the unrolled loops over D are the same code for
    every code width).  The compiled shapes are ones other tests compile too (each shape and format is a numba
    specialisation, ~10 s to compile on a fresh checkout); the fast tier runs the compiled 64-wide shape."""
    slow = pytest.mark.slow
    for fmt in CODE_FORMATS:
        yield pytest.param(fmt, 3, 9, 64, False, marks=slow, id=f"{fmt.name}-3-9-64-plain")
        yield pytest.param(fmt, 1, 2, 128, False, marks=slow, id=f"{fmt.name}-1-2-128-plain")
        yield pytest.param(fmt, 2, 4, 64, True, id=f"{fmt.name}-2-4-64-compiled")
    for name in ("k4v3", "k3qjl-v3", "kv_bits=4/g32"):
        fmt = next(f for f in CODE_FORMATS if f.name == name)
        yield pytest.param(fmt, 2, 6, 96, True, marks=slow, id=f"{fmt.name}-2-6-96-compiled")


@pytest.mark.parametrize("fmt,kv_heads,heads,d,compiled", list(_code_attention_cases()))
def test_code_attention_random_shapes_and_block_boundaries(fmt, kv_heads, heads, d, compiled, monkeypatch):
    """The vectorised path over the codes (one table gather per packed byte, scores of every query
    per block, values summed from the probabilities) equals softmax attention over the decoded rows,
    for random rows, odd lengths and blocks/chunks that end anywhere: DECODE_ROWS and SCORE_BUDGET are
    shrunk so a few hundred rows cross many blocks and chunks, with decode rows (T = 1) and chunks.

    Where numba is installed, decode rows (T = 1) go to its compiled kernel (cpu_kernels.usable) instead of
    this path.  The compiled cases keep that (each format's kernel against the same reference; the head size 96 is
    covered nowhere else); the others set SWIFTLM_NUMBA=0, so their decode rows run the vectorised path with the
    shrunk DECODE_ROWS and SCORE_BUDGET.  The kernels' own checks against float64 at several shapes and row
    counts are tests/test_cpu_kernels.py's."""
    import swiftlm.backends.torch.code_attention as ca

    if not compiled:
        monkeypatch.setenv("SWIFTLM_NUMBA", "0")
    a = shape(layers=1, kv_heads=kv_heads, heads=heads, d=d)
    g = torch.Generator().manual_seed(d * 7 + heads)
    for rows, budget in [(64, 1 << 21), (37, 500), (5, 1 << 21), (2048, 64)]:
        monkeypatch.setattr(ca, "DECODE_ROWS", rows)
        monkeypatch.setattr(ca, "SCORE_BUDGET", budget)
        cache = CompressedCache(a, fmt, torch.float32, CPU)
        pos = 0
        for T in (1, 131, 7, 1, 259, 1):
            q = torch.randn(heads, T, d, generator=g) * 2
            k = torch.randn(kv_heads, T, d, generator=g) * 3
            v = torch.randn(kv_heads, T, d, generator=g)
            L = cache._write(0, pos, k, v)
            out = cache._attend(L, q, pos)
            ref = reference_attention(cache, 0, q, pos)
            tol = fp32_matmul_tol(max(pos + T, d), float(ref.abs().max()), 5)
            err = float((out - ref).abs().max())
            assert err <= tol, (fmt.name, rows, budget, T, pos, err, tol)
            cache._compress(L)
            pos += T
        assert cache.layers[0].n_code > 0


def test_unit_rows_equal_unit_and_signs_equal_unpack():
    """The table gathers decode exactly what ``unit``/``unpack`` decode (same fp32 values, in the
    coordinate order documented for each), for every code width and a row range inside storage."""
    from swiftlm.backends.torch.kv_quant import unpack

    x = torch.randn(2, 300, 64, generator=torch.Generator().manual_seed(3))
    for bits in (1, 2, 3, 4):
        for qjl in (False, True):
            if qjl and bits == 1:
                continue
            c = TurboCodec(64, bits, 5, CPU, qjl=qjl)
            enc = c.encode(x)
            want = c.unit([p[:, 17:250] for p in enc.planes])
            assert torch.equal(c.unit_rows(enc.planes, 17, 250), want)
            if qjl:
                signs = unpack([enc.signs[:, 17:250]], 1, 64).float() * 2 - 1
                got = c.sign_rows(enc.signs, 17, 250)
                order = [8 * k + 4 * h + t for h in (0, 1) for k in range(8) for t in range(4)]
                assert torch.equal(got, signs[..., order]) and torch.equal(c.S_rows, c.S[order])
    for bits in (4, 8):
        for group in (32, 64):
            c = AffineCodec(64, bits, group)
            enc = c.encode(x)
            want = enc.planes[0].float() if bits == 8 else unpack(enc.planes, 4, 64).float()
            got = c.code_rows(enc.planes, 5, 299)
            if c.inverse is not None:
                got = got[..., c.inverse]
            assert torch.equal(got, want[:, 5:299])


def test_static_affine_cache_eager_path_equals_dynamic():
    """A static affine cache (fixed storage for CUDA graphs) fed eagerly, prefill chunks larger than its
    16-bit buffer included, holds the codes of the growing cache bit for bit and attends alike (the same
    calls on the same rows); a threshold is refused (graph steps quantize every row as it arrives)."""
    from swiftlm.turboquant.presets import with_options

    a = shape(layers=2)
    with pytest.raises(ValueError):
        CompressedCache(a, with_options(affine(4, 32), threshold=8), torch.float32, CPU, capacity=64)
    g = torch.Generator().manual_seed(5)
    for fmt in (affine(4, 32), affine(8, 64)):
        st = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16, capacity=300)
        dy = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16)
        pos = 0
        for T in (70, 1, 1, 33, 1, 100):
            q = torch.randn(a.heads, T, a.head_dim, generator=g)
            k, v = (torch.randn(a.kv_heads, T, a.head_dim, generator=g) for _ in range(2))
            for layer in range(a.layers):
                assert torch.equal(st.update_attend(layer, pos, q, k, v), dy.update_attend(layer, pos, q, k, v))
            pos += T
        assert st.counts() == dy.counts() == (pos, 0)
        for L1, L2 in zip(st.layers, dy.layers):
            for x, y in (
                (L1.kp[0], L2.kp[0]),
                (L1.kn, L2.kn),
                (L1.ks, L2.ks),
                (L1.vp[0], L2.vp[0]),
                (L1.vn, L2.vn),
                (L1.vb, L2.vb),
            ):
                assert torch.equal(x[:, :pos], y[:, :pos])


@pytest.mark.parametrize("preset", ["k4v3", "k3qjl-v3"])
def test_compress_block_equals_eager_compress(preset):
    """A static cache stepped as the CUDA-graph decode steps it (the new row written into the 16-bit buffer,
    then ``after_graph_step``): compressing through ``compress_block`` (the fixed-shape, capturable path the
    graph decoder replays) leaves exactly the codes, norms, signs, buffer and counters that the eager
    per-layer ``_compress`` leaves, block after block."""
    a = SimpleNamespace(layers=2, kv_heads=2, heads=4, head_dim=32)
    fmt = parse_turbo(preset, window=8)
    dev = torch.device("cpu")
    caches = [CompressedCache(a, fmt, torch.float32, dev, capacity=256) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    calls = []

    def graphed(n_code):
        calls.append(n_code)
        caches[0].compress_block(torch.tensor([n_code]))

    for pos in range(150):
        k = torch.randn(a.layers, a.kv_heads, a.head_dim, generator=g)
        v = torch.randn(a.layers, a.kv_heads, a.head_dim, generator=g)
        for c in caches:
            for i, L in enumerate(c.layers):
                L.dk[:, L.n_dense] = k[i]
                L.dv[:, L.n_dense] = v[i]
        caches[0].after_graph_step(pos, graphed)
        caches[1].after_graph_step(pos)
    assert len(calls) >= 3 and calls == sorted(calls)  # the block path ran, block after block
    for L0, L1 in zip(caches[0].layers, caches[1].layers):
        assert (L0.n_code, L0.n_dense) == (L1.n_code, L1.n_dense)
        n = L0.n_code
        for t0, t1 in zip(L0.kp + L0.vp + [L0.kn, L0.vn, L0.ks, L0.kr], L1.kp + L1.vp + [L1.kn, L1.vn, L1.ks, L1.kr]):
            if t0 is not None:
                assert torch.equal(t0[:, :n], t1[:, :n])
        assert torch.equal(L0.dk[:, : L0.n_dense], L1.dk[:, : L1.n_dense])
        assert torch.equal(L0.dv[:, : L0.n_dense], L1.dv[:, : L1.n_dense])
