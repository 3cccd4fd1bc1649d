#!/usr/bin/env python3
"""Where one prompt chunk's attention over a long compressed prefix spends its time, per layer, on a GPU.

For each KV format and prefix length: one layer of an attention shape (default the 8B Llama's: 32 query heads,
8 KV heads, head dim 128) in the cache the server builds (a static cache; TurboQuant codes in code pages), filled
to ``prefix`` positions, then a prompt chunk of ``--chunk`` rows at that position is timed: ``update_attend``
(write, attend, compress) as the host issues it (launch time, no sync) and as the device runs it (CUDA events,
median of ``--reps``), with its kernels by device time from one ``torch.profiler`` run.  The 16-bit baseline is
``model.chunk_attention`` over bf16 keys and values of the same length.  Multiply the per-layer difference by the
layers and chunks of a prompt to compare with a server's time to first token.

    python scripts/profile_prompt_attention.py --prefix 4096,16384,31744 --json /tmp/pa.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch


def _formats(names: list[str]) -> dict:
    from swiftlm.turboquant.presets import affine, parse_turbo

    out = {}
    for n in names:
        out[n] = None if n == "16bit" else affine(int(n[2:]), 64) if n.startswith("kv") else parse_turbo(n)
    return out


def _cache(a, fmt, capacity: int, dev):
    from swiftlm.backends.torch.code_pages import CodePages
    from swiftlm.backends.torch.compressed_cache import CompressedCache

    pages = CodePages(a, fmt, -(-capacity // 256) + 1, dev) if fmt.kind == "turbo" else None
    c = CompressedCache(a, fmt, torch.bfloat16, dev, dense_dtype=torch.bfloat16, capacity=capacity, pages=pages)
    c.use_triton = True
    return c


def _time(fn, reps: int, cuda: bool) -> tuple[float, float]:
    """(median device ms, median host launch ms) of ``fn`` (no GPU: both the wall time)."""
    dev, host = [], []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            host.append(1e3 * (time.perf_counter() - t0))
            dev.append(host[-1])
            continue
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        fn()
        e1.record()
        host.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        dev.append(e0.elapsed_time(e1))
    return statistics.median(dev), statistics.median(host)


def _kernels(fn, top: int, cuda: bool) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dt > 0 and e.key and not e.key.startswith(("aten::", "cuda", "Memcpy")):
            rows.append({"kernel": e.key[:90], "calls": e.count, "device_us": round(dt, 1)})
    rows.sort(key=lambda r: -r["device_us"])
    return rows[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="16bit,k4v3,k3v2,kv8,kv4")
    ap.add_argument("--prefix", default="4096,16384,31744", help="positions before the chunk")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=12, help="kernels listed per run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    from swiftlm.backends.torch.model import chunk_attention

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    a = SimpleNamespace(layers=1, kv_heads=args.kv_heads, heads=args.heads, head_dim=args.head_dim)
    H, KVH, D, T = args.heads, args.kv_heads, args.head_dim, args.chunk
    g = torch.Generator(device=dev).manual_seed(0)
    prefixes = [int(x) for x in args.prefix.split(",")]
    cap = max(prefixes) + T + 64

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)

    q, k, v = rnd(H, T, D), rnd(KVH, T, D), rnd(KVH, T, D)
    results = []
    for name, fmt in _formats(args.formats.split(",")).items():
        c = None if fmt is None else _cache(a, fmt, cap, dev)
        filled = 0
        for P in prefixes:
            if fmt is None:
                K, V = rnd(KVH, P + T, D), rnd(KVH, P + T, D)

                def fn(P=P, K=K, V=V):
                    return chunk_attention(q, K, V, P, H // KVH)
            else:
                with torch.inference_mode():
                    while filled < P:  # fill in prompt-sized chunks, as a prompt would
                        n = min(T, P - filled)
                        c.append(0, filled, rnd(KVH, n, D), rnd(KVH, n, D))
                        filled += n

                def fn(P=P, c=c):
                    with torch.inference_mode():
                        return c.update_attend(0, P, q, k, v)

            for _ in range(3):
                fn()  # compile / autotune / allocator
            dev_ms, host_ms = _time(fn, args.reps, cuda)
            row = {"format": name, "prefix": P, "chunk": T, "device_ms": round(dev_ms, 4), "host_ms": round(host_ms, 4)}
            row["kernels"] = _kernels(fn, args.top, cuda)
            if fmt is not None:
                filled = c.layers[0].n_code + c.layers[0].n_dense
            results.append(row)
            print(f"{name:>6} prefix {P:>6}: device {dev_ms:7.3f} ms  host {host_ms:7.3f} ms", flush=True)
            for r in row["kernels"][:6]:
                print(f"        {r['device_us']:>9.1f} us  x{r['calls']:<3} {r['kernel']}")
        del c
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        doc = {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch": torch.__version__,
            "args": vars(args),
        }
        with open(args.json, "w") as f:
            json.dump({**doc, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
