#!/usr/bin/env python3
"""Summarise a py-spy raw (collapsed-stack) profile: per thread, the share of samples, the top
functions by self time and by inclusive time.

    python scripts/pyspy_top.py profile.txt [--top 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict


def frame_name(f: str) -> str:
    # py-spy frames look like "function (path/to/file.py:123)"; keep the function and file name
    m = re.match(r"(.*?) \((.*?)(?::(\d+))?\)$", f.strip())
    if not m:
        return f.strip()
    fn, path, _ = m.groups()
    return f"{fn} ({path.rsplit('/', 1)[-1]})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    total = 0
    per_thread: Counter = Counter()
    self_t: dict[str, Counter] = defaultdict(Counter)
    incl_t: dict[str, Counter] = defaultdict(Counter)
    for line in open(a.raw, errors="replace"):
        line = line.rstrip()
        if not line or " " not in line:
            continue
        stack, _, n = line.rpartition(" ")
        try:
            n = int(n)
        except ValueError:
            continue
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else "all"
        names = [frame_name(f) for f in frames[1:] if f] if thread != "all" else [frame_name(f) for f in frames if f]
        total += n
        per_thread[thread] += n
        if names:
            self_t[thread][names[-1]] += n
            for nm in set(names):
                incl_t[thread][nm] += n
    out = {"samples": total, "threads": {}}
    for thread, n in per_thread.most_common():
        print(f"\n== {thread}: {n} samples ({100 * n / max(total, 1):.1f}%)")
        print("  self:")
        for nm, c in self_t[thread].most_common(a.top):
            print(f"    {100 * c / n:5.1f}%  {nm}")
        print("  inclusive:")
        for nm, c in incl_t[thread].most_common(a.top):
            print(f"    {100 * c / n:5.1f}%  {nm}")
        out["threads"][thread] = {
            "samples": n,
            "self": self_t[thread].most_common(a.top),
            "inclusive": incl_t[thread].most_common(a.top),
        }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
