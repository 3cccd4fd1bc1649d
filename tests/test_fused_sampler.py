"""The fused sampler (temperature / logit bias / greedy in one call; a CUDA graph on GPU) gives the
general batched sampler's tokens exactly, row by row, over many draws; rows that need more (top-p,
penalties, logprobs, a bias outside the vocabulary) take the general path."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from swiftlm import sampler  # noqa: E402
from swiftlm.backends.torch.ops import TorchOps  # noqa: E402
from swiftlm.sampling import SamplerState, SamplingParams  # noqa: E402

V = 1000
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class GeneralOps(TorchOps):
    sample_simple = None  # no fused path: the general one


def _rows(n: int, rng: np.random.Generator) -> list[sampler.Row]:
    rows = []
    for i in range(n):
        kind = i % 4
        bias = {
            int(t): float(b)
            for t, b in zip(rng.choice(V, rng.integers(0, 9), replace=False), rng.choice([-100.0, -2.5, 3.0, 5.0], 8))
        }
        p = SamplingParams(
            temperature=0.0 if kind == 0 else float(rng.uniform(0.2, 1.5)),
            logit_bias=bias if kind != 3 else {},
            seed=int(rng.integers(1 << 40)),
        )
        rows.append(sampler.Row(p, SamplerState(seed=p.seed)))
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_equals_general(device, dtype):
    dev = torch.device(device)
    rng = np.random.default_rng(0)
    fused_ops, general_ops = TorchOps(dev), GeneralOps(dev)
    for n, skip in ((1, 0), (3, 0), (64, 0), (3, 1)):  # the last: no greedy row (the sampler skips its argmax)
        rows_a = _rows(n + skip, np.random.default_rng(n))[skip:]
        rows_b = _rows(n + skip, np.random.default_rng(n))[skip:]
        assert any(r.params.greedy for r in rows_a) == (skip == 0)
        for step in range(6):
            logits = torch.from_numpy(rng.normal(0, 3, (n, V)).astype(np.float32)).to(dev, getattr(torch, dtype))
            host = sampler.simple_inputs(
                [r.params for r in rows_a], [r.state for r in rows_a], [r.state.draws for r in rows_a], V
            )
            assert host is not None  # these rows take the fused path
            a = sampler.launch(fused_ops, logits, rows_a).finish()
            b = sampler.launch(general_ops, logits, rows_b).finish()
            assert [s.token for s in a] == [s.token for s in b], (n, step)
            for r, s in zip(rows_a, a):  # banned tokens never drawn
                assert r.params.logit_bias.get(s.token, 0.0) > -100.0


def test_rows_needing_more_take_the_general_path():
    s = [SamplerState(seed=1)]
    base = dict(temperature=0.7)
    for extra in (
        {"top_p": 0.9},
        {"top_k": 5},
        {"min_p": 0.1},
        {"repetition_penalty": 1.2},
        {"presence_penalty": 0.5},
        {"logprobs": True},
        {"logit_bias": {V + 5: 1.0}},
        {"logit_bias": {i: 1.0 for i in range(9)}},
    ):
        p = SamplingParams(**base, **extra)
        assert sampler.simple_inputs([p], s, [0], V) is None, extra
    assert sampler.simple_inputs([SamplingParams(temperature=0.0, top_p=0.5)], s, [0], V) is not None  # greedy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", [False, True])
def test_fused_replay_does_not_synchronise(kernel):
    """Neither the captured graph of torch operations nor the Triton sampling kernels wait for the device."""
    ops = TorchOps(torch.device("cuda"), sample_kernel=kernel)
    rows = _rows(48, np.random.default_rng(5))
    logits = torch.randn(48, V, device="cuda")
    sampler.launch(ops, logits, rows).finish()  # captures the graph / compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.launch(ops, logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(pending.finish()) == 48
    assert (ops._fused is None) if kernel else bool(ops._fused.graphs)  # and it was that path that ran
