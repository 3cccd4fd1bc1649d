#!/usr/bin/env python3
"""The table of scripts/gpu_issue26.sh's results folder (default /tmp/r26): per served configuration and
concurrency the output tok/s, TTFT and ITL; TP=2 over TP=1 per shape and N; greedy equality; the rank-kill
outcome; the data-parallel table.  Also writes summary.json beside the files.

    python scripts/gpu_issue26_summary.py /tmp/r26
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main() -> int:
    r = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/r26")
    rows = []
    for f in sorted(r.glob("bench_*_n*.json")):
        m = re.match(r"bench_(.+)_n(\d+)\.json", f.name)
        if not m:
            continue
        try:
            res = json.loads(f.read_text())["results"]
        except (OSError, ValueError, KeyError):
            continue
        rows.append(
            {
                "config": m.group(1),
                "n": int(m.group(2)),
                "tok_s": round(res["output_throughput"], 1),
                "ttft_p50_ms": round(res["ttft_ms"]["p50"], 1),
                "itl_p50_ms": round(res["itl_ms"]["p50"], 2),
                "itl_p99_ms": round(res["itl_ms"]["p99"], 2),
                "ok": res["requests_ok"],
                "failed": res["requests_failed"],
            }
        )
    rows.sort(key=lambda x: (x["config"].split("_")[-1], x["config"], x["n"]))
    print("| config | N | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | ok | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(
            f"| {x['config']} | {x['n']} | {x['tok_s']} | {x['ttft_p50_ms']} | {x['itl_p50_ms']} | "
            f"{x['itl_p99_ms']} | {x['ok']} | {x['failed']} |"
        )
    by = {(x["config"], x["n"]): x["tok_s"] for x in rows}
    ratios = {}
    for (cfg, n), v in sorted(by.items()):
        if cfg.startswith("tp2_"):
            base = by.get(("tp1_" + cfg[4:], n))
            if base:
                ratios[f"{cfg[4:]} N={n}"] = round(v / base, 3)
                print(f"TP=2 / TP=1, {cfg[4:]} N={n}: {v / base:.2f}x")
    out = {"runs": rows, "tp2_over_tp1": ratios}
    for f in sorted(r.glob("greedy_equal_*.json")):
        d = json.loads(f.read_text())
        out[f.stem] = {k: d[k] for k in ("prompts", "equal", "fraction_equal")}
        out[f.stem]["differs"] = [(x["first_diff"], x["ref_margin_at_diff"]) for x in d["rows"] if not x["equal"]]
        print(
            f"{f.stem}: {d['equal']}/{d['prompts']} equal; (first differing token, reference margin): "
            f"{out[f.stem]['differs']}"
        )
    for f in sorted(r.glob("rank_kill_*.json")):
        d = json.loads(f.read_text())
        ex = r / f"{f.stem}_exit.txt"
        summ = {k: v for k, v in d.items() if k != "streams"}
        summ["exit"] = ex.read_text().strip() if ex.exists() else None
        summ["errors"] = sorted({s.get("error") or "" for s in d["streams"]})
        out[f.stem] = summ
        print(f"{f.stem}: {json.dumps(summ)}")
    dp = r / "dp" / "bench_data_parallel.md"
    if dp.exists():
        print(dp.read_text())
        out["data_parallel"] = json.loads((r / "dp" / "bench_data_parallel.json").read_text())
    (r / "summary.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
