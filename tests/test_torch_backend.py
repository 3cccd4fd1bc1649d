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


def test_batched_static_decode_and_verify_equal_eager(tiny_torch):
    """The bodies of the batched decode graph (rows of a shared slot tensor, padded to a power
    of two with the scratch slot) and of the speculative verify graph, run eagerly on CPU,
    against the eager forward of each sequence alone (fp32; masked rows are exact zeros)."""
    import torch

    from swiftlm.backends.torch.graphs import GraphDecoder, SlotPool
    from swiftlm.backends.torch.model import SeqCache

    m = tiny_torch.engine.model.module
    cpu = torch.device("cpu")
    prompts = [tiny_torch.engine.text_prompt(t) for t in ("a b c", "The quick brown fox jumps", "x")]
    with torch.inference_mode():
        pool = SlotPool(m.a, 4, 512, torch.float32, cpu)
        gd = GraphDecoder(m, cpu, use_graph=False, fused=False)
        slots, refs = [pool.take() for _ in prompts], [SeqCache(m.a, torch.float32, cpu) for _ in prompts]
        last = []
        for p, sc, rc in zip(prompts, slots, refs):
            m(torch.tensor(p), sc, 0)
            last.append(int(m(torch.tensor(p), rc, 0)[-1].argmax()))
        for step in range(3):  # B = 3 runs padded to 4
            pos = [len(p) + step for p in prompts]
            got = gd.run_batch(pool, [c.slot for c in slots], last, pos)
            want = torch.stack([m(torch.tensor([t]), rc, q)[-1] for t, rc, q in zip(last, refs, pos)])
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
            last = [int(r.argmax()) for r in want]
        block = [5, 9, 11, 3, 7]
        start = len(prompts[1]) + 3
        got = gd.verify(slots[1], block, start)
        want = m(torch.tensor(block), refs[1], start, last_only=False)
        assert torch.allclose(got, want, atol=1e-5)
        # the verify block wrote the same KV rows as the eager pass
        assert torch.allclose(slots[1].k[0][:, : start + 5], refs[1].k[0][:, : start + 5], atol=1e-6)


def test_slot_pool_layout_runs_engine_exactly(tiny_llama):
    """The CUDA layout on CPU (slot pool + the graph bodies run eagerly): four concurrent greedy
    requests and n-gram speculation give the tokens of plain solo runs."""
    import torch

    from swiftlm import LLM, SamplingParams
    from swiftlm.backends.torch.graphs import GraphDecoder, SlotPool

    prompts = ["a b c a b c a b", "the cat sat on the mat the cat", "one two three", "x y z"]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", prompt_cache_bytes=0) as plain:
        solo = [plain.generate(q, p).token_ids for q in prompts]
    for kw in ({"parallel": 4}, {"parallel": 1, "speculative": "ngram"}):
        with LLM(str(tiny_llama), backend="torch", ctx_size=512, prompt_cache_bytes=0, **kw) as llm:
            m = llm.engine.model
            m.static, m.info.context_length = True, 512
            m.pool = SlotPool(m.module.a, kw["parallel"], 512, torch.float32, torch.device("cpu"))
            m.graphs = GraphDecoder(m.module, torch.device("cpu"), use_graph=False, fused=False)
            outs = llm.generate(prompts, p)
            assert [o.token_ids for o in outs] == solo, kw


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
