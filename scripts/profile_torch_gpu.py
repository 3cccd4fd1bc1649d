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
    llm = LLM(a.model, backend="torch", parallel=8, prompt_cache_bytes=0)
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
    ids = torch.tensor([5] * 5, device="cuda")
    print(f"eager forward T=5 at {start}: {timed(lambda: m.module(ids, m._cache(1, start), start)):.3f} ms")
    caches = []
    for sid in range(10, 18):
        m.logits(sid, prompt, 0)
        caches.append(m._cache(sid, start))
    from swiftlm.backends.torch.model import decode_batch

    for B in (1, 4, 8):
        ms = timed(lambda: decode_batch(m.module, caches[:B], [5] * B, [start] * B))
        g = timed(lambda: m.graphs.run_batch(m.pool, [c.slot for c in caches[:B]], [5] * B, [start] * B))
        print(f"decode_batch B={B}: eager {ms:.3f} ms, graphed {g:.3f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            m.module(ids, m._cache(1, start), start)
        sync()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            decode_batch(m.module, caches[:4], [5] * 4, [start] * 4)
        sync()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))
    llm.close()


if __name__ == "__main__":
    main()
