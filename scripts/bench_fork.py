#!/usr/bin/env python3
"""n choices of one prompt: forked (one prefill, shared KV) vs one chain vs n separate requests.

    python scripts/bench_fork.py [--model smollm2-135m-instruct] [--prompt-tokens 1000] [--n 8]
                                 [--tokens 32] [--repeats 2] [--json docs/results/bench_fork_cpu.json]

One engine (torch, CPU by default, fp32, --parallel n, prompt cache off so nothing is reused by
accident), greedy decoding of --tokens tokens with ignore_eos, on a ~--prompt-tokens prompt:

- ``one chain``: a single request;
- ``n forked``: one request with n choices (``Engine.submit_group``: the prompt prefilled once, its
  KV rows shared copy-on-write by the n choices);
- ``n separate``: n requests of the same prompt submitted together (each prefills it).

Per mode: wall time (median of --repeats, submit to the last choice's end), prompt positions run
through the model (``fork_stats.prefill_tokens``), tokens generated, and the peak of the engine's
``kv_stats()`` bytes seen at any output event.  Greedy outputs of every choice are compared with the
single chain's.  Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = (
    "The lighthouse keeper counted the ships that passed each night, writing their names in a "
    "leather book. Some were fishing boats returning with silver catches, others were tall cargo "
    "vessels bound for distant ports. "
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "docs/results/bench_fork_cpu.json"))
    a = ap.parse_args()

    from swiftlm import LLM, SamplingParams

    kw = {"device": a.device} if a.backend == "torch" else {}
    llm = LLM(a.model, backend=a.backend, parallel=a.n, prompt_cache_bytes=0, **kw)
    eng = llm.engine
    text, prompt = "", []
    while len(prompt) < a.prompt_tokens:
        text += TEXT
        prompt = eng.text_prompt("Story: " + text + "\nQuestion: what did the keeper write down? Answer:")
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    choices = [params.for_choice(i) for i in range(a.n)]

    def run(submit) -> dict:
        q: queue.Queue = queue.Queue()
        pre = eng.fork_stats.prefill_tokens
        t0 = time.perf_counter()
        ids = submit(q.put)
        toks = {i: [] for i in ids}
        left, kv = set(ids), 0
        while left:
            ev = q.get(timeout=600)
            toks[ev.seq_id] += ev.token_ids
            kv = max(kv, eng.kv_stats()["bytes"])
            if ev.finished:
                left.discard(ev.seq_id)
        return {
            "wall_s": time.perf_counter() - t0,
            "prefill_tokens": eng.fork_stats.prefill_tokens - pre,
            "tokens_generated": sum(len(t) for t in toks.values()),
            "kv_peak_bytes": kv,
            "outputs": [toks[i] for i in ids],
        }

    modes = {
        "one chain": lambda sink: [eng.submit(prompt, params, sink)],
        f"n={a.n} forked": lambda sink: eng.submit_group(prompt, choices, sink),
        f"n={a.n} separate": lambda sink: [eng.submit(prompt, p, sink) for p in choices],
    }
    run(modes["one chain"])  # warm-up
    results: dict[str, dict] = {}
    for _ in range(a.repeats):
        for name, fn in modes.items():
            r = run(fn)
            prev = results.setdefault(name, {**r, "wall_s": []})
            prev["wall_s"].append(r["wall_s"])
            prev["kv_peak_bytes"] = max(prev["kv_peak_bytes"], r["kv_peak_bytes"])
    single = results["one chain"]["outputs"][0]
    rows = []
    for name, r in results.items():
        r["wall_s_median"] = statistics.median(r["wall_s"])
        r["identical_to_single"] = all(o == single for o in r.pop("outputs"))
        rows.append(
            (
                name,
                f"{r['wall_s_median']:.2f}",
                str(r["prefill_tokens"]),
                str(r["tokens_generated"]),
                f"{r['kv_peak_bytes'] / 2**20:.1f}",
                str(r["identical_to_single"]),
            )
        )
    forked, separate = results[f"n={a.n} forked"], results[f"n={a.n} separate"]
    bpt = eng.info.kv_bytes_per_token
    head = ("mode", "wall s (median)", "prefill tokens", "tokens generated", "KV peak MiB", "greedy == single")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(
        f"\nfork: {llm.spec.name}, {a.backend} {a.device}, {len(prompt)} prompt tokens, {a.tokens} new per choice, "
        f"n={a.n}, {platform.machine()}"
    )
    for line in [head, tuple("-" * w for w in widths)] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    speed = separate["wall_s_median"] / forked["wall_s_median"]
    kv_ratio = separate["kv_peak_bytes"] / forked["kv_peak_bytes"]
    print(
        f"forked vs separate: {speed:.2f}x faster, {kv_ratio:.2f}x less KV at peak "
        f"({(separate['kv_peak_bytes'] - forked['kv_peak_bytes']) / bpt:.0f} token rows; "
        f"{a.n - 1} prompts = {(a.n - 1) * len(prompt)})"
    )
    out = {
        "model": llm.spec.name,
        "backend": a.backend,
        "device": a.device,
        "machine": platform.machine(),
        "prompt_tokens": len(prompt),
        "new_tokens": a.tokens,
        "n": a.n,
        "repeats": a.repeats,
        "kv_bytes_per_token": bpt,
        "modes": results,
        "speedup_forked_vs_separate": speed,
        "kv_ratio_separate_over_forked": kv_ratio,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.json}")
    llm.close()


if __name__ == "__main__":
    main()
