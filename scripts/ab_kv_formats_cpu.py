#!/usr/bin/env python3
"""KV formats against 16-bit KV in one process, interleaved step by step: a diagnostic for a busy machine.

Through HTTP (``bench_kv_formats_serve.py``) each format's prompt and decode run at their own minutes, so on a
shared CPU another process's load lands on one format and not the other.  Here the torch model (default: the bundled
SmolLM2) runs one prompt per format, chunk by chunk (``--prefill-size``) with the formats taking turns, then decode
steps with the formats taking turns; each step is timed.  Reported per format: prompt time (sum over its chunks) and
its ratio to 16-bit, the median decode step and ``decode`` = the median over rounds of the ratio 16-bit step / the
format's step taken within one round.  The model's forward is the engine's, not its scheduler or the server.

    OMP_NUM_THREADS=1 python scripts/ab_kv_formats_cpu.py --prompt-tokens 4000 --json /tmp/ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--formats", default="16bit,k4v3,k3v2,kv8,kv4")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--prefill-size", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--no-stage",
        action="store_true",
        help="compress prompt chunks as they go (the server holds a prompt in 16 bits until it ends)",
    )
    args = ap.parse_args()
    from swiftlm.backends.torch.compressed_cache import CompressedCache, StageBudget
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve
    from swiftlm.turboquant.presets import affine, parse_turbo

    tm = load_model(resolve(args.model), None)
    m, a, dev = tm.module, tm.module.a, torch.device("cpu")
    names = [n.strip() for n in args.formats.split(",")]

    def cache(name: str):
        if name == "16bit":
            return SeqCache(a, torch.float32, dev)
        fmt = affine(int(name[2:]), 64) if name.startswith("kv") else parse_turbo(name)
        stage = None if args.no_stage else StageBudget()
        return CompressedCache(a, fmt, torch.float32, dev, dense_dtype=torch.float16, stage=stage)

    N = args.prompt_tokens
    toks = torch.randint(0, a.vocab, (N + args.decode_steps + 1,), generator=torch.Generator().manual_seed(0))
    caches = {n: cache(n) for n in names}
    prefill = {n: 0.0 for n in names}
    steps: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for n in names:  # warm-up (numba compilation, allocator): a short prompt with codes, two decode steps
            c = cache(n)
            m(toks[:300], c, 0)
            m(toks[300:301], c, 300)
            m(toks[301:302], c, 301)
        for s in range(0, N, args.prefill_size):
            for n in names:
                t0 = time.perf_counter()
                m(toks[s : min(N, s + args.prefill_size)], caches[n], s)
                prefill[n] += time.perf_counter() - t0
        for i in range(args.decode_steps):
            for n in names:
                t0 = time.perf_counter()
                m(toks[N + i : N + i + 1], caches[n], N + i)
                steps[n].append(time.perf_counter() - t0)
    rows = []
    for n in names:
        per_round = [b / x for b, x in zip(steps["16bit"], steps[n])]
        rows.append(
            {
                "format": n,
                "prefill_s": round(prefill[n], 3),
                "prefill_ratio": round(prefill[n] / prefill["16bit"], 3),
                "decode_ms_p50": round(1e3 * statistics.median(steps[n]), 2),
                "decode": round(statistics.median(per_round), 3),
                "first_decode_ms": round(1e3 * steps[n][0], 2),  # a staged prompt is compressed in this step
            }
        )
    print(f"{'format':<8}{'prompt s':>10}{'x':>7}{'step ms':>10}{'decode x':>10}{'1st step ms':>13}")
    for r in rows:
        print(
            f"{r['format']:<8}{r['prefill_s']:>10.2f}{r['prefill_ratio']:>7.2f}{r['decode_ms_p50']:>10.2f}"
            f"{r['decode']:>10.3f}{r['first_decode_ms']:>13.1f}"
        )
    if args.json:
        doc = {"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
