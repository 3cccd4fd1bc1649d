"""The Triton sampling kernels (``swiftlm.cuda_ext.sample_kernel``) under TRITON_INTERPRET=1 on CPU tensors (on a
GPU the same code runs on CUDA): the inverse-CDF draw equals a float64 reference wherever ``u`` is not within
float32 rounding of a CDF boundary, never picks a token of zero probability, and a temperature / bias / greedy
row draws the same token whether its batch takes the fused path or the general one (both call the kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, needs_torch

pytestmark = [
    needs_torch,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
    ),
]

KERNEL_VS_REF = r"""
import json, torch
from swiftlm.cuda_ext.sample_kernel import CHUNK, draw, draw_ref
g = torch.Generator().manual_seed(3)
out = []
# vocabularies below, at and across the chunk size, and SmolLM2's; flat, peaked and masked rows
for V, n, K in [(1000, 16, 8), (CHUNK, 8, 0), (CHUNK + 1, 8, 2), (3 * CHUNK - 5, 8, 8), (49152, 6, 8)]:
    for dtype, scale in (("float32", 1.0), ("bfloat16", 3.0), ("float32", 12.0)):
        logits = (torch.randn(n, V, generator=g) * scale).to(getattr(torch, dtype))
        if scale == 12.0:  # a top-k-like mask: most of each row at -inf (whole chunks included)
            keep = torch.rand(n, V, generator=g) < 0.02
            logits = torch.where(keep, logits, torch.tensor(float("-inf"), dtype=logits.dtype))
            logits[:, 7] = 1.0  # at least one live token per row
        inp = torch.zeros(n, 3 + 2 * K)
        inp[:, 0] = torch.rand(n, generator=g) * 1.4 + 0.1
        inp[:, 1] = torch.rand(n, generator=g).clamp_min(1e-6)
        inp[:, 2] = (torch.arange(n) % 5 == 0).float()
        inp[inp[:, 2] > 0, 0] = 1.0
        for k in range(K):
            inp[:, 3 + k] = torch.randint(0, V, (n,), generator=g).float()
            inp[:, 3 + K + k] = torch.tensor([-100.0, 5.0, 3.0, -2.5])[k % 4]
        got = draw(logits, inp).tolist()
        ref = draw_ref(logits, inp).tolist()
        # each row's float64 CDF: how far the target lies from the nearest boundary (relative to the total)
        x = logits.double().clone()
        margins, weights = [], []
        for i in range(n):
            for k in range(K):
                c = int(inp[i, 3 + k]); x[i, c] += float(inp[i, 3 + K + k])
            w = torch.exp(x[i] / float(inp[i, 0]) - (x[i] / float(inp[i, 0])).max())
            cdf = torch.cumsum(w, 0) / w.sum()
            t = float(inp[i, 1])
            margins.append(float((cdf - t).abs().min()))
            weights.append(float(w[got[i]]))
        out.append(dict(V=V, dtype=dtype, scale=scale, got=got, ref=ref, greedy=inp[:, 2].tolist(),
                        margins=margins, weights=weights))
nan = torch.full((2, 5000), float("nan"))
out.append(dict(nan_tokens=draw(nan, torch.tensor([[0.7, 0.5, 0.0], [1.0, 0.5, 1.0]])).tolist()))
print(json.dumps(out))
"""

PATHS_AGREE = r"""
import json, numpy as np, torch
from swiftlm import sampler
from swiftlm.backends.torch.ops import TorchOps
from swiftlm.sampling import SamplerState, SamplingParams

V = 3000
class GeneralOps(TorchOps):
    sample_simple = None

def rows(rng, n):
    out = []
    for i in range(n):
        bias = {int(t): float(b) for t, b in zip(rng.choice(V, rng.integers(0, 9), replace=False),
                                                rng.choice([-100.0, -2.5, 3.0, 5.0], 8))}
        p = SamplingParams(temperature=0.0 if i % 4 == 0 else float(rng.uniform(0.2, 1.5)), logit_bias=bias,
                           seed=int(rng.integers(1 << 40)))
        out.append(sampler.Row(p, SamplerState(seed=p.seed)))
    return out

dev = torch.device("cpu")
fused, general = TorchOps(dev, sample_kernel=True), GeneralOps(dev, sample_kernel=True)
calls = []
draw_rows = general.draw_rows
general.draw_rows = lambda y, u: calls.append(len(u)) or draw_rows(y, u)
res = []
rng = np.random.default_rng(0)
for n in (1, 5, 12):
    a, b = rows(np.random.default_rng(n), n), rows(np.random.default_rng(n), n)
    # batch b also holds a top-p row: the general path (filters, then the kernel) for every row
    extra = sampler.Row(SamplingParams(temperature=0.8, top_p=0.5, seed=1), SamplerState(seed=1))
    for step in range(4):
        logits = torch.from_numpy(rng.normal(0, 3, (n + 1, V)).astype(np.float32)).to(torch.bfloat16)
        assert sampler.simple_inputs([r.params for r in a], [r.state for r in a], [r.state.draws for r in a], V) is not None
        ta = [s.token for s in sampler.launch(fused, logits[:n], a).finish()]
        tb = [s.token for s in sampler.launch(general, logits, b + [extra]).finish()][:n]
        res.append(dict(n=n, step=step, fused=ta, general=tb,
                        banned=[r.params.logit_bias.get(t, 0.0) <= -100.0 for r, t in zip(a, ta)]))
res.append(dict(kernel_calls=calls, graphed=fused._fused is not None))
print(json.dumps(res))
"""


def _run(code: str) -> list:
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernel_draws_the_inverse_cdf_token():
    cases = _run(KERNEL_VS_REF)
    nan = cases.pop()["nan_tokens"]
    assert len(nan) == 2 and all(0 <= t < 5000 for t in nan), nan  # NaN logits (a broken model): still a token id
    assert len(cases) == 15
    checked = near = 0
    for c in cases:
        for got, ref, greedy, margin, weight in zip(c["got"], c["ref"], c["greedy"], c["margins"], c["weights"]):
            assert 0 <= got < c["V"] and weight > 0, c  # never a token of zero probability (masked, banned)
            # the kernels' float32 CDF: sums of tree depth ~12 per chunk, a scan over <= 38 chunk sums and one
            # over the chosen chunk (depth ~12 each), exp and division within a few ulps: well under 64 float32
            # ulps of the total.  A target farther than that from every boundary has one right answer.
            if greedy or margin > 64 * 2**-24:
                assert got == ref, (c["V"], c["dtype"], c["scale"], got, ref, margin)
                checked += 1
            else:
                near += 1
    assert checked >= 0.8 * (checked + near), (checked, near)  # the check is not vacuous


def test_fused_and_general_paths_draw_the_same_token():
    res = _run(PATHS_AGREE)
    tail = res.pop()
    assert tail == {"kernel_calls": [2] * 4 + [6] * 4 + [13] * 4, "graphed": False}  # both paths: the kernels
    assert len(res) == 12
    for r in res:
        assert r["fused"] == r["general"], r
        assert not any(r["banned"]), r
