#!/usr/bin/env python3
"""Linear layers of an 8B (Llama-3-8B shape) decode step with quantized weights on the GPU, against bf16 cuBLAS:
the FP8 and int4 decode kernels of cuda_ext/quant_gemv.py at 1 and 16 rows, and torch._scaled_mm (FP8 tensor
cores, dynamic per-row activation scales, as backends/torch/quant_linear.py calls it) at 1, 64 and 128 rows.
Each variant is checked against a float32 reference (||y - ref|| / ||ref||) and timed as a CUDA graph of calls
that each read a different copy of the weights (more bytes than L2 holds), median of repeats.  Achieved
bandwidth = weight bytes / time, beside a measured device-to-device copy bandwidth.  Kernel figures explain; the
acceptance figure of a quantized model is end-to-end decode, which needs the seam wired into the model.

    python scripts/bench_quant_linear.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_ext.quant_gemv import fp8_linear_small_m, int4_linear_small_m  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FP8_MAX = 448.0
GROUP = 128


def timed(fn_list, reps: int = 20) -> float:
    """Median seconds per call of one CUDA graph that runs every fn in ``fn_list`` once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fn_list))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = timed([lambda: y.copy_(x)], reps=10)
    return 2 * x.numel() / t


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    N, K = codes.shape
    c = codes.to(torch.int64).reshape(N, K // 8, 8)
    word = torch.zeros(N, K // 8, dtype=torch.int64, device=codes.device)
    for i in range(8):
        word |= c[:, :, i] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)


def scaled_mm(x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    sx = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    x8 = (x.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9}
    rows = []
    print(f"{out['device']}  copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'layer':8} {'rows':>4} {'variant':14} {'us':>8} {'GB/s':>7} {'x bf16':>7} {'rel err':>9}")
    totals: dict[tuple[int, str], float] = {}
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda") / math.sqrt(K)
        sw = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).float()
        w8 = (w / sw).to(torch.float8_e4m3fn)
        wg = w.reshape(N, K // GROUP, GROUP)
        lo, hi = wg.amin(-1), wg.amax(-1)
        s4 = ((hi - lo).clamp(min=1e-5) / 15).half()
        z4 = torch.round(-lo / s4.float()).clamp(0, 15)
        q4 = (torch.round(wg / s4.float()[..., None]) + z4[..., None]).clamp(0, 15).reshape(N, K)
        qw = pack_rows(q4.to(torch.int32))
        z4 = z4.half().contiguous()
        w_fp8_ref = w8.float() * sw
        g = torch.arange(K, device="cuda") // GROUP
        w_int4_ref = (q4 - z4.float()[:, g]) * s4.float()[:, g]
        wb = w.bfloat16()
        nbytes = {"bf16": N * K * 2, "fp8": N * K + N * 4, "int4": N * K // 2 + 2 * 2 * N * K // GROUP}
        copies = {k: max(2, math.ceil(4e8 / v)) for k, v in nbytes.items()}
        W = {
            "bf16": [wb.clone() for _ in range(copies["bf16"])],
            "fp8": [w8.clone() for _ in range(copies["fp8"])],
            "int4": [qw.clone() for _ in range(copies["int4"])],
        }
        del w
        for M in (1, 16, 64, 128):
            x = torch.randn(M, K, device="cuda").bfloat16()
            variants = {"bf16 cuBLAS": ("bf16", lambda wi: F.linear(x, wi), wb.float())}
            if M <= 16:
                variants["fp8 triton"] = ("fp8", lambda wi: fp8_linear_small_m(x, wi, sw), w_fp8_ref)
                variants["int4 triton"] = ("int4", lambda wi: int4_linear_small_m(x, wi, s4, z4, GROUP), w_int4_ref)
            if M != 16:
                variants["fp8 _scaled_mm"] = ("fp8", lambda wi: scaled_mm(x, wi, sw.reshape(1, N)), w_fp8_ref)
            base = None
            for vname, (kind, fn, wref) in variants.items():
                ref = x.float() @ wref.T
                err = rel(fn(W[kind][0]), ref)
                t = timed([(lambda wi=wi: fn(wi)) for wi in W[kind]])
                base = base or t
                gbps = nbytes[kind] / t / 1e9
                totals[(M, vname)] = totals.get((M, vname), 0.0) + t
                rows.append(
                    dict(
                        layer=name,
                        N=N,
                        K=K,
                        rows=M,
                        variant=vname,
                        us=t * 1e6,
                        GBps=gbps,
                        speedup=base / t,
                        rel_err=err,
                    )
                )
                print(f"{name:8} {M:>4} {vname:14} {t * 1e6:8.1f} {gbps:7.0f} {base / t:7.2f} {err:9.2e}")
        del W
        torch.cuda.empty_cache()
    print("\nper decode step, 32 layers' projections (lm_head excluded):")
    summary = []
    for (M, vname), t in sorted(totals.items()):
        b = totals[(M, "bf16 cuBLAS")]
        summary.append(dict(rows=M, variant=vname, ms=32 * t * 1e3, speedup=b / t))
        print(f"  rows {M:>4} {vname:14} {32 * t * 1e3:7.3f} ms  {b / t:5.2f}x bf16")
    out.update(rows=rows, step=summary)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
