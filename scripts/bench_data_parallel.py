#!/usr/bin/env python3
"""--data-parallel, measured: a server with 1 replica vs N replicas under the same load, and the
prefix-affinity prompt-cache hit rate with a few shared system prompts.

For each replica count R (--replicas 1,2): start `swiftlm serve --data-parallel R`, then
  1. random prompts at --concurrency N (default 128), `swiftlm bench serve` measuring throughput, TTFT
     (the one-replica server also at N / R for every other R: R replicas at N streams are R replicas at N / R
     streams each, so R x that figure is the most R replicas can give, whatever the server does; the table
     shows it and how much of it the R-replica server reached);
  2. --shared-prompts system prompts (default 8, each --system-tokens long) each followed by a unique
     question, the same load; then /health's prompt-cache hits and the routing counters.
Writes one JSON per run and a summary (JSON + Markdown) to --out.

    python scripts/bench_data_parallel.py --model /tmp/m8b --replicas 1,2 --out $OUT   # a 2-GPU machine

On a CPU-only machine it runs too (R engines share the CPU: a mechanics check, not a speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

WORDS = (
    "system assistant careful policy answer question detail context model output summary format "
    "concise reason example table number source user request language style safety helpful"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, replicas: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "swiftlm.cli",
        "serve",
        "--model",
        args.model,
        "--backend",
        "torch",
        "--port",
        str(port),
        "--data-parallel",
        str(replicas),
        "--parallel",
        str(args.parallel),
        "--ctx-size",
        str(args.ctx_size),
        "--max-queue",
        str(max(64, args.concurrency * 2)),
        "--log-level",
        "warning",
        *args.serve_arg,
    ]
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh, text=True)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if '"ready"' in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + args.load_timeout
    while not ready.wait(1):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"server with --data-parallel {replicas} did not start; see {log}")
    return proc, f"http://127.0.0.1:{port}"


def bench(args: argparse.Namespace, base: str, out: Path, extra: list[str], concurrency: int | None = None) -> dict:
    n = concurrency or args.concurrency
    cmd = [
        sys.executable,
        "-m",
        "swiftlm.cli",
        "bench",
        "serve",
        "--base-url",
        base,
        "--endpoint",
        "completions",
        "--concurrency",
        str(n),
        "--num-requests",
        str(args.num_requests),
        "--warmup",
        str(args.warmup),
        "--output-tokens",
        str(args.output_tokens),
        "--ignore-eos",
        "--temperature",
        "0",
        "--json",
        str(out),
        "--no-progress",
        # one client process tops out at a few thousand SSE events/s: spread the load
        "--workers",
        str(args.workers or (4 if n >= 32 else 1)),
        *extra,
    ]
    subprocess.run(cmd, check=True, timeout=args.run_timeout)
    return json.loads(out.read_text())["results"]


def shared_dataset(args: argparse.Namespace, path: Path) -> None:
    rng = random.Random(0)
    systems = [" ".join(rng.choice(WORDS) for _ in range(args.system_tokens)) for _ in range(args.shared_prompts)]
    with open(path, "w") as f:
        for i in range(args.num_requests + args.warmup):
            q = " ".join(rng.choice(WORDS) for _ in range(16))
            f.write(
                json.dumps(
                    {"prompt": f"System {i % len(systems)}: {systems[i % len(systems)]}\nUser {i}: {q}\nAssistant:"}
                )
                + "\n"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--replicas", default="1,2", help="replica counts to compare (default 1,2)")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=256, help="random prompts' length (run 1)")
    p.add_argument("--parallel", type=int, default=128, help="--parallel of each replica")
    p.add_argument(
        "--ctx-size",
        type=int,
        default=2048,
        help="--ctx-size of each replica (CUDA preallocates "
        "--parallel slots of this many tokens: 8B shape, 128 x 2048 = 34 GB of KV per GPU)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="load-generator processes (default: 4 from 32 concurrent requests, else 1)",
    )
    p.add_argument("--shared-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=400, help="words per shared system prompt (run 2)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `swiftlm serve` argument (repeatable)")
    p.add_argument("--load-timeout", type=float, default=900)
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "dp_shared_prompts.jsonl"
    shared_dataset(args, data)
    summary = []
    counts = [int(x) for x in args.replicas.split(",")]
    share = {}  # one replica's random-prompt throughput at concurrency / R: what each of R replicas serves
    for r in counts:
        proc, base = start_server(args, r, out / f"dp{r}_server.log")
        try:
            row: dict = {"replicas": r}
            rnd_args = ["--prompt-tokens", str(args.prompt_tokens), "--tokenizer", args.model]
            if r == 1:
                for k in sorted({c for c in counts if c > 1}):
                    n_k = max(1, args.concurrency // k)
                    share[k] = bench(args, base, out / f"dp1_random_n{n_k}.json", rnd_args, concurrency=n_k)[
                        "output_throughput"
                    ]
            rnd = bench(args, base, out / f"dp{r}_random.json", rnd_args)
            h0 = httpx.get(base + "/health", timeout=30).json()["stats"]
            shr = bench(args, base, out / f"dp{r}_shared.json", ["--dataset", str(data), "--tokenizer", args.model])
            h1 = httpx.get(base + "/health", timeout=30).json()["stats"]
            hits = h1["prompt_cache"]["hits"] - h0["prompt_cache"]["hits"]
            misses = h1["prompt_cache"]["misses"] - h0["prompt_cache"]["misses"]
            row.update(
                random_req_s=rnd["request_throughput"],
                random_tok_s=rnd["output_throughput"],
                random_ttft_p50_ms=rnd["ttft_ms"]["p50"],
                random_failed=rnd["requests_failed"],
                shared_tok_s=shr["output_throughput"],
                shared_ttft_p50_ms=shr["ttft_ms"]["p50"],
                shared_hits=hits,
                shared_misses=misses,
                shared_hit_rate=round(hits / (hits + misses), 4) if hits + misses else 0.0,
                routing=h1.get("data_parallel"),
            )
            summary.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "routing"}), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    base_tok = summary[0]["random_tok_s"] or 1.0
    for row in summary:  # R replicas at N streams are R replicas at N / R streams each: the most they can give
        r = row["replicas"]
        if r > 1 and share.get(r) and summary[0]["replicas"] == 1:
            bound = row["bound_tok_s"] = r * share[r]
            row["bound_x"] = round(bound / base_tok, 3)
            row["of_bound"] = round(row["random_tok_s"] / bound, 3)
    (out / "bench_data_parallel.json").write_text(
        json.dumps({"concurrency": args.concurrency, "rows": summary, "one_replica_at_share": share}, indent=1)
    )
    lines = [
        "| replicas | random: req/s | output tok/s | x vs first | R x one replica at N/R (x) | of that | "
        "TTFT p50 ms | shared prompts: tok/s | prompt-cache hit rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        bound = (
            f"{row['bound_tok_s']:.0f} ({row['bound_x']:.2f}x) | {row['of_bound']:.0%}"
            if "bound_tok_s" in row
            else "| "
        )
        lines.append(
            f"| {row['replicas']} | {row['random_req_s']:.2f} | {row['random_tok_s']:.0f} | "
            f"{row['random_tok_s'] / base_tok:.2f} | {bound} | {row['random_ttft_p50_ms']:.0f} | "
            f"{row['shared_tok_s']:.0f} | {row['shared_hit_rate']:.3f} |"
        )
    (out / "bench_data_parallel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
