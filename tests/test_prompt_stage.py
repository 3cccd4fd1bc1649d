"""A prompt held in 16 bits while it prefills (``CompressedCache`` with a ``StageBudget``), compressed when it ends.

- The codes after the prompt's end equal the codes of a cache that compressed chunk by chunk (the same rows encoded:
  encoding is row by row), and the 16-bit window holds the same rows, for TurboQuant with and without QJL and both
  ``kv_bits``; static caches (the CUDA layout: a fixed buffer) too.
- While staged, a chunk attends the exact 16-bit rows: its output equals softmax attention over them.
- The first decode row after the prompt reads codes plus window: its output equals the output of the cache that
  compressed chunk by chunk.
- The budget: a chunk that would pass it compresses what is held and goes on the compressed way; the budget is
  released when the prompt settles, and when a sequence ends staged.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_kv_compressed import reference_attention, shape  # noqa: E402
from tolerances import fp32_matmul_tol  # noqa: E402

from swiftlm.backends.torch import cpu_kernels  # noqa: E402
from swiftlm.backends.torch.compressed_cache import CompressedCache, StageBudget  # noqa: E402
from swiftlm.turboquant.presets import affine, parse_turbo  # noqa: E402

CPU = torch.device("cpu")
FORMATS = [parse_turbo("k4v3", window=16), parse_turbo("k3qjl-v3", window=8), affine(4, 32), affine(8, 64)]
CHUNKS = (64, 131, 40)


@pytest.fixture(autouse=True)
def _torch_decode_rows(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)  # numba compilation is not what is tested


def _rows(a, g, T):
    q = torch.randn(a.heads, T, a.head_dim, generator=g) * 2.0
    k = torch.randn(a.kv_heads, T, a.head_dim, generator=g) * 3.0
    v = torch.randn(a.kv_heads, T, a.head_dim, generator=g)
    return q, k.half(), v.half()


def _state(cache):
    out = []
    for L in cache.layers:
        n = L.n_code
        codes = [p[:, :n] for p in (L.kp or []) + (L.vp or [])]
        codes += [t[:, :n] for t in (L.kn, L.vn, L.ks, L.kr, L.vb) if t is not None]
        dk, dv = cache._dense(L)
        out.append((n, L.n_dense, codes, dk.clone(), dv.clone()))
    return out


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_staged_prompt_settles_to_the_same_codes(fmt, static):
    a = shape(layers=2)
    cap = 400 if static else None
    staged = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16, capacity=cap, stage=StageBudget())
    plain = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16, capacity=cap)
    g = torch.Generator().manual_seed(1)
    pos = 0
    for T in CHUNKS:
        q, k, v = _rows(a, g, T)
        for layer in range(a.layers):
            out = staged.update_attend(layer, pos, q, k, v)
            plain.update_attend(layer, pos, q, k, v)
            ref = reference_attention(staged, layer, q, pos)  # over the staged 16-bit rows, exactly
            assert staged.layers[layer].n_code == 0 and staged.layers[layer].n_dense == pos + T
            tol = fp32_matmul_tol(max(pos + T, a.head_dim), float(ref.abs().max()), 5)
            assert float((out - ref).abs().max()) <= tol
        pos += T
    assert staged.stage_budget.in_use() > 0
    q, k, v = _rows(a, g, 1)  # the first decode row: the prompt is compressed first
    for layer in range(a.layers):
        out = staged.update_attend(layer, pos, q, k, v)
        ref = plain.update_attend(layer, pos, q, k, v)
        assert torch.equal(out, ref)
    assert staged.stage_budget.in_use() == 0
    for (n1, d1, c1, k1, v1), (n2, d2, c2, k2, v2) in zip(_state(staged), _state(plain)):
        assert (n1, d1) == (n2, d2) and n1 > 0
        assert all(torch.equal(x, y) for x, y in zip(c1, c2))
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert all(L.stage is None and not L.staging for L in staged.layers)


def test_settle_before_a_graph_step_and_drop_on_end():
    """``graphable`` (what every CUDA-graph decode path asks first) settles a staged prompt; ``drop_stage`` (a
    sequence that ends mid-prompt) frees the 16-bit rows and the budget without compressing."""
    a = shape(layers=2)
    fmt = parse_turbo("k4v3", window=16)
    budget = StageBudget()
    c = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16, capacity=300, stage=budget)
    g = torch.Generator().manual_seed(2)
    q, k, v = _rows(a, g, 200)
    for layer in range(a.layers):
        c.update_attend(layer, 0, q, k, v)
    assert c.counts() == (0, 200)
    c.graphable()
    assert c.counts() == (200 - 16, 16) and budget.in_use() == 0
    d = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16, stage=budget)
    for layer in range(a.layers):
        d.update_attend(layer, 0, q, k, v)
    assert budget.in_use() > 0
    d.drop_stage()
    assert budget.in_use() == 0 and all(L.stage is None for L in d.layers)


def test_a_chunk_past_the_budget_compresses_and_goes_on():
    """The budget holds the first chunk only: the second compresses the first (all but the window) and attends it
    through the codes, as without staging; the budget is free again."""
    a = shape(layers=2)
    fmt = parse_turbo("k4v3", window=16)
    row = 2 * a.kv_heads * a.head_dim * 2 * a.layers  # fp16 keys and values of every layer
    budget = StageBudget(limit=100 * row)
    c = CompressedCache(a, fmt, torch.float32, CPU, dense_dtype=torch.float16, stage=budget)
    g = torch.Generator().manual_seed(3)
    q, k, v = _rows(a, g, 64)
    for layer in range(a.layers):
        c.update_attend(layer, 0, q, k, v)
    assert c.counts() == (0, 64) and budget.in_use() > 0
    q, k, v = _rows(a, g, 64)
    for layer in range(a.layers):
        out = c.update_attend(layer, 64, q, k, v)
        assert out.shape == (64, a.heads * a.head_dim)
    n_code, n_dense = c.counts()
    assert n_code >= 128 - 16 - 31 and n_code + n_dense == 128 and budget.in_use() == 0


def test_auto_staging_room(monkeypatch):
    """--turbo-kv-prompt-memory: explicit sizes and off as given; auto is off on CPUs, and on CUDA 4 GiB, or one
    whole context of 16-bit rows when the server's default format is compressed, never past 35% of the free
    memory (the value the code pool's default then leaves free)."""
    from types import SimpleNamespace

    from swiftlm.backends.torch import devices

    a = SimpleNamespace(layers=32, kv_heads=8, head_dim=128)
    row = 2 * 32 * 8 * 128 * 2  # bytes of one position's 16-bit keys and values, every layer
    free = [200 << 30]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 1 << 40))
    cuda = torch.device("cuda")

    def cfg(mem="auto", turbo=None):
        return SimpleNamespace(
            turbo_kv_prompt_memory=mem,
            turbo_kv=turbo,
            turbo_kv_window=128,
            turbo_kv_threshold=0,
            turbo_kv_keep_layers=0,
        )

    def size(c, device=cuda, ctx=131072):
        return devices.stage_bytes(c, a, device, ctx, torch.bfloat16)

    assert size(cfg("6GB")) == 6 * 10**9
    assert size(cfg("off")) == 0 and size(cfg("0")) == 0
    assert size(cfg(), device=CPU) == 0
    assert size(cfg()) == devices.STAGE_BYTES  # 16-bit default: turbo per request only
    assert size(cfg(turbo="k4v3")) == 131072 * row  # 16 GiB: a 128K prompt stages whole
    assert size(cfg(turbo="k4v3"), ctx=8192) == devices.STAGE_BYTES
    free[0] = 20 << 30
    assert size(cfg(turbo="k4v3")) == 7 << 30  # 35% of what is free
