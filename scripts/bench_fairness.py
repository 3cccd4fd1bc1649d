#!/usr/bin/env python3
"""Head-of-line blocking: how much a long prompt arriving mid-stream delays running streams.

    python scripts/bench_fairness.py [--backend torch] [--streams 4] [--long 4000] [--prefill-size 512]

Starts N decoding streams, lets them run, then submits one long prompt.  Prints each
stream's worst inter-token gap before and while the long prompt is prefilled, next to the
time of one prefill chunk of --prefill-size tokens measured alone (the scheduler adds at most
one chunk per step beside the decode rows, so that is the bound).  Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long", type=int, default=4000)
    ap.add_argument("--prefill-size", type=int, default=512)
    ap.add_argument("--json", default="bench_results/bench_fairness.json")
    a = ap.parse_args()
    from swiftlm import LLM, SamplingParams

    llm = LLM(
        a.model,
        backend=a.backend,
        parallel=a.streams + 1,
        prefill_size=a.prefill_size,
        prompt_cache_bytes=0,
        ctx_size=a.long + 256,
    )
    long_prompt = llm.tokenizer.encode("lorem ipsum dolor sit amet " * (a.long // 5))[: a.long]
    # the long prompt alone: the slowest of its prefill chunks (later chunks attend to more keys)
    from swiftlm.engine import SyncSink

    sink = SyncSink()
    t0 = time.perf_counter()
    llm.engine.submit(long_prompt, SamplingParams(max_tokens=1, temperature=0), sink)
    marks = [t0] + [time.perf_counter() for ev in sink if ev.progress is not None or ev.finished]
    chunk_s = max(b - a_ for a_, b in zip(marks, marks[1:]))

    stamps: list[list[float]] = [[] for _ in range(a.streams)]

    def stream(i: int) -> None:
        p = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        for d in llm.stream(f"Stream {i}: count slowly", p):
            if d.token_ids:
                stamps[i].append(time.perf_counter())
            if stop.is_set():
                break

    stop = threading.Event()
    ts = [threading.Thread(target=stream, args=(i,)) for i in range(a.streams)]
    [t.start() for t in ts]
    time.sleep(3.0)
    t_long = time.perf_counter()
    out = llm.generate(long_prompt, SamplingParams(max_tokens=1, temperature=0))
    t_done = time.perf_counter()
    time.sleep(0.5)
    stop.set()
    [t.join(60) for t in ts]

    def worst(s: list[float], lo: float, hi: float) -> float:
        gaps = [b - a_ for a_, b in zip(s, s[1:]) if lo <= b <= hi]
        return max(gaps) if gaps else 0.0

    before = max(worst(s, 0, t_long) for s in stamps)
    during = max(worst(s, t_long, t_done) for s in stamps)
    res = {
        "streams": a.streams,
        "long_prompt_tokens": len(out.prompt_token_ids),
        "prefill_size": a.prefill_size,
        "one_chunk_alone_s": chunk_s,
        "worst_gap_before_s": before,
        "worst_gap_during_s": during,
        "increase_s": during - before,
        "long_prompt_ttft_s": t_done - t_long,
        "within_one_chunk": during - before <= chunk_s,
    }
    print(
        f"{a.streams} streams decoding; a {res['long_prompt_tokens']}-token prompt arrives "
        f"(prefill {res['long_prompt_ttft_s']:.2f} s in chunks of {a.prefill_size})"
    )
    print(
        f"worst inter-token gap before: {before * 1000:.0f} ms, during: {during * 1000:.0f} ms, "
        f"increase {res['increase_s'] * 1000:.0f} ms; slowest {a.prefill_size}-token chunk alone: {chunk_s * 1000:.0f} ms "
        f"-> {'within' if res['within_one_chunk'] else 'OVER'} one chunk"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
