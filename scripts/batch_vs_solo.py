#!/usr/bin/env python3
"""Do greedy outputs of N concurrent requests equal their solo runs?

    python scripts/batch_vs_solo.py --model DIR [--backend torch] [--requests 64] [--tokens 64] [--json out.json]

Sends N different prompts at once (one ``LLM.generate`` call: they are batched, their prompts packed), then each
alone, greedy (temperature 0, EOS ignored, prompt cache off), and reports the fraction whose tokens are equal and,
for each that differs, the first differing position.  On the CPU (fp32) the engine's tests require all equal; on
CUDA in bf16 a batch computes each row's matmuls with other tile shapes than a lone row (cuBLAS picks kernels by
the row count), so near-ties can flip: this measures how often.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("SWIFTLM_ENGINE_PROCESS", "off")
    from swiftlm import LLM, SamplingParams

    llm = LLM(a.model, backend=a.backend, parallel=a.requests, prompt_cache_bytes=0, ctx_size=1024)
    rng = random.Random(0)
    vocab = llm.engine.model.info.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(8, 48))] for _ in range(a.requests)]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    try:
        batched = [o.token_ids for o in llm.generate(prompts, params)]
        solo = [llm.generate([p], params)[0].token_ids for p in prompts]
    finally:
        llm.close()
    diffs = []
    for i, (b, s) in enumerate(zip(batched, solo)):
        if b != s:
            first = next((j for j, (x, y) in enumerate(zip(b, s)) if x != y), min(len(b), len(s)))
            diffs.append({"request": i, "first_difference": first})
    out = {
        "model": a.model or "bundled SmolLM2",
        "backend": a.backend,
        "host": platform.node(),
        "requests": a.requests,
        "tokens": a.tokens,
        "equal": a.requests - len(diffs),
        "fraction_equal": round((a.requests - len(diffs)) / a.requests, 4),
        "differ": diffs,
    }
    try:
        import torch

        if torch.cuda.is_available():
            out["device"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    print(
        json.dumps({k: v for k, v in out.items() if k != "differ"}),
        "first differences:",
        sorted(d["first_difference"] for d in diffs),
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
