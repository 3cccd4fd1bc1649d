"""The batched sampler (swiftlm/sampler.py): a batch equals each row sampled alone, on every
ops shim; the draw follows the distribution; one transfer per step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import HAS_MLX, HAS_TORCH

from swiftlm.sampler import Row, launch, sample_row, uniforms
from swiftlm.sampling import NumpyOps, SamplerState, SamplingParams

OPS = ["numpy"] + (["mlx"] if HAS_MLX else []) + (["torch"] if HAS_TORCH else [])
V = 300


@pytest.fixture(params=OPS)
def ops(request):
    if request.param == "numpy":
        return NumpyOps(), lambda a: np.asarray(a, dtype=np.float32)
    if request.param == "torch":
        import torch

        from swiftlm.backends.torch.ops import TorchOps

        return TorchOps(torch.device("cpu")), lambda a: torch.tensor(np.asarray(a, dtype=np.float32))
    import mlx.core as mx

    from swiftlm.backends.mlx.ops import MLXOps

    return MLXOps(), lambda a: mx.array(np.asarray(a, dtype=np.float32))


def _mixed_params(n: int, rng: np.random.Generator) -> list[SamplingParams]:
    """Every knob, in every combination the rows happen to draw."""
    out = []
    for i in range(n):
        kind = i % 8
        p = SamplingParams(temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])), seed=int(rng.integers(1 << 40)))
        if kind == 1:
            p.top_k = int(rng.integers(1, 40))
        elif kind == 2:
            p.top_p = float(rng.uniform(0.1, 0.95))
        elif kind == 3:
            p.min_p = float(rng.uniform(0.01, 0.3))
        elif kind == 4:
            p.repetition_penalty = 1.3
            p.presence_penalty, p.frequency_penalty = 0.5, 0.25
        elif kind == 5:
            p.logit_bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, V, 5)}
        elif kind == 6:
            p.logprobs, p.top_logprobs = True, int(rng.integers(0, 5))
        elif kind == 7:
            p.top_k, p.top_p, p.min_p, p.logprobs = 20, 0.8, 0.05, True
        out.append(p.validate(V))
    return out


def _states(params, rng):
    st = []
    for p in params:
        s = SamplerState(
            seed=p.seed, prompt_tokens=rng.integers(0, V, 12).tolist(), output_tokens=rng.integers(0, V, 7).tolist()
        )
        st.append(s)
    return st


def test_a_batch_equals_each_row_alone(ops):
    """Every row of a 64-row batch with mixed settings gives the token (and logprobs) it gives
    alone: the per-row arithmetic does not depend on the other rows."""
    o, arr = ops
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (64, V)).astype(np.float32)
    params = _mixed_params(64, rng)
    states = _states(params, np.random.default_rng(1))
    alone_states = _states(params, np.random.default_rng(1))
    for step in range(3):
        batch = launch(o, arr(logits), [Row(p, s) for p, s in zip(params, states)]).finish()
        alone = [sample_row(o, arr(logits[r]), params[r], alone_states[r]) for r in range(64)]
        assert [b.token for b in batch] == [a[0] for a in alone], step
        for b, a in zip(batch, alone):
            assert (b.logprob is None) == (a[1] is None)
            if b.logprob is not None:
                assert b.logprob == a[1] and b.top_logprobs == a[2]
        for s, b in zip(states + alone_states, batch + batch):
            s.output_tokens.append(b.token)


def test_shims_agree_with_the_numpy_reference(ops):
    """Same uniforms, same masks: torch / mlx draw the reference's tokens.  A float32 cumsum in
    another order could only move a draw whose uniform lies within ~1e-6 of a boundary."""
    o, arr = ops
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (32, V)).astype(np.float32)
    params = _mixed_params(32, rng)
    ref = launch(NumpyOps(), logits, [Row(p, s) for p, s in zip(params, _states(params, np.random.default_rng(3)))])
    got = launch(o, arr(logits), [Row(p, s) for p, s in zip(params, _states(params, np.random.default_rng(3)))])
    r, g = ref.finish(), got.finish()
    assert [x.token for x in g] == [x.token for x in r]
    for x, y in zip(g, r):
        if x.logprob is not None:
            assert math.isclose(x.logprob, y.logprob, rel_tol=1e-5, abs_tol=1e-5)  # float32 log-softmax


def test_draws_follow_the_distribution():
    """20,000 draws from a 6-token distribution: each frequency within 4.5 standard errors of its
    probability (a false failure has probability ~1e-5 per token)."""
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    logits = np.log(probs).astype(np.float32)[None].repeat(20000, 0)
    params = SamplingParams(temperature=1.0)
    rows = [Row(params, SamplerState(seed=i)) for i in range(20000)]
    toks = np.array([s.token for s in launch(NumpyOps(), logits, rows).finish()])
    freq = np.bincount(toks, minlength=6) / len(toks)
    se = np.sqrt(probs * (1 - probs) / len(toks))
    assert np.all(np.abs(freq - probs) < 4.5 * se), (freq, probs)


def test_uniforms_are_counter_based_and_in_range():
    u = uniforms(np.arange(50000), np.zeros(50000))
    assert u.min() > 0 and u.max() <= 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    # the same (seed, counter) always gives the same value; a different counter another one
    assert uniforms([7], [3])[0] == uniforms([7, 8], [3, 3])[0] != uniforms([7], [4])[0]
    # any integer seed a request may send (negative, beyond 64 bits) is taken modulo 2**64 (schemathesis found -491945)
    assert (
        0 < uniforms([-491945, 1 << 70], [0, 0]).min() and uniforms([-1], [2])[0] == uniforms([(1 << 64) - 1], [2])[0]
    )


def test_draw_counter_advances_per_token_not_per_batch():
    p = SamplingParams(temperature=1.0)
    x = np.random.default_rng(5).normal(0, 1, (1, V)).astype(np.float32)
    a, b = SamplerState(seed=9), SamplerState(seed=9)
    seq_a = [launch(NumpyOps(), x, [Row(p, a)]).finish()[0].token for _ in range(20)]
    seq_b = [
        launch(NumpyOps(), np.repeat(x, 2, 0), [Row(p, b), Row(p, SamplerState(seed=1))]).finish()[0].token
        for _ in range(20)
    ]
    assert seq_a == seq_b and a.draws == b.draws == 20 and len(set(seq_a)) > 1


def test_plain_greedy_batch_reads_back_only_ids():
    class Counting(NumpyOps):
        transfers = 0

        def to_host(self, x):
            Counting.transfers += 1
            return super().to_host(x)

    x = np.random.default_rng(6).normal(0, 1, (16, V)).astype(np.float32)
    mixed = [SamplingParams(temperature=0)] * 8 + [
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=True, top_logprobs=3)
    ] * 8
    out = launch(Counting(), x, [Row(p, SamplerState(seed=i)) for i, p in enumerate(mixed)]).finish()
    assert Counting.transfers == 1  # ids, logprobs and top logprobs come back in one array
    assert [s.token for s in out[:8]] == np.argmax(x[:8], -1).tolist()
    assert all(len(s.top_logprobs) == 3 and s.top_logprobs[0][1] >= s.top_logprobs[1][1] for s in out[8:])
