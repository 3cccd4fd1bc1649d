#!/usr/bin/env python3
"""Decode tok/s and time-to-first-token: swiftlm's Python API vs mlx-lm's stream_generate,
on the same loaded model, the same prompt tokens and greedy sampling, in one process.

    python scripts/bench_generate.py [--model smollm2-135m-instruct] [--tokens 64] [--repeats 3]

Runs alternate (mlx-lm, swiftlm, mlx-lm, ...) so drift hits both; prints a table of medians
and the ratio swiftlm / mlx-lm, and writes JSON (default bench_results/bench_generate.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="bench_results/bench_generate.json")
    a = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from rich.console import Console
    from rich.table import Table

    from swiftlm import LLM, SamplingParams

    llm = LLM(a.model, backend="mlx")
    module = llm.engine.model.module
    ids = llm.engine.chat_prompt([{"role": "user", "content": a.prompt}])
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)

    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    wrap = TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=llm.tokenizer.tok))
    wrap._eos_token_ids = set()  # generate exactly --tokens on both sides (like ignore_eos)

    def run_mlx_lm():
        t0 = time.perf_counter()
        first = last = None
        n = 0
        toks = []
        for r in stream_generate(module, wrap, mx.array(ids), max_tokens=a.tokens, sampler=make_sampler(0.0)):
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
            toks.append(r.token)
        return first - t0, (n - 1) / (last - first), toks

    def run_swiftlm():
        t0 = time.perf_counter()
        first = last = None
        n = 0
        toks = []
        for d in llm.stream(ids, params):
            if not d.token_ids:
                continue
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(d.token_ids)
            toks += d.token_ids
        return first - t0, (n - 1) / (last - first), toks

    run_mlx_lm()  # warm-up both paths
    run_swiftlm()
    res = {"mlx_lm": {"ttft": [], "tps": []}, "swiftlm": {"ttft": [], "tps": []}}
    same = True
    for _ in range(a.repeats):
        for name, fn in (("mlx_lm", run_mlx_lm), ("swiftlm", run_swiftlm)):
            ttft, tps, toks = fn()
            res[name]["ttft"].append(ttft)
            res[name]["tps"].append(tps)
            res[name]["tokens"] = toks
    same = res["mlx_lm"].pop("tokens") == res["swiftlm"].pop("tokens")
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in res.items()}
    table = Table(
        title=f"generate: {llm.spec.name}, {len(ids)} prompt tokens, {a.tokens} new, "
        f"{mx.default_device()} ({platform.machine()})"
    )
    for col in ("runner", "TTFT s (median)", "decode tok/s (median)"):
        table.add_column(col)
    for k in ("mlx_lm", "swiftlm"):
        table.add_row(k, f"{med[k]['ttft']:.3f}", f"{med[k]['tps']:.2f}")
    ratio_tps = med["swiftlm"]["tps"] / med["mlx_lm"]["tps"]
    ratio_ttft = med["swiftlm"]["ttft"] / med["mlx_lm"]["ttft"]
    table.add_row("ratio swiftlm/mlx-lm", f"{ratio_ttft:.3f} (lower is better)", f"{ratio_tps:.3f}")
    Console().print(table)
    print(f"identical greedy tokens: {same}")
    out = {
        "model": llm.spec.name,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "prompt_tokens": len(ids),
        "new_tokens": a.tokens,
        "repeats": a.repeats,
        "runs": res,
        "median": med,
        "decode_ratio": ratio_tps,
        "ttft_ratio": ratio_ttft,
        "identical_tokens": same,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
