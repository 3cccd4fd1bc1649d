#!/usr/bin/env python3
"""Speculative decoding: speed-up and acceptance against plain greedy decoding, one run.

    python scripts/bench_speculative.py [--backend torch] [--model M] [--tokens 128] [--k 4]
                                        [--draft-model D] [--modes plain,ngram,self]

Two prompts: a copy-heavy one ("repeat and correct this paragraph"), where prompt lookup
finds long matches, and a free-form one.  Modes: plain, ngram (prompt lookup), self (the
model as its own draft: every draft is accepted, so the ratio shows the overhead bound of
drafting with a model as expensive as the target), draft (--draft-model).  Greedy, so every
mode must produce the same tokens (checked).  Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = {
    "copy": "Repeat the following paragraph, correcting the two spelling mistakes and changing nothing else:\n\n"
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its "
    "keeper climbed the narow stairs, cleaned the great lens and lit the lamp, so that ships passing in "
    "the dark would know where the rocks were. When the keeper retired, the town decided to keep the "
    "light burning with an electric lamp, and the lighthouse became a musuem about the sea.",
    "free": "Write a short story about a robot who learns to bake bread.",
}


def run(llm, prompt: str, tokens: int):
    from swiftlm import SamplingParams

    p = SamplingParams(max_tokens=tokens, temperature=0)
    msgs = [{"role": "user", "content": prompt}]
    llm.generate(msgs, p)  # warm-up: the same request (CUDA graphs captured, prompt cache filled)
    st = llm.engine.speculator.stats if llm.engine.speculator else None
    before = (st.steps, st.drafted, st.accepted, st.emitted) if st else None
    t0 = time.perf_counter()
    out = llm.generate(msgs, p)
    dt = time.perf_counter() - t0
    row = {"tokens": len(out.token_ids), "seconds": dt, "tok_s": len(out.token_ids) / dt, "ids": out.token_ids}
    if st:
        steps, drafted, accepted, emitted = (
            a - b for a, b in zip((st.steps, st.drafted, st.accepted, st.emitted), before)
        )
        row.update(
            verify_steps=steps,
            drafted=drafted,
            accepted=accepted,
            acceptance=accepted / drafted if drafted else 0.0,
            tokens_per_step=emitted / steps if steps else 0.0,
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--modes", default="plain,ngram,self")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", default="bench_results/bench_speculative.json")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from swiftlm import LLM

    modes = a.modes.split(",")
    if a.draft_model and "draft" not in modes:
        modes.append("draft")
    results: dict[str, dict[str, dict]] = {}
    name = device = ""
    for mode in modes:
        kw: dict = {}
        if mode == "ngram":
            kw["speculative"] = "ngram"
        elif mode == "self":
            kw["draft_model"] = a.model or "smollm2-135m-instruct"
        elif mode == "draft":
            kw["draft_model"] = a.draft_model
        # prompt cache on (the warm-up fills it) so both runs time decoding, not a second prefill
        llm = LLM(a.model, backend=a.backend, parallel=1, num_draft_tokens=a.k, **kw)
        name, device = llm.spec.name, llm.backend_choice
        results[mode] = {k: run(llm, p, a.tokens) for k, p in PROMPTS.items()}
        llm.close()
    base = results["plain"]
    t = Table(
        title=f"speculative decoding, {name} on {device}, greedy, {a.tokens} tokens, k={a.k}, {platform.machine()}"
    )
    for col in ("prompt", "mode", "tok/s", "speed-up", "acceptance", "tokens/verify", "same tokens"):
        t.add_column(col)
    for k in PROMPTS:
        for mode in modes:
            r = results[mode][k]
            r["speedup"] = r["tok_s"] / base[k]["tok_s"]
            r["same_as_plain"] = r["ids"] == base[k]["ids"]
            t.add_row(
                k,
                mode,
                f"{r['tok_s']:.1f}",
                f"{r['speedup']:.2f}x",
                f"{r['acceptance']:.0%}" if "acceptance" in r else "-",
                f"{r['tokens_per_step']:.2f}" if "tokens_per_step" in r else "-",
                "yes" if r["same_as_plain"] else "NO",
            )
    Console().print(t)
    for m in results.values():
        for r in m.values():
            r.pop("ids")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps(
            {
                "model": name,
                "device": device,
                "tokens": a.tokens,
                "k": a.k,
                "machine": platform.machine(),
                "results": results,
            },
            indent=2,
        )
    )
    if not all(r["same_as_plain"] for m in results.values() for r in m.values()):
        sys.exit("speculative output differs from plain greedy output")


if __name__ == "__main__":
    main()
