#!/usr/bin/env bash
# Issue 49 acceptance on a lent 2-GPU machine (device kind nvidia-h200-x2 or nvidia-h100-x2), one command, ~9 min:
# the 8B Llama shape (random weights) through HTTP, 256 new tokens (EOS banned), ~40-token prompts, prompt cache off:
#   A  one GPU, --api-workers 1, --parallel 256:   N = 1, 64, 128, 256   (the baselines: TP=1, one replica)
#   B  one GPU, --api-workers 2:                    N = 256               (goal: >= A at 256)
#   C  --data-parallel 2 --api-workers 2:           N = 256               (goal: >= 1.9 x A at 128)
#   D  --tensor-parallel 2 (engine process: auto):  N = 1, 64, 128        (goal: >= 1.3 x A at 64 and 128, >= 1.5 x at 1)
#   E  D with --api-workers 1:                      N = 128               (a diagnosis run: not in the summary)
# Every server runs the engine in its own process (auto on CUDA).  Output: $OUT/api_workers_*.json (bench serve
# runs), $OUT/serve_*.log, and the summary $OUT/docs/results/api_workers.json (copy it to docs/results/).
#   bash scripts/gpu_api_workers.sh
# Env: RUNS="A B C D" (which servers), A_NS / D_NS (stream counts), D_FLAGS (extra flags of the TP server),
# STEPLOG=1 (every server writes SWIFTLM_STEP_LOG; after each load, scripts/step_timeline.py's summary of its steps
# goes to steps_<label>_n<N>.json).  Everything but the summary is packed into $OUT/runs.tgz (the device returns
# few files).
# Needs carried: .whl (wheels), .gpu/tok (SmolLM2 tokenizer files), like scripts/gpu_tp.sh.
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
if [ -z "${LOCAL:-}" ]; then
  source scripts/gpu_site.sh
else  # a dry run on a machine whose $PY has the dependencies: LOCAL=1 SHAPE=tiny bash scripts/gpu_api_workers.sh
  OUT=${OUT:-/tmp/out}; mkdir -p $OUT
  $PY -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
fi
export PYTHONPATH= NCCL_NVLS_ENABLE=0
SHAPE=${SHAPE:-8b}
TOK=${TOK:-256}
mkdir -p /tmp/run "$OUT/docs/results" && cd /tmp/run
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null

M=/tmp/m$SHAPE
if [ ! -d $M ]; then
  case $SHAPE in
    8b) shape="--hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 --reuse-layers" ;;
    1b) shape="--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 8192 --reuse-layers" ;;
    *)  shape="--hidden 128 --layers 2 --heads 4 --kv-heads 2 --head-dim 32 --intermediate 256" ;;
  esac
  env PYTHONPATH=/tmp/site $PY $REPO/scripts/make_checkpoint.py $M --arch llama $shape --ctx 4096 \
      --dtype bfloat16 --no-tie --shard-mb 4000 --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
fi

run() {  # label "serve flags" "N list"
  local label=$1 flags=$2 ns=$3 port=$((6000 + RANDOM % 1000)) steplog=
  [ -n "${STEPLOG:-}" ] && steplog=/tmp/run/steps_${label}_{pid}.jsonl
  env PYTHONPATH=/tmp/site SWIFTLM_STEP_LOG=$steplog $PY -m swiftlm.cli serve --model $M --backend torch --parallel 256 --max-queue 1024 \
      --ctx-size 1024 --prompt-cache-bytes 0 --port $port $flags > "$OUT/serve_$label.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server $label died:"; tail -5 "$OUT/serve_$label.log"; return; }
    sleep 1
  done
  for n in $ns; do
    local reqs=$(( n < 4 ? 4 : n ))
    PYTHONPATH=/tmp/site timeout 240 $PY -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$port" \
        --endpoint completions --concurrency $n --num-requests $reqs --warmup $(( n < 16 ? 1 : 16 )) \
        --workers $(( n >= 64 ? 4 : 1 )) --prompt-tokens 40 --output-tokens $TOK --ignore-eos \
        --tokenizer $REPO/.gpu/tok --no-progress --label "${label}_n$n" --json "$OUT/api_workers_${label}_n$n.json" \
        2>&1 | grep -E "output tok/s|failed|ITL|TTFT" | sed "s/^/[$label N=$n] /"
    if [ -n "$steplog" ]; then
      for f in /tmp/run/steps_${label}_*.jsonl; do
        PYTHONPATH=/tmp/site $PY $REPO/scripts/step_timeline.py "$f" --since-gap 0.5 \
            --json "$OUT/steps_${label}_n${n}_$(basename $f .jsonl | sed 's/.*_//').json" | sed "s/^/[$label N=$n steps] /"
      done
    fi
  done
  curl -s "http://127.0.0.1:$port/health" > "$OUT/health_$label.json"
  kill $pid; wait $pid 2>/dev/null
  [ -n "$steplog" ] && cp /tmp/run/steps_${label}_*.jsonl "$OUT/" 2>/dev/null
  grep -h "forward calls" "$OUT/serve_$label.log" | sed "s/^/[$label follower] /"
}

RUNS=" ${RUNS:-A B C D} "  # which of the four servers to run
[[ $RUNS == *" A "* ]] && run A "--api-workers 1" "${A_NS:-1 64 128 256}"
[[ $RUNS == *" B "* ]] && run B "--api-workers 2" "256"
[[ $RUNS == *" C "* ]] && run C "--data-parallel 2 --api-workers 2" "256"
[[ $RUNS == *" D "* ]] && run D "--tensor-parallel 2 ${D_FLAGS:-}" "${D_NS:-1 64 128}"
[[ $RUNS == *" E "* ]] && run E "--tensor-parallel 2 --api-workers 1" "${E_NS:-128}"  # D with one HTTP process

PYTHONPATH=/tmp/site $PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def tps(label, n):
    f = out / f"api_workers_{label}_n{n}.json"
    if not f.exists():
        return None
    r = json.loads(f.read_text())["results"]
    return r.get("output_throughput") or r.get("output_tok_s")

def ratio(a, b):
    return None if a is None or not b else round(a / b, 3)

runs = {f"{l}_n{n}": tps(l, n) for l, ns in (("A", (1, 64, 128, 256)), ("B", (256,)), ("C", (256,)), ("D", (1, 64, 128))) for n in ns}
goals = {
    "api_workers_2_vs_1_at_256": (ratio(runs["B_n256"], runs["A_n256"]), 1.0),
    "dp2_workers2_at_256_vs_one_replica_at_128": (ratio(runs["C_n256"], runs["A_n128"]), 1.9),
    "tp2_vs_tp1_at_1": (ratio(runs["D_n1"], runs["A_n1"]), 1.5),
    "tp2_vs_tp1_at_64": (ratio(runs["D_n64"], runs["A_n64"]), 1.3),
    "tp2_vs_tp1_at_128": (ratio(runs["D_n128"], runs["A_n128"]), 1.3),
}
summary = {
    "what": "issue 49: engine process under TP, --api-workers; output tok/s through HTTP (swiftlm bench serve)",
    "output_tok_s": runs,
    "ratios": {k: {"ratio": v, "goal": g, "met": v is not None and v >= g} for k, (v, g) in goals.items()},
}
(out / "docs/results/api_workers.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary["ratios"], indent=2))
PYEOF
cd "$OUT" && tar czf runs.tgz --remove-files $(ls | grep -v -e '^docs$' -e '^runs.tgz$') 2>/dev/null; ls "$OUT"
