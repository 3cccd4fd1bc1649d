"""The CPU batched decode step's numba attention (backends/torch/cpu_batch_attention.py) against the
torch path it replaces (pad_sequence + masked batched matmuls): same logits within fp32 rounding,
the same new KV rows bit for bit, caches grown across a capacity boundary, and greedy generation of
several concurrent sequences equal to their solo runs."""

from __future__ import annotations

import pytest
from conftest import needs_torch

pytest.importorskip("numba")


def _filled(m, lengths, seed):
    """Per-sequence caches holding ``lengths`` rows of random history (every layer)."""
    import torch

    from swiftlm.backends.torch.kv_cache import SeqCache

    g = torch.Generator().manual_seed(seed)
    a = m.a
    caches = []
    for n in lengths:
        c = SeqCache(a, torch.float32, torch.device("cpu"))
        for layer in range(a.layers):
            k = torch.randn(a.kv_heads, n, a.head_dim, generator=g)
            v = torch.randn(a.kv_heads, n, a.head_dim, generator=g)
            c.update(layer, 0, k, v)
        caches.append(c)
    return caches


def _copy(caches):
    import copy

    out = []
    for c in caches:
        d = copy.copy(c)
        d._k = [t.clone() for t in c._k]
        d._v = [t.clone() for t in c._v]
        out.append(d)
    return out


@needs_torch
def test_numba_batch_attention_equals_the_torch_path(tiny_llama, monkeypatch):
    import torch

    from swiftlm.backends.torch import cpu_batch_attention
    from swiftlm.backends.torch.decode_rows import decode_batch
    from swiftlm.backends.torch.kv_cache import GROW_ROWS
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    m = load_model(resolve(str(tiny_llama)), None).module
    # 1 row, a row at a capacity boundary (its new row needs a grown cache), odd lengths, a long one
    lengths = [1, GROW_ROWS, 37, 300, GROW_ROWS - 1]
    fast = _filled(m, lengths, 0)
    ref = _copy(fast)
    assert cpu_batch_attention.usable(m, fast, type(fast[0]))
    toks = [5, 17, 123, 9, 64]
    with torch.inference_mode():
        for step in range(3):
            pos = [n + step for n in lengths]
            got = decode_batch(m, fast, toks, pos)
            with monkeypatch.context() as mp:
                mp.setattr(cpu_batch_attention, "usable", lambda *a: False)
                want = decode_batch(m, ref, toks, pos)
            # fp32 both ways, summed in another order (the kernel's loops vs batched matmuls over padded
            # rows): rounding of a few hundred terms, far below 1e-4 of the logits' scale
            err, scale = float((got - want).abs().max()), float(want.abs().max())
            assert err <= 1e-4 * scale, (step, err, scale)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            toks = want.argmax(-1).tolist()
            for c, d, p, n0 in zip(fast, ref, pos, lengths):
                assert c.length == d.length == p + 1
                for layer in range(m.a.layers):
                    for mine, theirs in ((c._k[layer], d._k[layer]), (c._v[layer], d._v[layer])):
                        # the history is untouched and the new rows are the ones update() writes: bit for bit
                        # in layer 0 (same tokens), later layers' rows carry the attention's rounding
                        assert mine.shape[1] >= p + 1
                        exact = p + 1 if layer == 0 else n0
                        assert torch.equal(mine[:, :exact], theirs[:, :exact])
                        torch.testing.assert_close(mine[:, : p + 1], theirs[:, : p + 1], rtol=1e-4, atol=1e-5)


@needs_torch
def test_numba_batch_attention_takes_only_plain_fp32_caches(tiny_llama, monkeypatch):
    import torch

    from swiftlm.backends.torch import cpu_batch_attention
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    m = load_model(resolve(str(tiny_llama)), None).module
    plain = _filled(m, [3, 5], 1)
    assert cpu_batch_attention.usable(m, plain, SeqCache)
    half = [SeqCache(m.a, torch.bfloat16, torch.device("cpu"))]
    assert not cpu_batch_attention.usable(m, plain + half, SeqCache)  # a bf16 cache: the torch path
    trimmed = _filled(m, [4], 2)
    trimmed[0]._off = [0] * m.a.layers  # a sliding-window cache
    assert not cpu_batch_attention.usable(m, plain + trimmed, SeqCache)
    monkeypatch.setenv("SWIFTLM_NUMBA", "0")
    assert not cpu_batch_attention.usable(m, plain, SeqCache)
