"""Batched decoding (several sequences' decode rows in one forward pass) against each
request run alone."""

from __future__ import annotations

import pytest
from conftest import BACKENDS, HAS_MLX, needs_torch

from swiftlm import SamplingParams

TOPICS = [
    "cats",
    "the long history of ancient Rome and its emperors",
    "Python programming",
    "a long and winding road through the mountains",
    "prime numbers and their many curious properties",
    "the deep blue sea",
    "music theory, harmony and counterpoint in the baroque era of European music",
    "the sky and why it is blue during the day but red at sunset and black at night",
]


@needs_torch
@pytest.mark.slow
def test_eight_concurrent_greedy_requests_equal_solo_runs(torch_llm):
    """fp32 on CPU.  The batched matmuls compute each row with the same dot products as a
    one-row matmul; if the BLAS blocking ever made a last-bit difference, a greedy flip would
    need two logits within ~1e-6 of each other, which SmolLM2's peaked distributions do not
    produce on these prompts, so the tokens must be identical."""
    from swiftlm import LLM

    chats = [[{"role": "user", "content": f"Tell me about {t}."}] for t in TOPICS]
    assert len({len(torch_llm.engine.chat_prompt(c)) for c in chats}) == len(chats)  # all lengths differ
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    solo = [torch_llm.generate(c, p).token_ids for c in chats]  # one by one
    batched = LLM(backend="torch", parallel=8)
    try:
        outs = batched.generate(chats, p)  # all eight at once: decode rows share each step
        assert batched.engine.stats.steps < 8 * 20  # they really were batched
    finally:
        batched.close()
    assert [o.token_ids for o in outs] == solo


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_budget_preempts_and_recomputes_exactly(tiny_llama, backend):
    """A KV budget of ~1.3 contexts for four concurrent sequences: admission waits, running
    sequences outgrow it, the newest are preempted and recomputed from prompt + output.
    Greedy outputs equal each request run alone, nothing fails, and the budget is never
    exceeded at a step boundary."""
    from swiftlm import LLM

    prompts = ["a b c", "the cat sat on the mat and", "one two three four five six", "x y"]
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    solo_llm = LLM(str(tiny_llama), backend=backend, ctx_size=96, prompt_cache_bytes=0)
    try:
        solo = [solo_llm.generate(q, p).token_ids for q in prompts]
        per_token = solo_llm.engine.info.kv_bytes_per_token
    finally:
        solo_llm.close()
    llm = LLM(
        str(tiny_llama), backend=backend, ctx_size=96, parallel=4, prompt_cache_bytes=0, kv_budget_bytes=128 * per_token
    )
    try:
        sched = llm.engine.scheduler
        seen: list[int] = []
        orig = sched.schedule

        def watched():
            batch = orig()
            seen.append(sum(s.kv_demand for s in sched.running))
            return batch

        sched.schedule = watched
        outs = llm.generate(prompts, p)
        assert sched.preemptions > 0
        assert max(seen) <= sched.kv_budget
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == solo
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.skipif(not HAS_MLX, reason="mlx / mlx-lm not installed on this machine")
def test_mlx_batched_decode_equals_solo(mlx_llm):
    """MLX: decode rows of several sequences go through the model as one [B, 1] batch over
    merged (left-padded) BatchKVCaches; SmolLM2 fp32 on CPU gives each request's solo tokens."""
    chats = [[{"role": "user", "content": q}] for q in ("Hi.", "Name a color.", "What is two plus two?", "Yes?")]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    solo = [mlx_llm.generate(c, p).token_ids for c in chats]
    steps = mlx_llm.engine.stats.steps
    outs = mlx_llm.generate(chats, p)  # mlx_llm runs with --parallel 4
    assert mlx_llm.engine.stats.steps - steps < 4 * 8  # decode rows shared steps
    assert [o.token_ids for o in outs] == solo
