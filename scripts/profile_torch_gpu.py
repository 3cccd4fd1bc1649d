#!/usr/bin/env python3
"""Where the torch backend's time goes on a GPU: per-call timings of the graph decode, the
eager multi-token pass used by speculative verification and chunked prefill, and the batched
decode, plus the top ops of a profiled eager pass.  Diagnostic, not a benchmark.

    python scripts/profile_torch_gpu.py --model M
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    import torch

    from swiftlm import LLM

    torch.inference_mode().__enter__()
    llm = LLM(a.model, backend="torch", parallel=9, prompt_cache_bytes=0)  # sequence 1 + eight for batching
    m = llm.engine.model
    sync = torch.cuda.synchronize

    def timed(fn, n=20):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n * 1e3

    prompt = list(range(100, 400))
    m.logits(1, prompt, 0)
    start = len(prompt)
    print(f"graph decode (1 token at {start}): {timed(lambda: m.logits(1, [5], start)):.3f} ms")
    for T in (1, 2, 5, 9):
        print(f"score T={T} at {start} (graphed): {timed(lambda: m.score(1, [5] * T, start)):.3f} ms")
    caches = []
    for sid in range(10, 18):
        m.logits(sid, prompt, 0)
        caches.append(m._cache(sid, start))
    for B in (1, 4, 8):
        g = timed(lambda: m.graphs.run_batch(m.pool, [c.slot for c in caches[:B]], [5] * B, [start] * B))
        print(f"batched decode B={B} (graphed): {g:.3f} ms")
    from torch.profiler import ProfilerActivity, profile

    llm.close()
    # a self-drafting request end to end, profiled across threads (the engine runs on its own)
    from swiftlm import SamplingParams

    spec = LLM(a.model, backend="torch", draft_model=a.model or "smollm2-135m-instruct", prompt_cache_bytes=0)
    msgs = [{"role": "user", "content": "Write a short story about a robot who learns to bake bread."}]
    sp = SamplingParams(max_tokens=64, temperature=0)
    spec.generate(msgs, sp)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = spec.generate(msgs, sp)
        sync()
    print(
        f"self-draft: {len(out.token_ids)} tokens in {time.perf_counter() - t0:.3f} s, {spec.engine.speculator.stats}"
    )
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    spec.close()


if __name__ == "__main__":
    main()
