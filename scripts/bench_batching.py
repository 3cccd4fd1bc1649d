#!/usr/bin/env python3
"""Aggregate decode throughput with N concurrent streams against serial execution, one run.

    python scripts/bench_batching.py [--backend torch] [--model M] [--streams 1,4,8,16] [--tokens 32]

For each N: N chat requests (different prompts) run one after another (serial baseline), then
all N at once with --parallel N (the engine batches their decode rows into one forward pass).
Prints aggregate generated tok/s for both and the ratio; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = [
    "cats",
    "Rome",
    "Python",
    "mountains",
    "prime numbers",
    "the sea",
    "music",
    "the sky",
    "bread",
    "rivers",
    "chess",
    "volcanoes",
    "bees",
    "glass",
    "trains",
    "the moon",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default="bench_results/bench_batching.json")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from swiftlm import LLM, SamplingParams

    counts = [int(x) for x in a.streams.split(",")]
    # the prompt cache is off so that the ratio measures batching alone (the prompts share the template prefix)
    llm = LLM(a.model, backend=a.backend, parallel=max(counts), max_queue=256, prompt_cache_bytes=0)
    p = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    chats = [[{"role": "user", "content": f"Write a paragraph about {t}."}] for t in TOPICS]
    llm.generate(chats[0], p)  # warm-up
    rows = []
    for n in counts:
        batch = [chats[i % len(chats)] for i in range(n)]
        llm.generate(batch, p)  # warm-up at this width (on CUDA: the batch graphs get captured here)
        t0 = time.perf_counter()
        for c in batch:
            llm.generate(c, p)
        serial = n * a.tokens / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = llm.generate(batch, p)
        conc = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
        rows.append({"streams": n, "serial_tok_s": serial, "concurrent_tok_s": conc, "ratio": conc / serial})
    t = Table(
        title=f"aggregate tok/s, {llm.spec.name} on {llm.backend_choice}, {a.tokens} tokens per stream, "
        f"{platform.machine()}"
    )
    for col in ("streams", "serial tok/s", "concurrent tok/s", "ratio"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["streams"]), f"{r['serial_tok_s']:.2f}", f"{r['concurrent_tok_s']:.2f}", f"{r['ratio']:.2f}")
    Console().print(t)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps({"backend": a.backend, "model": llm.spec.name, "tokens": a.tokens, "rows": rows}, indent=2)
    )
    llm.close()


if __name__ == "__main__":
    main()
