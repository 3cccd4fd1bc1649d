"""MLX TurboQuant decode through the numba kernel (``swiftlm.turboquant.cpu_attention``) on the CPU.

The kernel reads the MLX cache's codes in place (numpy views) and must give the same attention as
the pure-MLX block path (``metal_kernels.turboquant.partials_ref``, ``SWIFTLM_NUMBA=0``): the same
codes and the same math, so the two differ only by fp32 summation order.  Bound: ``fp32_matmul_tol``
over 5 chained reductions (query rotation, Q.K^T, softmax sum, P.V, rotation back) of length at most
max(rows, head dim), as in test_kv_compressed_mlx.py; a wrong kernel (a span dropped, a code misread,
a row off by one) moves the output by ~1e-2 or more, this bound is ~1e-5.

The shapes are those of tests/test_cpu_kernels.py (the same compiled kernels, shared through numba's
disk cache and the specialisation cache)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("numba", reason="numba not installed: the pure-MLX path runs instead")

from tolerances import fp32_matmul_tol  # noqa: E402

from swiftlm.backends.mlx import turbo_cache as tcm  # noqa: E402
from swiftlm.backends.mlx.turbo_cache import Codec, TurboKVCache, attention  # noqa: E402
from swiftlm.metal_kernels import turboquant as mk  # noqa: E402
from swiftlm.turboquant import cpu_attention  # noqa: E402
from swiftlm.turboquant.presets import parse_turbo  # noqa: E402

D = 64


@pytest.fixture(autouse=True)
def on_cpu():
    """The kernel serves MLX's CPU device (on a Mac: not the default)."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


@pytest.fixture
def spans(monkeypatch):
    """Count the kernel's calls."""
    calls = []
    real = cpu_attention.turbo_spans

    def spy(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(cpu_attention, "turbo_spans", spy)
    return calls


def _fresh(name: str, window: int = 0) -> TurboKVCache:
    fmt = parse_turbo(name, window=window)
    kc = Codec(D, fmt.key_code_bits, fmt.seed * 2 + 1, qjl=fmt.key_qjl)
    vc = Codec(D, fmt.value_bits, fmt.seed * 2 + 2)
    return TurboKVCache(fmt, True, kc, vc)


def _cache(name: str, kvh: int, n: int, seed: int = 0):
    """n rows compressed (window 0), then the decode row in 16 bits."""
    c = _fresh(name)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, kvh, n + 1, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, kvh, n + 1, D)).astype(np.float32))
    c.update_and_fetch(k[:, :, :n], v[:, :, :n])
    c._compress()  # all n rows to codes
    c.update_and_fetch(k[:, :, n:], v[:, :, n:])  # the decode row itself, 16-bit
    return c, rng


def _tol(ref: np.ndarray, n: int) -> float:
    return fp32_matmul_tol(max(n, D), float(np.abs(ref).max()), 5)


CASES = [("k4v3", 3, 3), ("k3v2", 2, 1), ("k3qjl-v3", 2, 4)]  # (format, kv heads, query heads per kv head)


@pytest.mark.parametrize("name,kvh,rep", CASES)
@pytest.mark.parametrize("n", [37, 1001])  # below one tile; two spans per KV head, neither a tile multiple
def test_kernel_equals_pure_mlx_path(monkeypatch, spans, name, kvh, rep, n):
    c, rng = _cache(name, kvh, n, seed=n)
    assert (c.n_code, c.n_dense) == (n, 1)
    q = mx.array(rng.standard_normal((1, kvh * rep, 1, D)).astype(np.float32))
    monkeypatch.setenv("SWIFTLM_NUMBA", "1")
    fast = np.array(attention(c, q, D**-0.5))
    assert spans == [n]
    monkeypatch.setenv("SWIFTLM_NUMBA", "0")
    ref = np.array(attention(c, q, D**-0.5))
    assert spans == [n]  # switched off: the pure-MLX path
    err = np.abs(fast - ref).max()
    assert err <= _tol(ref, n), (name, n, err, _tol(ref, n))
    # the partials themselves (m, l exact up to rounding; acc unnormalised, rotated domain)
    qg = q.reshape(kvh, rep, D)
    got = tcm.cpu_partials(c, qg, D**-0.5)
    want = mk.partials_ref(
        (qg @ c.kc.RT) * D**-0.5, c.codes, n, c.kc, c.vc, (qg @ c.kc.S.T) * D**-0.5 if c.kc.qjl else None
    )
    for a, b in zip(got, want):
        a, b = np.array(a), np.array(b)
        assert a.shape == b.shape and np.abs(a - b).max() <= _tol(b, n), (name, n, np.abs(a - b).max())


def test_decode_after_compression(monkeypatch, spans):
    """A prefill chunk (pure-MLX path), then decode steps through the kernel while rows leave the
    window and are compressed between steps: every step equals a twin cache on the pure-MLX path."""
    fast, slow = _fresh("k4v3", window=8), _fresh("k4v3", window=8)
    rng = np.random.default_rng(5)
    codes_seen = set()
    for step, T in enumerate([70] + [1] * 40):
        q = mx.array(rng.standard_normal((1, 9, T, D)).astype(np.float32))
        k = mx.array(rng.standard_normal((1, 3, T, D)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, 3, T, D)).astype(np.float32))
        outs = []
        for c, flag in ((fast, "1"), (slow, "0")):
            monkeypatch.setenv("SWIFTLM_NUMBA", flag)
            c.update_and_fetch(k, v)
            outs.append(np.array(c.attend(q, D**-0.5)))
        codes_seen.add(fast.n_code)
        assert np.abs(outs[0] - outs[1]).max() <= _tol(outs[1], fast.offset), (step, fast.n_code)
    assert len(codes_seen) >= 2 and fast.n_code == slow.n_code  # compressed again mid-decode
    assert len(spans) == 40 and spans[0] == 62 and spans[-1] > 62  # every decode step, none for the prefill


def test_falls_back_when_numba_is_off_or_absent(monkeypatch, spans):
    c, rng = _cache("k4v3", 3, 100)
    q = mx.array(rng.standard_normal((1, 9, 1, D)).astype(np.float32))
    monkeypatch.setenv("SWIFTLM_NUMBA", "0")
    assert not tcm.cpu_kernel_usable(c, 3)
    mx.eval(attention(c, q, 0.125))
    monkeypatch.setenv("SWIFTLM_NUMBA", "1")
    monkeypatch.setattr(cpu_attention, "nb", None)  # numba not installed
    assert not tcm.cpu_kernel_usable(c, 3)
    mx.eval(attention(c, q, 0.125))
    assert spans == []


def test_prefill_chunks_and_the_gpu_keep_the_mlx_path(monkeypatch, spans):
    c, rng = _cache("k4v3", 3, 100)
    monkeypatch.setenv("SWIFTLM_NUMBA", "1")
    assert tcm.cpu_kernel_usable(c, 3) and not tcm.cpu_kernel_usable(c, 64)
    k = mx.array(rng.standard_normal((1, 3, 4, D)).astype(np.float32))
    c.update_and_fetch(k, k)
    mx.eval(attention(c, mx.zeros((1, 9, 5, D)), 0.125))  # a 5-row verify/prefill chunk
    assert spans == []
    monkeypatch.setattr(tcm.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not tcm.cpu_kernel_usable(c, 3)


def test_codes_are_read_in_place():
    """np.asarray of an evaluated MLX CPU array is a view of its buffer: the kernel reads the cache's
    codes without copying them (a write through the view shows in the MLX array)."""
    c, _ = _cache("k3v2", 2, 40)
    plane = c.codes["kp"][0]
    mx.eval(plane)
    view = tcm._np(plane)
    assert view.flags.c_contiguous and view.shape == tuple(plane.shape)
    old = int(view[0, 0, 0])
    view[0, 0, 0] = old ^ 0xFF
    assert int(plane[0, 0, 0].item()) == old ^ 0xFF
    view[0, 0, 0] = old


def test_kernel_module_imports_neither_mlx_nor_torch():
    import subprocess
    import sys

    code = (
        "import sys, swiftlm.turboquant.cpu_attention; "
        "bad = [m for m in ('mlx', 'mlx.core', 'torch') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_warm_up_compiles_the_signature_decode_uses(monkeypatch):
    """make_turbo_cache warms the kernel of the model's shape up once (numpy arguments of the types
    the MLX glue passes): the first decode step then adds no second compiled signature."""
    from types import SimpleNamespace

    monkeypatch.setattr(cpu_attention, "_WARMED", set())
    cpu_attention.turbo_kernel.cache_clear()
    warmed = []
    real = cpu_attention.warm_up_turbo
    monkeypatch.setattr(cpu_attention, "warm_up_turbo", lambda *a: warmed.append(real(*a)))
    model = SimpleNamespace(layers=[0, 1], args=SimpleNamespace(num_attention_heads=8, num_key_value_heads=2))
    tcm.make_turbo_cache(model, parse_turbo("k3qjl-v3"), D)
    assert len(warmed) == 1 and warmed[0] is not None
    warmed[0].join(120)
    c, rng = _cache("k3qjl-v3", 2, 50)
    key = (D, 4, c.kc.mse_bits, c.vc.mse_bits, True)  # 8 query heads over 2 KV heads
    assert cpu_attention._WARMED == {key} and real(*key) is None  # once per shape
    kernel = cpu_attention.turbo_kernel(*key, cpu_attention.parallel())
    assert len(kernel.signatures) == 1
    mx.eval(attention(c, mx.array(rng.standard_normal((1, 8, 1, D)).astype(np.float32)), 0.125))
    assert len(kernel.signatures) == 1
