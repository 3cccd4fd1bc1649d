#!/usr/bin/env python
"""MLX on a CPU: decode steps with the projections split over CPU streams (backends/mlx/cpu_split.py) against
the same model unsplit, in one process, alternating rounds.  Prints a table and writes JSON.

    python scripts/bench_mlx_cpu_split.py [--model smollm2-135m-instruct] [--rows 1 4 8] [--steps 16]
        [--rounds 2] [--slices N] [--out docs/results/mlx_cpu_split.json]

Each row of a batch decodes after a 40-token prompt; a step is one forward of [rows, 1] tokens evaluated
(no sampling, no server).  The logits of both models are compared for bit equality."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slices", type=int, default=0, help="0: the default (usable cores)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "mlx_cpu_split.json"))
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from swiftlm.backends.mlx import cpu_split
    from swiftlm.backends.mlx.model import load_model
    from swiftlm.config import Settings
    from swiftlm.registry import resolve

    spec = resolve(args.model)
    os.environ["SWIFTLM_MLX_CPU_SPLIT"] = "0"
    plain = load_model(spec, Settings(model=args.model))
    if args.slices:
        os.environ["SWIFTLM_MLX_CPU_SPLIT"] = str(args.slices)
    else:
        os.environ.pop("SWIFTLM_MLX_CPU_SPLIT")
    n = cpu_split.slices_wanted()
    split = load_model(spec, Settings(model=args.model))

    def run(model, rows: int) -> tuple[float, list]:
        cache = make_prompt_cache(model.module)
        mx.eval(model.module(mx.array([[1 + (i * 7 + r) % 500 for i in range(40)] for r in range(rows)]), cache=cache))
        outs, t0 = [], time.perf_counter()
        for s in range(args.steps):
            o = model.module(mx.array([[5 + s + r] for r in range(rows)]), cache=cache)
            mx.eval(o)
            outs.append(o)
        return (time.perf_counter() - t0) / args.steps, outs

    results = []
    for rows in args.rows:
        run(plain, rows), run(split, rows)  # warm-up
        tp, ts, equal = [], [], True
        for _ in range(args.rounds):
            a, oa = run(plain, rows)
            b, ob = run(split, rows)
            tp.append(a)
            ts.append(b)
            equal = equal and all(mx.array_equal(x, y).item() for x, y in zip(oa, ob))
        p, s = statistics.median(tp), statistics.median(ts)
        results.append(
            {
                "rows": rows,
                "plain_ms": round(p * 1e3, 2),
                "split_ms": round(s * 1e3, 2),
                "plain_tok_s": round(rows / p, 2),
                "split_tok_s": round(rows / s, 2),
                "speedup": round(p / s, 3),
                "logits_equal": equal,
            }
        )
    print(
        f"MLX {mx.__version__}, {args.model}, {n} slices, {os.cpu_count()} CPUs, median of {args.rounds} rounds "
        f"of {args.steps} steps"
    )
    print(f"{'rows':>4} {'plain ms':>9} {'split ms':>9} {'plain tok/s':>11} {'split tok/s':>11} {'ratio':>6} equal")
    for r in results:
        print(
            f"{r['rows']:>4} {r['plain_ms']:>9} {r['split_ms']:>9} {r['plain_tok_s']:>11} {r['split_tok_s']:>11} "
            f"{r['speedup']:>5}x {r['logits_equal']}"
        )
    out = {
        "model": args.model,
        "mlx": mx.__version__,
        "slices": n,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "steps": args.steps,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
