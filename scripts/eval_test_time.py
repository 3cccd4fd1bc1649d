#!/usr/bin/env python3
"""Accuracy and cost of test-time compute on arithmetic word problems with known answers:
greedy vs self-consistency@N vs best-of-N (mean log-probability) vs best-of-N (verifier), one model.

Problems are generated from a seed (sums, differences, products, two-step word problems). The N
chains of a problem run in one batch; self-consistency and both best-of-N rankings read the same
chains (same seeds), so their accuracy differs only by how they choose. Cost: wall time and
completion tokens per problem, relative to one greedy chain. Prints a table; writes JSON.

    python scripts/eval_test_time.py [--model M] [--backend torch] [--problems 40] [--n 8]
        [--json docs/results/test_time_accuracy_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Maya"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils"]


def problems(k: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(k):
        a, b = rng.randint(11, 60), rng.randint(2, 30)
        who, what = rng.choice(NAMES), rng.choice(ITEMS)
        kind = i % 4
        if kind == 0:
            q, ans = f"What is {a} + {b}?", a + b
        elif kind == 1:
            q, ans = f"What is {a} - {b}?", a - b
        elif kind == 2:
            c = rng.randint(2, 9)
            q, ans = f"What is {c} * {b}?", c * b
        else:
            c = rng.randint(1, min(a, 9))
            q, ans = (
                f"{who} has {a} {what}, buys {b} more and gives away {c}. How many {what} does {who} have now?",
                a + b - c,
            )
        out.append((q + " Answer with just the number.", ans))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from swiftlm import LLM, SamplingParams
    from swiftlm import test_time as tt

    llm = LLM(a.model, backend=a.backend, parallel=max(8, a.n), prompt_cache_bytes=0)
    probs = problems(a.problems, a.seed)
    tk = {"enable_thinking": False}
    right = {
        "greedy": 0,
        f"self_consistency@{a.n}": 0,
        f"best_of_{a.n}_logprob": 0,
        f"best_of_{a.n}_verifier": 0,
        f"oracle@{a.n}": 0,
    }
    cost = {"greedy": [0.0, 0], "chains": [0.0, 0], "verifier": [0.0, 0]}
    for j, (q, ans) in enumerate(probs):
        msgs = [{"role": "user", "content": q}]
        prompt = llm.engine.chat_prompt(msgs, **tk)
        t0 = time.perf_counter()
        g = tt.engine_sample(llm.engine, prompt, SamplingParams(temperature=0.0, max_tokens=a.max_tokens))(1)[0]
        cost["greedy"][0] += time.perf_counter() - t0
        cost["greedy"][1] += g.tokens
        right["greedy"] += tt.extract_answer(g.text) == str(ans)
        p = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed * 1000 + j)
        t0 = time.perf_counter()
        chains = tt.engine_sample(llm.engine, prompt, p)(a.n)
        cost["chains"][0] += time.perf_counter() - t0
        cost["chains"][1] += sum(c.tokens for c in chains)
        sc = tt.self_consistency(lambda n: chains, a.n)
        right[f"self_consistency@{a.n}"] += sc.answer == str(ans)
        right[f"oracle@{a.n}"] += any(c.answer == str(ans) for c in sc.candidates)
        bl = tt.best_of_n(lambda n: chains, a.n)
        right[f"best_of_{a.n}_logprob"] += tt.extract_answer(bl.text) == str(ans)
        t0 = time.perf_counter()
        bv = tt.best_of_n(lambda n: chains, a.n, "verifier", tt.engine_verify(llm.engine, q, tk))
        cost["verifier"][0] += time.perf_counter() - t0
        cost["verifier"][1] += a.n
        right[f"best_of_{a.n}_verifier"] += tt.extract_answer(bv.text) == str(ans)
        print(
            f"[{j + 1}/{len(probs)}] {q[:60]!r} answer {ans}: greedy {tt.extract_answer(g.text)}, votes {sc.votes[:3]}",
            file=sys.stderr,
        )
    llm.close()
    k = len(probs)
    acc = {m: round(v / k, 3) for m, v in right.items()}
    per = {
        m: {"seconds_per_problem": round(s / k, 3), "tokens_per_problem": round(t / k, 1)} for m, (s, t) in cost.items()
    }
    ratio = {
        "chains_vs_greedy_seconds": round(cost["chains"][0] / max(cost["greedy"][0], 1e-9), 2),
        "chains_vs_greedy_tokens": round(cost["chains"][1] / max(cost["greedy"][1], 1), 2),
    }
    print(f"\n{'method':<28} {'accuracy':>9}")
    for m, v in acc.items():
        print(f"{m:<28} {v:>9.1%}")
    print(f"cost per problem: {per}\n{a.n} chains in one batch vs one greedy chain: {ratio}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "model": a.model or "bundled SmolLM2-135M-Instruct (Q4_1 GGUF)",
                    "backend": a.backend,
                    "host": platform.node(),
                    "machine": platform.machine(),
                    "problems": k,
                    "n": a.n,
                    "max_tokens": a.max_tokens,
                    "temperature": a.temperature,
                    "seed": a.seed,
                    "accuracy": acc,
                    "cost": per,
                    "ratios": ratio,
                    "note": "oracle@N: some chain has the right answer (the ceiling of any selection rule)",
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
