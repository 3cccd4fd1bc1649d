#!/usr/bin/env python3
"""Where a decode step's GPU time goes for each KV format, at a long context: the CUDA kernels of the engine's
decode steps (graph replays included) over a window of one streamed request, summed per kernel name and divided by
the steps in the window; "on the path": how much each kernel's end moved the latest end of the kernels before it
(with programmatic dependent launch a kernel starts before the one before it ends, so its own duration overstates
what it adds to the step).  Diagnostic for the inter-token latency that `swiftlm bench serve` measures.

    python scripts/profile_kv_step.py --model /tmp/m8b --prompt-tokens 32000 --formats 16bit,k4v3 [--json out.json]

One engine (Python API, 16-bit server default); each format is a request field (``turbo_kv`` / ``kv_bits``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict


def request_fields(fmt: str) -> dict:
    if fmt == "16bit":
        return {}
    if fmt.startswith("kv"):
        return {"kv_bits": int(fmt[2:])}
    return {"turbo_kv": fmt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=32000)
    ap.add_argument("--formats", default="16bit,k4v3,k3v2")
    ap.add_argument("--skip", type=int, default=40, help="decode steps before the profiled window")
    ap.add_argument("--steps", type=int, default=60, help="decode steps profiled")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra LLM settings, key=value")
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from swiftlm import LLM, SamplingParams

    extra = {}
    for kv in a.serve_arg:
        k, v = kv.split("=", 1)
        extra[k] = int(v) if v.isdigit() else v
    llm = LLM(
        a.model, backend="torch", parallel=2, ctx_size=a.prompt_tokens + a.skip + a.steps + 64, prompt_cache_bytes=0,
        **extra,
    )  # fmt: skip
    vocab = llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else 32000
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rng = random.Random(0)
    layers = llm.engine.model.info.num_layers  # attention launches per decode step
    out = {"model": a.model, "prompt_tokens": a.prompt_tokens, "steps": a.steps, "layers": layers, "formats": {}}
    for fmt in a.formats.split(","):
        prompt = [rng.randrange(100, min(vocab, 32000) - 100) for _ in range(a.prompt_tokens)]
        p = SamplingParams(max_tokens=a.skip + a.steps + 8, temperature=0, ignore_eos=True, **request_fields(fmt))
        it = llm.stream(prompt, p)
        stamps, n, prof = [], 0, None
        for d in it:
            n += len(d.token_ids)
            stamps.append(time.perf_counter())
            if prof is None and n >= a.skip:
                sync()
                prof = profile(
                    activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
                )
                prof.__enter__()
                n0, t0 = n, time.perf_counter()
            elif prof is not None and n - n0 >= a.steps:
                sync()
                wall = time.perf_counter() - t0
                prof.__exit__(None, None, None)
                break
        for _ in it:
            pass
        steps = n - n0
        kern: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
        cuda = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
        last_end = None
        for ev in sorted(cuda, key=lambda e: e.time_range.start):
            k = kern[ev.name[:90]]
            k[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            k[1] += 1
            # critical path: how far this kernel's end moved the latest end so far (overlapped launches, as with
            # programmatic dependent launch, count only past the kernel before them)
            end = ev.time_range.end
            if last_end is not None:
                k[2] += max(0.0, end - last_end)
            last_end = end if last_end is None else max(last_end, end)
        total = sum(v[0] for v in kern.values())
        itl = [b - a_ for a_, b in zip(stamps[a.skip :], stamps[a.skip + 1 :])]
        row = {
            "steps": steps,
            "wall_ms_per_step": wall / steps * 1e3,
            "itl_ms_p50": statistics.median(itl) * 1e3 if itl else None,
            "gpu_ms_per_step": total / steps / 1e3,
            "kernels": {
                k: {"us_per_step": v[0] / steps, "calls_per_step": v[1] / steps, "critical_us_per_step": v[2] / steps}
                for k, v in sorted(kern.items(), key=lambda kv: -kv[1][0])
            },
        }
        out["formats"][fmt] = row
        print(
            f"== {fmt}: {steps} steps, wall {row['wall_ms_per_step']:.3f} ms/step, itl p50 {row['itl_ms_p50']:.3f} ms, "
            f"kernels {row['gpu_ms_per_step']:.3f} ms/step",
            flush=True,
        )
        for k, v in list(row["kernels"].items())[: a.top]:
            print(
                f"   {v['us_per_step']:9.1f} us  {v['critical_us_per_step']:9.1f} us on the path  "
                f"{v['calls_per_step']:6.1f}x  {k}",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
