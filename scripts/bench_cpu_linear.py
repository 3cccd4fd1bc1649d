#!/usr/bin/env python3
"""fp32 linear layers on this CPU, the way a decode step runs them: every matrix of a model's layers once
per step (so they stream from DRAM, not from cache), for 1 / 4 / 16 rows, through

  mkl         ``F.linear`` (x @ W^T; the torch backend's path for weights without a packed copy, with
              ``rows_linear``'s (W @ x^T)^T for 3-64 rows)
  onednn      oneDNN's prepacked weights (``torch.ops.mkldnn._reorder_linear_weight(w, hint)`` once, then
              ``_linear_pointwise`` per call): a second, blocked copy of every weight -- the torch backend's
              CPU path (``backends/torch/cpu_packed.py``, hint 64).  The hint is the row count oneDNN picks
              its blocking for: a hint of 1 is slower at 3-64 rows

Fewer than three rows are padded to three on both paths, as ``rows_linear`` does.

and the LM head alone (the largest single matrix).  Reported: ms per pass, GB/s of weights read, and
the speed-up over mkl measured in the same run; the streaming-read bandwidth (a sum over 1 GiB) is the
bound.  Default shapes: SmolLM2-135M (hidden 576, 30 layers, 9/3 heads of 64, MLP 1536, vocab 49152).

    python scripts/bench_cpu_linear.py [--rows 1,4,16] [--hint 64] [--json docs/results/bench_cpu_linear_packed.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(fn, reps: int = 7) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--hint", type=int, default=64, help="oneDNN's row-count hint for the packed layout")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    H, I = a.hidden, a.intermediate
    qkv = (a.heads + 2 * a.kv_heads) * a.head_dim
    shapes = [(qkv, H), (H, a.heads * a.head_dim), (2 * I, H), (H, I)]
    layers = [[torch.randn(n, k) / k**0.5 for n, k in shapes] for _ in range(a.layers)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, a.hint) for w in ws] for ws in layers]
    head = torch.randn(a.vocab, H) / H**0.5
    head_p = torch.ops.mkldnn._reorder_linear_weight(head, a.hint)
    layer_bytes = sum(w.numel() * 4 for ws in layers for w in ws)
    big = torch.randn(256 * 1024 * 1024)  # 1 GiB: the streaming-read bound
    read_gbs = big.numel() * 4 / timed(lambda: big.sum(), 5) / 1e9
    del big

    def pad(x):  # one or two rows padded to three (MKL's GEMV is the slow path here)
        return torch.cat([x, x.new_zeros(3 - x.shape[0], x.shape[1])]) if x.shape[0] < 3 else x

    def mkl(w, x):  # as backends/torch/linear_rows.py rows_linear did before the packed weights
        x = pad(x)
        return (w @ x.t()).t() if x.shape[0] <= 64 else F.linear(x, w)

    def onednn(p, x):
        return torch.ops.mkldnn._linear_pointwise(pad(x), p, None, "none", [], "")

    rows_out = []
    for rows in [int(r) for r in a.rows.split(",")]:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        t_mkl = timed(lambda: [mkl(w, xs[w.shape[1]]) for ws in layers for w in ws])
        t_dnn = timed(lambda: [onednn(p, xs[w.shape[1]]) for ws, ps in zip(layers, packed) for w, p in zip(ws, ps)])
        xh = torch.randn(rows, H)
        h_mkl = timed(lambda: mkl(head, xh))
        h_dnn = timed(lambda: onednn(head_p, xh))
        # the two must compute the same function (fp32 rounding apart)
        ref, got = mkl(head, xh), onednn(head_p, xh)
        err = float((ref - got).abs().max() / ref.abs().max())
        rows_out.append(
            {
                "rows": rows,
                "layers_mkl_ms": round(t_mkl * 1e3, 2),
                "layers_onednn_ms": round(t_dnn * 1e3, 2),
                "layers_speedup": round(t_mkl / t_dnn, 2),
                "layers_mkl_gbs": round(layer_bytes / t_mkl / 1e9, 1),
                "layers_onednn_gbs": round(layer_bytes / t_dnn / 1e9, 1),
                "head_mkl_ms": round(h_mkl * 1e3, 2),
                "head_onednn_ms": round(h_dnn * 1e3, 2),
                "head_speedup": round(h_mkl / h_dnn, 2),
                "head_rel_err": err,
            }
        )
    print(
        f"streaming read bound: {read_gbs:.1f} GB/s; layer weights {layer_bytes / 1e6:.0f} MB, "
        f"head {head.numel() * 4 / 1e6:.0f} MB; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("| rows | layers: mkl ms (GB/s) | oneDNN packed ms (GB/s) | x | head: mkl ms | oneDNN ms | x |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(
            f"| {r['rows']} | {r['layers_mkl_ms']} ({r['layers_mkl_gbs']}) | {r['layers_onednn_ms']} "
            f"({r['layers_onednn_gbs']}) | {r['layers_speedup']} | {r['head_mkl_ms']} | {r['head_onednn_ms']} | "
            f"{r['head_speedup']} |"
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "what": "fp32 linears of one decode step (every layer matrix once) on this CPU: MKL (F.linear) "
                    "vs oneDNN prepacked weights (the torch backend's CPU path)",
                    "shapes": vars(a),
                    "read_bound_gbs": round(read_gbs, 1),
                    "host": {
                        "machine": platform.machine(),
                        "threads": torch.get_num_threads(),
                        "torch": torch.__version__,
                    },
                    "rows": rows_out,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
