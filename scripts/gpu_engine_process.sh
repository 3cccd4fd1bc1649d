#!/usr/bin/env bash
# The engine core in its own process vs on a thread: one server per shape and
# setting (SWIFTLM_ENGINE_PROCESS=off, then =on), each measured by `swiftlm bench serve` at N
# concurrent streams (~40-token prompts, OUTTOK new tokens, EOS banned, prompt cache off).
#
# On the lent GPU (a few minutes for both shapes: the checkpoints, then 4 servers):
#   bash scripts/gpu_engine_process.sh 1b 8b
# Needs carried: .whl (wheels), .gpu/tok (SmolLM2 tokenizer files).  No extra wheel: the IPC is
# a multiprocessing Pipe with pickle (standard library).
# On this CPU (the bundled SmolLM2, fp32; what docs/results/engine_process_cpu.json holds):
#   LOCAL=1 NS="1 8 16" PARALLEL=16 OUTTOK=96 bash scripts/gpu_engine_process.sh bundled-ab
# (bundled-ab: both servers up at once, runs alternating off / on, REPS=2 of each: the load of a shared
# machine drifts; `bundled` runs the two servers one after the other as on the GPU)
# Results: $OUT/ep_<shape>_<off|on>_n<N>.json (bench serve), $OUT/ep_health_<shape>_<mode>.json,
# and $OUT/engine_process_<shape>.json (the table).
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
if [ -z "${LOCAL:-}" ]; then
  source scripts/gpu_site.sh                     # swiftlm + wheels -> /tmp/site, $OUT
  SITE=/tmp/site
  TOK="--tokenizer $REPO/.gpu/tok"
else  # this machine: the checkout's own environment
  OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
  PY=${PY:-$REPO/.venv/bin/python}
  [ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python
  SITE=$REPO
  TOK=
  export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
fi
NS=${NS:-"1 64 128"}
PARALLEL=${PARALLEL:-128}
OUTTOK=${OUTTOK:-128}
MODES=${MODES:-"off on"}
mkdir -p /tmp/run && cd /tmp/run                 # import the installed copies, not the source tree

ckpt() {  # name hidden layers heads kv head_dim inter
  [ -d /tmp/m$1 ] && return
  /usr/bin/time -f "checkpoint $1: %e s" env PYTHONPATH=$SITE $PY $REPO/scripts/make_checkpoint.py /tmp/m$1 --arch llama \
      --hidden $2 --layers $3 --heads $4 --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 --dtype bfloat16 \
      --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
}

serve_and_bench() {  # shape model-argument mode
  local shape=$1 model=$2 mode=$3 port=$((6000 + RANDOM % 1000))
  env PYTHONPATH=$SITE SWIFTLM_ENGINE_PROCESS=$mode $PY -m swiftlm.cli serve $model --backend torch \
      --parallel $PARALLEL --max-queue 512 --ctx-size 1024 --prompt-cache-bytes 0 --port $port \
      > "$OUT/ep_serve_${shape}_$mode.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server $shape $mode died:"; tail -5 "$OUT/ep_serve_${shape}_$mode.log"; return; }
    sleep 1
  done
  for n in $NS; do
    local reqs=$(( n < 8 ? 4 : ${REQ_MULT:-2} * n )) workers=$(( n >= 32 ? 4 : 1 ))
    PYTHONPATH=$SITE timeout 300 $PY -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$port" \
        --concurrency $n --num-requests $reqs --workers $workers --warmup $(( n < 32 ? n : 32 )) --prompt-tokens 40 \
        --output-tokens $OUTTOK --ignore-eos $TOK --no-progress --label "${shape}_${mode}_n$n" \
        --json "$OUT/ep_${shape}_${mode}_n$n.json" 2>&1 | grep -E "output tok/s|ITL|TTFT|failed" \
        | sed "s/^/[$shape $mode N=$n] /"
  done
  curl -s "http://127.0.0.1:$port/health" > "$OUT/ep_health_${shape}_$mode.json"
  kill $pid; wait $pid 2>/dev/null
  pgrep -f "swiftlm.engine_process" > /dev/null && echo "WARNING: an engine process outlived its server"
}

start_server() {  # shape model-argument mode -> sets $pid $port
  port=$((6000 + RANDOM % 1000))
  env PYTHONPATH=$SITE SWIFTLM_ENGINE_PROCESS=$3 $PY -m swiftlm.cli serve $2 --backend torch \
      --parallel $PARALLEL --max-queue 512 --ctx-size 1024 --prompt-cache-bytes 0 --port $port \
      > "$OUT/ep_serve_${1}_$3.log" 2>&1 &
  pid=$!
  for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return
    kill -0 $pid 2>/dev/null || { echo "server $1 $3 died:"; tail -5 "$OUT/ep_serve_${1}_$3.log"; exit 1; }
    sleep 1
  done
}

interleaved() {  # shape model-argument: both servers up, runs alternate off/on per N and repeat
  # (a shared machine's load drifts: alternating keeps the comparison fair; REPS repeats)
  start_server $1 "$2" off; local poff=$pid portoff=$port
  start_server $1 "$2" on; local pon=$pid porton=$port
  for n in $NS; do
    for r in $(seq 1 ${REPS:-2}); do
      for mode in off on; do
        local p=$portoff; [ $mode = on ] && p=$porton
        local reqs=$(( n < 8 ? 4 : ${REQ_MULT:-2} * n ))
        PYTHONPATH=$SITE timeout 600 $PY -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$p" \
            --concurrency $n --num-requests $reqs --warmup $n --prompt-tokens 40 --output-tokens $OUTTOK \
            --ignore-eos $TOK --no-progress --label "${1}_${mode}_n${n}_r$r" \
            --json "$OUT/ep_${1}_${mode}_n${n}_r$r.json" 2>&1 | grep -E "output tok/s" \
            | sed "s/^/[$1 $mode N=$n rep $r load $(cut -d' ' -f1 /proc/loadavg)] /"
      done
    done
  done
  curl -s "http://127.0.0.1:$portoff/health" > "$OUT/ep_health_${1}_off.json"
  curl -s "http://127.0.0.1:$porton/health" > "$OUT/ep_health_${1}_on.json"
  kill $poff $pon; wait $poff $pon 2>/dev/null
}

table() {  # shape: one JSON of every run, and a table on stdout
  $PY - "$OUT" "$1" <<'EOF'
import glob, json, os, sys
out, shape = sys.argv[1], sys.argv[2]
rows = []
for f in sorted(glob.glob(os.path.join(out, f"ep_{shape}_*_n*.json"))):
    d = json.load(open(f))
    r = d["results"]
    label = os.path.basename(f)[3:-5]
    parts = label.split("_")
    rep = int(parts.pop()[1:]) if parts[-1].startswith("r") else 1
    mode, n = parts[-2], int(parts[-1][1:])
    rows.append({"mode": mode, "concurrency": n, "rep": rep, "output_tok_per_s": round(r["output_throughput"], 2),
                 "requests_ok": r["requests_ok"], "requests_failed": r["requests_failed"],
                 "ttft_ms_p50": r["ttft_ms"]["p50"], "itl_ms_p50": r["itl_ms"]["p50"], "itl_ms_p99": r["itl_ms"]["p99"],
                 "tpot_ms_mean": r["tpot_ms"]["mean"]})
json.dump({"shape": shape, "runs": rows}, open(os.path.join(out, f"engine_process_{shape}.json"), "w"), indent=1)
for r in sorted(rows, key=lambda r: (r["concurrency"], r["mode"])):
    print(json.dumps(r))
EOF
}

for what in "$@"; do
  case $what in
    bundled) for m in $MODES; do serve_and_bench bundled "" $m; done; table bundled ;;
    bundled-ab) interleaved bundled ""; table bundled ;;
    tiny) ckpt tiny 128 2 4 2 32 256; for m in $MODES; do serve_and_bench tiny "--model /tmp/mtiny" $m; done
          table tiny ;;
    1b) ckpt 1b 2048 16 32 8 64 8192; for m in $MODES; do serve_and_bench 1b "--model /tmp/m1b" $m; done; table 1b ;;
    8b) ckpt 8b 4096 32 32 8 128 14336; for m in $MODES; do serve_and_bench 8b "--model /tmp/m8b" $m; done; table 8b ;;
  esac
done
