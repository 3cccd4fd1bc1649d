#!/usr/bin/env python3
"""Where an engine step's time goes: the engine's own step timers (swiftlm/timers.py) for N
concurrent streams through the Python API, per phase in ms per step, plus aggregate tok/s.

    python scripts/profile_engine.py [--backend torch] [--model M] [--streams 1,8,16] [--tokens 64]
        [--temperature 0.6] [--json out.json]

For a sampling profile of the same run, wrap it in py-spy:
    py-spy record -o engine.svg -- python scripts/profile_engine.py --streams 16
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
    "and many curious people watch"
).split()


def run(llm, n: int, tokens: int, temperature: float) -> dict:
    from swiftlm import SamplingParams

    p = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True, seed=1)
    llm.generate("warm up " * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.timers.reset()  # measure the run only (the output worker's timers are the same object)
    steps0 = llm.engine.stats.steps
    prompts = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(30 + i % 7)) for i in range(n)]
    done: list[int] = []
    t0 = time.perf_counter()
    ts = [threading.Thread(target=lambda q=q: done.append(len(llm.generate(q, p).token_ids))) for q in prompts]
    [t.start() for t in ts]
    [t.join() for t in ts]
    wall = time.perf_counter() - t0
    snap = llm.engine.timers.snapshot()
    steps = llm.engine.stats.steps - steps0
    return {
        "streams": n,
        "tokens": sum(done),
        "seconds": round(wall, 3),
        "tok_per_s": round(sum(done) / wall, 2),
        "steps": steps,
        "ms_per_step": round(1e3 * wall / max(steps, 1), 3),
        "phases_ms_per_step": {k: round(1e3 * v["seconds"] / max(steps, 1), 4) for k, v in snap.items()},
        "overlapped_steps": llm.engine.stats.overlapped_steps,
    }


def profiled(llm, n: int, a, path: str) -> dict:
    """One run under torch.profiler (CUPTI sees every thread's CUDA calls and kernels): tables of
    the runtime calls by host time and of the kernels by device time, and the device's busy share."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        row = run(llm, n, a.tokens, a.temperature)
    if a.trace:  # the timeline, for scripts/trace_gaps.py (device idle time and what the host did meanwhile)
        prof.export_chrome_trace(a.trace)
    ka = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA") / 1e6
    row["device_busy_s"] = round(busy, 4)
    with open(path, "w") as f:
        f.write(f"N={n}: wall {row['seconds']} s, device kernels {busy:.3f} s ({100 * busy / row['seconds']:.1f}%)\n\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n")
        f.write(ka.table(sort_by="self_device_time_total", row_limit=30) + "\n")
    print(f"  torch profile: device busy {busy:.3f} s of {row['seconds']} s -> {path}")
    return row


class SyncLog:
    """torch's CUDA sync debug mode, recording where each blocking call came from (the innermost
    frames in swiftlm or the backends) instead of printing a warning each time."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def start(self) -> None:
        import traceback
        import warnings

        import torch

        self.counts = {}

        def show(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack() if "swiftlm" in f.filename or "backends" in f.filename]
            where = (
                " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))
                or f"{filename}:{lineno}"
            )
            key = f"{str(message)[:60]} @ {where}"
            self.counts[key] = self.counts.get(key, 0) + 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> dict[str, int]:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        top = dict(sorted(self.counts.items(), key=lambda kv: -kv[1])[:20])
        for k, v in top.items():
            print(f"  sync x{v}: {k}")
        return top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", default="1,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ctx-size", type=int, default=None)
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks (this process is rank 0; its profile)")
    ap.add_argument(
        "--trace", default=None, metavar="JSON", help="with --torch-profile: also write the chrome trace here"
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA: after warm-up, report every host-blocking CUDA call of the runs (file:line, count)",
    )
    ap.add_argument(
        "--torch-profile",
        default=None,
        metavar="TXT",
        help="CUDA: run the last N under torch.profiler and write its op tables (CPU and device) here",
    )
    a = ap.parse_args()
    from swiftlm import LLM

    ns = [int(n) for n in a.streams.split(",")]
    extra = {"ctx_size": a.ctx_size} if a.ctx_size else {}
    if a.tensor_parallel > 1:
        extra["tensor_parallel"] = a.tensor_parallel
    llm = LLM(a.model, backend=a.backend, parallel=max(ns), prompt_cache_bytes=0, **extra)  # one load for all N
    syncs = None
    if a.sync_debug:
        import torch

        syncs = SyncLog() if torch.cuda.is_available() else print("--sync-debug: no CUDA device; ignored")
    try:
        rows = []
        for i, n in enumerate(ns):
            if syncs:
                syncs.start()
            if a.torch_profile and i == len(ns) - 1:  # the last run (``--streams 1,1``: a warm run, then this)
                rows.append(profiled(llm, n, a, a.torch_profile))
            else:
                rows.append(run(llm, n, a.tokens, a.temperature))
            if syncs:
                rows[-1]["host_syncs"] = syncs.stop()
    finally:
        llm.close()
    from swiftlm.timers import PHASES

    print(f"{'N':>4} {'tok/s':>9} {'ms/step':>8} " + " ".join(f"{p:>9}" for p in PHASES))
    for r in rows:
        print(
            f"{r['streams']:>4} {r['tok_per_s']:>9.1f} {r['ms_per_step']:>8.2f} "
            + " ".join(f"{r['phases_ms_per_step'][p]:>9.3f}" for p in PHASES)
        )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "backend": a.backend,
                    "model": a.model or "bundled SmolLM2",
                    "host": platform.node(),
                    "machine": platform.machine(),
                    "temperature": a.temperature,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
