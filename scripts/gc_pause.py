#!/usr/bin/env python3
"""How long Python's garbage collector stops a serving process, with and without ``gc.freeze`` after
the model is loaded (swiftlm/gc_pauses.py).

Part 1, in this process: the model loaded through the Python API, then one full collection timed
(``gc.collect()``) with every object still collectable, and again after ``freeze()``.
Part 2, one subprocess per setting (SWIFTLM_GC_FREEZE=0 / 1): N concurrent streams through the Python
API for a while; the collections of that process by generation, their total and longest pause.

    python scripts/gc_pause.py [--model M] [--backend torch] [--streams 16] [--tokens 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load(a):
    from swiftlm import LLM

    return LLM(a.model, backend=a.backend, parallel=a.streams, prompt_cache_bytes=0)


def part1(a) -> dict:
    os.environ["SWIFTLM_GC_FREEZE"] = "0"
    llm = load(a)
    try:
        from swiftlm.gc_pauses import freeze

        n_obj = len(gc.get_objects())
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            gc.collect()
            runs.append(time.perf_counter() - t)
        os.environ["SWIFTLM_GC_FREEZE"] = "1"
        frozen = freeze()
        after = []
        for _ in range(3):
            t = time.perf_counter()
            gc.collect()
            after.append(time.perf_counter() - t)
    finally:
        llm.close()
    return {
        "tracked_objects": n_obj,
        "frozen_objects": frozen,
        "full_collect_ms": round(1e3 * min(runs), 2),
        "full_collect_after_freeze_ms": round(1e3 * min(after), 2),
    }


def part2_child(a) -> None:
    from swiftlm import SamplingParams

    llm = load(a)
    p = SamplingParams(max_tokens=a.tokens, temperature=0.6, ignore_eos=True, seed=1)
    llm.generate("warm up", SamplingParams(max_tokens=4, ignore_eos=True))
    g = llm.engine.gc_pauses
    before = g.snapshot()
    t0 = time.perf_counter()
    ts = [
        threading.Thread(target=lambda i=i: llm.generate(f"request {i}: tell me a long story", p))
        for i in range(a.streams)
    ]
    [t.start() for t in ts]
    [t.join() for t in ts]
    wall = time.perf_counter() - t0
    after = g.snapshot()
    llm.close()
    out = {
        "wall_s": round(wall, 2),
        "tok_per_s": round(a.streams * a.tokens / wall, 1),
        "frozen_objects": after["frozen_objects"],
    }
    for k in ("gen0", "gen1", "gen2"):
        out[k] = {
            "collections": after[k]["collections"] - before[k]["collections"],
            "seconds": round(after[k]["seconds"] - before[k]["seconds"], 4),
            "max_ms": after[k]["max_ms"],
        }
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default="docs/results/gc_pause_cpu.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return part2_child(a)
    res = {
        "host": platform.node(),
        "python": platform.python_version(),
        "model": a.model or "bundled SmolLM2",
        "backend": a.backend,
        "streams": a.streams,
        "tokens": a.tokens,
        "in_process": part1(a),
        "serving": {},
    }
    for freeze in ("0", "1"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--backend",
            a.backend,
            "--streams",
            str(a.streams),
            "--tokens",
            str(a.tokens),
        ] + (["--model", a.model] if a.model else [])
        r = subprocess.run(cmd, env=dict(os.environ, SWIFTLM_GC_FREEZE=freeze), capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not line:
            sys.exit(f"child failed (freeze={freeze}):\n{r.stderr[-3000:]}")
        res["serving"]["freeze" if freeze == "1" else "no_freeze"] = json.loads(line[0][7:])
    p = res["in_process"]
    print(
        f"tracked objects after load: {p['tracked_objects']:,}; one full collection {p['full_collect_ms']} ms, "
        f"after freeze() {p['full_collect_after_freeze_ms']} ms ({p['frozen_objects']:,} frozen)"
    )
    print(f"{'setting':>10} {'tok/s':>7} " + " ".join(f"{'gen' + g + ' n / total ms / max ms':>28}" for g in "012"))
    for k, v in res["serving"].items():
        print(
            f"{k:>10} {v['tok_per_s']:>7} "
            + " ".join(
                f"{v[g]['collections']:>8} / {1e3 * v[g]['seconds']:>8.1f} / {v[g]['max_ms']:>7.2f}"
                for g in ("gen0", "gen1", "gen2")
            )
        )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
