"""A growing (CPU) KV cache holds at most ~1.25x its rows plus one block, and growing keeps every row
(doubling from a fixed start would hold several times the KV of many short streams)."""

import pytest

torch = pytest.importorskip("torch")

from types import SimpleNamespace  # noqa: E402

from swiftlm.backends.torch.kv_cache import GROW_ROWS, SeqCache  # noqa: E402


def _args(ctx: int = 4096) -> SimpleNamespace:  # the fields a SeqCache reads
    return SimpleNamespace(layers=2, kv_heads=1, head_dim=8, ctx=ctx)


@pytest.mark.parametrize("steps", [[1], [40, 1, 1, 1], [300] + [1] * 200, [64, 64, 64, 64, 64], [1000, 1]])
def test_growth_is_bounded_and_keeps_rows(steps):
    a = _args()
    c = SeqCache(a, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    written_k, pos = [], 0
    for n in steps:
        for layer in range(a.layers):
            k = torch.randn(a.kv_heads, n, a.head_dim, generator=g)
            keys, values = c.update(layer, pos, k, -k)
            assert keys.shape[1] == pos + n and torch.equal(values, -keys)
            if layer == 0:
                written_k.append(k)
        pos += n
        bound = -(-(pos + pos // 4) // GROW_ROWS) * GROW_ROWS
        assert pos <= c.capacity <= max(bound, GROW_ROWS), (pos, c.capacity)
    assert torch.equal(c.k[0][:, :pos], torch.cat(written_k, dim=1))


def test_growth_stops_at_the_context():
    a = _args(ctx=200)
    c = SeqCache(a, torch.float32, torch.device("cpu"))
    for layer in range(a.layers):
        c.update(layer, 0, torch.zeros(a.kv_heads, 190, a.head_dim), torch.zeros(a.kv_heads, 190, a.head_dim))
    assert c.capacity == 200
