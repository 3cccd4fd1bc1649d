#!/usr/bin/env python3
"""End-to-end TurboQuant on a GPU through the Python API (the server's engine): SmolLM2 greedy with
k4v3 (16-token window, so compression happens) against the 16-bit cache, three requests decoding
together against each alone (static caches + graphed decode), pool reuse, and /health's kv stats.

    python scripts/gpu_turbo_e2e.py --model /tmp/smollm2.gguf
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    from swiftlm import LLM, SamplingParams

    llm = LLM(a.model, backend="torch", parallel=4, turbo_kv="k4v3", turbo_kv_window=16)
    prompts = [
        "Write a long story about a cat who learns to fly. Once upon a time",
        "The capital of France is Paris. Tell me more about Paris and its long history",
        "List the planets of the solar system in order from the sun, with one fact each:",
    ]
    p = SamplingParams(max_tokens=96, temperature=0)
    t0 = time.perf_counter()
    together = [o.token_ids for o in llm.generate(prompts, p)]
    t_together = time.perf_counter() - t0
    alone = [llm.generate([q], p)[0].token_ids for q in prompts]
    t0 = time.perf_counter()
    again = llm.generate([prompts[0]], p)[0]
    t_solo = time.perf_counter() - t0
    off = llm.generate([prompts[0]], SamplingParams(max_tokens=96, temperature=0, turbo_kv="off"))[0]
    model = llm.engine.model
    same = sum(x == y for x, y in zip(again.token_ids, off.token_ids))
    first_diff = next((i for i, (x, y) in enumerate(zip(again.token_ids, off.token_ids)) if x != y), None)
    out = {
        "batched_equals_solo": together == alone,
        "solo_repeat_equal": again.token_ids == alone[0],
        "k4v3_vs_16bit_equal_tokens": same,
        "first_difference_at": first_diff,
        "tokens": len(off.token_ids),
        "graph_captures": model.graphs.captures if model.graphs else None,
        "pooled_caches": {f.name: len(v) for f, v in model.seqs.turbo_free.items()},
        "solo_tok_s": len(again.token_ids) / t_solo,
        "batched_seconds": t_together,
        "k4v3_text": again.text[:200],
        "fp16_text": off.text[:200],
    }
    print(json.dumps(out, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
