"""TurboQuant math: codebooks, rotations, packing, distortion and the prod variant's bias."""

from __future__ import annotations

import math

import numpy as np
import pytest

from swiftlm.turboquant import Rotation, TurboQuantMSE, TurboQuantProd, lloyd_max
from swiftlm.turboquant.packing import pack, unpack

# Lloyd-Max MSE of a unit Gaussian at 1..4 bits (Max 1960): 1 - 2/π, 0.1175, 0.03454, 0.009497
GAUSSIAN = {1: 1 - 2 / math.pi, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _unit(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_limit_codebooks_match_the_classic_values(bits):
    assert lloyd_max(None, bits).vector_mse == pytest.approx(GAUSSIAN[bits], rel=2e-3)
    # the exact density at large d approaches the limit
    assert lloyd_max(4096, bits).vector_mse == pytest.approx(GAUSSIAN[bits], rel=5e-3)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_distortion_on_10000_unit_vectors_matches_the_derived_value(d, bits):
    """Measured mean ||x - x̂||² against d * (Lloyd-Max MSE of the exact coordinate density):
    the design allows 5%; with 10,000 vectors the sampling error is well under 1%, so 2% is
    asserted (fp16 norms add nothing measurable for unit vectors)."""
    x = _unit(10_000, d, seed=d * 10 + bits)
    q = TurboQuantMSE(d, bits, seed=3)
    err = np.sum((q.decode(q.encode(x)) - x) ** 2, axis=1).mean()
    exact = lloyd_max(d, bits).vector_mse
    assert err == pytest.approx(exact, rel=0.02)
    assert exact < GAUSSIAN[bits]  # the bounded density is easier than its Gaussian limit


@pytest.mark.parametrize("d", [64, 128])
def test_prod_inner_products_are_unbiased(d):
    """TurboQuant-prod (2-bit mse + 1-bit QJL): the mean error of <q, x> estimates over 20,000
    random pairs lies within 3.3 standard errors of 0 (a 99.9% interval)."""
    n = 20_000
    x, q = _unit(n, d, 1), _unit(n, d, 2)
    p = TurboQuantProd(d, 3, seed=5)
    err = p.inner(q, p.encode(x)) - np.sum(q * x, axis=1)
    se = err.std(ddof=1) / math.sqrt(n)
    assert abs(err.mean()) < 3.3 * se, (err.mean(), se)
    # the mse-only estimate at the same total bits is biased towards zero (|<q, û>| shrinks)
    m = TurboQuantMSE(d, 2, seed=5)
    mse_est = np.sum(q * m.decode(m.encode(x)), axis=1)
    slope = np.polyfit(np.sum(q * x, axis=1), mse_est, 1)[0]
    assert slope < 0.95


@pytest.mark.parametrize("d", [64, 96, 128])
def test_rotations_are_orthogonal_and_seeded(d):
    r = Rotation(d, 7)
    # float64 throughout: Householder QR and the scaled Hadamard are orthogonal, and the fast
    # transform equals the matmul, to O(d * eps64) ~ 3e-14 (d-term sums), well inside 1e-12
    assert np.allclose(r.matrix @ r.matrix.T, np.eye(d), atol=1e-12)
    x = _unit(4, d, 0)
    assert np.allclose(r.forward(x), x @ r.matrix.T, atol=1e-12)
    assert np.allclose(r.inverse(r.forward(x)), x, atol=1e-12)
    assert np.allclose(Rotation(d, 7).matrix, r.matrix) and not np.allclose(Rotation(d, 8).matrix, r.matrix)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_packing_round_trips_at_exactly_b_bits(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=(5, 128)).astype(np.uint8)
    planes = pack(codes, bits)
    assert sum(p.shape[-1] for p in planes) == 128 * bits // 8
    assert np.array_equal(unpack(planes, bits, 128), codes)


def test_bytes_per_vector_formula():
    # k4v3 at head_dim 128: (64 + 2) + (48 + 2) bytes against 2 * 256 in 16-bit -> 0.227x
    k, v = TurboQuantMSE(128, 4), TurboQuantMSE(128, 3)
    assert (k.bytes_per_vector(), v.bytes_per_vector()) == (66, 50)
    assert (k.bytes_per_vector() + v.bytes_per_vector()) / 512 < 0.30
    # SwiftLM's k3qjl-v3 layout: 3-bit + QJL keys = 4.25 bits/dim, 3-bit values = 3.125 bits/dim
    kq = TurboQuantProd(128, 4)  # 3-bit mse + 1-bit QJL
    assert kq.bytes_per_vector() * 8 / 128 == pytest.approx(4.25)
    assert v.bytes_per_vector() * 8 / 128 == pytest.approx(3.125)
    enc = TurboQuantMSE(128, 3).encode(_unit(10, 128, 0))
    assert enc.nbytes() == 10 * 50


def _softmax_attend(q, K, V, scale):
    s = K @ q * scale
    p = np.exp(s - s.max())
    return (p / p.sum()) @ V


@pytest.mark.parametrize("d,window", [(64, 0), (128, 16), (96, 8)])
def test_attention_over_codes_equals_dequantize_then_attend(d, window):
    """Scoring the rotated query against centroids (and summing values in the rotated domain)
    is the same arithmetic as decoding the history first: equal to float64 rounding."""
    from swiftlm.turboquant.attention import CompressedHead

    rng = np.random.default_rng(d)
    head = CompressedHead(TurboQuantMSE(d, 4, seed=1), TurboQuantMSE(d, 3, seed=2), window=window)
    K, V = rng.standard_normal((300, d)), rng.standard_normal((300, d))
    for a in range(0, 300, 37):  # appended in uneven steps, as decode and prefill chunks do
        head.append(K[a : a + 37], V[a : a + 37])
    assert len(head) == 300 and len(head.recent_k) == window
    q = rng.standard_normal(d)
    Kd, Vd = head.dequantized()
    # float64: the same products in another order (300 rows, d dims): rounding ~1e-14 << 1e-10
    assert np.allclose(head.attend(q), _softmax_attend(q, Kd, Vd, d**-0.5), atol=1e-10)
    # and it approximates exact attention (4-bit keys, 3-bit values; loose: a sanity bound)
    exact = _softmax_attend(q, K, V, d**-0.5)
    assert np.linalg.norm(head.attend(q) - exact) < 0.35 * np.linalg.norm(exact) + 0.05


def test_compressed_head_bytes_follow_the_layout():
    from swiftlm.turboquant.attention import CompressedHead

    head = CompressedHead(TurboQuantMSE(128, 4), TurboQuantMSE(128, 3), window=32)
    head.append(np.ones((1000, 128)), np.ones((1000, 128)))
    assert head.nbytes() == 968 * (66 + 50) + 32 * 2 * 128 * 2
