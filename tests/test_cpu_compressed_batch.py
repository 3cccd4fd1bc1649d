"""CPU decode steps of several sequences with compressed caches of one format (backends/torch/cpu_code_batch.py: each
layer's code attention for all rows in one kernel call and one merge call) against the same steps attended row by
row (``RowsAttend``'s per-row path: each cache's ``update_attend``).  Both run the same compiled kernel and merge on
each row's own tasks (the row-by-row path is the batched one with a single row), so the logits and every cache's
storage are bit-equal.  TurboQuant k4v3: the sequences have mixed lengths, long ones with compressed rows, one whose
prompt is shorter than the window (no codes: the cache's own path inside the batched step), one that starts
compressing during the run.  Affine ``kv_bits`` 8 and 4 (no window: every row goes to codes as it is written, the
step's own row attended in 16 bits first).  The models have SmolLM2's attention shape (9 query heads over 3 KV heads
of 64; k4v3 and kv_bits=8/g64) and 4 over 2 (kv_bits=4/g32): kernels other tests compile too.  A step that mixes a
compressed cache with a plain one, or two formats, goes row by row."""

from __future__ import annotations

import copy
import functools

import pytest
from conftest import needs_torch

pytest.importorskip("numba")
pytestmark = needs_torch

WINDOW = 16
PROMPTS = [150, 70, 9, 40]  # 40: crosses window + 32 rows at its 9th decode step and compresses
STEPS = 12


@functools.cache
def _model(kv_heads: int = 3, heads: int = 9):
    import torch

    from swiftlm.backends.torch.model import Transformer
    from swiftlm.backends.torch.model_config import Args

    cfg = dict(
        model_type="llama",
        hidden_size=192,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        intermediate_size=256,
        vocab_size=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Transformer(Args.from_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.eval()
    model.init_rope()
    with torch.no_grad():
        for blk in model.layers:  # QKV and gate/up fused, as the loader leaves them
            blk.self_attn.fuse()
            blk.mlp.fuse()
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


def _cache(model, fmt, prompt):
    """A CPU compressed cache as the server makes one (fp16 16-bit rows), holding ``prompt``."""
    import torch

    from swiftlm.backends.torch.compressed_cache import CompressedCache

    c = CompressedCache(model.a, fmt, torch.float32, torch.device("cpu"), dense_dtype=torch.float16)
    with torch.inference_mode():
        model(torch.tensor(prompt), c, 0)
    return c


def _state(c):
    """Everything a cache holds for its positions: counters, codes, norms (scales, biases) and 16-bit rows, per
    layer."""
    out = [c.length]
    for L in c.layers:
        n, nd = L.n_code, L.n_dense
        out.append((n, nd))
        for t in (*(L.kp or []), *(L.vp or []), L.kn, L.vn, L.ks, L.kr, L.vb):  # kv_bits: ks, vb the biases
            out.append(None if t is None else t[:, :n].clone())
        out += [L.dk[:, :nd].clone(), L.dv[:, :nd].clone()]
    return out


def _same(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True)
    )


def _fmt(name: str):
    from swiftlm.turboquant.presets import affine, parse_turbo

    return {"k4v3": parse_turbo("k4v3", window=WINDOW), "kv8": affine(8, 64), "kv4": affine(4, 32)}[name]


@pytest.mark.parametrize("name,shape", [("k4v3", (3, 9)), ("kv8", (3, 9)), ("kv4", (2, 4))], ids=["k4v3", "kv8", "kv4"])
def test_batched_rows_equal_row_by_row(name, shape, monkeypatch):
    import torch

    from swiftlm.backends.torch import cpu_code_batch
    from swiftlm.backends.torch.decode_rows import decode_batch

    model, fmt = _model(*shape), _fmt(name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPTS]
    batched = [_cache(model, fmt, p) for p in prompts]
    solo = [copy.deepcopy(c) for c in batched]
    turbo = fmt.kind == "turbo"
    assert [c.counts()[0] > 0 for c in batched] == ([True, True, False, False] if turbo else [True] * 4)
    assert cpu_code_batch.usable(model, batched)
    toks = [p[-1] for p in prompts]
    pos = list(PROMPTS)
    calls = cpu_code_batch.CALLS[0]
    with torch.inference_mode():
        for _ in range(STEPS):
            got = decode_batch(model, batched, toks, pos)
            with monkeypatch.context() as mp:
                mp.setattr(cpu_code_batch, "usable", lambda *a: False)  # RowsAttend: each cache's update_attend
                want = decode_batch(model, solo, toks, pos)
            assert torch.equal(got, want)
            for c, d in zip(batched, solo):
                assert _same(_state(c), _state(d))
            toks = got.argmax(-1).tolist()
            pos = [p + 1 for p in pos]
    assert cpu_code_batch.CALLS[0] - calls == STEPS * model.a.layers  # every layer of every step batched
    counts = [c.counts() for c in batched]
    if turbo:
        assert counts[2] == (0, PROMPTS[2] + STEPS)  # the short prompt never compressed: its own path throughout
        assert counts[3][0] > 0  # ... and this one started compressing during the run
    else:  # kv_bits: every row in codes after each step
        assert counts == [(p, 0) for p in pos]
    assert all(c.length == p for c, p in zip(batched, pos))


def test_mixed_steps_go_row_by_row(model):
    """A compressed cache beside a plain one, or two formats (TurboQuant windows, TurboQuant and kv_bits) in one step:
    not batched; the rows are what each sequence's own step gives (one-row matmuls against the step's, so within
    rounding)."""
    import torch
    from tolerances import transformer_logits_tol

    from swiftlm.backends.torch import cpu_code_batch
    from swiftlm.backends.torch.decode_rows import decode_batch
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.turboquant.presets import parse_turbo

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (120, 60)]
    k4 = parse_turbo("k4v3", window=WINDOW)
    plain = SeqCache(model.a, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        model(torch.tensor(prompts[1]), plain, 0)
    for caches in (
        [_cache(model, k4, prompts[0]), plain],
        [_cache(model, k4, prompts[0]), _cache(model, parse_turbo("k4v3", window=2 * WINDOW), prompts[1])],
        [_cache(model, k4, prompts[0]), _cache(model, _fmt("kv8"), prompts[1])],
    ):
        assert not cpu_code_batch.usable(model, caches)
        alone = [copy.deepcopy(c) for c in caches]
        toks, pos = [p[-1] for p in prompts], [len(p) for p in prompts]
        with torch.inference_mode():
            for _ in range(3):
                calls = cpu_code_batch.CALLS[0]
                got = decode_batch(model, caches, toks, pos)
                assert cpu_code_batch.CALLS[0] == calls
                want = torch.cat([decode_batch(model, [c], [t], [p]) for c, t, p in zip(alone, toks, pos)])
                tol = transformer_logits_tol(model.a, float(want.abs().max()), max(pos) + 1)
                assert float((got - want).abs().max()) <= tol
                toks = want.argmax(-1).tolist()
                pos = [p + 1 for p in pos]
