#!/usr/bin/env bash
# Engine throughput on the lent GPU machine (no network), before vs after in one run:
# the old engine (a source tree of an earlier commit, carried in .gpu/old) and this tree, each
# serving random-weight Llama shapes through HTTP, measured by `swiftlm bench serve`
# (~40-token prompts, 128 new tokens, EOS banned, prompt cache off).
#   bash scripts/gpu_engine.sh 1b [8b] [kernel] [profile]
# Needs carried: .whl (wheels), .gpu/tok (SmolLM2 tokenizer files), .gpu/old (old source tree).
set -uo pipefail
source scripts/gpu_site.sh                       # new swiftlm + wheels -> /tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site_old \
    .gpu/old || exit 1
cp -r .whl /tmp/whl && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_old /tmp/whl/*.whl
NS=${NS:-"1 8 32 64 128"}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"

ckpt() {  # name hidden layers heads kv head_dim inter
  [ -d /tmp/m$1 ] && return
  /usr/bin/time -f "checkpoint $1: %e s" python3 scripts/make_checkpoint.py /tmp/m$1 --arch llama --hidden $2 --layers $3 \
      --heads $4 --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 --dtype bfloat16 --no-tie \
      --shard-mb 4000 --tokenizer-from .gpu/tok > /dev/null || exit 1
}

serve_and_bench() {  # version model
  local ver=$1 m=$2 port=$((6000 + RANDOM % 1000))
  PYTHONPATH=/tmp/site_$ver python3 -m swiftlm.cli serve --model /tmp/m$m --backend torch --parallel 128 \
      --max-queue 512 --ctx-size 1024 --prompt-cache-bytes 0 --port $port > "$OUT/serve_${ver}_$m.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  for n in $NS; do
    local reqs=$(( n < 8 ? 8 : 2 * n ))
    PYTHONPATH=/tmp/site timeout 240 python3 -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$port" \
        --concurrency $n --num-requests $reqs --warmup $n --prompt-tokens 40 --output-tokens 128 --ignore-eos \
        --tokenizer .gpu/tok --no-progress --label "${ver}_${m}_n$n" --json "$OUT/serve_${ver}_${m}_n$n.json" \
        2>&1 | grep -E "output tok/s|ITL|TTFT|failed" | sed "s/^/[$ver $m N=$n] /"
  done
  curl -s "http://127.0.0.1:$port/health" > "$OUT/health_${ver}_$m.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^swiftlm_step_seconds_(sum|count)" > "$OUT/steps_${ver}_$m.txt"
  kill $pid; wait $pid 2>/dev/null
}

for what in "$@"; do
  case $what in
    1b) ckpt 1b 2048 16 32 8 64 8192; for v in old new; do serve_and_bench $v 1b; done ;;
    8b) ckpt 8b 4096 32 32 8 128 14336; for v in old new; do serve_and_bench $v 8b; done ;;
    kernel) PYTHONPATH=/tmp/site timeout 300 python3 scripts/bench_paged_attention.py --quick \
              --json "$OUT/bench_paged_attention_gpu.json" 2>&1 | tail -40 ;;
  esac
done
