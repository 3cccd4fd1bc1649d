"""Time to first token of long prompts through the Python API (prompt chunks past position 0 on the paged KV
pool attend over gathered blocks: this measures what that costs, against another build).

    PYTHONPATH=... python scripts/check_long_prefill.py --model /tmp/m8b --lengths 2000,7900 --json out.json

One engine (engine on a thread, prompt cache off, --ctx-size 8192), one request at a time, max_tokens 1: the
wall time of ``generate`` per prompt length, best and median of ``--reps`` after a warm-up request.  With
``--prefix N``: the prompt cache on, prompts sharing their first N tokens, each request's time and cached tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="2000,7900")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--prefix",
        type=int,
        default=0,
        help="instead: a shared first part of this many tokens with distinct 30-token endings, prompt "
        "cache on: the first request's time and the next ones' (served from the cache)",
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.prefix:
        return prefix_run(a)
    from swiftlm import LLM, SamplingParams

    p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = {"label": a.label, "runs": {}}
    with LLM(a.model, backend="torch", ctx_size=8192, prompt_cache_bytes=0, parallel=4) as llm:
        base = llm.engine.text_prompt("the quick brown fox jumps over the lazy dog " * 1000)
        llm.generate(base[:600], p)  # warm-up
        for n in (int(x) for x in a.lengths.split(",")):
            ts = []
            for r in range(a.reps):
                ids = [(t + r) % 1000 + 100 for t in base[:n]]  # a different prompt each time
                t0 = time.perf_counter()
                llm.generate(ids, p)
                ts.append(time.perf_counter() - t0)
            out["runs"][n] = {
                "seconds": [round(t, 4) for t in ts],
                "best_s": round(min(ts), 4),
                "median_s": round(statistics.median(ts), 4),
                "prefill_tok_per_s": round(n / min(ts), 1),
            }
            print(a.label, n, out["runs"][n], flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


def prefix_run(a: argparse.Namespace) -> None:
    from swiftlm import LLM, SamplingParams

    p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out: dict = {"label": a.label, "prefix_tokens": a.prefix, "requests": []}
    with LLM(a.model, backend="torch", ctx_size=8192, parallel=4) as llm:
        base = llm.engine.text_prompt("the quick brown fox jumps over the lazy dog " * 1000)
        llm.generate(base[:600], p)  # warm-up
        shared = [(t * 7 + 3) % 1000 + 100 for t in base[: a.prefix]]
        for i in range(1 + 2 * a.reps):
            ids = shared + [(t + 11 * i) % 1000 + 100 for t in base[:30]]
            t0 = time.perf_counter()
            o = llm.generate(ids, p)
            out["requests"].append(
                {"seconds": round(time.perf_counter() - t0, 4), "cached_tokens": o.usage["cached_tokens"]}
            )
            print(a.label, a.prefix, out["requests"][-1], flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
