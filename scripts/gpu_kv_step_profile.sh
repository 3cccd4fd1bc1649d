#!/usr/bin/env bash
# On the lent GPU machine: the decode step's CUDA kernels per KV format at long contexts (scripts/profile_kv_step.py)
# on the 8B-shape random checkpoint.   bash scripts/gpu_kv_step_profile.sh   (carry .whl .gpu; LENGTHS, FORMATS)
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
[ -f /tmp/m8b/config.json ] || /usr/bin/time -f "checkpoint 8b: %e s" python3 $REPO/scripts/make_checkpoint.py \
    /tmp/m8b --arch llama --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \
    --ctx 135168 --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
for n in ${LENGTHS:-32000 131000}; do
  timeout ${TIMEOUT:-300} python3 $REPO/scripts/profile_kv_step.py --model /tmp/m8b --prompt-tokens $n \
    --formats ${FORMATS:-16bit,k4v3,k3v2} ${STEP_ARGS:-} --json $OUT/kv_step_${TAG:-}$n.json 2>&1 | grep -v "^USDT\|profiler_st" | tail -80
done
