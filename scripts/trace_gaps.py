#!/usr/bin/env python3
"""Where the GPU sits idle between kernels, from a torch.profiler chrome trace (profile_engine.py --trace):
every gap between consecutive device activities longer than --min-us, split into

- host-late: the activity after the gap was launched (its runtime call ended) after the gap began: the device
  waited for the host; attributed to the launching call and to the host ops (cpu_op events of the launching
  thread) that ran during the gap;
- device-wait: the activity was queued before the gap began (a stream wait, an event, a dependency).

    python scripts/trace_gaps.py trace.json [--min-us 5] [--json gaps.json]
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict


def analyse(path: str, min_us: float = 5.0) -> dict:
    ev = json.load(open(path))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    dev = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = {
        e["args"]["correlation"]: e
        for e in ev
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    cpu_ops = defaultdict(list)  # tid -> [(ts, end, name)] top-level-ish host ops
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            cpu_ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for v in cpu_ops.values():
        v.sort()
    dev.sort(key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in dev)
    span = dev[-1]["ts"] + dev[-1]["dur"] - dev[0]["ts"] if dev else 0.0
    late_by_call: dict[str, float] = defaultdict(float)
    late_ops: dict[str, float] = defaultdict(float)
    wait_total = late_total = 0.0
    gaps = []
    end = dev[0]["ts"] + dev[0]["dur"] if dev else 0
    for e in dev[1:]:
        gap = e["ts"] - end
        if gap >= min_us:
            rt = runtime.get(e.get("args", {}).get("correlation"))
            launched = rt["ts"] + rt["dur"] if rt else None
            if launched is not None and launched > end:
                late_total += gap
                late_by_call[rt["name"]] += gap
                ops = cpu_ops.get(rt["tid"], [])
                i = bisect.bisect_left(ops, (end - 1e5,))
                for ts, te, name in ops[i:]:
                    if ts > e["ts"]:
                        break
                    ov = min(te, e["ts"]) - max(ts, end)
                    if ov > 0:
                        late_ops[name] += ov
                kind = "host-late"
            else:
                wait_total += gap
                kind = "device-wait"
            gaps.append((gap, kind, rt["name"] if rt else "?", e["name"][:60]))
        end = max(end, e["ts"] + e["dur"])
    gaps.sort(reverse=True)
    return {
        "span_us": span,
        "busy_us": busy,
        "idle_us": span - busy,
        "host_late_us": late_total,
        "device_wait_us": wait_total,
        "host_late_by_launch_call": dict(late_by_call),
        "host_ops_during_late_gaps_us": dict(sorted(late_ops.items(), key=lambda kv: -kv[1])[:25]),
        "largest_gaps": [dict(us=round(g, 1), kind=k, launch=c, next=n) for g, k, c, n in gaps[:25]],
        "gaps": len(gaps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    r = analyse(a.trace, a.min_us)
    print(
        f"device span {r['span_us'] / 1e3:.1f} ms, busy {r['busy_us'] / 1e3:.1f} ms, idle {r['idle_us'] / 1e3:.1f} ms; "
        f"gaps >= {a.min_us} us: {r['gaps']}, host-late {r['host_late_us'] / 1e3:.1f} ms, "
        f"device-wait {r['device_wait_us'] / 1e3:.1f} ms"
    )
    print("host-late by launch call (ms):", {k: round(v / 1e3, 2) for k, v in r["host_late_by_launch_call"].items()})
    print("host ops during host-late gaps (ms):")
    for k, v in list(r["host_ops_during_late_gaps_us"].items())[:15]:
        print(f"  {v / 1e3:8.2f}  {k}")
    print("largest gaps:")
    for g in r["largest_gaps"][:10]:
        print("  ", g)
    if a.json:
        json.dump(r, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
