"""``convert.dequantize_blocks`` (chunks of whole blocks through gguf-py) gives gguf-py's own ``dequantize`` values
bit for bit (random bytes: NaN where a scale's bits are all ones, in the same places), for every block type the
loader meets, at sizes that end mid-chunk and below one chunk."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from swiftlm import convert

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_chunked_dequantize_equals_gguf_py(qtype):
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    for n_blocks in (1, 7, 3 * (convert.DEQUANT_CHUNK // block_bytes) + 5):
        data = rng.integers(0, 256, n_blocks * block_bytes, dtype=np.uint8)
        want = np.asarray(dequantize(data, qtype), dtype=np.float32).ravel()
        got = convert.dequantize_blocks(data, qtype)
        assert got.dtype == np.float32 and got.shape == (n_blocks * block,)
        np.testing.assert_array_equal(got, want, err_msg=f"{qtype.name} x {n_blocks}")
