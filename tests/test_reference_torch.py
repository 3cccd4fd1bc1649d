"""torch backend on the SmolLM2 GGUF: against transformers' GGUF reference, and against MLX."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHAT_PROMPTS, needs_mlx, needs_torch
from reference_runs import mlx_run, reference
from tolerances import transformer_logits_tol

pytestmark = [needs_torch, pytest.mark.slow]

N_TOKENS = 32
# Both sides hold the same fp32 weights (gguf-py's dequantization, Q/K rows un-permuted by
# us and by transformers); only the kernels and summation order differ, so logits agree to
# the fp32 rounding bound of tests/tolerances.py (30 blocks, widths <= 1536: ~5e-4 of the
# largest logit).
# Against MLX: MLX multiplies the 4-bit codes with fp16 scales in its quantized kernel; torch
# multiplies pre-dequantized fp32 weights.  Same numbers, different order (and at most one more
# rounding per weight): the same bound.
# The reference's and MLX's runs are computed once per test run and shared with test_reference_mlx.py
# (tests/reference_runs.py).


@pytest.fixture(scope="module")
def torch_greedy(torch_llm) -> dict[str, tuple[list[int], list[int]]]:
    """Each chat prompt's token ids and torch's N_TOKENS greedy tokens (ignore_eos), for both tests: the five prompts
    as one batch (torch_llm runs 4 at a time; batched greedy equals one-at-a-time greedy token for token,
    tests/test_batching.py), ~3 s where one at a time took ~8 s.  The MLX test compares the first 16: a shorter
    greedy run is a prefix of a longer one (token i depends on tokens < i only)."""
    from swiftlm.sampling import SamplingParams

    ids = [torch_llm.engine.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    outs = torch_llm.generate(ids, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == N_TOKENS for o in outs)
    return {p: (i, o.token_ids) for p, i, o in zip(CHAT_PROMPTS, ids, outs, strict=True)}


def _torch_logits(llm, ids):
    model = llm.engine.model
    model.free([-1])
    x = model.logits(-1, ids, 0).float().numpy()
    model.free([-1])
    return x


def test_torch_matches_transformers_reference(torch_llm, torch_greedy, request):
    worst = 0.0
    for prompt in CHAT_PROMPTS:
        ids, tokens = torch_greedy[prompt]
        ref_tokens, ref_logits, ref_config = reference(request, ids, N_TOKENS)
        assert len(ref_tokens) == N_TOKENS
        assert tokens == ref_tokens, prompt
        diff = float(np.max(np.abs(_torch_logits(torch_llm, ids) - ref_logits)))
        worst = max(worst, diff)
        tol = transformer_logits_tol(ref_config, float(np.abs(ref_logits).max()), len(ids))
        assert diff <= tol, (prompt, diff, tol)
    print(f"torch vs transformers: max |logit diff| {worst:.2e}")


@needs_mlx
def test_mlx_and_torch_agree(torch_llm, torch_greedy, mlx_llm):
    worst = 0.0
    for prompt in CHAT_PROMPTS:
        ids, tokens = torch_greedy[prompt]
        assert ids == mlx_llm.engine.chat_prompt([{"role": "user", "content": prompt}])
        mlx_tokens, mlx_logits = mlx_run(mlx_llm, ids, 16)
        torch_logits = _torch_logits(torch_llm, ids)
        diff = float(np.max(np.abs(torch_logits - mlx_logits)))
        worst = max(worst, diff)
        tol = transformer_logits_tol(torch_llm.engine.model.module.a, float(np.abs(torch_logits).max()), len(ids))
        assert diff <= tol, (prompt, diff, tol)
        assert tokens[:16] == mlx_tokens, prompt
    print(f"mlx vs torch: max |logit diff| {worst:.2e}")
