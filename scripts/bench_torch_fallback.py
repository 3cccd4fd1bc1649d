#!/usr/bin/env python3
"""Native torch path vs the transformers fallback on the same llama checkpoint (CPU, fp32):
decode tokens/s through the engine, one run each, greedy, same prompts.

    python scripts/bench_torch_fallback.py CKPT_DIR [--streams 1 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(path: str, streams: int, tokens: int, fallback: bool) -> float:
    from unittest import mock

    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    patch = mock.patch(
        "swiftlm.backends.torch.fallback.path_for", return_value="transformers fallback" if fallback else "native"
    )
    with patch:
        llm = LLM(path, backend="torch", parallel=streams)
    try:
        prompts = [[1, 200 + i, 300, 400, 500, 600, 700, 800] for i in range(streams)]
        p = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        t = time.perf_counter()
        outs = llm.generate(prompts, p)
        dt = time.perf_counter() - t
        return sum(len(o.token_ids) for o in outs) / dt
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    for s in a.streams:
        nat, fb = run(a.ckpt, s, a.tokens, False), run(a.ckpt, s, a.tokens, True)
        print(f"streams {s}: native {nat:.1f} tok/s, transformers fallback {fb:.1f} tok/s, ratio {nat / fb:.2f}x")


if __name__ == "__main__":
    main()
