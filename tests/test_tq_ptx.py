"""The TurboQuant lookups' inline PTX (``cuda_ext/tq_codes.py``), executed instruction by instruction by an
emulator of PTX's integer semantics (``tests/ptx_emu.py``) on this CPU: every code in every lane position
must come out as its codebook's fp16 centroid, bit for bit.  (The kernels that embed these blocks are checked
against the torch reference on a GPU by tests/test_cuda_ext.py.)"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(__file__))
import ptx_emu  # noqa: E402

from swiftlm.cuda_ext import tq_codes  # noqa: E402
from swiftlm.turboquant.codebook import lloyd_max, scaled  # noqa: E402


def _codebooks(bits: int) -> list[torch.Tensor]:
    """The codebooks the caches use (Lloyd-Max at head dims 64 and 128, the scaled Gaussian limit)."""
    return [
        torch.tensor(lloyd_max(64, bits).centroids),
        torch.tensor(lloyd_max(128, bits).centroids),
        torch.tensor(scaled(lloyd_max(None, bits), 128).centroids),
    ]


def _f16_bits(c: torch.Tensor) -> np.ndarray:
    return c.float().half().view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random 32-bit words plus, for every nibble position, each of the 16 values (the rest random)."""
    w = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    extra = []
    for t in range(8):
        for v in range(16):
            base = int(rng.integers(0, 2**32))
            extra.append((base & ~(0xF << 4 * t) | v << 4 * t) & 0xFFFFFFFF)
    return np.concatenate([w, np.array(extra, dtype=np.uint32)])


@pytest.mark.parametrize("cb", range(3))
def test_prmt_asm4s_looks_up_every_code(cb):
    c = _codebooks(4)[cb]
    assert tq_codes.symmetric_fp16(c)
    table = _f16_bits(c)
    w = _words(np.random.default_rng(cb), 2000)
    outs = ptx_emu.run(tq_codes.prmt_asm4s(c), {8: w}, 8)
    for t in range(8):
        np.testing.assert_array_equal(outs[t], table[(w >> np.uint32(4 * t)) & np.uint32(15)], err_msg=f"code {t}")


def test_symmetry_check_and_what_breaks_without_it():
    c = _codebooks(4)[1]
    skew = c.clone()
    skew[12] *= 1.01  # no longer -c[3] in fp16
    assert not tq_codes.symmetric_fp16(skew)
    # the symmetric lookup would return -c[3] for code 12: the check is what keeps it off such codebooks
    w = np.full(4, 0xCCCCCCCC, dtype=np.uint32)
    got = ptx_emu.run(tq_codes.prmt_asm4s(skew), {8: w}, 8)[0]
    assert got[0] != _f16_bits(skew)[12] and got[0] == _f16_bits(-skew[3:4])[0]


@pytest.mark.parametrize("cb", range(3))
def test_prmt_asm_4bit_bytes(cb):
    """``prmt_asm`` (any 16-entry codebook): four bytes in, low nibbles' centroids in $0/$1, high in $2/$3."""
    c = _codebooks(4)[cb]
    g = torch.Generator().manual_seed(cb)
    c = torch.sort(torch.randn(16, generator=g)).values if cb == 2 else c  # also a non-symmetric one
    table = _f16_bits(c)
    w = _words(np.random.default_rng(10 + cb), 2000)
    o = ptx_emu.run(tq_codes.prmt_asm(c), {4: w}, 4)
    for k in range(4):  # byte k: element k of the lo / hi outputs, two fp16 per register
        reg = k // 2
        sh = np.uint32(16 * (k % 2))
        byte = (w >> np.uint32(8 * k)) & np.uint32(0xFF)
        np.testing.assert_array_equal((o[reg] >> sh) & np.uint32(0xFFFF), table[byte & np.uint32(15)])
        np.testing.assert_array_equal((o[2 + reg] >> sh) & np.uint32(0xFFFF), table[byte >> np.uint32(4)])


@pytest.mark.parametrize("bits", [2, 3])
def test_prmt_asm16_and_asm3(bits):
    """2- and 3-bit codes: sixteen from a 32-bit word of the 2-bit plane and 16 bits of the 1-bit plane
    (``prmt_asm16``, the high half of the 1-bit word garbage: a sign-extended int16), and four given as
    selector nibbles (``prmt_asm3``, the byte path)."""
    for c in _codebooks(bits) + [torch.sort(torch.randn(2**bits, generator=torch.Generator().manual_seed(1))).values]:
        table = _f16_bits(c)
        rng = np.random.default_rng(bits)
        n = 3000
        codes = rng.integers(0, 2**bits, size=(n, 16)).astype(np.uint32)
        w = np.zeros(n, dtype=np.uint32)
        h = rng.integers(0, 2**16, size=n, dtype=np.uint64).astype(np.uint32) << np.uint32(16)
        for t in range(16):
            w |= (codes[:, t] & np.uint32(3)) << np.uint32(2 * t)
            h |= (codes[:, t] >> np.uint32(2)) << np.uint32(t)
        outs = ptx_emu.run(tq_codes.prmt_asm16(c, bits - 2), {16: w, 17: h}, 16)
        for t in range(16):
            np.testing.assert_array_equal(outs[t], table[codes[:, t]], err_msg=f"code {t}")
        sel = np.zeros(n, dtype=np.uint32)
        for t in range(4):
            sel |= codes[:, t] << np.uint32(4 * t)
        o0, o1 = ptx_emu.run(tq_codes.prmt_asm3(c), {2: sel}, 2)
        for t, (reg, sh) in enumerate([(o0, 0), (o0, 16), (o1, 0), (o1, 16)]):
            np.testing.assert_array_equal((reg >> np.uint32(sh)) & np.uint32(0xFFFF), table[codes[:, t]])


def _ttgir_tq():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "ttgir_tq.py")
    spec = importlib.util.spec_from_file_location("ttgir_tq", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "preset,trans,page", [("k4v3", 1, 0), ("k3v2", 1, 0), ("k4v3", 0, 0), ("k4v3", 1, 256), ("k3v2", 0, 256)]
)
def test_split_kernel_compiles_for_sm90(preset, trans, page):
    """The CUDA path of the split kernel -- the word lookups' inline PTX included -- compiled for an H100 here
    (Triton lowers it and ptxas assembles it; no GPU needed): a PTX syntax error or a kernel that does not lower
    fails on this CPU instead of on the GPU machine.  ``page``: over paged codes (code_pages.py)."""
    k = _ttgir_tq().compile_split(preset, trans, page=page)
    assert len(k.asm["cubin"]) > 0
    ptx = k.asm["ptx"]
    # the lookups went in as inline asm: the 8-entry tables' immediates and the byte permutes are in the PTX
    assert ptx.count("prmt.b32") >= 8 and "lop3.b32" in ptx
    assert ("wgmma" in ptx) or ("mma.sync" in ptx)
