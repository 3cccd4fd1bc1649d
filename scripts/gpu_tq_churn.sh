#!/usr/bin/env bash
# Compressed decode batches under requests that come and go, on the lent GPU: first the engine check of one CUDA
# graph per batch size against one per set of caches (scripts/check_set_graphs_cuda.py, 1B Llama shape), then
# the churn load through `swiftlm serve` (scripts/bench_serve_churn.py, 8B Llama shape, random weights): 16-bit KV,
# --turbo-kv k4v3 (its first run on the machine compiles the Triton kernels: k4v3_first), k4v3 with a graph per set of
# caches (SWIFTLM_TQ_SET_TABLES=0), and k4v3 again.
# Carries: .whl/ and .gpu/tok (scripts/gpu_prepare.sh).   bash scripts/gpu_tq_churn.sh check serve
# Env: STREAMS (8), REQUESTS (48), PROMPT (4000), TIMEOUT (seconds for the serve part, 420), TAG (JSON name:
# serve_churn_<TAG>), VARIANTS (bench_serve_churn.py variants separated by '|').
# Results: $OUT/set_graphs_check.json, $OUT/serve_churn_<gpu>.json, $OUT/churn_logs.tgz.
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
mkdir -p /tmp/churn && cd /tmp/churn  # import the installed copy, not the source tree
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | grep -o 'h[0-9]*' | head -1)
for what in "$@"; do
  case $what in
    check)
      [ -f /tmp/m1b/config.json ] || python3 $REPO/scripts/make_checkpoint.py /tmp/m1b --arch llama --hidden 2048 \
          --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 8192 --ctx 8192 --dtype bfloat16 --no-tie \
          --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
      cp $REPO/scripts/check_set_graphs_cuda.py $REPO/scripts/check_paged_cuda.py /tmp/churn/
      timeout ${CHECK_TIMEOUT:-240} python3 /tmp/churn/check_set_graphs_cuda.py --model /tmp/m1b \
          --json $OUT/set_graphs_check.json 2>&1 | grep -v Warning | tail -8 ;;
    serve)
      [ -f /tmp/m8b/config.json ] || /usr/bin/time -f "checkpoint 8b: %e s" python3 $REPO/scripts/make_checkpoint.py \
          /tmp/m8b --arch llama --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \
          --ctx 16384 --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok \
          > /dev/null || exit 1
      IFS='|' read -ra vs <<< "${VARIANTS:-16bit=|k4v3_first=--turbo-kv k4v3|k4v3_graph_per_set=--turbo-kv k4v3;SWIFTLM_TQ_SET_TABLES=0|k4v3=--turbo-kv k4v3}"
      vargs=(); for v in "${vs[@]}"; do vargs+=(--variant "$v"); done
      timeout ${TIMEOUT:-420} python3 $REPO/scripts/bench_serve_churn.py --model /tmp/m8b --device cuda \
          --streams ${STREAMS:-8} --num-requests ${REQUESTS:-48} --prompt-tokens ${PROMPT:-4000} --prompt-std 1500 \
          --output-tokens 256 --output-std 128 --tag ${TAG:-${gpu}_8b} --out $OUT --logs /tmp/churn/logs "${vargs[@]}" \
          --note "8B Llama shape, random weights, bf16; ${STREAMS:-8} concurrent, ${REQUESTS:-48} requests" 2>&1 | tail -12
      tar czf $OUT/churn_logs.tgz -C /tmp/churn logs 2>/dev/null ;;
    *) echo "gpu_tq_churn.sh: unknown part '$what' (check, serve)"; exit 2 ;;
  esac
done
