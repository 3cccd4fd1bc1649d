#!/usr/bin/env python3
"""Device time of one sampling call on CUDA: the Triton sampling kernels (``cuda_ext/sample_kernel.py``) against the
captured graph of torch operations they replace (``backends/torch/fused_sampler.py``), per batch size and vocabulary.

    python scripts/bench_sample_kernel.py [--json out.json] [--calls 50] [--reps 5]

Each timing: a ~5 ms matmul is queued first so that the host can queue ``--calls`` sampling calls (inputs' upload
included, as in serving) behind it; CUDA events around the calls give their device time, divided by the calls
(the host's launch cost is hidden, as behind a decode step).  Median over ``--reps``.  Rows are temperature 0.6
with no greedy row (the server's default request), as ``swiftlm bench serve`` sends them.  The two paths' tokens
are compared too (equal except where a row's uniform falls within float32 rounding of a CDF boundary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="1x49152,8x49152,64x49152,128x49152,1x128256,64x128256,128x128256")
    args = ap.parse_args()
    from swiftlm import sampler
    from swiftlm.backends.torch.ops import TorchOps

    dev = torch.device("cuda")
    paths = {"torch graph": TorchOps(dev, sample_kernel=False), "triton kernels": TorchOps(dev, sample_kernel=True)}
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    rows = []
    for shape in args.shapes.split(","):
        B, V = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cpu").manual_seed(B * 7 + V)
        logits = (torch.randn(B, V, generator=g) * 3).to(dev, torch.bfloat16)
        host = np.zeros((B, 3 + 2 * sampler.SIMPLE_BIAS), np.float32)
        host[:, 0] = 0.6
        host[:, 1] = np.random.default_rng(B).random(B)
        toks = {name: ops.sample_simple(logits, host).cpu() for name, ops in paths.items()}  # warm-up / capture
        row = {"batch": B, "vocab": V, "tokens_equal": int((toks["torch graph"] == toks["triton kernels"]).sum())}
        for name, ops in paths.items():
            times = []
            for _ in range(args.reps):
                for _ in range(3):
                    big @ big  # ~5 ms of device work queued ahead
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(args.calls):
                    ops.sample_simple(logits, host)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / args.calls)
            row[name] = round(statistics.median(times), 2)
        row["speed-up"] = round(row["torch graph"] / row["triton kernels"], 2)
        rows.append(row)
        print(
            f"B={B:4d} V={V:6d}  torch graph {row['torch graph']:7.2f} us  triton kernels {row['triton kernels']:7.2f} us"
            f"  x{row['speed-up']:.2f}  tokens equal {row['tokens_equal']}/{B}",
            flush=True,
        )
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "calls": args.calls,
        "reps": args.reps,
        "unit": "us of device time per sampling call (median)",
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
