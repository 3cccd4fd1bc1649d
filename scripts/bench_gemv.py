#!/usr/bin/env python3
"""Decode-step linear layers at a few rows on the GPU: cuBLAS (``F.linear``) against the Triton
small-M kernel (``cuda_ext/gemv.py``, a sweep of its tilings and its default), each as achieved bandwidth
(weight bytes / time) as a fraction of the data sheet's HBM bandwidth; each call reads a different copy of
the weight (more bytes than L2 holds), as a decode step does.  Timed as CUDA graphs of 20 calls (no host
launch cost in the figure).  Writes JSON.

    python scripts/bench_gemv.py --json docs/results/gemv_h100.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform

SHAPES = {  # name: (N, K) of w
    "1b.qkv": (3072, 2048),
    "1b.o": (2048, 2048),
    "1b.gate_up": (16384, 2048),
    "1b.down": (2048, 8192),
    "1b.lm_head": (49152, 2048),
    "8b.qkv": (6144, 4096),
    "8b.o": (4096, 4096),
    "8b.gate_up": (28672, 4096),
    "8b.down": (4096, 14336),
    "8b.lm_head": (49152, 4096),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from swiftlm.cuda_ext.gemv import _config, linear_small_m

    dev = torch.device("cuda")
    torch.manual_seed(0)

    def graph_time(fn, reps=24, iters=20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / (reps * iters) * 1e-3  # seconds per call

    name_gpu = torch.cuda.get_device_name()
    sheet_bw = 4.8e12 if "H200" in name_gpu else 3.35e12  # the data sheet's HBM bandwidth (H100 SXM / H200)
    big = torch.ones(2**29, dtype=torch.bfloat16, device=dev)
    read_bw = big.numel() * 2 / graph_time(lambda: big.sum(), reps=5, iters=10)  # what a streaming read reaches
    del big
    print(f"{name_gpu}: data sheet {sheet_bw / 1e12:.2f} TB/s, a 1 GB sum() reads at {read_bw / 1e12:.2f} TB/s")
    rows = []
    for M in [int(m) for m in a.rows.split(",")]:
        for name, (N, K) in SHAPES.items():
            # several copies of the weight, used in turn, more bytes than the L2 cache (50 MB): each call
            # reads its weight from HBM, as in a decode step (one layer's matrix, then the next layer's)
            byts = N * K * 2
            ws = [
                torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
                for _ in range(max(2, -(-300_000_000 // byts)))
            ]
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = ws[0]
            ref = x.float() @ w.float().T
            it = [0]

            def nxt():
                it[0] += 1
                return ws[it[0] % len(ws)]

            t_cub = graph_time(lambda: torch.nn.functional.linear(x, nxt()))
            best = None
            for bn, bk, sp, nw in itertools.product((4, 8, 16, 32, 64), (256, 512, 1024, 2048), (1, 2, 4), (4, 8)):
                if M > 1 and (bn < 16 or bk > 256):
                    continue
                cfg = (bn, bk, sp, nw)
                try:
                    y = linear_small_m(x, w, cfg)
                    err = (y.float() - ref).abs().max().item()
                    t = graph_time(lambda: linear_small_m(x, nxt(), cfg), reps=len(ws) * 2, iters=10)
                except Exception as e:  # a tiling this GPU cannot run (shared memory): skip it
                    print(f"  {name} M={M} {cfg}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            dflt = _config(M, K)
            t_def = graph_time(lambda: linear_small_m(x, nxt()))
            r = {
                "shape": name,
                "M": M,
                "N": N,
                "K": K,
                "mb": round(byts / 1e6, 1),
                "cublas_us": round(t_cub * 1e6, 2),
                "cublas_frac_datasheet": round(byts / t_cub / sheet_bw, 3),
                "triton_best_us": round(best[0] * 1e6, 2),
                "triton_best_cfg": best[1],
                "triton_best_frac": round(byts / best[0] / sheet_bw, 3),
                "triton_best_max_err": best[2],
                "triton_default_cfg": dflt,
                "triton_default_us": round(t_def * 1e6, 2),
            }
            rows.append(r)
            print(
                f"M={M} {name:12s} {r['mb']:7.1f} MB  cuBLAS {r['cublas_us']:7.2f} us ({r['cublas_frac_datasheet']:.0%})"
                f"  triton best {r['triton_best_us']:7.2f} us ({r['triton_best_frac']:.0%}) {best[1]}"
                f"  default {r['triton_default_us']:7.2f} us  err {best[2]:.3g}",
                flush=True,
            )
    if a.json:
        json.dump(
            {
                "gpu": torch.cuda.get_device_name(),
                "host": platform.node(),
                "datasheet_Bps": sheet_bw,
                "sum_read_Bps": read_bw,
                "rows": rows,
            },
            open(a.json, "w"),
            indent=1,
        )


if __name__ == "__main__":
    main()
