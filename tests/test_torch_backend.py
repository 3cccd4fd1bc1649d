"""torch backend internals: the fixed-shape decode step (the CUDA-graph body) against the
eager forward, CUDA-graph replay (on a GPU), and our model file against mlx-lm's for every
architecture we implement (tiny random checkpoints, fp32 on both sides)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_ckpt, needs_mlx, needs_torch
from tolerances import REDUCTIONS_PER_BLOCK, fp32_matmul_tol, transformer_logits_tol
from torch_layout import relayout

pytestmark = needs_torch


@pytest.fixture(scope="module")
def tiny_torch(tiny_llama):
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend="torch")
    yield llm
    llm.close()


def test_static_decode_equals_eager_forward(tiny_torch):
    import torch

    from swiftlm.backends.torch.graphs import GraphDecoder, bucket_for
    from swiftlm.backends.torch.kv_cache import SeqCache

    m = tiny_torch.engine.model.module
    prompt = tiny_torch.engine.text_prompt("The quick brown fox jumps over")
    with torch.inference_mode():
        eager, static = (
            SeqCache(m.a, torch.float32, torch.device("cpu")),
            SeqCache(m.a, torch.float32, torch.device("cpu"), capacity=1024),
        )
        le = m(torch.tensor(prompt), eager, 0)[-1]
        m(torch.tensor(prompt), static, 0)
        gd = GraphDecoder(m, torch.device("cpu"))
        tok_e = tok_s = int(le.argmax())
        for i in range(40):  # crosses the 256-row bucket edge? no: exercises masking of unused rows
            pos = len(prompt) + i
            le = m(torch.tensor([tok_e]), eager, pos)[-1]
            ls = gd.eager(static, tok_s, pos)
            # same math in another summation order (SDPA over the 256-row bucket, whose masked
            # rows add exact zeros, against attention over the live rows): fp32 rounding only
            tol = transformer_logits_tol(m.a, float(le.abs().max()), pos + 1)
            assert float((le - ls).abs().max()) <= tol, (i, float((le - ls).abs().max()), tol)
            tok_e, tok_s = int(le.argmax()), int(ls.argmax())
            assert tok_e == tok_s
        # the tolerance cannot hide a mask bug: the next step with the newest row (the token's
        # own key) masked out misses by orders of magnitude more
        pos = len(prompt) + 40
        le = m(torch.tensor([tok_e]), eager, pos)[-1]
        arange = gd.arange.clone()
        arange[pos] = arange[-1] + 1
        bad = gd.fn(m, static, torch.tensor([tok_s]), torch.tensor([pos]), bucket_for(pos, static.capacity), arange)
        assert float((bad - le).abs().max()) > 100 * transformer_logits_tol(m.a, float(le.abs().max()), pos + 1)


def test_batched_static_decode_and_verify_equal_eager(tiny_torch):
    """The bodies of the batched decode graph (rows of the paged pool, each sequence's 16-position
    blocks scattered over it in shuffled order, padded to a power of two with the scratch slot) and of
    the speculative verify graph, run eagerly on CPU, against the eager forward of each sequence alone
    (fp32; masked rows are exact zeros).
    Batched GEMMs and one-row GEMVs sum in different orders (which depend on the CPU's BLAS
    kernels): equal to the fp32 rounding bound of tests/tolerances.py, not to a constant."""
    import copy

    import torch

    from swiftlm.backends.torch.graphs import GraphDecoder, SlotPool
    from swiftlm.backends.torch.kv_cache import SeqCache

    m = tiny_torch.engine.model.module
    cpu = torch.device("cpu")
    prompts = [tiny_torch.engine.text_prompt(t) for t in ("a b c", "The quick brown fox jumps", "x")]

    def tol(want: torch.Tensor, context: int) -> float:
        return transformer_logits_tol(m.a, float(want.abs().max()), context)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    with torch.inference_mode():
        pool = SlotPool(m.a, 4, 512, torch.float32, cpu, block_size=16)
        pool.attach()  # tables from here on, as the engine's block manager fills them
        order = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        gd = GraphDecoder(m, cpu, use_graph=False, fused=False)
        slots, refs = [pool.take() for _ in prompts], [SeqCache(m.a, torch.float32, cpu) for _ in prompts]
        for j, c in enumerate(slots):
            c.blocks.extend(order[j * 32 : (j + 1) * 32])  # 512 positions, scattered
            c.sync()
        last = []
        for p, sc, rc in zip(prompts, slots, refs):
            m(torch.tensor(p), sc, 0)
            last.append(int(m(torch.tensor(p), rc, 0)[-1].argmax()))
        for step in range(3):  # B = 3 runs padded to 4
            pos = [len(p) + step for p in prompts]
            got = gd.run_batch(pool, [c.slot for c in slots], last, pos)
            want = torch.stack([m(torch.tensor([t]), rc, q)[-1] for t, rc, q in zip(last, refs, pos)])
            assert got.shape == want.shape
            assert diff(got, want) <= tol(want, max(pos) + 1), (step, diff(got, want), tol(want, max(pos) + 1))
            last = [int(r.argmax()) for r in want]
        block = [5, 9, 11, 3, 7]
        start = len(prompts[1]) + 3
        before = copy.deepcopy(refs[1])  # the eager cache before the block, for the bug check below
        got = gd.verify(slots[1], block, start)
        want = m(torch.tensor(block), refs[1], start, last_only=False)
        assert diff(got, want) <= tol(want, start + 5), (diff(got, want), tol(want, start + 5))
        # the KV rows: the prompt's were written by the same prefill call on both sides (bit-equal);
        # the decode and verify rows by batched vs single-row matmuls, through i blocks and the
        # K/V projection of block i
        n = len(prompts[1])
        for i in range(m.a.layers):
            pk, pv = slots[1].rows(i, start + 5)
            for a, b in ((pk, refs[1].k[i]), (pv, refs[1].v[i])):
                assert torch.equal(a[:, :n], b[:, :n]), i
                a, b = a[:, : start + 5], b[:, : start + 5]
                t = fp32_matmul_tol(
                    max(m.a.hidden, m.a.intermediate, start + 5), float(b.abs().max()), REDUCTIONS_PER_BLOCK * i + 1
                )
                assert diff(a[:, n:], b[:, n:]) <= t, (i, diff(a[:, n:], b[:, n:]), t)
        # the tolerance cannot hide a position bug: the same block with rope one position off
        # (the cache and mask right) misses by orders of magnitude more
        cos, sin = m.cos, m.sin
        try:
            m.cos, m.sin = cos[1:], sin[1:]
            bad = m(torch.tensor(block), before, start, last_only=False)
        finally:
            m.cos, m.sin = cos, sin
        assert diff(bad, want) > 100 * tol(want, start + 5), (diff(bad, want), tol(want, start + 5))


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
            relayout(
                m,
                static=True,
                context=512,
                pool=SlotPool(m.module.a, kw["parallel"], 512, torch.float32, torch.device("cpu")),
                graphs=GraphDecoder(m.module, torch.device("cpu"), use_graph=False, fused=False),
            )
            outs = llm.generate(prompts, p)
            assert [o.token_ids for o in outs] == solo, kw


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_cuda_graph_replay_equals_eager(tiny_llama):

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
def test_our_model_file_matches_mlx_lm(tmp_path_factory, monkeypatch, arch):
    """Our torch implementation of each architecture against mlx-lm's (same fp32 weights)."""
    import mlx.core as mx
    import torch

    from swiftlm import LLM, SamplingParams

    if arch == "gemma":
        # mlx-lm's Gemma MLP applies the exact (erf) GELU; the checkpoint (hidden_activation
        # gelu_pytorch_tanh), transformers and our file the tanh approximation.  The two differ
        # by up to 4.7e-4 per activation (7.7e-4 on these logits): a model difference, not
        # rounding, so give mlx-lm the tanh form and leave only the summation order to compare.
        import mlx.nn as nn
        from mlx_lm.models import gemma

        monkeypatch.setattr(
            gemma.MLP, "__call__", lambda self, x: self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))
        )
    ck = make_ckpt(
        tmp_path_factory.mktemp(arch) / arch, "--arch", arch, "--dtype", "float32", "--layers", "2", "--experts", "4"
    )
    t = LLM(str(ck), backend="torch")
    m = LLM(str(ck), backend="mlx")
    try:
        ids = t.engine.text_prompt("Mixture of experts and attention, tested")
        tl = t.engine.model.logits(-1, ids, 0).float().numpy()
        ml = np.array(m.engine.model.logits(-1, ids, 0).astype(mx.float32))
        # fp32 on both sides; different kernels and summation order: the rounding bound
        tol = transformer_logits_tol(t.engine.model.module.a, float(np.abs(tl).max()), len(ids))
        assert float(np.abs(tl - ml).max()) <= tol, (float(np.abs(tl - ml).max()), tol)
        p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        assert t.generate(ids, p).token_ids == m.generate(ids, p).token_ids
    finally:
        t.close()
        m.close()
    del torch


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
)
def test_fused_decode_step_equals_plain_interpreted(tiny_llama):
    """The decode step built on the Triton kernels (interpreted on CPU) against the plain one."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    code = f"""
import sys
import torch
sys.path.insert(0, {str(ROOT / "tests")!r})
from tolerances import transformer_logits_tol
from swiftlm import LLM
from swiftlm.backends.torch.graphs import GraphDecoder
from swiftlm.backends.torch.kv_cache import SeqCache
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
    worst = 0.0  # the largest |difference| as a fraction of the fp32 rounding bound
    for i in range(6):
        la, lb = plain.eager(a, ta, len(prompt) + i), fused.eager(b, tb, len(prompt) + i)
        tol = transformer_logits_tol(m.a, float(la.abs().max()), len(prompt) + i + 1)
        worst = max(worst, float((la - lb).abs().max()) / tol)
        ta, tb = int(la.argmax()), int(lb.argmax())
        assert ta == tb
print(worst)
llm.close()
"""
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # fp32 both ways; rope, residual add and RMSNorm in another order: within the rounding bound
    assert float(r.stdout.strip().splitlines()[-1]) <= 1.0
