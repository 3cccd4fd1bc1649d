#!/usr/bin/env bash
# Quantized weights on the lent GPU (8B Llama shape, random weights): scripts/bench_quant_serve.py checks the
# FP8 / int4 paths against their references on 8B-shaped matrices (and times every path and launch configuration
# at 1/16/64/128 rows: the fastest per format and rows is printed, the data for quant_linear.PATHS), a small
# --quantize fp8 model against its FP8-rounded bf16 twin at 10/40/128 prompt rows, then serves bf16, --quantize
# fp8 and a GPTQ int4 copy and measures decode at 1, 64 and 128 streams through `swiftlm bench serve` (rows whose
# streams failed, ended early or never decoded together are refused, with the reasons).
# Carries: .whl/ (wheels for the device's python), .gpu/tok (SmolLM2 tokenizer files): scripts/gpu_prepare.sh.
#   bash scripts/gpu_quant.sh
# Env: FORMATS (bf16,fp8,int4), STREAMS (1,64,128), ROWS (1,16,64,128), SKIP (kernels,sweep,model,serve),
#      TIMEOUT (seconds for the bench), SWIFTLM_QUANT_PATHS (override PATHS entries, e.g. int4:128=kernel).
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
    --formats ${FORMATS:-bf16,fp8,int4} --streams ${STREAMS:-1,64,128} --rows ${ROWS:-1,16,64,128} --skip "${SKIP:-}" \
    --json $OUT/quant_formats_h100.json 2>&1 | tail -110
rc=${PIPESTATUS[0]}
tar czf $OUT/quant_logs.tgz -C /tmp/qb $(cd /tmp/qb && ls *.log *_[0-9]*.json 2>/dev/null) 2>/dev/null  # logs, bench records
exit $rc
