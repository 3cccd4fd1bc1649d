"""TurboQuant KV cache on MLX: codes equal the numpy reference, attention equals the torch cache's
(itself checked against attention over the decoded history), rollback, storage formula, and the
Metal kernel's self-check / fallback."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from tolerances import fp32_matmul_tol  # noqa: E402

from swiftlm.backends.mlx.turbo_cache import Codec, TurboKVCache  # noqa: E402
from swiftlm.metal_kernels import turboquant as mk  # noqa: E402
from swiftlm.turboquant import TurboQuantMSE  # noqa: E402
from swiftlm.turboquant.presets import parse_turbo, turbo_layout_bytes  # noqa: E402


def make_layers(fmt, n_layers, d):
    kc = Codec(d, fmt.key_code_bits, fmt.seed * 2 + 1, qjl=fmt.key_qjl)
    vc = Codec(d, fmt.value_bits, fmt.seed * 2 + 2)
    return [TurboKVCache(fmt, fmt.layer_compressed(i, n_layers), kc, vc) for i in range(n_layers)]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_match_numpy_reference(bits):
    x = np.random.default_rng(bits).standard_normal((500, 64))
    enc = Codec(64, bits, 5).encode(mx.array(x.astype(np.float32)))
    ref = TurboQuantMSE(64, bits, 5).encode(x)
    from swiftlm.turboquant.packing import unpack

    ours = unpack([np.array(p) for p in enc["planes"]], bits, 64)
    want = unpack(ref.planes, bits, 64)
    # float32 rotation vs float64: a coordinate within ~1e-6 of a decision boundary may round
    # to the neighbouring code; anything beyond that rate is a bug
    assert (ours != want).mean() < 1e-3
    # fp16 norms of a float32 vs a float64 sum: at most one fp16 ulp apart (2^-10 relative)
    assert np.allclose(np.array(enc["norms"]), ref.norms, rtol=2**-10, atol=0)


def _code_mismatches(mc, tc) -> tuple[int, int]:
    """(differing, all) entries of the compressed rows' packed codes, fp16 norms and QJL
    signs/residual norms between the MLX cache ``mc`` and the torch cache ``tc`` (same layout)."""
    L, n = tc.layers[0], tc.layers[0].n_code
    assert mc.n_code == n
    pairs = [("kp", L.kp), ("vp", L.vp), ("kn", [L.kn]), ("vn", [L.vn])]
    if L.ks is not None:
        pairs += [("ks", [L.ks]), ("kr", [L.kr])]
    diff = total = 0
    for name, ours in pairs:
        theirs = mc.codes.get(name) if n else None
        if theirs is None:
            continue
        for a, b in zip(theirs if isinstance(theirs, list) else [theirs], ours):
            a, b = np.array(a)[:, :n], b[:, :n].numpy()
            diff += int((a != b).sum())
            total += a.size
    return diff, total


@pytest.mark.parametrize("name,window", [("k4v3", 16), ("k3qjl-v3", 16), ("k3v2", 0)])
def test_attention_equals_torch_cache(name, window):
    torch = pytest.importorskip("torch")
    from swiftlm.backends.torch.compressed_cache import CompressedCache

    fmt = parse_turbo(name, window=window)
    a = SimpleNamespace(layers=1, kv_heads=2, heads=6, head_dim=64)
    tc = CompressedCache(a, fmt, torch.float32, torch.device("cpu"))
    mc = make_layers(fmt, 1, 64)[0]
    rng = np.random.default_rng(3)
    pos = 0
    flipped = False
    for T in [40, 1, 1, 30, 1, 1, 90, 1]:
        q = rng.standard_normal((6, T, 64)).astype(np.float32)
        k = rng.standard_normal((2, T, 64)).astype(np.float32)
        v = rng.standard_normal((2, T, 64)).astype(np.float32)
        want = tc.update_attend(0, pos, torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)).numpy()
        mc.update_and_fetch(mx.array(k)[None], mx.array(v)[None])
        got = np.array(mc.attend(mx.array(q)[None], 64**-0.5))[0]  # [H, T, D]
        got = got.transpose(1, 0, 2).reshape(T, -1)
        pos += T
        if flipped:
            continue
        # the same codes: the difference is fp32 summation order only (at most 5 chained
        # reductions: query rotation, Q.K^T, softmax sum, P.V, rotation back, over pos rows or d)
        tol = fp32_matmul_tol(max(pos, 64), float(np.abs(want).max()), 5)
        assert np.abs(got - want).max() <= tol, (name, T, np.abs(got - want).max(), tol)
        # codes written by this step (after attending) are read by the next one.  float32
        # rotations in two libraries may put a coordinate within rounding of a decision boundary
        # on either side (CPU-dependent, rare: see test_codes_match_numpy_reference); past such
        # a flip the outputs differ by a centroid step, not by rounding, and are not compared
        # further (the torch cache against attention over its own codes: test_kv_compressed.py)
        n_diff, n_all = _code_mismatches(mc, tc)
        assert n_diff <= 1e-3 * max(n_all, 1), (name, n_diff, n_all)
        flipped = n_diff > 0
    assert (mc.n_code, mc.n_dense) == tc.counts()


def test_trim_equals_feeding_only_accepted_rows():
    fmt = parse_turbo("k4v3", window=8)
    x, y = make_layers(fmt, 1, 64)[0], make_layers(fmt, 1, 64)[0]
    rng = np.random.default_rng(4)
    rows = [mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)) for _ in range(70)]
    q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
    cat = lambda i, j: mx.concatenate(rows[i:j], axis=2)  # noqa: E731
    for c in (x, y):
        c.update_and_fetch(cat(0, 50), cat(0, 50))
        c.attend(mx.zeros((1, 4, 50, 64)), 0.125)
    x.update_and_fetch(cat(50, 55), cat(50, 55))  # a verify block of 5 ...
    x.attend(mx.zeros((1, 4, 5, 64)), 0.125)
    x.trim(3)  # ... 2 accepted
    y.update_and_fetch(cat(50, 52), cat(50, 52))
    y.attend(mx.zeros((1, 4, 2, 64)), 0.125)
    for c in (x, y):
        c.update_and_fetch(cat(52, 53), cat(52, 53))
    assert x.offset == y.offset == 53
    # the same rows held (codes of rows 0-41 from the same call, the rest 16-bit copies) and the
    # same attention call: bit-equal, not merely close
    assert np.array_equal(np.array(x.attend(q, 0.125)), np.array(y.attend(q, 0.125)))


def test_storage_equals_layout_formula():
    fmt = parse_turbo("k4v3")
    layers = make_layers(fmt, 2, 64)
    pos = 0
    for T in [512] * 4 + [1] * 40:
        kv = mx.array(np.random.default_rng(pos).standard_normal((1, 3, T, 64)).astype(np.float16))
        for c in layers:
            c.update_and_fetch(kv, kv)
            c.attend(mx.zeros((1, 9, T, 64), dtype=mx.float16), 0.125)
        pos += T
    n_code, n_dense = layers[0].n_code, layers[0].n_dense
    assert n_code + n_dense == pos and n_code > 0
    f = turbo_layout_bytes(fmt, n_code=n_code, n_dense=n_dense, layers=2, kv_heads=3, head_dim=64)
    assert sum(c.nbytes for c in layers) == f["codes_allocated"] + f["dense_allocated"]


def test_metal_selfcheck_falls_back_when_the_kernel_disagrees(caplog):
    def broken(q, codes, n, kc, vc, sq=None):
        m, l, acc = mk.partials_ref(q, codes, n, kc, vc)
        return m, l, acc * 1.01  # a 1% error in the value sum

    def crashing(*args, **kw):
        raise RuntimeError("no Metal device")

    with caplog.at_level(logging.WARNING):
        assert mk.selfcheck(kernel=broken) is False
        assert "disagrees" in caplog.text
        assert mk.selfcheck(kernel=crashing) is False
        assert "failed to run" in caplog.text
    assert mk.selfcheck(kernel=mk.partials_ref) is True


def test_partials_use_the_reference_when_the_kernel_is_off(monkeypatch):
    monkeypatch.setattr(mk, "_STATE", {"ok": False})
    called = []
    monkeypatch.setattr(mk, "partials_metal", lambda *a, **k: called.append(1))
    fmt = parse_turbo("k4v3", window=0)
    c = make_layers(fmt, 1, 64)[0]
    kv = mx.array(np.random.default_rng(0).standard_normal((1, 2, 64, 64)).astype(np.float32))
    c.update_and_fetch(kv, kv)
    c.attend(mx.zeros((1, 4, 64, 64)), 0.125)
    q = mx.array(np.random.default_rng(1).standard_normal((1, 4, 1, 64)).astype(np.float32))
    c.update_and_fetch(kv[:, :, :1], kv[:, :, :1])
    out = c.attend(q, 0.125)
    mx.eval(out)
    assert not called and c.n_code > 0


@pytest.mark.skipif(not mk.metal_available(), reason="no Metal device on this machine (Apple GPU needed)")
def test_metal_kernel_equals_reference_on_metal():
    assert mk.selfcheck() is True
