"""On CUDA nothing between a step's forward launch and its one read-back may wait for the device:
the batched sampler's launch (every knob) and a batched decode forward run under torch's sync
debug mode, which raises on any synchronising call (e.g. a scalar ``torch.tensor(x, device="cuda")``
in the sampler would make every step wait for its forward).
Needs a CUDA GPU; skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_sampler_launch_does_not_synchronise():
    from swiftlm.backends.torch.ops import TorchOps
    from swiftlm.sampler import Row, launch
    from swiftlm.sampling import SamplerState, SamplingParams

    ops = TorchOps(torch.device("cuda"))
    V = 4096
    logits = torch.randn(16, V, device="cuda")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05),
        SamplingParams(temperature=0.6, logit_bias={2: -100}),
        SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5, logprobs=True, top_logprobs=3),
    ] * 3 + [SamplingParams(temperature=0.6)]
    rows = [
        Row(p.validate(V), SamplerState(seed=i, prompt_tokens=[1, 2, 3], output_tokens=[4, 5]))
        for i, p in enumerate(params)
    ]
    launch(ops, logits, rows).finish()  # warm-up (allocations, page-locked ring)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = launch(ops, logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = pending.finish()
    assert len(out) == 16 and all(0 <= s.token < V for s in out)
    assert np.all(np.isfinite([s.logprob for s in out if s.logprob is not None]))
