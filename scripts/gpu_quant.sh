#!/usr/bin/env bash
# Quantized weights on the lent GPU (8B Llama shape, random weights): scripts/bench_quant_serve.py checks the
# FP8 / int4 kernels against their references on 8B-shaped matrices and a small --quantize fp8 model against its
# FP8-rounded bf16 twin, then serves bf16, --quantize fp8 and a GPTQ int4 copy and measures decode at 1, 64 and
# 128 streams through `swiftlm bench serve`.
# Carries: .whl/ (wheels for the device's python), .gpu/tok (SmolLM2 tokenizer files): scripts/gpu_prepare.sh.
#   bash scripts/gpu_quant.sh
# Env: FORMATS (bf16,fp8,int4), STREAMS (1,64,128), SKIP (kernels,model,serve), TIMEOUT (seconds for the bench).
# Results: $OUT/quant_formats_h100.json (copy to docs/results/), $OUT/quant_logs.tgz (servers' logs).
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
mkdir -p /tmp/qb && cd /tmp/qb  # import the installed copy, not the source tree
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
[ -f /tmp/m8b/config.json ] || /usr/bin/time -f "checkpoint 8b: %e s" python3 $REPO/scripts/make_checkpoint.py \
    /tmp/m8b --arch llama --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \
    --ctx 4096 --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok \
    > /dev/null || exit 1
timeout ${TIMEOUT:-390} python3 $REPO/scripts/bench_quant_serve.py --model /tmp/m8b --work /tmp/qb \
    --formats ${FORMATS:-bf16,fp8,int4} --streams ${STREAMS:-1,64,128} --skip "${SKIP:-}" \
    --json $OUT/quant_formats_h100.json 2>&1 | tail -70
rc=${PIPESTATUS[0]}
tar czf $OUT/quant_logs.tgz -C /tmp/qb $(cd /tmp/qb && ls *.log 2>/dev/null) 2>/dev/null
exit $rc
