#!/usr/bin/env python3
"""What compressing a staged prompt costs (``CompressedCache.settle``), on a GPU: the cache the server builds (static,
TurboQuant codes in code pages) holding a prompt of ``--rows`` positions in 16 bits in every layer of an attention
shape (default the 8B Llama's: 32 layers, 8 KV heads, head dim 128), then ``settle`` timed as the host issues it and
as the device runs it, with its kernels and host-side ops from one ``torch.profiler`` run.

    python scripts/profile_settle.py --rows 8192,32768 --json /tmp/settle.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch


def _filled(a, fmt, rows: int, dev):
    from swiftlm.backends.torch.code_pages import CodePages
    from swiftlm.backends.torch.compressed_cache import CompressedCache, StageBudget

    pages = CodePages(a, fmt, -(-rows // 256) + 2, dev)
    c = CompressedCache(
        a, fmt, torch.bfloat16, dev, dense_dtype=torch.bfloat16, capacity=rows + 512, pages=pages, stage=StageBudget()
    )
    c.use_triton = c.kc.use_triton = c.vc.use_triton = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for s in range(0, rows, 512):
        T = min(512, rows - s)
        for layer in range(a.layers):
            k = torch.randn(a.kv_heads, T, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
            c._write(layer, s, k, k)
    assert all(L.staging for L in c.layers)
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8192,32768")
    ap.add_argument("--formats", default="k4v3,k3v2")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from swiftlm.turboquant.presets import parse_turbo

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a = SimpleNamespace(layers=args.layers, kv_heads=args.kv_heads, heads=4 * args.kv_heads, head_dim=args.head_dim)
    out = []
    for name in args.formats.split(","):
        fmt = parse_turbo(name)
        _filled(a, fmt, 1024, dev).settle()  # compile the kernels
        for rows in [int(r) for r in args.rows.split(",")]:
            c = _filled(a, fmt, rows, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            c.settle()
            host = time.perf_counter() - t0
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            c = _filled(a, fmt, rows, dev)
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []
            )
            with torch.profiler.profile(activities=acts) as prof:
                c.settle()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            ka = prof.key_averages()
            dev_key = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
            kern = sorted(ka, key=lambda e: -getattr(e, dev_key, 0))[: args.top]
            ops = sorted(ka, key=lambda e: -e.self_cpu_time_total)[: args.top]
            row = {
                "format": name,
                "rows": rows,
                "host_ms": round(1e3 * host, 2),
                "wall_ms": round(1e3 * wall, 2),
                "kernels": [
                    {"name": e.key[:90], "calls": e.count, "us": round(getattr(e, dev_key, 0), 1)} for e in kern
                ],
                "host_ops": [
                    {"name": e.key[:90], "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1)} for e in ops
                ],
            }
            out.append(row)
            print(f"\n{name} {rows} rows x {a.layers} layers: host {row['host_ms']} ms, wall {row['wall_ms']} ms")
            print("  device:", "; ".join(f"{k['name'][:50]} x{k['calls']} {k['us']}us" for k in row["kernels"][:8]))
            print(
                "  host:",
                "; ".join(f"{k['name'][:40]} x{k['calls']} {k['self_cpu_us']}us" for k in row["host_ops"][:10]),
            )
    if args.json:
        dev_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        json.dump(
            {"device": dev_name, "torch": torch.__version__, "args": vars(args), "results": out},
            open(args.json, "w"),
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
