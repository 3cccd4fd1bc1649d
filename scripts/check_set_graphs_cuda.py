"""Compressed decode batches on a GPU: one CUDA graph per batch size (``turbo_batch.SetTables``) against one per set
of caches (``SWIFTLM_TQ_SET_TABLES=0``), through the Python API (the served engine's step loop, CUDA graphs on).

    python scripts/check_set_graphs_cuda.py --model /tmp/m1b --json out.json

A ``--turbo-kv k4v3`` engine with ``--parallel`` P serves N greedy requests (EOS banned) of different prompt lengths,
so that sequences start and end at different steps and the set of caches decoding together keeps changing.  Each
engine serves the requests twice; the second round is timed.  Per mode: the tokens (they must equal: the same
kernels read the same caches, only the tables that address them differ), the CUDA graphs captured in each round
(all, and those of compressed decode batches through the tables), the sets loaded into the tables, and the round's
seconds and output tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_paged_cuda import compare, word_prompts  # noqa: E402 (next to this script: copy both to the GPU machine)


def run(model: str, prompts: list[list[int]], max_tokens: int, set_tables: bool, **kw) -> dict:
    from swiftlm import LLM, SamplingParams
    from swiftlm.backends.torch import graphs, turbo_batch

    graphs.SET_TABLES = set_tables
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(model, backend="torch", turbo_kv="k4v3", **kw) as llm:
        gd = llm.engine.model.graphs

        def compressed_graphs() -> int:
            return sum(1 for k in gd.graphs if k[0] in ("compressed-set", "compressed-batch"))

        def set_graphs() -> int:
            return sum(1 for k in gd.graphs if k[0] == "compressed-set")

        rounds = []
        for _ in range(2):
            c0, l0, s0 = gd.captures, turbo_batch.LOADS, set_graphs()
            t1 = time.perf_counter()
            outs = llm.generate(prompts, p)
            dt = time.perf_counter() - t1
            rounds.append(
                {
                    "captures": gd.captures - c0,  # every CUDA graph (also one-cache steps and compressions)
                    "set_graph_captures": set_graphs() - s0,
                    "set_loads": turbo_batch.LOADS - l0,
                    "generate_s": round(dt, 3),
                    "out_tok_s": round(len(prompts) * max_tokens / dt, 1),
                }
            )
        return {
            "tokens": [o.token_ids for o in outs],
            "rounds": rounds,
            "compressed_batch_graphs": compressed_graphs(),
            "set_tables": len(gd.set_tables),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json")
    a = ap.parse_args()
    # lengths that differ by more than a step's prompt budget: sequences start decoding at different steps
    prompts = word_prompts(a.model, a.ctx, [150 + (i * 397) % 1400 for i in range(a.n)], step=5)
    kw = {"ctx_size": a.ctx, "parallel": a.parallel, "prompt_cache_bytes": 0}
    res = {"sets": run(a.model, prompts, a.max_tokens, True, **kw)}
    res["per_set"] = run(a.model, prompts, a.max_tokens, False, **kw)
    res["sets_again"] = run(a.model, prompts, a.max_tokens, True, **kw)
    ref = res["per_set"]["tokens"]
    for k in res:
        res[k]["vs_per_set"] = compare(ref, res[k].pop("tokens"))
        print(k, json.dumps(res[k]))
    ok = all(r["vs_per_set"]["equal"] == r["vs_per_set"]["of"] for r in res.values())
    ok &= res["sets"]["rounds"][1]["set_graph_captures"] == 0  # the second round's sets reused the first's graphs
    ok &= res["sets"]["compressed_batch_graphs"] == res["sets"]["set_tables"]  # one graph per batch size
    res["ok"] = ok
    print("ok" if ok else "FAILED")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
