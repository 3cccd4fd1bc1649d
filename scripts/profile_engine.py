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

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "and many curious people watch").split()


def run(llm, n: int, tokens: int, temperature: float) -> dict:
    from swiftlm import SamplingParams
    from swiftlm.timers import StepTimers

    p = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True, seed=1)
    llm.generate("warm up " * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.timers = llm.engine.outputs.timers = StepTimers()  # measure the run only
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
    return {"streams": n, "tokens": sum(done), "seconds": round(wall, 3), "tok_per_s": round(sum(done) / wall, 2),
            "steps": steps, "ms_per_step": round(1e3 * wall / max(steps, 1), 3),
            "phases_ms_per_step": {k: round(1e3 * v["seconds"] / max(steps, 1), 4) for k, v in snap.items()},
            "overlapped_steps": llm.engine.stats.overlapped_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", default="1,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ctx-size", type=int, default=None)
    a = ap.parse_args()
    from swiftlm import LLM

    ns = [int(n) for n in a.streams.split(",")]
    extra = {"ctx_size": a.ctx_size} if a.ctx_size else {}
    llm = LLM(a.model, backend=a.backend, parallel=max(ns), prompt_cache_bytes=0, **extra)  # one load for all N
    try:
        rows = [run(llm, n, a.tokens, a.temperature) for n in ns]
    finally:
        llm.close()
    from swiftlm.timers import PHASES

    print(f"{'N':>4} {'tok/s':>9} {'ms/step':>8} " + " ".join(f"{p:>9}" for p in PHASES))
    for r in rows:
        print(f"{r['streams']:>4} {r['tok_per_s']:>9.1f} {r['ms_per_step']:>8.2f} "
              + " ".join(f"{r['phases_ms_per_step'][p]:>9.3f}" for p in PHASES))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"backend": a.backend, "model": a.model or "bundled SmolLM2",
                                            "host": platform.node(), "machine": platform.machine(),
                                            "temperature": a.temperature, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
