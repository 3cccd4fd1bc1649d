#!/usr/bin/env python3
"""Greedy tokens of a running server, for comparing two configurations (e.g. --tensor-parallel 2
against 1) token for token.

    python scripts/greedy_probe.py --base-url http://127.0.0.1:8000 --json tp1.json     # record
    python scripts/greedy_probe.py --compare tp1.json tp2.json --json equal.json       # compare

Recording sends --prompts fixed prompts one at a time (no batching, so the batch composition is the
same in both runs) to /v1/completions with temperature 0, EOS ignored, and top-2 logprobs, and keeps
the generated tokens and the top-1/top-2 margin at each position.  Comparing prints the fraction of
prompts whose --max-tokens tokens are equal, and for each that differs the first differing position
and the margin there in the reference run (a near-tie flipped by rounding has a small margin).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Write a haiku about the sea.",
    "Once upon a time",
    "The quick brown fox",
    "import numpy as np\n",
    "Q: What is 17 * 23?\nA:",
    "Translate to German: good morning",
    "<html><body>",
    "SELECT * FROM",
    "The meaning of life is",
    "Dear Sir or Madam,",
    "In 1969, the first",
    "Roses are red,",
    "The following is a list of",
]


def record(base: str, n: int, max_tokens: int) -> list[dict]:
    out = []
    with httpx.Client(timeout=300) as c:
        for i in range(n):
            prompt = PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
            r = c.post(
                base + "/v1/completions",
                json={
                    "model": "x",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 2,
                },
            )
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]
            margins = []
            for top in lp["top_logprobs"]:
                v = sorted(top.values(), reverse=True)
                margins.append(round(v[0] - v[1], 5) if len(v) > 1 else None)
            out.append({"prompt": prompt, "tokens": lp["tokens"], "margins": margins})
    return out


def compare(ref: list[dict], other: list[dict]) -> dict:
    rows = []
    for a, b in zip(ref, other):
        ta, tb = a["tokens"], b["tokens"]
        first = next((k for k in range(min(len(ta), len(tb))) if ta[k] != tb[k]), None)
        rows.append(
            {
                "prompt": a["prompt"],
                "equal": ta == tb,
                "tokens": len(ta),
                "first_diff": first,
                "ref_margin_at_diff": a["margins"][first] if first is not None else None,
            }
        )
    eq = sum(r["equal"] for r in rows)
    return {"prompts": len(rows), "equal": eq, "fraction_equal": round(eq / max(1, len(rows)), 4), "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--compare", nargs=2, metavar=("REF", "OTHER"))
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.compare:
        res = compare(*(json.loads(Path(p).read_text()) for p in a.compare))
        print(f"{res['equal']}/{res['prompts']} prompts equal over their tokens")
        for r in res["rows"]:
            if not r["equal"]:
                print(
                    f"  differs at token {r['first_diff']} of {r['tokens']} (reference top-1/top-2 margin "
                    f"{r['ref_margin_at_diff']}): {r['prompt']!r}"
                )
    elif a.base_url:
        res = record(a.base_url, a.prompts, a.max_tokens)
        print(f"recorded {len(res)} prompts x {a.max_tokens} tokens")
    else:
        ap.error("--base-url or --compare")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
