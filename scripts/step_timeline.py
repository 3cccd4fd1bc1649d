"""Where a serving run's wall time went, from the engine's step log (``SWIFTLM_STEP_LOG``).

Each step's share is the interval from its start to the next step's start.  Steps are grouped
into decode-only steps (by decode rows: 1, 2-8, 9-32, 33-64, 65-128, more), steps that carry prompt
chunks (by prompt tokens), and idle gaps (intervals over ``--idle-ms`` after a decode-only step
whose rows had all ended, i.e. the engine waiting for requests).  Prints a table; ``--json`` writes it.

    SWIFTLM_STEP_LOG=/tmp/steps.jsonl swiftlm serve ...   # then run the load
    python scripts/step_timeline.py /tmp/steps.jsonl [--since-gap 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by the process's exit
    rows.sort(key=lambda r: r["t"])
    return rows


def last_run(rows: list[dict], gap_s: float) -> list[dict]:
    """The steps after the last pause longer than ``gap_s`` (the measured run after a warm-up)."""
    start = 0
    for i in range(1, len(rows)):
        if rows[i]["t"] - rows[i - 1]["t"] > gap_s:
            start = i
    return rows[start:]


def group(r: dict) -> str:
    if r["prefill_seqs"]:
        n = r["prefill_tokens"]
        size = "<=64" if n <= 64 else "<=256" if n <= 256 else "<=640" if n <= 640 else ">640"
        return f"prompt chunks ({size} tokens)"
    d = r["decode"]
    for hi, name in ((1, "1"), (8, "2-8"), (32, "9-32"), (64, "33-64"), (128, "65-128")):
        if d <= hi:
            return f"decode only ({name} rows)"
    return "decode only (>128 rows)"


def summarise(rows: list[dict], idle_ms: float) -> dict:
    out: dict[str, dict] = {}
    tokens = 0
    for r, nxt in zip(rows, rows[1:]):
        dt = nxt["t"] - r["t"]
        g = group(r)
        if dt * 1e3 > idle_ms and not r["prefill_seqs"]:
            g = "idle (waiting for requests)"
        e = out.setdefault(
            g,
            {
                "steps": 0,
                "seconds": 0.0,
                "decode_rows": 0,
                "prompt_tokens": 0,
                "forward_ms": 0.0,
                "sync_ms": 0.0,
                "overlapped": 0,
                "_dts": [],
            },
        )
        e["_dts"].append(dt)
        e["steps"] += 1
        e["seconds"] += dt
        e["decode_rows"] += r["decode"]
        e["prompt_tokens"] += r["prefill_tokens"]
        e["forward_ms"] += r.get("forward", 0.0)
        e["sync_ms"] += r.get("sync", 0.0)
        e["overlapped"] += bool(r["overlapped"])
        tokens += r["decode"]
    span = rows[-1]["t"] - rows[0]["t"] if len(rows) > 1 else 0.0
    for e in out.values():
        n = max(1, e["steps"])
        e["ms_per_step"] = round(1e3 * e["seconds"] / n, 3)
        e["rows_per_step"] = round(e["decode_rows"] / n, 1)
        e["forward_ms"] = round(e["forward_ms"] / n, 3)
        e["sync_ms"] = round(e["sync_ms"] / n, 3)
        e["share"] = round(e["seconds"] / span, 4) if span else 0.0
        e["seconds"] = round(e["seconds"], 4)
        dts = sorted(e.pop("_dts"))
        for q, name in ((0.5, "p50_ms"), (0.9, "p90_ms"), (0.99, "p99_ms"), (1.0, "max_ms")):
            e[name] = round(1e3 * dts[min(len(dts) - 1, int(q * len(dts)))], 3) if dts else 0.0
    return {
        "span_s": round(span, 4),
        "steps": len(rows),
        "decode_tokens": tokens,
        "decode_tok_per_s": round(tokens / span, 1) if span else 0.0,
        "groups": out,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument(
        "--since-gap",
        type=float,
        default=0.0,
        metavar="S",
        help="only the steps after the last pause longer than S seconds (0: all)",
    )
    ap.add_argument("--idle-ms", type=float, default=50.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = load(a.log)
    if a.since_gap:
        rows = last_run(rows, a.since_gap)
    s = summarise(rows, a.idle_ms)
    print(
        f"{s['steps']} steps over {s['span_s']:.3f} s, {s['decode_tokens']} decode rows "
        f"({s['decode_tok_per_s']:.0f} rows/s)"
    )
    print(
        f"{'group':34s} {'steps':>6s} {'share':>7s} {'ms/step':>8s} {'rows/step':>9s} {'fwd ms':>7s} "
        f"{'sync ms':>8s} {'overlap':>7s} {'p50':>7s} {'p99':>7s} {'max':>7s}"
    )
    for g, e in sorted(s["groups"].items(), key=lambda kv: -kv[1]["seconds"]):
        print(
            f"{g:34s} {e['steps']:6d} {100 * e['share']:6.1f}% {e['ms_per_step']:8.2f} {e['rows_per_step']:9.1f} "
            f"{e['forward_ms']:7.2f} {e['sync_ms']:8.2f} {e['overlapped']:7d} {e['p50_ms']:7.2f} {e['p99_ms']:7.2f} "
            f"{e['max_ms']:7.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
