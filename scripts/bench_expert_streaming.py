#!/usr/bin/env python3
"""SSD expert streaming benchmark: streamed vs resident experts on one MoE checkpoint.

    python scripts/bench_expert_streaming.py CKPT [--backend torch|mlx] [--tokens 16]
        [--topk 8,6,4,2] [--quick] [--mem-limit 2GB] [--out docs/results/expert_streaming.json]

Each configuration runs in its own process (clean peak RSS) and decodes ``--tokens`` greedy
tokens after a 16-token prompt, one token per step (decode is what streaming serves).  With
``--repeat N`` every configuration runs N times, interleaved, and the median run is reported
(a shared machine's disk and memory bandwidth vary a lot between runs).

- seq bandwidth: the checkpoint's files read sequentially in 16 MiB reads after
  ``POSIX_FADV_DONTNEED`` (cold).  The cold bound is that bandwidth / expert bytes per token.
- cold: the files' pages are dropped before *every* decoded token (nothing stays cached: the
  regime of a model larger than RAM); warm: the page cache holds the whole file.
- bytes/token: bytes the reader returned; disk/token: ``read_bytes`` from /proc/self/io (what the
  kernel fetched from storage); expected: layers x k x bytes per expert.
- memory: peak RSS (VmHWM), anonymous and file-backed RSS at the end, and the bound
  resident weights + read buffers + 500 MB.
Prints a table and writes JSON.  Random weights: speed and bytes only, never quality.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 1e6
SLACK = 500 * 10**6


def seq_bandwidth(files: list[Path], cold: bool = True, limit: int = 1 << 62) -> float:
    """Sequential read bandwidth of the files (bytes/s), cold (pages dropped first) or warm;
    stops after ``limit`` bytes."""
    from swiftlm.experts.reader import drop_file_pages

    if cold:
        drop_file_pages(files)
    buf = bytearray(16 << 20)
    total, t0 = 0, time.perf_counter()
    for f in files:
        if total >= limit:
            break
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        try:
            while True:
                n = os.readv(fd, [buf])
                if not n or total + n >= limit:
                    total += n
                    break
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0)


# ------------------------------------------------------------------ one configuration (child)
def child(conf: dict) -> dict:
    from swiftlm.experts.reader import drop_file_pages, page_cache_bytes, proc_io, proc_memory
    from swiftlm.registry import resolve

    spec = resolve(conf["ckpt"])
    cfg = SimpleNamespace(
        stream_experts=conf["stream"],
        expert_read_mode=conf.get("mode", "pread"),
        expert_read_threads=conf.get("threads", 16),
        expert_prefetch=conf.get("prefetch", False),
        expert_top_k=conf.get("k", 0),
        mem_limit=conf.get("mem_limit"),
        ctx_size=512,
        parallel=1,
        turbo_kv=None,
        turbo_kv_window=128,
        turbo_kv_threshold=0,
        turbo_kv_keep_layers=0,
    )
    mem_start = proc_memory()
    t0 = time.perf_counter()
    if conf["backend"] == "mlx":
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from swiftlm.backends.mlx.model import load_model

        model = load_model(spec, cfg)
        cache = make_prompt_cache(model.module)

        def step(tokens: list[int]) -> int:
            out = model.module(mx.array([tokens]), cache=cache)
            return int(mx.argmax(out[0, -1]).item())
    else:
        import torch

        from swiftlm.backends.torch.kv_cache import SeqCache
        from swiftlm.backends.torch.runner import load_model

        model = load_model(spec, cfg)
        cache = SeqCache(model.module.a, model.dtype, model.device)
        pos = [0]

        def step(tokens: list[int]) -> int:
            with torch.no_grad():
                out = model.module(torch.tensor(tokens, device=model.device), cache, pos[0])
            pos[0] += len(tokens)
            return int(out[-1].argmax().item())

    load_s = time.perf_counter() - t0
    mem_loaded = proc_memory()
    reader = model.expert_stream
    files = list(spec.weight_files)
    tok = step(list(range(100, 116)))  # prompt (not timed)
    per_tok: list[dict] = []
    for _ in range(conf["tokens"]):
        if conf.get("cold"):
            if reader is not None:
                reader.drop_page_cache()  # also unmaps an mmap reader's pages (else they are not evicted)
            else:
                drop_file_pages(files)
        io0 = proc_io()
        h0 = getattr(getattr(reader, "h2d", None), "bytes", 0)
        b0 = reader.stats.bytes_read if reader else 0
        w0 = reader.stats.read_seconds if reader else 0.0
        t = time.perf_counter()
        tok = step([tok])
        dt = time.perf_counter() - t
        io1 = proc_io()
        per_tok.append(
            {
                "s": dt,
                "bytes": (reader.stats.bytes_read - b0) if reader else 0,
                "wait_s": (reader.stats.read_seconds - w0) if reader else 0.0,
                "disk": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
                "h2d": getattr(getattr(reader, "h2d", None), "bytes", 0) - h0,
                "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
            }
        )
    n = len(per_tok)
    total_s = sum(p["s"] for p in per_tok)
    mem_end = proc_memory()
    lay = reader.layout if reader else None
    k = model.info.experts_per_token
    out = {
        **conf,
        "load_s": round(load_s, 2),
        "tok_per_s": n / total_s,
        "s_per_token": total_s / n,
        "bytes_per_token": sum(p["bytes"] for p in per_tok) / n,
        "expected_bytes_per_token": lay.bytes_per_token(k) if lay else 0,
        "disk_bytes_per_token": sum(p["disk"] for p in per_tok) / n,
        "rchar_per_token": sum(p["rchar"] for p in per_tok) / n,
        "read_wait_fraction": sum(p["wait_s"] for p in per_tok) / total_s,
        "h2d_bytes_per_token": sum(p["h2d"] for p in per_tok) / n,
        "experts_per_token": k,
        "resident_weight_bytes": model.info.weight_bytes,
        "buffer_bytes": reader.buffer_bytes() if reader else 0,
        "rss_start": mem_start.get("rss", 0),
        "rss_loaded": mem_loaded.get("rss", 0),
        "peak_rss_loaded": mem_loaded.get("peak_rss", 0),
        "peak_rss": mem_end.get("peak_rss", 0),
        "rss_anon": mem_end.get("rss_anon", 0),
        "rss_file": mem_end.get("rss_file", 0),
        "page_cache": page_cache_bytes(),
    }
    if reader is not None:
        out["prefetch_hit_rate"] = reader.stats.snapshot()["prefetch_hit_rate"]
        h2d = getattr(reader, "h2d", None)
        if h2d is not None:
            out.update(h2d.snapshot())
    if conf["backend"] == "torch" and model.device.type == "cuda":
        import torch

        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def run_child(conf: dict, timeout: float = 1800) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(conf)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        return {**conf, "error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(lines[-1])


# ------------------------------------------------------------------ driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--topk", default="8,6,4,2", help="experts-per-token values for the table")
    ap.add_argument("--quick", action="store_true", help="only resident, pread warm/cold")
    ap.add_argument("--no-resident", action="store_true", help="skip the in-memory run (model larger than RAM)")
    ap.add_argument("--mem-limit", default=None, help="cap device memory (torch on CUDA)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every configuration N times, interleaved; the table shows the median tok/s run",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "expert_streaming.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    from swiftlm.experts import scan_experts
    from swiftlm.registry import resolve

    spec = resolve(a.ckpt)
    lay = scan_experts(spec.weight_files)
    files = list(spec.weight_files)
    k_model = spec.experts_per_token
    # the disk's speed varies between runs here: the bound uses the best of three cold reads of
    # 2 GB (before the runs), which makes the cold ratios conservative
    colds = [seq_bandwidth(files, cold=True, limit=2 * 10**9) for _ in range(3)]
    seq_cold = max(colds)
    seq_warm = seq_bandwidth(files, cold=False)
    base = {"ckpt": str(spec.path), "backend": a.backend, "tokens": a.tokens, "mem_limit": a.mem_limit}
    confs = []
    if not a.no_resident:
        if a.mem_limit:  # the resident model under the cap (expected to fail) and without it
            confs.append({**base, "name": f"resident cap {a.mem_limit}", "stream": False})
            confs.append({**base, "name": "resident", "stream": False, "mem_limit": None})
        else:
            confs.append({**base, "name": "resident", "stream": False})
    confs += [
        {**base, "name": "pread warm", "stream": True, "mode": "pread"},
        {**base, "name": "pread cold", "stream": True, "mode": "pread", "cold": True},
    ]
    if not a.quick:
        confs += [
            {**base, "name": "mmap warm", "stream": True, "mode": "mmap"},
            {**base, "name": "mmap cold", "stream": True, "mode": "mmap", "cold": True},
            {**base, "name": "pread cold +prefetch", "stream": True, "mode": "pread", "cold": True, "prefetch": True},
            {**base, "name": "pread warm +prefetch", "stream": True, "mode": "pread", "prefetch": True},
        ]
        for k in (int(x) for x in a.topk.split(",")):
            if k >= k_model:
                continue
            if not a.no_resident:
                confs.append({**base, "name": f"resident k={k}", "stream": False, "k": k})
            confs += [
                {**base, "name": f"pread warm k={k}", "stream": True, "mode": "pread", "k": k},
                {**base, "name": f"pread cold k={k}", "stream": True, "mode": "pread", "cold": True, "k": k},
            ]
    runs: dict[str, list[dict]] = {}
    for _ in range(max(1, a.repeat)):  # interleaved, so slow phases of the disk hit every configuration
        for c in confs:
            if c.get("stream") and not c.get("cold"):
                seq_bandwidth(files, cold=False)  # warm: the whole checkpoint in the page cache
            r = run_child(c)
            runs.setdefault(c["name"], []).append(r)
            print(
                json.dumps({k: r.get(k) for k in ("name", "tok_per_s", "bytes_per_token", "peak_rss", "error")}),
                flush=True,
            )
    results = []
    for c in confs:
        ok = sorted((r for r in runs[c["name"]] if "error" not in r), key=lambda r: r["tok_per_s"])
        r = ok[len(ok) // 2] if ok else runs[c["name"]][0]
        if ok:
            r["tok_per_s_runs"] = [round(x["tok_per_s"], 4) for x in runs[c["name"]] if "error" not in x]
        results.append(r)
    by = {r["name"]: r for r in results}
    resident = {
        r.get("experts_per_token") or k_model: r
        for r in results
        if r["name"].startswith("resident") and "error" not in r and "cap" not in r["name"]
    }
    for r in results:
        if "error" in r or not r.get("stream"):
            continue
        bpt = r["expected_bytes_per_token"]
        if r.get("cold"):
            r["bound_tok_per_s"] = seq_cold / bpt
            r["ratio_vs_bound"] = r["tok_per_s"] / r["bound_tok_per_s"]
        else:
            ref = resident.get(r["experts_per_token"])
            if ref:
                r["ratio_vs_resident"] = r["tok_per_s"] / ref["tok_per_s"]
        r["memory_bound"] = r["resident_weight_bytes"] + r["buffer_bytes"] + SLACK
        r["memory_ok"] = r["peak_rss"] < r["memory_bound"]
    summary = {
        "checkpoint": str(spec.path),
        "backend": a.backend,
        "expert_bytes": lay.expert_bytes_total,
        "resident_bytes_on_disk": lay.resident_bytes,
        "bytes_per_expert": lay.bytes_per_expert(),
        "moe_layers": len(lay.layers),
        "experts": lay.num_experts,
        "experts_per_token": k_model,
        "seq_read_cold_bytes_per_s": seq_cold,
        "seq_read_cold_samples": colds,
        "seq_read_warm_bytes_per_s": seq_warm,
        "cpu_count": os.cpu_count(),
        "repeat": a.repeat,
        "results": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=2))
    print(
        f"\n{spec.path.name}: experts {lay.expert_bytes_total / 1e9:.2f} GB on disk, "
        f"{lay.bytes_per_expert() / MB:.2f} MB per expert, {len(lay.layers)} MoE layers x {lay.num_experts} "
        f"experts, k={k_model}; sequential read {seq_cold / 1e9:.2f} GB/s cold, {seq_warm / 1e9:.2f} GB/s warm"
    )
    hdr = (
        f"{'run':24} {'tok/s':>7} {'vs':>14} {'MB/tok':>8} {'expect':>8} {'disk MB/tok':>11} {'wait':>5} "
        f"{'peak RSS':>9} {'anon':>7} {'file':>7} {'bound':>7} {'hit':>5}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if "error" in r:
            print(f"{r['name']:24} error: {r['error']}")
            continue
        spread = r.get("tok_per_s_runs") or []
        if len(spread) > 1:
            print(f"{'':24} tok/s over {len(spread)} runs: " + ", ".join(f"{x:.2f}" for x in spread))
        vs = (
            f"{r['ratio_vs_bound']:.2f}x bound"
            if "ratio_vs_bound" in r
            else f"{r['ratio_vs_resident']:.2f}x resid"
            if "ratio_vs_resident" in r
            else ""
        )
        hit = r.get("prefetch_hit_rate")
        if r.get("h2d_bandwidth_bytes_per_s"):
            print(
                f"{'':24} host-to-device {r['h2d_bytes_per_token'] / MB:.0f} MB/token at "
                f"{r['h2d_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (copy-stream time), CUDA peak "
                f"{r.get('cuda_peak_bytes', 0) / 1e9:.2f} GB"
            )
        print(
            f"{r['name']:24} {r['tok_per_s']:7.2f} {vs:>14} {r['bytes_per_token'] / MB:8.1f} "
            f"{r['expected_bytes_per_token'] / MB:8.1f} {r['disk_bytes_per_token'] / MB:11.1f} "
            f"{r['read_wait_fraction']:5.2f} {r['peak_rss'] / MB:9.0f} {r['rss_anon'] / MB:7.0f} "
            f"{r['rss_file'] / MB:7.0f} {r.get('memory_bound', 0) / MB:7.0f} "
            f"{'' if hit is None else f'{hit:.2f}':>5}"
        )
    print(f"\nwrote {a.out}")
    del by


if __name__ == "__main__":
    main()
