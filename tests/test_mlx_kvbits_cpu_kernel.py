"""MLX ``kv_bits`` decode through the numba kernel (``backends/mlx/affine_cpu.py``) on the CPU.

The kernel reads mlx-lm's ``QuantizedKVCache`` buffers in place and must give the attention of mlx-lm's own
``quantized_scaled_dot_product_attention`` over the same cache: the same codes, scales and biases, the same
math in fp32, summed in another order and split differently (the kernel: per group, scale * (q . code) +
bias * sum(q), a running softmax over spans and tiles, value codes and biases summed apart; mlx-lm: dequantized
rows in ``quantized_matmul``, a softmax over the whole row).  The bound is ``tolerances.py``'s rounding walk
(two summation orders of K terms whose partial sums stay within M differ by at most lam * eps * sqrt(K) * M):

- a score is a reduction over D coordinates (the kernel: D within groups, then 2 * D / group group terms);
  Ms = the largest partial sum in either decomposition, measured on the cache's own rows (the bias terms
  b * sum(q) dominate: they cancel against the code terms).  A score error d scales every probability by
  e^(+-d), which moves the output by at most d * max_j |v_j - out|;
- the softmax normaliser and the value sum are two reductions of length n whose partial sums (codes times
  scales, and the biases, summed apart in the kernel) stay within Mv = max(|v|, v - b, |b|).
  tol = fp32_matmul_tol(D + 2 D / group, Ms) * max|v - out| + fp32_matmul_tol(n, Mv, 2).

That is 3e-4 to 1.3e-3 at 37 to 1,537 rows (for one row, where nothing is summed over rows, 5e-6 to 1e-5).  A
kernel that drops one of 37 or 257 rows moves the output by 50 to 2,000 times the bound (checked below; at 1,537
rows one row weighs too little for that), a misread code or scale by more at every length, and every routed case
checks that the kernel actually ran.
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("numba", reason="numba not installed: mlx-lm's quantized attention runs instead")

from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_quantized_sdpa  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402
from tolerances import fp32_matmul_tol, transformer_logits_tol  # noqa: E402

from swiftlm.backends.mlx import affine_cpu  # noqa: E402
from swiftlm.backends.mlx.turbo_cache import install_attention_hook  # noqa: E402
from swiftlm.turboquant import cpu_attention  # noqa: E402

D = 64


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    """The kernel serves MLX's CPU device (on a Mac: not the default); the kernel on unless a test says."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    monkeypatch.setenv("SWIFTLM_NUMBA", "1")
    yield
    mx.set_default_device(old)


@pytest.fixture
def spans(monkeypatch):
    """The rows of each kernel call (on this thread: not a background warm-up's)."""
    calls = []
    real = cpu_attention.affine_spans

    def spy(*a, **kw):
        if threading.current_thread() is threading.main_thread():
            calls.append(a[7])
        return real(*a, **kw)

    monkeypatch.setattr(cpu_attention, "affine_spans", spy)
    return calls


def _cache(bits: int, group: int, kvh: int, n: int, seed: int = 0, dtype=mx.float32) -> QuantizedKVCache:
    """n rows written in uneven chunks (the buffers grow in steps of 256 rows, sliced and re-grown)."""
    c = QuantizedKVCache(group_size=group, bits=bits)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, kvh, n, D)).astype(np.float32)).astype(dtype)
    v = mx.array((1.5 * rng.standard_normal((1, kvh, n, D)) + 0.3).astype(np.float32)).astype(dtype)
    s = 0
    for T in [300, 1, 100, 57] * (n // 458 + 1):
        if s >= n:
            break
        c.update_and_fetch(k[:, :, s : s + T], v[:, :, s : s + T])
        s += T
    assert c.offset == n
    return c


def _fp32(x):
    return [a if a.dtype == mx.uint32 else a.astype(mx.float32) for a in x]


def _reference(c: QuantizedKVCache, q: mx.array, scale: float, rows: int | None = None) -> np.ndarray:
    """mlx-lm's quantized attention over the cache's first ``rows`` (default: all) rows, fp32."""
    n = c.offset if rows is None else rows
    kk = _fp32(x[..., :n, :] for x in c.keys)
    vv = _fp32(x[..., :n, :] for x in c.values)
    out = mlx_quantized_sdpa(mx.array(q.astype(mx.float32)), kk, vv, scale, None, c.group_size, c.bits)
    return np.array(out)


def _tol(c: QuantizedKVCache, q: mx.array, scale: float, out: np.ndarray) -> float:
    """The bound of the module doc, from the cache's own dequantized rows and the reference output."""
    n, g, b = c.offset, c.group_size, c.bits
    k = np.array(mx.dequantize(*[x[..., :n, :] for x in c.keys], group_size=g, bits=b).astype(mx.float32))[0]
    v = np.array(mx.dequantize(*[x[..., :n, :] for x in c.values], group_size=g, bits=b).astype(mx.float32))[0]
    kb = np.repeat(np.array(c.keys[2][..., :n, :].astype(mx.float32))[0], g, axis=-1)  # [KVH, n, D]
    vb = np.repeat(np.array(c.values[2][..., :n, :].astype(mx.float32))[0], g, axis=-1)
    KVH = k.shape[0]
    qg = np.array(q.astype(mx.float32)).reshape(KVH, -1, 1, D) * scale  # [KVH, M, 1, D]
    # partial sums of a score: over d of q k (mlx-lm), within each group of q (k - b) and the group terms
    # b * sum(q) (the kernel)
    qk = qg * k[:, None]
    qc = (qg * (k - kb)[:, None]).reshape(KVH, -1, n, D // g, g)
    qb = (qg * kb[:, None]).reshape(KVH, -1, n, D // g, g).sum(-1)
    Ms = max(
        np.abs(np.cumsum(qk, -1)).max(),
        np.abs(np.cumsum(qc, -1)).max(),
        np.abs(qb).max(),
        np.abs(np.cumsum(qc.sum(-1) + qb, -1)).max(),
    )
    spread = np.abs(v[:, None] - out[0].reshape(KVH, -1, 1, D)).max()  # max |v_j - out|
    Mv = max(np.abs(v).max(), (v - vb).max(), np.abs(vb).max())
    return fp32_matmul_tol(D + 2 * (D // g), Ms) * spread + fp32_matmul_tol(n, Mv, 2)


# (bits, group, KV heads, query heads per KV head)
CASES = [(8, 64, 2, 3), (4, 64, 2, 3), (4, 32, 3, 1), (8, 32, 1, 4)]


@pytest.mark.parametrize("bits,group,kvh,rep", CASES)
@pytest.mark.parametrize("n", [1, 37, 257, 1537])  # one row; under a tile; past the cache's 256-row step; 3+ spans
def test_kernel_equals_mlx_lm_quantized_attention(spans, bits, group, kvh, rep, n):
    c = _cache(bits, group, kvh, n, seed=n + bits)
    rng = np.random.default_rng(n)
    q = mx.array(rng.standard_normal((1, kvh * rep, 1, D)).astype(np.float32))
    scale = D**-0.5
    assert affine_cpu.routes(c, q, None)
    got = np.array(affine_cpu.attend(c, q, scale))
    assert spans == [n]
    want = _reference(c, q, scale)
    tol = _tol(c, q, scale, want)
    err = np.abs(got - want).max()
    assert got.shape == want.shape == (1, kvh * rep, 1, D)
    assert err <= tol, (bits, group, n, err, tol)
    if 1 < n <= 257:  # the bound cannot hide a kernel that loses a row
        assert np.abs(_reference(c, q, scale, rows=n - 1) - want).max() > 10 * tol


def test_fp16_cache_converts_scales_and_keeps_the_dtype(spans):
    """A 16-bit model's cache (fp16 scales and biases): fp32 copies of the first n rows go to the kernel and
    the output comes back in fp16; against mlx-lm's attention over the same codes with fp32 scales, the
    fp16 rounding of the output on top of the fp32 bound."""
    c = _cache(4, 64, 2, 257, seed=3, dtype=mx.float16)
    q = mx.array(np.random.default_rng(3).standard_normal((1, 6, 1, D)).astype(np.float32)).astype(mx.float16)
    got = affine_cpu.attend(c, q, D**-0.5)
    assert got.dtype == mx.float16 and spans == [257]
    want = _reference(c, q, D**-0.5)
    tol = _tol(c, q, D**-0.5, want) + float(np.abs(want).max()) * 2.0**-11
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= tol


def test_codes_are_read_in_place():
    """The kernel's code arrays are byte views of the cache's uint32 buffers (a write shows in MLX)."""
    c = _cache(8, 64, 2, 40)
    mx.eval(c.keys[0])
    view = affine_cpu._np(c.keys[0]).view(np.uint8)[0]
    assert view.flags.c_contiguous and view.shape == (2, c.keys[0].shape[2], D)
    old = int(view[0, 0, 1])
    view[0, 0, 1] = old ^ 0xFF
    word = int(c.keys[0][0, 0, 0, 0].item())
    assert (word >> 8) & 0xFF == old ^ 0xFF
    view[0, 0, 1] = old


def test_routes_only_single_decode_rows_on_the_cpu(monkeypatch):
    c = _cache(8, 64, 2, 100)
    q = mx.zeros((1, 6, 1, D))
    assert affine_cpu.routes(c, q, None) and affine_cpu.routes(c, q, "causal")
    assert not affine_cpu.routes(c, mx.zeros((1, 6, 5, D)), "causal")  # prefill / verify chunk
    assert not affine_cpu.routes(c, mx.zeros((2, 6, 1, D)), None)  # two sequences
    assert not affine_cpu.routes(c, q, mx.ones((1, 101), dtype=mx.bool_))  # an explicit mask
    assert not affine_cpu.routes(c, q, None, mx.zeros((6,)))  # attention sinks
    plain = KVCache()
    plain.update_and_fetch(mx.zeros((1, 2, 3, D)), mx.zeros((1, 2, 3, D)))
    assert not affine_cpu.routes(plain, q, None)
    monkeypatch.setenv("SWIFTLM_NUMBA", "0")
    assert not affine_cpu.routes(c, q, None)
    monkeypatch.setenv("SWIFTLM_NUMBA", "1")
    monkeypatch.setattr(cpu_attention, "nb", None)  # numba not installed
    assert not affine_cpu.routes(c, q, None)
    monkeypatch.undo()
    monkeypatch.setenv("SWIFTLM_NUMBA", "1")
    monkeypatch.setattr(affine_cpu.mx, "default_device", lambda: mx.Device(mx.gpu))  # Metal: mlx-lm's path
    assert not affine_cpu.routes(c, q, None)


def _tiny_mlx_lm_model():
    cfg = dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=D,
        intermediate_size=256,
        vocab_size=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    install_attention_hook(model)
    return model, cfg


@pytest.mark.parametrize("bits", [8, 4])
def test_hooked_model_decode_matches_mlx_lm(monkeypatch, spans, bits):
    """Through the model's hooked attention: the prefill chunk keeps mlx-lm's path, every decode step's
    layers go through the kernel, and the logits equal a twin cache's on mlx-lm's path within the
    transformer bound (tolerances.transformer_logits_tol)."""
    model, cfg = _tiny_mlx_lm_model()
    caches = {f: [QuantizedKVCache(group_size=64, bits=bits) for _ in range(2)] for f in ("1", "0")}
    prompt = mx.array([list(range(3, 73))])
    for flag, cache in caches.items():
        monkeypatch.setenv("SWIFTLM_NUMBA", flag)
        mx.eval(model(prompt, cache=cache))
    assert spans == []
    tok = mx.array([[5]])
    for step in range(4):
        out = {}
        for flag, cache in caches.items():
            monkeypatch.setenv("SWIFTLM_NUMBA", flag)
            out[flag] = np.array(model(tok, cache=cache)[0, -1])
        tol = transformer_logits_tol(SimpleNamespace(**cfg), float(np.abs(out["0"]).max()), 71 + step)
        assert np.abs(out["1"] - out["0"]).max() <= tol, (step, np.abs(out["1"] - out["0"]).max(), tol)
        tok = mx.array([[int(out["0"].argmax())]])
    assert spans == [71, 71, 72, 72, 73, 73, 74, 74]  # 2 layers x 4 decode steps


def test_greedy_decode_kv_bits_8_same_tokens(monkeypatch, spans, tiny_llama):
    """End to end through the MLX backend's model (load_model, kv_bits=8 default format, prefill then greedy
    decode): SWIFTLM_NUMBA=1 and =0 give the same tokens, and logits within the transformer bound."""
    from swiftlm.backends.mlx.model import load_model
    from swiftlm.config import Settings
    from swiftlm.registry import resolve
    from swiftlm.turboquant.presets import affine

    cfg = SimpleNamespace(**json.loads((tiny_llama / "config.json").read_text()))
    model = load_model(resolve(str(tiny_llama)), Settings(model=str(tiny_llama)))
    model.kv_default = affine(8, 64)
    prompt = list(range(10, 40))
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SWIFTLM_NUMBA", flag)
        toks, logits = [], []
        x = model.logits(1, prompt, 0)
        for i in range(8):
            logits.append(np.array(x.astype(mx.float32)))
            toks.append(int(np.argmax(logits[-1])))
            x = model.logits(1, [toks[-1]], len(prompt) + i)
        assert isinstance(model.caches[1][0], QuantizedKVCache) and model.caches[1][0].bits == 8
        model.free([1])
        runs[flag] = (toks, logits)
        if flag == "1":
            # the last prompt token is a decode row (logits() feeds a chunk's last token alone)
            assert len(spans) == 9 * cfg.num_hidden_layers and spans[0] == len(prompt)
    assert runs["1"][0] == runs["0"][0]
    for step, (a, b) in enumerate(zip(runs["1"][1], runs["0"][1])):
        tol = transformer_logits_tol(cfg, float(np.abs(b).max()), len(prompt) + step)
        assert np.abs(a - b).max() <= tol, (step, np.abs(a - b).max(), tol)
    assert len(spans) == 9 * cfg.num_hidden_layers  # none with the kernel off


def test_warm_up_compiles_the_signature_decode_uses(monkeypatch):
    """``prepare`` (what the backend calls for a kv_bits cache on the CPU, after installing the hook) warms this
    shape's kernel once, with the argument types the decode step passes: decoding adds no signature."""
    monkeypatch.setattr(cpu_attention, "_WARMED", set())
    cpu_attention.affine_kernel.cache_clear()
    warmed = []
    real = cpu_attention.warm_up_affine
    monkeypatch.setattr(cpu_attention, "warm_up_affine", lambda *a: warmed.append(real(*a)))
    model = SimpleNamespace(
        layers=[0], args=SimpleNamespace(num_attention_heads=6, num_key_value_heads=2), modules=lambda: []
    )
    affine_cpu.prepare(model, D, 4, 64)
    assert len(warmed) == 1 and warmed[0] is not None
    warmed[0].join(120)
    assert real(D, 3, 4, 64) is None  # once per shape
    kernel = cpu_attention.affine_kernel(D, 3, 4, 64, cpu_attention.parallel())
    assert len(kernel.signatures) == 1
    c = _cache(4, 64, 2, 50)
    mx.eval(affine_cpu.attend(c, mx.ones((1, 6, 1, D)), 0.125))
    assert len(kernel.signatures) == 1
