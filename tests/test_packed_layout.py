"""The packed-code layout (``swiftlm/turboquant/packing.py``'s docstring is the specification): the numpy
reference follows the written text bit by bit, and each backend's packing available on a CPU equals the
reference exactly.  (torch's ``pack`` / ``TurboCodec`` against the reference: tests/test_kv_compressed.py;
MLX's codec: tests/test_kv_compressed_mlx.py; the Metal kernel checks itself against its MLX reference.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from swiftlm.turboquant.packing import PLANES, pack, unpack
from swiftlm.turboquant.quantizer import TurboQuantProd


def spec_pack(codes: np.ndarray, bits: int) -> list[np.ndarray]:
    """The docstring's sentence as a loop: coordinate i of a plane of width w is bits
    [(i % (8/w)) * w, +w) of byte i // (8/w); planes take the code's bits low first."""
    n, d = codes.shape
    out, shift = [], 0
    for w in PLANES[bits]:
        per = 8 // w
        plane = np.zeros((n, d // per), np.uint8)
        for r in range(n):
            for i in range(d):
                plane[r, i // per] |= ((int(codes[r, i]) >> shift) & ((1 << w) - 1)) << ((i % per) * w)
        out.append(plane)
        shift += w
    return out


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_reference_pack_follows_the_written_layout(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=(6, 64)).astype(np.uint8)
    ref = pack(codes, bits)
    want = spec_pack(codes, bits)
    assert [p.shape for p in ref] == [(6, 64 * w // 8) for w in PLANES[bits]]
    assert all(np.array_equal(a, b) for a, b in zip(ref, want))
    assert np.array_equal(unpack(want, bits, 64), codes)
    assert sum(p.shape[-1] for p in ref) == 64 * bits // 8  # exactly b bits per code


def test_qjl_sign_bits_follow_the_written_layout():
    d = 64
    q = TurboQuantProd(d, 3, 11)
    x = np.random.default_rng(0).standard_normal((20, d))
    enc = q.encode(x)
    u = x / np.linalg.norm(x, axis=-1, keepdims=True)
    mse = q.mse
    r = u - mse.codebook.centroids[unpack(enc.mse.planes, 2, d)] @ mse.rotation.matrix
    bits = (r @ q.S.T >= 0).astype(np.uint8)
    assert np.array_equal(enc.signs, spec_pack(bits, 1)[0])
    assert np.array_equal(enc.residual_norms, np.linalg.norm(r, axis=-1).astype(np.float16))
    assert np.array_equal(enc.mse.norms, np.linalg.norm(x, axis=-1).astype(np.float16))


def test_cpu_kernel_sign_table_reads_the_layout():
    """The CPU kernels' sign table: entry [b, t] is bit t of byte b as ±1 (coordinate 8k + t of sign byte k)."""
    from swiftlm.turboquant.cpu_attention import SIGNS

    for b in range(256):
        assert SIGNS[b].tolist() == [((b >> t) & 1) * 2.0 - 1 for t in range(8)]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mlx_pack_equals_reference(bits):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from swiftlm.backends.mlx.turbo_cache import pack as mlx_pack

    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=(5, 3, 64)).astype(np.uint8)
    ours = mlx_pack(mx.array(codes), bits)
    ref = pack(codes, bits)
    assert len(ours) == len(ref)
    assert all(np.array_equal(np.array(a), b) for a, b in zip(ours, ref))


TRITON_SCRIPT = r"""
import json, sys
import numpy as np, torch
from swiftlm.backends.torch.kv_quant import TurboCodec
from swiftlm.turboquant import TurboQuantMSE
from swiftlm.turboquant.packing import unpack
res = {}
for bits in (2, 3, 4):
    x = np.random.default_rng(bits).standard_normal((64, 128)).astype(np.float32)
    codec = TurboCodec(128, bits, 5, torch.device("cpu"))
    codec.use_triton = True  # cuda_ext.tq_codes.tq_encode, interpreted
    enc = codec.encode(torch.from_numpy(x))
    ref = TurboQuantMSE(128, bits, 5).encode(x.astype(np.float64))
    ours, want = unpack([p.numpy() for p in enc.planes], bits, 128), unpack(ref.planes, bits, 128)
    norm_err = np.abs(enc.norms.numpy().astype(np.float64) / ref.norms.astype(np.float64) - 1).max()
    res[bits] = [float((ours != want).mean()), float(norm_err), [list(p.shape) for p in enc.planes],
                 [list(p.shape) for p in ref.planes]]
print(json.dumps(res))
"""


def test_triton_encode_equals_reference():
    """The fused Triton encode (CUDA's), interpreted on CPU tensors: the reference's planes (float32 rotation
    against float64: a coordinate within rounding of a boundary may take the neighbouring code, nothing
    more) and fp16 norms at most one ulp apart."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for bits, (mismatch, norm_err, shapes, ref_shapes) in res.items():
        assert shapes == ref_shapes, bits
        assert mismatch < 1e-3, (bits, mismatch)
        assert norm_err <= 2**-10, (bits, norm_err)
