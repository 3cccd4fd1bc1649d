#!/usr/bin/env bash
# SwiftLM against its peers on this CPU, same fp32 weights, same load (`swiftlm bench serve`):
#   swiftlm --backend torch  vs  transformers serve --continuous-batching
#   swiftlm --backend mlx    vs  mlx_lm.server
# for N concurrent streams in 1 4 8 16: random 40-token prompts (seeded, identical for every server), 128 output
# tokens with EOS banned (logit_bias -100 on the EOS ids; "ignore_eos" too where the server accepts it),
# max(8, 4N) measured requests after N warmup requests.  Each server is started, measured and stopped in turn.
#
#   scripts/bench_peers.sh [--quick] [--output-tokens T] [--ns "1 4 8 16"] [--servers "a b"] [--out PATH]
#
#   --quick           smoke test: N in 1 4, 32 output tokens, one warmup request, results under bench_results/
#   --servers         any of: swiftlm-torch transformers-serve swiftlm-mlx mlx-lm-server (default: all four)
#
# Steps: (1) `swiftlm convert` the bundled GGUF to an HF fp32 directory (bench_results/peers/smollm2-fp32);
# (2) the peers go into their own venv (.peers-venv, from PyPI: transformers[serving], torch==2.13.0, mlx[cpu],
# mlx-lm), never into .venv; (3) the runs, one JSON each under bench_results/peers/runs/, server logs under
# bench_results/peers/logs/; (4) docs/results/bench_peers_cpu.json (--quick: bench_results/peers/
# bench_peers_cpu_quick.json) and a table: aggregate output tok/s per server and N, and the ratios
# swiftlm-torch / transformers-serve and swiftlm-mlx / mlx-lm-server.
#
# Run it on an otherwise idle machine: on a few cores shared with another CPU-bound job, torch's intra-op threads
# stall each other and decode slows down many times over (both torch servers alike, but the numbers mean nothing then).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
PEERS="${PEERS_VENV:-$ROOT/.peers-venv}"
WORK="${BENCH_PEERS_WORK:-$ROOT/bench_results/peers}"
NS="1 4 8 16"
TOKENS=128
PROMPT_TOKENS=40
QUICK=0
SERVERS="swiftlm-torch transformers-serve swiftlm-mlx mlx-lm-server"
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; NS="1 4"; TOKENS=32 ;;
    --output-tokens) TOKENS="$2"; shift ;;
    --ns) NS="$2"; shift ;;
    --servers) SERVERS="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bench_peers.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$OUT" ]; then
  if [ "$QUICK" = 1 ]; then OUT="$WORK/bench_peers_cpu_quick.json"; else OUT="$ROOT/docs/results/bench_peers_cpu.json"; fi
fi
MODEL_DIR="$WORK/smollm2-fp32"
RUNS="$WORK/runs"
LOGS="$WORK/logs"
mkdir -p "$RUNS" "$LOGS"
rm -f "$RUNS"/*.json
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
T_START=$(date +%s)

log() { echo "[bench_peers $(date +%H:%M:%S)] $*" >&2; }

# ---------------------------------------------------------------- (1) the fp32 HF directory
if [ ! -f "$MODEL_DIR/config.json" ]; then
  log "converting the bundled GGUF to $MODEL_DIR (fp32)"
  "$PY" -m swiftlm.cli convert smollm2-135m-instruct "$MODEL_DIR" --dtype float32 --force
fi

# ---------------------------------------------------------------- (2) the peers' venv
need_peers=0
case " $SERVERS " in *" transformers-serve "*|*" mlx-lm-server "*) need_peers=1 ;; esac
if [ "$need_peers" = 1 ] && [ ! -f "$PEERS/.installed" ]; then
  log "installing the peers into $PEERS"
  BASE_PY="$("$PY" -c 'import sys; print(sys._base_executable)')"
  "$BASE_PY" -m venv "$PEERS"
  MLX="mlx[cpu]"; [ "$(uname -s)" = Darwin ] && MLX="mlx"
  # torch pinned to the version of .venv so that pip takes the same (local CPU) wheel
  "$PEERS/bin/pip" install -q "transformers[serving]" "torch==2.13.0" "$MLX" mlx-lm 2>&1 \
    | grep -v "^WARNING: Location" || true
  "$PEERS/bin/python" -c "import transformers, fastapi, uvicorn, mlx_lm, torch" && touch "$PEERS/.installed"
fi

# ---------------------------------------------------------------- (3) the runs
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_ready PID URL MODEL: until a 1-token chat completion answers 200 (a listening server may still be loading
# its model: SwiftLM answers 503 then), the process dies or 600 s pass
wait_ready() {
  "$PY" - "$1" "$2" "$3" <<'EOF'
import os, sys, time, httpx
pid, base, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
body = {"model": model or "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
deadline = time.time() + 600
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(1)
    try:
        if httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit(1)
EOF
}

stop_server() {
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }; sleep 1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# start_server NAME N PORT LOG: start one server in the background; its pid in SERVER_PID
SERVER_PID=""
trap '[ -n "$SERVER_PID" ] && stop_server "$SERVER_PID"' EXIT
start_server() {
  local name=$1 n=$2 port=$3 logf=$4
  case "$name" in
    swiftlm-torch)
      "$PY" -m swiftlm.cli serve --model "$MODEL_DIR" --backend torch --parallel "$n" --host 127.0.0.1 \
        --port "$port" --log-level warning >"$logf" 2>&1 & ;;
    swiftlm-mlx)
      "$PY" -m swiftlm.cli serve --model "$MODEL_DIR" --backend mlx --parallel "$n" --host 127.0.0.1 \
        --port "$port" --log-level warning >"$logf" 2>&1 & ;;
    # its /v1/models scans the HF cache and answers 500 when the cache directory is missing; its KV cache takes
    # 60-90% of free RAM by default: 64 blocks of 256 tokens hold 16 streams of ~200 tokens 5 times over
    transformers-serve)
      mkdir -p "$WORK/hf-cache"
      HF_HUB_CACHE="$WORK/hf-cache" "$PEERS/bin/transformers" serve "$MODEL_DIR" --continuous-batching \
        --cb-num-blocks 64 --device cpu --dtype float32 \
        --host 127.0.0.1 --port "$port" --log-level warning >"$logf" 2>&1 & ;;
    mlx-lm-server)
      "$PEERS/bin/mlx_lm.server" --model "$MODEL_DIR" --decode-concurrency "$n" --prompt-concurrency "$n" \
        --host 127.0.0.1 --port "$port" --log-level WARNING >"$logf" 2>&1 & ;;
    *) echo "unknown server $name" >&2; exit 2 ;;
  esac
  SERVER_PID=$!
}

# the model name each server expects in a request (none: the first id of its /v1/models)
model_name() {
  case "$1" in
    swiftlm-*) echo "" ;;                    # SwiftLM serves one model whatever the name: bench asks /v1/models
    transformers-serve) echo "$MODEL_DIR" ;; # pinned: the name must equal its FORCE_MODEL argument
    mlx-lm-server) echo "default_model" ;;   # any other name would make it load that path
  esac
}

# transformers serve answers 422 to fields it does not know (ignore_eos).  Its continuous batching builds the
# logits processors once, from the first request's generation config, and applies them to every later request: the
# warmup request already carries the same logit_bias as all the others, so EOS is banned throughout (each run's
# "requests_with_all_tokens" in the JSON checks it).
bench_flags() {
  case "$1" in
    transformers-serve) echo "--no-ignore-eos-field" ;;
    *) echo "" ;;
  esac
}

for n in $NS; do
  reqs=$(( 4 * n )); [ "$reqs" -lt 8 ] && reqs=8
  warm=$n; [ "$QUICK" = 1 ] && warm=1
  for name in $SERVERS; do
    port=$(free_port)
    logf="$LOGS/$name-$n.log"
    out="$RUNS/$name-$n.json"
    log "$name N=$n: starting on port $port (log $logf)"
    t0=$(date +%s)
    start_server "$name" "$n" "$port" "$logf"
    pid=$SERVER_PID
    if ! wait_ready "$pid" "http://127.0.0.1:$port" "$(model_name "$name")"; then
      log "$name N=$n: the server did not become ready; see $logf"
      "$PY" -c 'import json,sys; json.dump({"error": "server did not start: " + open(sys.argv[2], errors="replace").read()[-1500:]}, open(sys.argv[1], "w"))' "$out" "$logf"
      stop_server "$pid"
      SERVER_PID=""
      continue
    fi
    log "$name N=$n: ready after $(( $(date +%s) - t0 )) s; $reqs requests of $TOKENS tokens, $warm warmup"
    # shellcheck disable=SC2046
    model=$(model_name "$name")
    if ! "$PY" -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$port" ${model:+--model "$model"} \
        $(bench_flags "$name") \
        --concurrency "$n" --num-requests "$reqs" --warmup "$warm" --prompt-tokens "$PROMPT_TOKENS" \
        --output-tokens "$TOKENS" --ignore-eos --tokenizer "$MODEL_DIR" --seed 0 --no-progress \
        --label "$name" --json "$out"; then
      log "$name N=$n: the benchmark failed (no successful request)"
    fi
    stop_server "$pid"
    SERVER_PID=""
  done
done

# ---------------------------------------------------------------- (4) the table and the JSON
"$PY" - "$RUNS" "$OUT" "$PEERS" "$QUICK" "$TOKENS" "$PROMPT_TOKENS" "$NS" "$SERVERS" "$(( $(date +%s) - T_START ))" <<'EOF'
import json, subprocess, sys, datetime, platform, os
from pathlib import Path
runs, out, peers, quick, tokens, prompt_tokens, ns, servers, elapsed = sys.argv[1:]
ns = [int(x) for x in ns.split()]
servers = servers.split()

def version(py, mod):
    try:
        return subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version('{mod}'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or None
    except Exception:
        return None

table = {}
for s in servers:
    table[s] = {}
    for n in ns:
        f = Path(runs) / f"{s}-{n}.json"
        if not f.exists():
            table[s][n] = {"error": "no result"}
            continue
        d = json.loads(f.read_text())
        if "results" not in d:
            table[s][n] = {"error": d.get("error", "no result")}
            continue
        r, reqs = d["results"], d["requests"]
        table[s][n] = {
            "output_throughput": r["output_throughput"], "requests_ok": r["requests_ok"],
            "requests_failed": r["requests_failed"], "duration_s": r["duration_s"],
            "mean_stream_tok_s": r["mean_stream_tok_s"], "ttft_ms_p50": r["ttft_ms"]["p50"],
            "itl_ms_p50": r["itl_ms"]["p50"], "e2e_ms_p50": r["e2e_ms"]["p50"],
            "requests_with_all_tokens": sum(1 for q in reqs if q["ok"] and q["output_tokens"] == q["max_tokens"]),
            "errors": r["errors"],
        }

def ratio(a, b, n):
    x, y = table.get(a, {}).get(n, {}), table.get(b, {}).get(n, {})
    if x.get("output_throughput") and y.get("output_throughput"):
        return x["output_throughput"] / y["output_throughput"]
    return None

ratios = {"swiftlm-torch/transformers-serve": {n: ratio("swiftlm-torch", "transformers-serve", n) for n in ns},
          "swiftlm-mlx/mlx-lm-server": {n: ratio("swiftlm-mlx", "mlx-lm-server", n) for n in ns}}
sw = os.path.join(os.path.dirname(sys.executable), "python")
pp = os.path.join(peers, "bin", "python")
doc = {
    "what": "aggregate output tok/s of swiftlm bench serve against each server, same fp32 SmolLM2-135M-Instruct "
            "weights (swiftlm convert of the bundled GGUF), EOS banned so every request generates max_tokens",
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "quick": quick == "1", "output_tokens": int(tokens), "prompt_tokens": int(prompt_tokens),
    "concurrency": ns, "num_requests": {n: max(8, 4 * n) for n in ns}, "elapsed_s": int(elapsed),
    "host": {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count()},
    "versions": {"swiftlm": version(sw, "swiftlm"), "torch (swiftlm)": version(sw, "torch"),
                 "mlx (swiftlm)": version(sw, "mlx"), "transformers (peer)": version(pp, "transformers"),
                 "torch (peer)": version(pp, "torch"), "mlx-lm (peer)": version(pp, "mlx-lm"),
                 "mlx (peer)": version(pp, "mlx")},
    "servers": {
        "swiftlm-torch": "swiftlm serve --model DIR --backend torch --parallel N",
        "transformers-serve": "transformers serve DIR --continuous-batching --cb-num-blocks 64 --device cpu --dtype float32 "
                              "(requests without the ignore_eos field: it answers 422 to unknown fields)",
        "swiftlm-mlx": "swiftlm serve --model DIR --backend mlx --parallel N",
        "mlx-lm-server": "mlx_lm.server --model DIR --decode-concurrency N --prompt-concurrency N",
    },
    "results": table, "ratios": ratios,
}
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(json.dumps(doc, indent=1))

from rich.console import Console
from rich.table import Table
t = Table(title=f"aggregate output tok/s ({tokens} tokens per request; ratio = swiftlm / peer)")
t.add_column("N", justify="right")
for s in servers:
    t.add_column(s, justify="right")
for k in ratios:
    t.add_column(k.replace("/", " / "), justify="right")
for n in ns:
    row = [str(n)]
    for s in servers:
        c = table[s][n]
        row.append(f"{c['output_throughput']:.1f}" + ("" if c["requests_failed"] == 0 else f" ({c['requests_failed']} failed)")
                   if c.get("output_throughput") else "error")
    for k in ratios:
        v = ratios[k][n]
        row.append(f"{v:.2f}x" if v else "-")
    t.add_row(*row)
con = Console(width=None if sys.stdout.isatty() else 160)
con.print(t)
for s in servers:
    for n in ns:
        c = table[s][n]
        if "error" in c:
            con.print(f"[red]{s} N={n}:[/] {c['error'][-600:]}")
        elif c["requests_failed"]:
            con.print(f"[red]{s} N={n}: {c['requests_failed']} requests failed:[/] {c['errors']}")
        elif c["requests_with_all_tokens"] != c["requests_ok"]:
            con.print(f"[yellow]{s} N={n}:[/] only {c['requests_with_all_tokens']} of {c['requests_ok']} requests "
                      "generated max_tokens (EOS not banned?)")
con.print(f"wrote {out}; took {elapsed} s")
EOF
