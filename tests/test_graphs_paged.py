"""Batched static decode with the Triton decode-attention kernel reading the slot pool in place
(CUDA's default) against the gather + SDPA path: on CPU under TRITON_INTERPRET=1, in a
subprocess (the interpreter flag must be set before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_torch

SCRIPT = textwrap.dedent("""
    import sys, torch
    from swiftlm.registry import resolve
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.backends.torch.graphs import SlotPool, decode_batch_static
    torch.manual_seed(0)
    tm = load_model(resolve(sys.argv[1]), None)
    m = tm.module
    a = m.a
    pool = SlotPool(a, 4, 96, torch.float32, torch.device("cpu"))
    for t in pool.k + pool.v:  # every slot filled with random history (position p of slot s)
        t.normal_()
    slots = torch.tensor([2, 0, 3, 4])          # 4 = the scratch slot: a padding row
    pos = torch.tensor([0, 37, 95, 0])           # lengths 1, 38, 96 (a full slot) and padding
    toks = torch.tensor([5, 17, 123, 0])
    ar = torch.arange(a.ctx)
    with torch.inference_mode():
        ref = decode_batch_static(m, pool, toks, slots, pos, 96, ar, 0)[:3]
        for splits in (1, 2, 4):
            got = decode_batch_static(m, pool, toks, slots, pos, 96, ar, splits)[:3]
            err = float((got - ref).abs().max())
            scale = float(ref.abs().max())
            # fp32 both ways; the kernel sums scores and values in another order (online softmax,
            # split-K): rounding of a few hundred terms, far below 1e-4 of the logits' scale
            assert err <= 1e-4 * scale, (splits, err, scale)
            print("splits", splits, "max err", err, "scale", scale)
""")


@needs_torch
def test_batched_decode_with_the_kernel_equals_gather_sdpa(tiny_llama):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("max err") == 3


@needs_torch
def test_packed_prefill_equals_per_prompt_forward(tiny_llama):
    """Several prompts' first chunks in one packed forward (CUDA's prefill of concurrent arrivals)
    give each prompt's last-token logits and KV rows as its own forward does: fp32 on CPU, the
    packed matmuls and the block-diagonal masked SDPA sum in another order, so within rounding."""
    import torch

    from swiftlm.backends.torch.graphs import SlotPool, prefill_packed_static
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    tm = load_model(resolve(str(tiny_llama)), None)
    m, a = tm.module, tm.module.a
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, a.vocab, (n,), generator=g).tolist() for n in (5, 17, 2, 33)]
    pool = SlotPool(a, 4, 64, torch.float32, torch.device("cpu"))
    slots = [3, 0, 2, 1]
    toks, sl, pos, seg, last = [], [], [], [], []
    for n, (p, s) in enumerate(zip(prompts, slots)):
        toks += p
        sl += [s] * len(p)
        pos += range(len(p))
        seg += [n] * len(p)
        last.append(len(toks) - 1)
    with torch.inference_mode():
        got = prefill_packed_static(m, pool, *(torch.tensor(x) for x in (toks, sl, pos, seg, last)))
        for n, (p, s) in enumerate(zip(prompts, slots)):
            c = SeqCache(a, torch.float32, torch.device("cpu"))
            want = m(torch.tensor(p), c, 0)[-1]
            tol = 1e-4 * float(want.abs().max())  # fp32 rounding of sums over a few hundred terms
            assert float((got[n] - want).abs().max()) <= tol, n
            for layer in range(a.layers):
                kv_err = (pool.k[layer][s, :, :len(p)] - c.k[layer][:, :len(p)]).abs().max()
                assert float(kv_err) <= 1e-5 * float(c.k[layer].abs().max()) + 1e-6, (n, layer)
