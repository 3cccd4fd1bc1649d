"""MLX on the SmolLM2 GGUF against transformers' GGUF reference (torch, fp32).

Both models get the same token ids (our chat-templated prompts), so this compares the
model math, not the tokenizers (tokenizers are compared in test_tokenizer.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHAT_PROMPTS, needs_mlx
from tolerances import transformer_logits_tol

pytestmark = [needs_mlx, pytest.mark.slow]

N_TOKENS = 16
# MLX multiplies with the GGUF's 4-bit codes and fp16 scales/mins in fp32 (quantized
# matmul); the reference dequantizes the same codes to fp32 weights first.  The products
# are the same numbers summed in another order, so first-step logits agree to fp32
# accumulation error over 30 layers: the rounding bound of tests/tolerances.py (widths
# <= 1536, 181 chained reductions: ~5e-4 of the largest logit, ~1e-2 at logits of ~20).
# The argmax is compared exactly as well.


def _ref_greedy(model, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy loop with the reference's KV cache; EOS is not special (as ignore_eos)."""
    import torch

    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        first = res.logits[0, -1].float().numpy()
        logits, past = res.logits[0, -1], res.past_key_values
        for _ in range(n):
            tok = int(torch.argmax(logits))
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            logits, past = res.logits[0, -1], res.past_key_values
    return out, first


def test_greedy_and_logits_match_reference(mlx_llm, hf_reference):
    import mlx.core as mx

    from swiftlm.sampling import SamplingParams

    model = mlx_llm.engine.model
    worst = 0.0
    for prompt in CHAT_PROMPTS:
        ids = mlx_llm.engine.chat_prompt([{"role": "user", "content": prompt}])
        ref_tokens, ref_logits = _ref_greedy(hf_reference, ids, N_TOKENS)
        out = mlx_llm.generate(ids, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True))
        assert out.token_ids == ref_tokens, f"greedy tokens differ for {prompt!r}"
        model.free([-1])
        logits = np.array(model.logits(-1, ids, 0).astype(mx.float32))
        model.free([-1])
        diff = float(np.max(np.abs(logits - ref_logits)))
        worst = max(worst, diff)
        tol = transformer_logits_tol(hf_reference.config, float(np.abs(ref_logits).max()), len(ids))
        assert diff <= tol, f"first-step logits differ by {diff} (bound {tol:.2e}) for {prompt!r}"
        assert int(np.argmax(logits)) == int(np.argmax(ref_logits))
    print(f"max |logit diff| over {len(CHAT_PROMPTS)} prompts: {worst:.2e}")
