"""TurboQuant code pages on a GPU: greedy outputs and speed of a ``--turbo-kv`` engine whose
compressed sequences keep their codes in pages of one pool, against the same engine with whole-context codes
per sequence (``SWIFTLM_CODE_PAGES=0``), through the Python API (the served engine's step loop, CUDA graphs on).

    python scripts/check_code_pages_cuda.py --model /tmp/m1b --json out.json

Runs, each on a fresh engine, N greedy requests at once (``--parallel`` N, EOS banned), prompts of ~100-300
tokens and ``--max-tokens`` new ones (so every sequence compresses rows: the window is 128):
- ``whole``: ``SWIFTLM_CODE_PAGES=0``, each sequence a whole-context static cache (no pages);
- ``pages``: the default: code pages, the pool sized for every sequence at full context;
- ``whole_again`` / ``pages_again``: both once more, alternating (run to run);
- ``tight``: code pages in ``--kv-cache-memory`` bytes that hold about a third of what the sequences need, so the
  newest are preempted and recomputed;
Each engine serves the requests twice and the second time is timed (the first compiles kernels and captures every
cache's CUDA graphs).  Prints and writes, per run: requests whose tokens equal ``whole``'s (and the first differing
positions), pages used at the end, preemptions, generate seconds and output tok/s (second round), the KV storage
allocated (``memory()``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_paged_cuda import compare, word_prompts  # noqa: E402 (next to this script: copy both to the GPU machine)


def run(model: str, prompts: list[list[int]], max_tokens: int, pages: bool = True, **kw) -> dict:
    from swiftlm import LLM, SamplingParams

    os.environ["SWIFTLM_CODE_PAGES"] = "1" if pages else "0"
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(model, backend="torch", turbo_kv="k4v3", **kw) as llm:
        eng = llm.engine
        # warm-up: the same requests once (kernels compiled, every cache's CUDA graphs captured), then timed
        llm.generate(prompts, p)
        pre = eng.scheduler.preemptions
        t1 = time.perf_counter()
        outs = llm.generate(prompts, p)
        dt = time.perf_counter() - t1
        stats = eng.scheduler.block_stats() or {}
        mem = eng.model.memory()
        return {
            "tokens": [o.token_ids for o in outs],
            "preemptions": eng.scheduler.preemptions - pre,
            "code_pages": stats.get("code_pages"),
            "generate_s": round(dt, 2),
            "out_tok_s": round(len(prompts) * max_tokens / dt, 1),
            "kv_allocated_gib": round(mem["kv_allocated"] / 2**30, 3),
            "pool": None if (cp := eng.model.seqs.code_pages) is None else [cp.pages, cp.page_rows, cp.page_bytes],
            "kw": dict(kw, pages=pages),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json")
    a = ap.parse_args()
    prompts = word_prompts(a.model, a.ctx, [100 + 13 * i for i in range(a.n)])
    base = {"ctx_size": a.ctx, "parallel": a.n, "prompt_cache_bytes": 0}
    res: dict = {}
    # alternating engines (whole, pages, whole, pages): the speeds of one configuration vary from run to run
    res["whole"] = run(a.model, prompts, a.max_tokens, pages=False, **base)
    ref = res["whole"]["tokens"]
    res["pages"] = run(a.model, prompts, a.max_tokens, **base)
    res["whole_again"] = run(a.model, prompts, a.max_tokens, pages=False, **base)
    res["pages_again"] = run(a.model, prompts, a.max_tokens, **base)
    # the bytes of pages the n sequences need together at the end, a third of that (at least one context)
    from swiftlm.backends.torch.code_pages import PAGE_ROWS

    page = res["pages"]["pool"][2]
    need = sum(-(-(len(p) + a.max_tokens + 1) // PAGE_ROWS) for p in prompts)
    mem = max(need // 3, -(-a.ctx // PAGE_ROWS)) * page
    res["tight"] = run(a.model, prompts, a.max_tokens, kv_cache_memory=str(mem), **base)
    for name in ("pages", "whole_again", "pages_again", "tight"):
        res[name]["vs_whole"] = compare(ref, res[name]["tokens"])
    for name in ("pages", "pages_again"):
        res[name]["speed_vs_whole"] = [
            round(res[name]["out_tok_s"] / res[w]["out_tok_s"], 4) for w in ("whole", "whole_again")
        ]
    for name, r in res.items():
        print(name, json.dumps({k: v for k, v in r.items() if k != "tokens"}))
    if a.json:
        json.dump(
            {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in res.items()}, open(a.json, "w"), indent=1
        )


if __name__ == "__main__":
    main()
