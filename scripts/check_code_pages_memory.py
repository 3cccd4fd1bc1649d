"""How many concurrent TurboQuant sequences one GPU serves at a long context: N greedy requests of a
few hundred positions each, all at once (``--parallel`` N), under ``--turbo-kv k4v3`` with code pages (the
default) and with whole-context codes per sequence (``SWIFTLM_CODE_PAGES=0``), each in a fresh process.

    python scripts/check_code_pages_memory.py --model /tmp/m1b --ctx 131072 --n 96 [--pages 0|1] --json out.json

Prints and writes: requests served / failed (and the first error), output tok/s, KV storage allocated, pages.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pages", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ["SWIFTLM_CODE_PAGES"] = str(a.pages)
    from swiftlm import LLM, SamplingParams

    out: dict = {"pages": bool(a.pages), "n": a.n, "ctx": a.ctx}
    t0 = time.perf_counter()
    with LLM(a.model, backend="torch", turbo_kv="k4v3", ctx_size=a.ctx, parallel=a.n, prompt_cache_bytes=0) as llm:
        out["load_s"] = round(time.perf_counter() - t0, 1)
        enc = llm.engine.text_prompt
        words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
        prompts = [enc(" ".join(words[(i * 5 + j) % len(words)] for j in range(200 + i))) for i in range(a.n)]
        p = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
        from concurrent.futures import ThreadPoolExecutor

        def one(q):
            try:
                return len(llm.generate(q, p).token_ids) == a.max_tokens, None
            except Exception as exc:  # this request failed (the others go on)
                return False, repr(exc)[:300]

        t1 = time.perf_counter()
        with ThreadPoolExecutor(a.n) as ex:
            res = list(ex.map(one, prompts))
        dt = time.perf_counter() - t1
        served = sum(ok for ok, _ in res)
        errors = sorted({e for _, e in res if e})[:3]
        out["failed"] = sum(1 for _, e in res if e)
        eng = llm.engine
        mem = eng.model.memory()
        out.update(
            served=served,
            errors=errors,
            generate_s=round(dt, 2),
            out_tok_s=round(served * a.max_tokens / dt, 1),
            kv_allocated_gib=round(mem["kv_allocated"] / 2**30, 2),
            peak_gib=round(mem.get("peak", 0) / 2**30, 2),
            preemptions=eng.scheduler.preemptions,
            code_pages=(eng.scheduler.block_stats() or {}).get("code_pages"),
        )
    print(json.dumps(out))
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
