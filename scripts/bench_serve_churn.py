#!/usr/bin/env python3
"""Requests that come and go, through a real server: each variant's latency under churn, as ratios to the first.

A server with ``--parallel C`` gets ``--num-requests N`` streamed requests at a fixed concurrency C, with random
prompt lengths (``--prompt-tokens`` mean, ``--prompt-std``) and random ``max_tokens`` (``--output-tokens``,
``--output-std``): every time a request ends, the next one starts, so the set of sequences decoding together
changes all through the run, and prompt chunks of arriving requests share steps with the others' decode rows.
This is the load where per-set work of a decode step shows (a CUDA graph captured for each new set of compressed
caches stalls every stream), which the fixed-set runs of ``bench_kv_formats_serve.py`` do not have.

A variant is ``NAME=SERVE_FLAGS[;VAR=VALUE...]`` (flags separated by spaces; ``16bit`` needs none), e.g.

    python scripts/bench_serve_churn.py --model /tmp/m8b --device cuda --tag h200_8b \\
        --variant "16bit=" --variant "k4v3=--turbo-kv k4v3" \\
        --variant "k4v3_graph_per_set=--turbo-kv k4v3;SWIFTLM_TQ_SET_TABLES=0"

Per variant: time to first token (p50, p99), inter-token latency (p50, p99, max), output tok/s, and from the
server's step log the steps with decode rows that took over ``--stall-ms`` (75 ms: over a step with a full prompt
chunk; count, and the time they took beyond the median decode-only step), counted from the moment the server was
ready (the steps of its start-up warm-up are left out: ``steps_before_ready``).  ``--resummarize JSON LOGS``
recomputes those step figures of an earlier run's JSON from its kept logs.  Ratios are to the first variant, run in the same invocation.
JSON: ``docs/results/serve_churn_<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_formats_serve import Server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "itl_ms_max", "output_tok_s")


def parse_variant(s: str) -> tuple[str, list[str], dict[str, str]]:
    name, _, rest = s.partition("=")
    flags, *envs = rest.split(";")
    env = dict(e.split("=", 1) for e in envs if e)
    return name, flags.split(), env


def steps_summary(paths: list[Path], stall_ms: float, since: float | None = None) -> dict:
    """The steps with decode rows in the step logs (their duration: to the next step's start): the median of the
    decode-only ones, and those over ``stall_ms`` (count, and the time they took beyond that median).  A gap after
    which no row decodes and that lasts over a second is the engine waiting for requests, not a step.  ``since``
    (the step log's clock, ``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process of the machine): the
    steps before it are left out, those of the server's start-up warm-up, which no request waits on."""
    rows = []
    for p in paths:
        for line in p.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by the process's exit
    before = [r for r in rows if since is not None and r["t"] < since]
    rows = sorted((r for r in rows if since is None or r["t"] >= since), key=lambda r: r["t"])
    steps = [
        ((b["t"] - a["t"]) * 1e3, bool(a["prefill_seqs"]))
        for a, b in zip(rows, rows[1:])
        if a["decode"] and (b["decode"] or b["t"] - a["t"] < 1.0)
    ]
    decode_only = [d for d, mixed in steps if not mixed]
    if not decode_only:
        return {"decode_steps": 0}
    med = statistics.median(decode_only)
    slow = [d for d, _ in steps if d > stall_ms]
    return {
        "steps_before_ready": len(before),
        "decode_steps": len(decode_only),
        "decode_step_ms_p50": med,
        "stalls": len(slow),
        "stall_ms_lost": sum(d - med for d in slow),
        "worst_step_ms": max(d for d, _ in steps),
    }


def run_variant(args: argparse.Namespace, name: str, flags: list[str], env: dict, tmp: Path) -> dict:
    log = tmp / f"serve_{name}.log"
    old = dict(os.environ)
    os.environ.update(env)  # the server's environment (Server copies os.environ)
    t_start = time.time()
    try:
        srv = Server(args, flags, log)
        ready_t = time.perf_counter()  # the step log's clock: its steps before this are the start-up warm-up's
    finally:
        os.environ.clear()
        os.environ.update(old)
    out = tmp / f"bench_{name}.json"
    cmd = [
        sys.executable, "-m", "swiftlm.cli", "bench", "serve", "--base-url", srv.base, "--endpoint", "completions",
        "--prompt-ids", "--prompt-tokens", str(args.prompt_mean), "--prompt-tokens-std", str(args.prompt_std),
        "--output-tokens", str(args.output_mean), "--output-tokens-std", str(args.output_std),
        "--num-requests", str(args.num_requests), "--concurrency", str(args.streams), "--warmup", str(args.warmup),
        "--warmup-prompt-tokens", str(args.warmup_prompt_tokens), "--ignore-eos", "--temperature", "0",
        "--seed", str(args.seed), "--timeout", str(args.timeout), "--no-progress", "--json", str(out),
    ]  # fmt: skip
    if args.tokenizer or args.model:
        cmd += ["--tokenizer", args.tokenizer or args.model]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    finally:
        srv.stop()
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench serve failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    res = json.loads(out.read_text())["results"]
    row = {
        "variant": name,
        "flags": flags,
        "env": env,
        "start_s": t0 - t_start,  # process start to ready: loading, graph captures, the warm-up
        "wall_s": time.time() - t0,
        "requests_ok": res["requests_ok"],
        "requests_failed": res["requests_failed"],
        "errors": res["errors"],
        "output_tok_s": res["output_throughput"],
        "ttft_ms_p50": res["ttft_ms"]["p50"],
        "ttft_ms_p99": res["ttft_ms"]["p99"],
        "itl_ms_p50": res["itl_ms"]["p50"],
        "itl_ms_p99": res["itl_ms"]["p99"],
        "itl_ms_max": res["itl_ms"]["max"],
        "ready_t": ready_t,
    }
    steps = sorted(tmp.glob(f"serve_{name}_steps_*.jsonl"))
    row.update(steps_summary(steps, args.stall_ms, ready_t) if steps else {})
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["variant", *METRICS, "stalls", "stall_ms_lost", "start_s"]
    print(" | ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if isinstance(v, float):
                rat = r["ratios"].get(c)
                v = f"{v:.1f}" + (f" ({rat:.2f}x)" if rat is not None and r is not rows[0] else "")
            cells.append(str(v))
        print(" | ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model served (default: the bundled SmolLM2)")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--variant", action="append", default=[], help="NAME=SERVE_FLAGS[;VAR=VALUE...]")
    ap.add_argument("--streams", type=int, default=8, help="concurrency and the server's --parallel")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=4000, help="mean prompt length")
    ap.add_argument("--prompt-std", type=int, default=1500)
    ap.add_argument("--output-tokens", type=int, default=256, help="mean max_tokens")
    ap.add_argument("--output-std", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--warmup-prompt-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-ms", type=float, default=75.0, help="a step with decode rows longer than this is a stall")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra serve flag for every variant")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--load-timeout", type=float, default=600)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument(
        "--logs", default=None, help="keep the servers' logs and step logs here (default: a temporary folder)"
    )
    ap.add_argument("--note", default="")
    ap.add_argument("--resummarize", nargs=2, metavar=("JSON", "LOGS"), help="recompute the step figures and exit")
    ap.add_argument(
        "--ready",
        action="append",
        default=[],
        metavar="VARIANT=T",
        help="with --resummarize: the step-log time at which that variant's server was ready (runs without ready_t)",
    )
    args = ap.parse_args()
    if args.resummarize:
        doc_path, logs = Path(args.resummarize[0]), Path(args.resummarize[1])
        doc = json.loads(doc_path.read_text())
        for name, t in (kv.split("=") for kv in args.ready):  # runs from before ready_t was recorded
            for r in doc["rows"]:
                if r["variant"] == name:
                    r["ready_t"], r["ready_t_from"] = float(t), "--ready (read off the step log)"
        for r in doc["rows"]:
            steps = sorted(logs.glob(f"serve_{r['variant']}_steps_*.jsonl"))
            r.update(steps_summary(steps, args.stall_ms, r.get("ready_t")) if steps else {})
        doc["config"]["stall_ms"] = args.stall_ms
        doc_path.write_text(json.dumps(doc, indent=1))
        print_table(doc["rows"])
        return 0
    if not args.variant:
        ap.error("--variant is required (one per server to run)")
    # what Server reads: the longest prompt and output to make room for (--ctx-size), and the step log switch
    args.prompt_mean, args.output_mean = args.prompt_tokens, args.output_tokens
    args.prompt_tokens = [args.prompt_mean + 4 * args.prompt_std]
    args.output_tokens = args.output_mean + 4 * args.output_std
    args.streams_output_tokens, args.step_log = 0, True
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.logs or d)
        tmp.mkdir(parents=True, exist_ok=True)
        for v in args.variant:
            name, flags, env = parse_variant(v)
            rows.append(run_variant(args, name, flags, env, tmp))  # (Server adds --serve-arg)
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for r in rows:
        r["ratios"] = {k: (r[k] / base[k] if r.get(k) and base.get(k) else None) for k in METRICS}
    print_table(rows)
    config = {k: v for k, v in vars(args).items() if k not in ("variant", "prompt_tokens", "output_tokens")}
    doc = {"benchmark": "serve_churn", "config": config, "note": args.note, "rows": rows}
    out = Path(args.out) / f"serve_churn_{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["requests_failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
