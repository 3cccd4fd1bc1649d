"""MLX on the SmolLM2 GGUF against transformers' GGUF reference (torch, fp32).

Both models get the same token ids (our chat-templated prompts), so this compares the
model math, not the tokenizers (tokenizers are compared in test_tokenizer.py).  The reference's
and MLX's runs are computed once per test run and shared with test_reference_torch.py
(tests/reference_runs.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHAT_PROMPTS, needs_mlx
from reference_runs import mlx_run, reference
from tolerances import transformer_logits_tol

pytestmark = [needs_mlx, pytest.mark.slow]

N_TOKENS = 16
# MLX multiplies with the GGUF's 4-bit codes and fp16 scales/mins in fp32 (quantized
# matmul); the reference dequantizes the same codes to fp32 weights first.  The products
# are the same numbers summed in another order, so first-step logits agree to fp32
# accumulation error over 30 layers: the rounding bound of tests/tolerances.py (widths
# <= 1536, 181 chained reductions: ~5e-4 of the largest logit, ~1e-2 at logits of ~20).
# The argmax is compared exactly as well.


def test_greedy_and_logits_match_reference(mlx_llm, request):
    worst = 0.0
    for prompt in CHAT_PROMPTS:
        ids = mlx_llm.engine.chat_prompt([{"role": "user", "content": prompt}])
        ref_tokens, ref_logits, ref_config = reference(request, ids, N_TOKENS)
        tokens, logits = mlx_run(mlx_llm, ids, N_TOKENS)
        assert len(ref_tokens) == N_TOKENS
        assert tokens == ref_tokens, f"greedy tokens differ for {prompt!r}"
        diff = float(np.max(np.abs(logits - ref_logits)))
        worst = max(worst, diff)
        tol = transformer_logits_tol(ref_config, float(np.abs(ref_logits).max()), len(ids))
        assert diff <= tol, f"first-step logits differ by {diff} (bound {tol:.2e}) for {prompt!r}"
        assert int(np.argmax(logits)) == int(np.argmax(ref_logits))
    print(f"max |logit diff| over {len(CHAT_PROMPTS)} prompts: {worst:.2e}")
