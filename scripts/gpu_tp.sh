#!/usr/bin/env bash
# Tensor and pipeline parallelism on a lent 2-GPU machine (no network): the same random-weight Llama
# shape served with --tensor-parallel 1 and 2 and --pipeline-parallel 2 through HTTP, measured by
# `swiftlm bench serve` at N=1 and N=64 (~40-token prompts, 128 new tokens, EOS banned, prompt cache
# off), plus a greedy-equality check of TP=2 and PP=2 against TP=1 on a few prompts.  NVLink multicast
# stays off (NCCL_NVLS_ENABLE=0).  PP runs with micro-batching at its default (split only at 64+ rows
# per micro-batch) and, for 8b, once more with SWIFTLM_PP_MICRO_MIN_ROWS=1 (forced on) at N=64.
#   bash scripts/gpu_tp.sh [8b] [1b] [tiny]      (device kind nvidia-h200-x2)
#   bash scripts/gpu_tp.sh 8b-base               (one GPU: the TP=1 baseline at N=1/64/128, --parallel 128)
# Needs carried: .whl (wheels), .gpu/tok (SmolLM2 tokenizer files), like scripts/gpu_engine.sh.
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
if [ -z "${LOCAL:-}" ]; then
  source scripts/gpu_site.sh                     # swiftlm + wheels -> /tmp/site
else  # a dry run on a machine whose $PY has the dependencies
  OUT=${OUT:-/tmp/out}; mkdir -p $OUT
  $PY -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
fi
export PYTHONPATH= NCCL_NVLS_ENABLE=0
NS=${NS:-"1 64"}
mkdir -p /tmp/run && cd /tmp/run
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.cuda.device_count(), 'GPUs')"

ckpt() {  # name hidden layers heads kv head_dim inter
  [ -d /tmp/m$1 ] && return
  env PYTHONPATH=/tmp/site $PY $REPO/scripts/make_checkpoint.py /tmp/m$1 --arch llama --hidden $2 --layers $3 \
      --heads $4 --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 --dtype bfloat16 --no-tie \
      --shard-mb 4000 --tokenizer-from $REPO/.gpu/tok ${CKPT_EXTRA:-} > /dev/null || exit 1
}

equal() {  # model: greedy tokens of TP=2 and PP=2 == TP=1 (bf16: a near-tie may flip late tokens; printed, not fatal)
  PYTHONPATH=/tmp/site timeout 600 $PY - /tmp/m$1 <<'EOF' 2>&1 | grep -E "^(EQUAL|DIFF|prompt)" | tee "$OUT/tp_equal_$1.txt"
import sys
from swiftlm import LLM, SamplingParams
if __name__ == "__main__":
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Write a haiku about the sea."]
    res = {}
    for name, kw in (("tp1", {}), ("tp2", {"tensor_parallel": 2}), ("pp2", {"pipeline_parallel": 2})):
        with LLM(sys.argv[1], backend="torch", parallel=8, ctx_size=1024, **kw) as llm:
            res[name] = [o.token_ids for o in llm.generate(prompts, p)]
    for other in ("tp2", "pp2"):
        for i, pr in enumerate(prompts):
            a, b = res["tp1"][i], res[other][i]
            same = next((k for k in range(len(a)) if a[k] != b[k]), len(a))
            print(("EQUAL" if a == b else "DIFF"), f"prompt {i} {other}: first {same} of {len(a)} tokens equal")
EOF
}

serve_and_bench() {  # tp model  (tp: 1, 2, pp2 = --pipeline-parallel 2, pp2m = pp2 with micro-batching forced)
  local tp=$1 m=$2 port=$((6000 + RANDOM % 1000)) par="--tensor-parallel $1" micro=64
  case $tp in pp2) par="--pipeline-parallel 2" ;; pp2m) par="--pipeline-parallel 2"; micro=1 ;; esac
  env PYTHONPATH=/tmp/site SWIFTLM_PP_MICRO_MIN_ROWS=$micro $PY -m swiftlm.cli serve --model /tmp/m$m --backend torch \
      --parallel ${PAR:-64} --max-queue 512 --ctx-size 1024 --prompt-cache-bytes 0 --port $port $par \
      > "$OUT/serve_tp${tp}_$m.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server tp=$tp $m died:"; tail -5 "$OUT/serve_tp${tp}_$m.log"; return; }
    sleep 1
  done
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | sed "s/^/[tp=$tp $m memory] /"
  for n in $NS; do
    local reqs=$(( n < 8 ? 8 : 2 * n ))
    PYTHONPATH=/tmp/site timeout 300 $PY -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$port" \
        --concurrency $n --num-requests $reqs --workers $(( n >= 32 ? 4 : 1 )) --warmup $(( n < 32 ? n : 32 )) \
        --prompt-tokens 40 --output-tokens 128 --ignore-eos --tokenizer $REPO/.gpu/tok --no-progress \
        --label "tp${tp}_${m}_n$n" --json "$OUT/serve_tp${tp}_${m}_n$n.json" \
        2>&1 | grep -E "output tok/s|ITL|TTFT|failed" | sed "s/^/[tp=$tp $m N=$n] /"
  done
  curl -s "http://127.0.0.1:$port/health" > "$OUT/health_tp${tp}_$m.json"
  kill $pid; wait $pid 2>/dev/null
}

for what in "$@"; do
  case $what in
    tiny) ckpt tiny 128 2 4 2 32 256; equal tiny; for tp in 1 2 pp2; do serve_and_bench $tp tiny; done ;;  # a dry run
    1b) ckpt 1b 2048 16 32 8 64 8192; equal 1b; for tp in ${TPS:-1 2 pp2}; do serve_and_bench $tp 1b; done ;;
    8b) CKPT_EXTRA=--reuse-layers ckpt 8b 4096 32 32 8 128 14336; equal 8b
        for tp in ${TPS:-1 2 pp2}; do serve_and_bench $tp 8b; done
        NS=64 serve_and_bench pp2m 8b ;;
    8b-base)  # the TP=1 baseline of gpu_issue26.sh's runs on a one-GPU machine: N=1/64/128, --parallel 128
      CKPT_EXTRA=--reuse-layers ckpt 8b 4096 32 32 8 128 14336; PAR=128 NS=${BASE_NS:-"1 64 128"} serve_and_bench 1 8b ;;
  esac
done
