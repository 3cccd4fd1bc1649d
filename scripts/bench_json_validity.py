#!/usr/bin/env python3
"""Fraction of structured outputs (response_format json_object / json_schema) that parse as JSON,
over N seeded runs at several max_tokens, with json_close / the repetition guard off (before) and
on (after), in one run on the bundled model (or --model).

    python scripts/bench_json_validity.py [--runs 50] [--max-tokens 32,64,150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "List three European capitals with their countries as JSON.",
    "Describe a cat as a JSON object with name, age and colors.",
    "Give a JSON object of a book: title, author, year, tags.",
    "Return JSON with a list of five prime numbers and their squares.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"label": {"type": "string"}, "value": {"type": "number"}},
                "required": ["label", "value"],
            },
        },
    },
    "required": ["name", "items"],
}


def run(model: str | None, backend: str, close: bool, runs: int, max_tokens: list[int]) -> list[dict]:
    from swiftlm import LLM, SamplingParams
    from swiftlm.chat.structured import grammar_for

    llm = LLM(
        model, backend=backend, parallel=16, json_close=close, json_repeat_guard=6 if close else 0, prompt_cache_bytes=0
    )
    rows = []
    try:
        for kind, rf in (
            ("json_object", {"type": "json_object"}),
            ("json_schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
        ):
            grammar = grammar_for(rf)
            for mt in max_tokens:
                prompts = [
                    llm.engine.chat_prompt([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
                    for i in range(runs)
                ]
                outs: dict[int, Any] = {}

                def one(i: int) -> None:
                    outs[i] = llm.generate(
                        prompts[i], SamplingParams(max_tokens=mt, temperature=0.8, seed=1000 + i, grammar=grammar)
                    )

                t0 = time.perf_counter()
                ts = [threading.Thread(target=one, args=(i,)) for i in range(runs)]
                [t.start() for t in ts]
                [t.join() for t in ts]
                valid = lengths = 0
                for o in outs.values():
                    try:
                        json.loads(o.text)
                        valid += 1
                    except ValueError:
                        pass
                    lengths += o.finish_reason == "length"
                rows.append(
                    {
                        "format": kind,
                        "max_tokens": mt,
                        "json_close": close,
                        "runs": runs,
                        "valid": valid,
                        "valid_fraction": round(valid / runs, 3),
                        "cut_by_length": lengths,
                        "seconds": round(time.perf_counter() - t0, 2),
                    }
                )
                print(rows[-1], flush=True)
    finally:
        llm.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--max-tokens", default="32,64,150")
    ap.add_argument("--json", default=str(ROOT / "docs/results/json_validity_cpu.json"))
    a = ap.parse_args()
    mts = [int(x) for x in a.max_tokens.split(",")]
    rows = run(a.model, a.backend, False, a.runs, mts) + run(a.model, a.backend, True, a.runs, mts)
    print(f"\n{'format':<12} {'max_tokens':>10} {'before':>8} {'after':>8}")
    for r in rows[: len(rows) // 2]:
        after = next(
            x for x in rows if x["json_close"] and x["format"] == r["format"] and x["max_tokens"] == r["max_tokens"]
        )
        print(f"{r['format']:<12} {r['max_tokens']:>10} {r['valid_fraction']:>8.0%} {after['valid_fraction']:>8.0%}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps(
            {
                "model": a.model or "bundled SmolLM2-135M-Instruct (Q4_1 GGUF)",
                "backend": a.backend,
                "machine": platform.machine(),
                "rows": rows,
            },
            indent=1,
        )
    )
    print("wrote", a.json)


if __name__ == "__main__":
    main()
