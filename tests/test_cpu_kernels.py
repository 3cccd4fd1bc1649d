"""The numba kernels for compressed-KV decode attention on CPU (backends/torch/cpu_kernels.py).

Each case fills a compressed cache, then attends one decode row three ways: the numba kernel, the
torch block path (SWIFTLM_NUMBA=0) and a float64 reference over the cache's own decoded rows.  Both
fp32 paths differ from the reference only by accumulation order and rounding, so the kernel must be
as close to float64 as the torch path is (within 4x, or 1e-5 of the output's scale, whichever is
larger: fp32 sums of up to ~4K terms drift ~sqrt(n) * 6e-8 relative)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba", reason="numba (torch extra) not installed: the torch path runs instead")

from swiftlm.backends.torch import cpu_kernels  # noqa: E402
from swiftlm.backends.torch.compressed_cache import CompressedCache  # noqa: E402
from swiftlm.backends.torch.kv_quant import Encoded  # noqa: E402
from swiftlm.turboquant.presets import affine, parse_turbo  # noqa: E402


def _filled(fmt, n: int, kvh: int, d: int, seed: int = 0, dense: int = 1):
    a = SimpleNamespace(layers=1, kv_heads=kvh, heads=kvh, head_dim=d)
    cache = CompressedCache(a, fmt, torch.float32, torch.device("cpu"), dense_dtype=torch.float16)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kvh, n + dense, d, generator=g)
    v = torch.randn(kvh, n + dense, d, generator=g)
    with torch.inference_mode():  # n compressed rows, then ``dense`` rows (the decode row last) in 16 bits
        L = cache.layers[0]
        cache._store(L, cache.kc.encode(k[:, :n]), cache.vc.encode(v[:, :n]), 0, n)
        L.n_code = n
        for i in range(n, n + dense):
            cache._write(0, i, k[:, i : i + 1], v[:, i : i + 1])
    cache.length = n + dense
    return cache, cache.layers[0]


def _reference(cache, L, q):
    """float64 attention over the cache's decoded compressed rows and its 16-bit rows."""
    n = L.n_code
    if cache.fmt.kind == "turbo":
        keys = cache.kc.decode(
            Encoded(
                [p[:, :n] for p in L.kp],
                L.kn[:, :n],
                L.ks[:, :n] if L.ks is not None else None,
                L.kr[:, :n] if L.kr is not None else None,
            )
        )
        vals = cache.vc.decode(Encoded([p[:, :n] for p in L.vp], L.vn[:, :n]))
    else:
        keys = cache.kc.decode_planes([p[:, :n] for p in L.kp], L.kn[:, :n], L.ks[:, :n])
        vals = cache.vc.decode_planes([p[:, :n] for p in L.vp], L.vn[:, :n], L.vb[:, :n])
    dk, dv = cache._dense(L)
    keys = torch.cat([keys.double(), dk.double()], 1)
    vals = torch.cat([vals.double(), dv.double()], 1)
    H, _, D = q.shape
    kvh = keys.shape[0]
    qg = q.double().reshape(kvh, H // kvh, D)
    p = torch.softmax(qg @ keys.transpose(1, 2) / math.sqrt(D), -1)
    return (p @ vals).reshape(H, D)


CASES = [
    # (format, kv heads, query heads per kv head, head dim)
    (parse_turbo("k4v3"), 3, 3, 64),
    (parse_turbo("k3v2"), 2, 1, 64),
    (parse_turbo("k3qjl-v3"), 2, 4, 64),
    (parse_turbo("k2v4"), 1, 2, 128),
    (parse_turbo("k1v1"), 1, 1, 64),
    (affine(8, 64), 3, 3, 64),
    (affine(4, 32), 2, 4, 128),
]


@pytest.mark.parametrize("fmt,kvh,rep,d", CASES, ids=lambda c: getattr(c, "name", None))
@pytest.mark.parametrize("n,dense", [(1, 1), (37, 1), (1000, 1), (3001, 1), (1000, 40)])
def test_kernel_matches_float64_as_well_as_the_torch_path(monkeypatch, fmt, kvh, rep, d, n, dense):
    """The kernel's partials and the 16-bit rows (the decode row alone, or 40 rows not yet compressed) merged
    by ``merge_kernel`` (``code_rows`` with one row)."""
    cache, L = _filled(fmt, n, kvh, d, seed=n, dense=dense)
    assert L.n_code == n and L.n_dense == dense
    q = torch.randn(kvh * rep, 1, d, generator=torch.Generator().manual_seed(n + 1))
    assert cpu_kernels.usable(cache, L, rep)
    with torch.inference_mode():
        monkeypatch.setenv("SWIFTLM_NUMBA", "0")
        assert not cpu_kernels.usable(cache, L, rep)
        plain = cache._attend(L, q, n + dense - 1)
        monkeypatch.setenv("SWIFTLM_NUMBA", "1")
        fast = cache._attend(L, q, n + dense - 1)
    ref = _reference(cache, L, q)
    err_fast = (fast.double().reshape(ref.shape) - ref).abs().max().item()
    err_plain = (plain.double().reshape(ref.shape) - ref).abs().max().item()
    assert err_fast <= max(4 * err_plain, 1e-5 * ref.abs().max().item()), (err_fast, err_plain)


def test_splits_cover_the_rows_and_use_every_thread():
    import numba

    threads = numba.get_num_threads()
    assert cpu_kernels.splits(100, 3) == 1  # short: one task per KV head
    s = cpu_kernels.splits(100_000, 1)
    assert s * 1 >= threads and math.ceil(100_000 / s) >= cpu_kernels.MIN_SPAN


def test_prefill_chunks_keep_the_torch_path():
    cache, L = _filled(parse_turbo("k4v3"), 600, 1, 64)
    assert cpu_kernels.usable(cache, L, 4)
    assert not cpu_kernels.usable(cache, L, 64)  # a prefill chunk's queries: matmul work


def test_warm_up_compiles_the_default_formats_kernel():
    """The server's default compressed format is compiled at load (a background thread), so the first
    request finds it in the specialisation cache."""
    a = SimpleNamespace(kv_heads=2, heads=6, head_dim=64)
    fmt = parse_turbo("k3v2")
    cpu_kernels.turbo_kernel.cache_clear()
    t = cpu_kernels.warm_up(a, fmt, CompressedCache)
    t.join(120)
    assert not t.is_alive()
    assert cpu_kernels.turbo_kernel.cache_info().currsize == 1  # built by the warm-up: (64, 3, 3, 2, False, par)
    cpu_kernels.turbo_kernel(64, 3, 3, 2, False, cpu_kernels.parallel())
    assert cpu_kernels.turbo_kernel.cache_info().hits == 1


def test_torch_path_buffers_work_inside_and_outside_inference_mode(monkeypatch):
    """The torch path's reused scratch buffers (kv_quant.workspace), first made under inference_mode,
    still take writes outside it (they are normal tensors)."""
    import threading

    monkeypatch.setenv("SWIFTLM_NUMBA", "0")
    out = {}

    def run():  # a fresh thread: fresh thread-local buffers
        cache, L = _filled(parse_turbo("k4v3"), 300, 1, 64)
        q = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            a = cache._attend(L, q, 300)
        b = cache._attend(L, q, 300)
        out["diff"] = float((a - b).abs().max())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["diff"] == 0.0


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (4, 32), (8, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_affine_encode_writes_the_bytes_of_the_torch_codec(bits, group, dtype):
    """``affine_encode`` (a kv_bits cache's compression on the CPU, ``cpu_kernels.encode_into``) does
    ``AffineCodec.encode``'s fp32 arithmetic (IEEE: compiled without fastmath; fp16 rounding by the hardware
    conversion, round to nearest even like torch's), so it writes the same bytes: codes, fp16 scales and biases.
    Also for constant groups (scale 1) and spreads below fp16's range (scale 0: codes from inf / nan)."""
    import numpy as np

    from swiftlm.backends.torch.kv_quant import AffineCodec
    from swiftlm.turboquant.cpu_affine import affine_encode

    codec = AffineCodec(64, bits, group)
    g = torch.Generator().manual_seed(bits * group)
    for spread in (1e-7, 1e-3, 1.0, 300.0):
        x = (torch.randn(3, 9, 64, generator=g) * spread).to(dtype)
        x[:, 0] = x[:, 0, :1]  # a row of constant groups
        e = codec.encode(x)
        at, cap = 5, 20
        kp = np.full((3, cap, 64 * bits // 8), 7, np.uint8)
        sb = np.full((2, 3, cap, 64 // group), 7, np.uint16)
        rows = x.numpy().view(np.uint16) if dtype == torch.float16 else x.numpy()
        affine_encode(rows, kp, sb[0], sb[1], at, bits, group)
        assert np.array_equal(kp[:, at : at + 9], e.planes[0].numpy()), spread
        assert np.array_equal(sb[0, :, at : at + 9], e.norms.numpy().view(np.uint16)), spread
        assert np.array_equal(sb[1, :, at : at + 9], e.signs.numpy().view(np.uint16)), spread
        assert (kp[:, :at] == 7).all() and (kp[:, at + 9 :] == 7).all() and (sb[:, :, :at] == 7).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_affine_kernel_reads_fp16_sides_as_their_fp32_values(bits):
    """Scales and biases handed over as fp16 bits (the torch cache's storage, no fp32 copy) give the partials of the
    same values as fp32 arrays (MLX's): the conversion is exact and the arithmetic the same, but each argument type
    is its own compiled kernel, and fastmath (reassoc, contract) lets LLVM order and fuse its sums differently in
    each: the fp32 bound for two summation orders of 3 chained reductions (D-term scores, n-row softmax sums,
    the value sums), at the largest value compared (seen: ~1e-5 at 74 on a fresh clone; equal bits elsewhere)."""
    import numpy as np
    from tolerances import fp32_matmul_tol

    from swiftlm.turboquant.cpu_attention import affine_spans

    rng = np.random.default_rng(bits)
    kvh, m, d, n = 2, 3, 64, 1500
    kp, vp = (rng.integers(0, 256, (kvh, n + 8, d * bits // 8), dtype=np.uint8) for _ in range(2))
    sides = [(rng.standard_normal((kvh, n + 8, 1)) * 0.05).astype(np.float16) for _ in range(4)]
    q = (rng.standard_normal((kvh, m, d)) * 0.3).astype(np.float32)
    half = affine_spans(
        q, kp, *(s.view(np.uint16) for s in sides[:2]), vp, *(s.view(np.uint16) for s in sides[2:]), n, bits, 64
    )
    full = affine_spans(
        q, kp, *(s.astype(np.float32) for s in sides[:2]), vp, *(s.astype(np.float32) for s in sides[2:]), n, bits, 64
    )
    for a, b in zip(half, full):
        assert a.shape == b.shape and np.isfinite(a).all()
        tol = fp32_matmul_tol(max(n, d), float(np.abs(b).max()), 3)
        assert float(np.abs(a - b).max()) <= tol, (float(np.abs(a - b).max()), tol)


@pytest.mark.parametrize("bits", [8, 4])
def test_affine_decode_steps_store_what_the_torch_codec_stores(monkeypatch, bits):
    """Decode steps of a kv_bits cache (each compresses its own row, every layer): the compiled encoder
    (``encode_into``) leaves the storage, the byte count and the outputs of the torch codec's path."""
    a = SimpleNamespace(layers=2, kv_heads=2, heads=4, head_dim=64)
    g = torch.Generator().manual_seed(bits)
    prompt_q, prompt = torch.randn(4, 20, 64, generator=g), torch.randn(2, 20, 64, generator=g)
    steps = [[torch.randn(h, 1, 64, generator=g) for h in (4, 2, 2)] for _ in range(40)]

    def run(fast: bool):
        if not fast:
            monkeypatch.setattr(cpu_kernels, "encode_into", lambda *args: False)
        cache = CompressedCache(a, affine(bits, 64), torch.float32, torch.device("cpu"), dense_dtype=torch.float16)
        outs = []
        with torch.inference_mode():
            for layer in range(2):
                cache.update_attend(layer, 0, prompt_q, prompt, prompt)
            for i, (q, k, v) in enumerate(steps):
                outs += [cache.update_attend(layer, 20 + i, q, k, v) for layer in range(2)]
        monkeypatch.undo()
        return cache, outs

    fast, out_fast = run(True)
    plain, out_plain = run(False)
    assert fast.counts() == plain.counts() == (60, 0)
    assert fast.nbytes() == plain.nbytes()
    for Lf, Lp in zip(fast.layers, plain.layers):
        for name in ("kn", "ks", "vn", "vb"):
            assert torch.equal(getattr(Lf, name)[:, :60], getattr(Lp, name)[:, :60]), name
        assert torch.equal(Lf.kp[0][:, :60], Lp.kp[0][:, :60]) and torch.equal(Lf.vp[0][:, :60], Lp.vp[0][:, :60])
    for x, y in zip(out_fast, out_plain):
        assert torch.equal(x, y)


def test_vectorised_exp_is_within_fp32_rounding_of_exp():
    """The kernels' exponential (``_exp_tile``: range reduction, a degree-6 polynomial, exponent bits) against
    float64 exp over the softmax's whole input range.  Relative error below 3e-7 from -20 to 0 (the terms that
    count next to the tile's max, e^0 = 1: the polynomial's truncation, 1.2e-7, plus fp32 rounding of its Horner
    steps), below 5e-7 down to -87 (k ln 2 is rounded in fp32 when fastmath fuses the two halves of ln 2, and
    grows with |k|: ~1e-7 more at k = -125); 0 < e^x < 2e-38 below -87, where it clamps."""
    from swiftlm.turboquant import cpu_attention as ca

    x = np.concatenate([np.linspace(-87, 0, 100_003), -np.logspace(-8, 0, 1001), [0.0, -1e-30]]).astype(np.float32)
    y = x.copy()
    E = np.zeros(len(x), np.int32)
    ca._exp_tile(y, len(y), E, E.view(np.float32))
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(y - ref) / ref
    near = x >= -20
    assert rel[near].max() < 3e-7, (float(rel[near].max()), float(x[near][rel[near].argmax()]))
    assert rel.max() < 5e-7, (float(rel.max()), float(x[rel.argmax()]))
    low = np.array([-87.5, -100.0, -1e4, -np.inf], np.float32)
    E = np.zeros(len(low), np.int32)
    ca._exp_tile(low, len(low), E, E.view(np.float32))
    assert np.all(low > 0) and np.all(low < 2e-38), low
