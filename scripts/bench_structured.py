#!/usr/bin/env python3
"""Per-token cost of constrained decoding (response_format json_schema through llguidance).

    python scripts/bench_structured.py [--backend torch] [--runs 20]

Runs the same seeded JSON-schema request --runs times, validating every output against the
schema, and prints: mask computation + token consumption time per token (measured inside the
sampler), and decode tok/s with the constraint next to unconstrained decoding of the same
prompt.  Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", default="bench_results/bench_structured.json")
    a = ap.parse_args()
    import jsonschema

    from swiftlm import LLM, SamplingParams
    from swiftlm.chat import structured

    timings: list[float] = []
    orig_allowed, orig_consume = structured.Constraint.allowed, structured.Constraint.consume

    def allowed(self):
        t0 = time.perf_counter()
        try:
            return orig_allowed(self)
        finally:
            timings.append(time.perf_counter() - t0)

    def consume(self, token):
        t0 = time.perf_counter()
        try:
            return orig_consume(self, token)
        finally:
            timings[-1] += time.perf_counter() - t0

    structured.Constraint.allowed, structured.Constraint.consume = allowed, consume
    llm = LLM(backend=a.backend, prompt_cache_bytes=0)
    g = structured.grammar_for({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    chat = [{"role": "user", "content": "Invent a person. Reply in JSON with name, age and city."}]
    valid, tps_c, n_tok = 0, [], 0
    for seed in range(a.runs):
        t0 = time.perf_counter()
        out = llm.generate(chat, SamplingParams(max_tokens=64, temperature=0.8, seed=seed, grammar=g))
        dt = time.perf_counter() - t0
        n_tok += len(out.token_ids)
        tps_c.append(len(out.token_ids) / dt)
        try:
            jsonschema.validate(json.loads(out.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"seed {seed}: invalid: {exc}: {out.text!r}")
    tps_u = []
    for seed in range(min(a.runs, 5)):
        t0 = time.perf_counter()
        out = llm.generate(chat, SamplingParams(max_tokens=32, temperature=0.8, seed=seed, ignore_eos=True))
        tps_u.append(len(out.token_ids) / (time.perf_counter() - t0))
    res = {
        "backend": a.backend,
        "runs": a.runs,
        "valid": valid,
        "tokens": n_tok,
        "mask_ms_per_token_median": 1000 * statistics.median(timings),
        "mask_ms_per_token_p95": 1000 * sorted(timings)[int(0.95 * (len(timings) - 1))],
        "constrained_tok_s_median": statistics.median(tps_c),
        "unconstrained_tok_s_median": statistics.median(tps_u),
    }
    print(f"{valid}/{a.runs} outputs valid against the schema ({n_tok} tokens)")
    print(
        f"mask + consume per token: median {res['mask_ms_per_token_median']:.3f} ms, "
        f"p95 {res['mask_ms_per_token_p95']:.3f} ms"
    )
    print(
        f"end to end (incl. prefill): constrained {res['constrained_tok_s_median']:.2f} tok/s, "
        f"unconstrained {res['unconstrained_tok_s_median']:.2f} tok/s"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
