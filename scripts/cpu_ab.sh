#!/usr/bin/env bash
# A/B of server settings on this CPU through HTTP: one `swiftlm serve` per setting (bundled SmolLM2, torch, fp32
# as scripts/bench_peers.sh uses it), all up at once, `swiftlm bench serve` runs alternating between them REPS times.
#   scripts/cpu_ab.sh "SWIFTLM_GC_FREEZE=0" "SWIFTLM_GC_FREEZE=1"      # each argument: env assignments for one server
#   NS="1 8" REQ=16 TOKENS=64 REPS=2 SERVE_ARGS="--parallel 16" scripts/cpu_ab.sh A B ...
# Results: $OUT/ab_<i>_n<N>_r<rep>.json and a table (aggregate output tok/s per setting and N).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT=${OUT:-/tmp/cpu_ab}; mkdir -p "$OUT"; rm -f "$OUT"/ab_*.json
NS=${NS:-"1 8"}; REQ=${REQ:-16}; TOKENS=${TOKENS:-64}; REPS=${REPS:-2}
MODEL=${MODEL:-$ROOT/bench_results/peers/smollm2-fp32}
SERVE_ARGS=${SERVE_ARGS:-"--parallel 16"}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd /tmp
pids=(); ports=()
for i in $(seq 1 $#); do
  port=$((7000 + RANDOM % 1000)); setting=${!i}
  env $setting "$PY" -m swiftlm.cli serve --model "$MODEL" --backend torch $SERVE_ARGS --prompt-cache-bytes 0 \
      --port $port > "$OUT/ab_serve_$i.log" 2>&1 &
  pids+=($!); ports+=($port)
done
trap 'kill ${pids[@]} 2>/dev/null' EXIT
for i in $(seq 0 $(($# - 1))); do
  for t in $(seq 1 120); do curl -sf "http://127.0.0.1:${ports[$i]}/health" > /dev/null && break; sleep 1; done
done
for n in $NS; do
  for r in $(seq 1 $REPS); do
    for i in $(seq 1 $#); do
      "$PY" -m swiftlm.cli bench serve --base-url "http://127.0.0.1:${ports[$((i - 1))]}" --concurrency $n \
          --num-requests $(( REQ > n ? REQ : n )) --warmup $n --prompt-tokens 40 --output-tokens $TOKENS --ignore-eos \
          --no-progress --json "$OUT/ab_${i}_n${n}_r$r.json" > /dev/null 2>&1
      "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(f\"N={sys.argv[2]:>3} rep {sys.argv[3]} [{sys.argv[4]}] {r['output_throughput']:8.1f} tok/s  ITL p50 {r['itl_ms']['p50']:6.1f} ms  TTFT p50 {r['ttft_ms']['p50']:7.1f} ms\")" \
          "$OUT/ab_${i}_n${n}_r$r.json" $n $r "${!i}" 2>/dev/null || echo "N=$n rep $r [${!i}] failed"
    done
  done
done
