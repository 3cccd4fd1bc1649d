"""Attention of a prompt chunk after earlier positions (chunked prefill): causal within the chunk, full to the
past, grouped-query heads.  Checked against a float64 softmax written out here, on CPU and (where present) CUDA,
where it runs through SDPA's flash kernel with a lower-right causal bias."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from swiftlm.backends.torch.model import chunk_attention  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
    ),
]


def _reference(q, k, v, start):
    H, T, D = q.shape
    KVH, S, _ = k.shape
    k = k.double().repeat_interleave(H // KVH, 0)
    v = v.double().repeat_interleave(H // KVH, 0)
    scores = q.double() @ k.transpose(1, 2) / D**0.5  # [H, T, S]
    qpos = torch.arange(start, start + T).view(T, 1)
    kpos = torch.arange(S).view(1, S)
    scores = scores.masked_fill((kpos > qpos).to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ v).unsqueeze(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start,T", [(5, 3), (64, 64), (300, 17), (1000, 128)])
def test_chunk_attention_matches_a_float64_softmax(device, start, T):
    g = torch.Generator().manual_seed(start + T)
    H, KVH, D = 8, 2, 64
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(H, T, D, generator=g).to(device, dtype)
    k = torch.randn(KVH, start + T, D, generator=g).to(device, dtype)
    v = torch.randn(KVH, start + T, D, generator=g).to(device, dtype)
    out = chunk_attention(q, k, v, start, H // KVH)
    ref = _reference(q, k, v, start)
    assert out.shape == (1, H, T, D)
    # fp32 on CPU: summation-order rounding only; bf16 on CUDA: the inputs' own rounding (8 bits of mantissa)
    # through a softmax-weighted average of unit-variance values, |out| <= ~4
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max().item() <= tol
    # the first query row sees exactly start + 1 keys: changing a later key must not change it
    k2 = k.clone()
    k2[:, start + 1 :] += 1.0
    if T > 1:
        out2 = chunk_attention(q, k2, v, start, H // KVH)
        assert torch.equal(out2[0, :, 0], out[0, :, 0])
        assert not torch.equal(out2[0, :, -1], out[0, :, -1])
