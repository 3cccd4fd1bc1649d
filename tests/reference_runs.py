"""The runs the reference tests compare, each computed once per test run (``conftest.run_once``) however many
tests and xdist workers compare against it: the transformers GGUF reference's greedy tokens and first-step logits
(test_reference_mlx.py, test_reference_torch.py) and MLX's (test_reference_mlx.py, test_reference_torch.py's MLX
against torch).  Loading the reference (``hf_reference``) and MLX's CPU prefill are the expensive parts."""

from __future__ import annotations

import hashlib
import json

import numpy as np
from conftest import run_once

# The longest greedy run any test asks of the reference.  A shorter run is its prefix: the greedy loop below
# computes token i from tokens < i only, with the same operations on the same inputs.
REF_TOKENS = 32


def _key(tag: str, ids: list[int], *extra) -> str:
    return tag + "-" + hashlib.sha256(json.dumps([ids, *extra]).encode()).hexdigest()[:24]


def ref_greedy(model, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
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


def reference(request, ids: list[int], n: int):
    """(greedy tokens, first-step logits, config) of transformers' reference on ``ids``; ``hf_reference`` is loaded
    (through ``request``) only by the worker that computes it."""
    assert n <= REF_TOKENS

    def compute():
        model = request.getfixturevalue("hf_reference")
        tokens, first = ref_greedy(model, ids, REF_TOKENS)
        return tokens, first, model.config

    tokens, first, config = run_once(_key("hf-ref", ids, REF_TOKENS), compute)
    return tokens[:n], first, config


def mlx_run(mlx_llm, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """MLX's greedy tokens (``n``, ignore_eos) and first-step logits (fp32) on ``ids``."""

    def compute():
        import mlx.core as mx

        from swiftlm.sampling import SamplingParams

        out = mlx_llm.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        model = mlx_llm.engine.model
        model.free([-1])
        logits = np.array(model.logits(-1, ids, 0).astype(mx.float32))
        model.free([-1])
        return out.token_ids, logits

    return run_once(_key("mlx", ids, n), compute)
