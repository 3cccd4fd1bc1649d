"""torch backend internals: the fixed-shape decode step (the CUDA-graph body) against the
eager forward, CUDA-graph replay (on a GPU), and our model file against mlx-lm's for every
architecture we implement (tiny random checkpoints, fp32 on both sides)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HAS_MLX, make_ckpt, needs_mlx, needs_torch

pytestmark = needs_torch


@pytest.fixture(scope="module")
def tiny_torch(tiny_llama):
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend="torch")
    yield llm
    llm.close()


def test_static_decode_equals_eager_forward(tiny_torch):
    import torch

    from swiftlm.backends.torch.graphs import GraphDecoder
    from swiftlm.backends.torch.model import SeqCache

    m = tiny_torch.engine.model.module
    prompt = tiny_torch.engine.text_prompt("The quick brown fox jumps over")
    with torch.inference_mode():
        eager, static = SeqCache(m.a, torch.float32, torch.device("cpu")), SeqCache(
            m.a, torch.float32, torch.device("cpu"), capacity=1024)
        le = m(torch.tensor(prompt), eager, 0)[-1]
        m(torch.tensor(prompt), static, 0)
        gd = GraphDecoder(m, torch.device("cpu"))
        tok_e = tok_s = int(le.argmax())
        for i in range(40):  # crosses the 256-row bucket edge? no: exercises masking of unused rows
            pos = len(prompt) + i
            le = m(torch.tensor([tok_e]), eager, pos)[-1]
            ls = gd.eager(static, tok_s, pos)
            # same math; the static path sums over masked (exactly zero) extra rows
            assert torch.allclose(le, ls, atol=1e-5), (i, float((le - ls).abs().max()))
            tok_e, tok_s = int(le.argmax()), int(ls.argmax())
            assert tok_e == tok_s


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_cuda_graph_replay_equals_eager(tiny_llama):
    import torch

    from swiftlm import LLM, SamplingParams

    graph = LLM(str(tiny_llama), backend="torch")
    p = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)  # crosses the 256 bucket
    ids = graph.engine.text_prompt("Once upon a time")
    a = graph.generate(ids, p).token_ids
    assert graph.engine.model.graphs is not None and graph.engine.model.graphs.captures >= 2
    graph.engine.model.graphs = None  # same weights, eager static-shape decode
    b = graph.generate(ids, p).token_ids
    graph.close()
    assert a == b


ARCHES = ["llama", "qwen3", "qwen3_moe", "mixtral", "gemma"]


@needs_mlx
@pytest.mark.parametrize("arch", ARCHES)
def test_our_model_file_matches_mlx_lm(tmp_path_factory, arch):
    """Our torch implementation of each architecture against mlx-lm's (same fp32 weights)."""
    import mlx.core as mx
    import torch

    from swiftlm import LLM, SamplingParams

    ck = make_ckpt(tmp_path_factory.mktemp(arch) / arch, "--arch", arch, "--dtype", "float32", "--layers", "2",
                   "--experts", "4")
    t = LLM(str(ck), backend="torch")
    m = LLM(str(ck), backend="mlx")
    try:
        ids = t.engine.text_prompt("Mixture of experts and attention, tested")
        tl = t.engine.model.logits(-1, ids, 0).float().numpy()
        ml = np.array(m.engine.model.logits(-1, ids, 0).astype(mx.float32))
        # fp32 on both sides; different kernels and summation order: ~1e-5 relative
        assert np.allclose(tl, ml, atol=1e-3, rtol=1e-4), float(np.abs(tl - ml).max())
        p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        assert t.generate(ids, p).token_ids == m.generate(ids, p).token_ids
    finally:
        t.close()
        m.close()
    del torch


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                    reason="triton not installed on this machine")
def test_fused_decode_step_equals_plain_interpreted(tiny_llama):
    """The decode step built on the Triton kernels (interpreted on CPU) against the plain one."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    code = f"""
import torch
from swiftlm import LLM
from swiftlm.backends.torch.graphs import GraphDecoder
from swiftlm.backends.torch.model import SeqCache
llm = LLM({str(tiny_llama)!r}, backend="torch")
m = llm.engine.model.module
prompt = llm.engine.text_prompt("The quick brown fox")
cpu = torch.device("cpu")
plain, fused = GraphDecoder(m, cpu, fused=False), GraphDecoder(m, cpu, fused=True)
with torch.inference_mode():
    a, b = SeqCache(m.a, torch.float32, cpu, capacity=512), SeqCache(m.a, torch.float32, cpu, capacity=512)
    m(torch.tensor(prompt), a, 0); m(torch.tensor(prompt), b, 0)
    b.k = [t.clone() for t in a.k]; b.v = [t.clone() for t in a.v]
    ta = tb = 7
    worst = 0.0
    for i in range(6):
        la, lb = plain.eager(a, ta, len(prompt) + i), fused.eager(b, tb, len(prompt) + i)
        worst = max(worst, float((la - lb).abs().max()))
        ta, tb = int(la.argmax()), int(lb.argmax())
        assert ta == tb
print(worst)
llm.close()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.strip().splitlines()[-1]) < 1e-4  # fp32 both ways; rope/norm summed in another order
