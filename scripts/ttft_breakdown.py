#!/usr/bin/env python3
"""Where one stream's time to first token goes, in-process: a one-stream request pays its time to the first
token once, and that time is many times a later token's, so it weighs on one stream's throughput.

    python scripts/ttft_breakdown.py [--model M] [--backend torch] [--reps 20] [--json out.json]

Measures, with the prompt cache off and the same ~40-word prompt each time:
  request_1tok_ms   ``LLM.generate(max_tokens=1)`` wall time: queueing, prefill, sampling, detokenise, hand-back
  request_128_ms    the same with 128 tokens (EOS ignored); itl_ms = (request_128 - request_1tok) / 127
  prefill_ms        the model's prefill alone (``model.logits`` of the prompt ids, device synchronised)
  phases_ms         the engine's step timers summed over the one-token requests, per request
  profile           (CUDA) one prefill under torch.profiler: host time, device busy time, kernel launches
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches and many "
    "curious people watch from the old stone bridge near the river on a cold bright morning in late autumn"
)


def ms(xs: list[float]) -> dict:
    return {
        "p50": round(1e3 * statistics.median(xs), 3),
        "min": round(1e3 * min(xs), 3),
        "max": round(1e3 * max(xs), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from swiftlm import LLM, SamplingParams

    llm = LLM(a.model, backend=a.backend, parallel=8, prompt_cache_bytes=0, ctx_size=1024)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.6, seed=1)
    full = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.6, seed=1)
    out: dict = {"backend": a.backend, "model": a.model or "bundled SmolLM2", "host": platform.node()}
    try:
        for _ in range(3):
            llm.generate(PROMPT, full)
        ids = llm.engine.model.tokenizer.encode(PROMPT)
        out["prompt_tokens"] = len(ids)
        llm.engine.timers.reset()  # the output worker's timers are the same object
        t1 = []
        for _ in range(a.reps):
            t = time.perf_counter()
            llm.generate(PROMPT, one)
            t1.append(time.perf_counter() - t)
        snap = llm.engine.timers.snapshot()
        out["phases_ms"] = {k: round(1e3 * v["seconds"] / a.reps, 3) for k, v in snap.items()}
        t128 = []
        for _ in range(max(3, a.reps // 4)):
            t = time.perf_counter()
            llm.generate(PROMPT, full)
            t128.append(time.perf_counter() - t)
        out["request_1tok_ms"], out["request_128_ms"] = ms(t1), ms(t128)
        out["itl_ms"] = round((out["request_128_ms"]["p50"] - out["request_1tok_ms"]["p50"]) / 127, 3)
        m = llm.engine.model
        sync = getattr(getattr(m, "ops", None), "synchronize", None)
        try:
            import torch

            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        except ImportError:
            sync = sync or (lambda: None)
        tp = []
        sid = 10**9
        for r in range(a.reps):
            sync()
            t = time.perf_counter()
            m.logits(sid + r, ids, 0)
            sync()
            tp.append(time.perf_counter() - t)
            m.free([sid + r])
        out["prefill_ms"] = ms(tp)
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if torch.cuda.is_available():
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    t = time.perf_counter()
                    m.logits(sid - 1, ids, 0)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t
                m.free([sid - 1])
                ka = prof.key_averages()
                kernels = [e for e in ka if e.device_type.name == "CUDA"]
                out["profile"] = {
                    "wall_ms": round(1e3 * wall, 3),
                    "device_busy_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 3),
                    "kernel_launches": int(sum(e.count for e in kernels)),
                    "top_host_ops": ka.table(sort_by="self_cpu_time_total", row_limit=12),
                }
        except ImportError:
            pass
    finally:
        llm.close()
    show = {k: v for k, v in out.items() if k != "profile"}
    print(json.dumps(show, indent=1))
    if "profile" in out:
        p = out["profile"]
        print(
            f"prefill under the profiler: wall {p['wall_ms']} ms, device busy {p['device_busy_ms']} ms, "
            f"{p['kernel_launches']} kernels\n{p['top_host_ops']}"
        )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
