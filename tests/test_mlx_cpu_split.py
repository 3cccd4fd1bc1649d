"""backends/mlx/cpu_split.py: MLX projections split over CPU streams give bit-for-bit the logits of the unsplit
model (fp32 and quantized layers, the tied LM head, uneven slices), through load_model on the bundled GGUF too;
the switch and its limits (off, Metal-only devices, adapters)."""

from __future__ import annotations

import threading

import pytest
from conftest import needs_mlx

pytestmark = needs_mlx


def _tiny_module(quantized: bool):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=320,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=1000,
        tie_word_embeddings=True,
    )
    mx.random.seed(3)
    m = Model(args)
    if quantized:
        nn.quantize(m, group_size=32, bits=4)
    mx.eval(m.parameters())
    return m


def _decode(m, steps: int = 3):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(m)
    outs = [m(mx.array([[1, 7, 42, 9, 300], [2, 8, 43, 10, 301]]), cache=cache)]
    for t in range(steps):
        outs.append(m(mx.array([[5 + t], [6 + t]]), cache=cache))
    mx.eval(outs)
    return outs


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
@pytest.mark.parametrize("n", [2, 3])
def test_split_logits_equal_unsplit(quantized, n):
    import mlx.core as mx
    import mlx.nn as nn

    from swiftlm.backends.mlx import cpu_split

    m = _tiny_module(quantized)
    ref = _decode(m)
    swapped = cpu_split.split_projections(m, n)
    # 7 projections per layer and the tied embedding (its as_linear is the LM head)
    assert swapped == 2 * 7 + 1
    q = m.model.layers[0].self_attn.q_proj
    assert type(q) is (cpu_split.SplitQuantizedLinear if quantized else cpu_split.SplitLinear)
    assert isinstance(q, nn.QuantizedLinear if quantized else nn.Linear)
    calls = []
    real, me = mx.concatenate, threading.get_ident()

    def counting(parts, axis=0, **kw):
        if threading.get_ident() == me:  # an engine thread of another test's fixture may join arrays too
            calls.append(len(parts))
        return real(parts, axis=axis, **kw)

    try:  # the split path really runs: every projection joins n slices
        mx.concatenate = counting
        out = _decode(m)
    finally:
        mx.concatenate = real
    assert calls and set(calls) == {n}
    for a, b in zip(ref, out):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    # parameter names and values untouched: the module's weights are what they were
    from mlx.utils import tree_flatten

    names = {k for k, _ in tree_flatten(m.parameters())}
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("slice" in k for k in names)


def test_off_switches_and_bad_values(monkeypatch):
    from swiftlm.backends.mlx import cpu_split

    m = _tiny_module(False)
    for v in ("0", "1", "many"):
        monkeypatch.setenv("SWIFTLM_MLX_CPU_SPLIT", v)
        assert cpu_split.split_projections(m) == 0
    monkeypatch.setenv("SWIFTLM_MLX_CPU_SPLIT", "2")
    assert cpu_split.slices_wanted() == 2
    monkeypatch.delenv("SWIFTLM_MLX_CPU_SPLIT")
    import os

    assert cpu_split.slices_wanted() == min(len(os.sched_getaffinity(0)), cpu_split.MAX_SLICES)
    # a layer with fewer output rows than slices stays plain
    import mlx.nn as nn

    small = nn.Linear(8, 2)
    assert cpu_split.split_projections(small, 3) == 0 and type(small) is nn.Linear


def test_unsplit_gives_the_plain_class_back():
    import mlx.nn as nn

    from swiftlm.backends.mlx import cpu_split

    m = _tiny_module(True)
    cpu_split.split_projections(m, 2)
    layer = m.model.layers[1].mlp.down_proj
    assert type(cpu_split.unsplit(layer)) is nn.QuantizedLinear
    other = nn.RMSNorm(4)
    assert cpu_split.unsplit(other) is other and type(other) is nn.RMSNorm


def test_load_model_splits_and_greedy_matches_unsplit(monkeypatch, bundled_gguf):
    """The bundled GGUF (4-bit projections, 8-bit tied embedding) through load_model: split by default on a
    machine with several cores, and the same greedy tokens and logits as SWIFTLM_MLX_CPU_SPLIT=0."""
    import mlx.core as mx

    from swiftlm.backends.mlx import cpu_split
    from swiftlm.backends.mlx.model import load_model
    from swiftlm.config import Settings
    from swiftlm.registry import resolve

    spec = resolve(str(bundled_gguf))
    runs = {}
    for v in ("0", "2"):
        monkeypatch.setenv("SWIFTLM_MLX_CPU_SPLIT", v)
        model = load_model(spec, Settings(model=str(bundled_gguf)))
        head = model.module.model.embed_tokens
        assert (type(head) is cpu_split.SplitQuantizedEmbedding) == (v == "2")
        ids = model.tokenizer.encode("The capital of France is")
        toks, logits = [], []
        x = model.logits(1, ids, 0)
        for i in range(6):
            logits.append(x)
            toks.append(int(mx.argmax(x).item()))
            x = model.logits(1, [toks[-1]], len(ids) + i)
        model.free([1])
        runs[v] = (toks, logits)
    assert runs["0"][0] == runs["2"][0]
    assert all(mx.array_equal(a, b).item() for a, b in zip(runs["0"][1], runs["2"][1]))
