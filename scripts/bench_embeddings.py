#!/usr/bin/env python3
"""Embeddings/s through the engine (``Engine.embed``: what /v1/embeddings runs) at batch 1 and 32,
beside transformers' AutoModel on the same checkpoint in the same run (padded batch, last-token
pooling, L2 norm: what a sentence-transformers user runs) as the baseline.

    python scripts/bench_embeddings.py [--model DIR] [--backend torch] [--batches 1,32] [--json out.json]

Without --model it writes a SmolLM2-135M-shaped embedding-only checkpoint (random weights,
Qwen3-Embedding layout) to a temporary directory."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "embeddings map text to vectors so that similar meanings land close together while unrelated "
    "sentences end up far apart in the space"
).split()


def texts(n: int, words: int = 24) -> list[str]:
    return [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(words - i % 5)) for i in range(n)]


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=str(ROOT / "docs/results/bench_embeddings_cpu.json"))
    a = ap.parse_args()
    model = a.model
    if model is None:
        model = str(Path(tempfile.mkdtemp()) / "emb")
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts/make_checkpoint.py"),
                model,
                "--arch",
                "qwen3",
                "--hidden",
                "576",
                "--layers",
                "30",
                "--heads",
                "9",
                "--kv-heads",
                "3",
                "--head-dim",
                "64",
                "--intermediate",
                "1536",
                "--dtype",
                "float32",
                "--embedding-only",
            ],
            check=True,
            capture_output=True,
        )
    import numpy as np
    import torch
    import transformers

    from swiftlm import LLM

    llm = LLM(model, backend=a.backend)
    ref = transformers.AutoModel.from_pretrained(model, torch_dtype=torch.float32).eval()
    tok = llm.engine.tokenizer
    rows = []
    try:
        for b in [int(x) for x in a.batches.split(",")]:
            prompts = [llm.engine.text_prompt(t) for t in texts(b)]

            def ours():
                return llm.engine.embed(prompts).result()

            def theirs():
                L = max(map(len, prompts))
                ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])  # left padding: last token at -1
                mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
                with torch.no_grad():
                    h = ref(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
                return torch.nn.functional.normalize(h, dim=-1).numpy()

            so, st = timed(ours, a.reps), timed(theirs, a.reps)
            agree = float(np.max(np.abs(np.stack(ours()) - theirs())))
            rows.append(
                {
                    "batch": b,
                    "tokens_per_input": round(sum(map(len, prompts)) / b, 1),
                    "swiftlm_emb_per_s": round(b / so, 2),
                    "transformers_emb_per_s": round(b / st, 2),
                    "ratio": round(st / so, 3),
                    "max_abs_diff": agree,
                }
            )
    finally:
        llm.close()
    print(f"{'batch':>5} {'swiftlm emb/s':>14} {'transformers emb/s':>19} {'ratio':>6} {'max |diff|':>10}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['swiftlm_emb_per_s']:>14.1f} {r['transformers_emb_per_s']:>19.1f} "
            f"{r['ratio']:>6.2f} {r['max_abs_diff']:>10.2e}"
        )
    out = {
        "model": a.model or "SmolLM2-135M-shaped embedding-only checkpoint (random weights)",
        "backend": a.backend,
        "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "tokenizer": type(tok).__name__,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print("wrote", a.json)


if __name__ == "__main__":
    main()
