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
    assert np.allclose(np.array(enc["norms"]), ref.norms, rtol=1e-3)


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
    for T in [40, 1, 1, 30, 1, 1, 90, 1]:
        q = rng.standard_normal((6, T, 64)).astype(np.float32)
        k = rng.standard_normal((2, T, 64)).astype(np.float32)
        v = rng.standard_normal((2, T, 64)).astype(np.float32)
        want = tc.update_attend(0, pos, torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)).numpy()
        mc.update_and_fetch(mx.array(k)[None], mx.array(v)[None])
        got = np.array(mc.attend(mx.array(q)[None], 64 ** -0.5))[0]          # [H, T, D]
        got = got.transpose(1, 0, 2).reshape(T, -1)
        # the same codes up to rare boundary flips (float32 rotations in two libraries)
        assert np.allclose(got, want, atol=2e-3), (name, T, np.abs(got - want).max())
        pos += T
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
    x.trim(3)                                     # ... 2 accepted
    y.update_and_fetch(cat(50, 52), cat(50, 52))
    y.attend(mx.zeros((1, 4, 2, 64)), 0.125)
    for c in (x, y):
        c.update_and_fetch(cat(52, 53), cat(52, 53))
    assert x.offset == y.offset == 53
    assert np.allclose(np.array(x.attend(q, 0.125)), np.array(y.attend(q, 0.125)), atol=1e-6)


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
