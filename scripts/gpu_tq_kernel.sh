#!/usr/bin/env bash
# On the lent GPU machine: the TurboQuant kernel tests on CUDA, the one-layer kernel benchmark
# (scripts/bench_tq_kernel.py) and, with "e2e", the 8B-shape decode benchmark at 32K (bench_turboquant.py).
#   bash scripts/gpu_tq_kernel.sh [e2e]        (carry .whl; see scripts/gpu_prepare.sh)
set -uo pipefail
source scripts/gpu_site.sh
rm -rf /tmp/gt && mkdir -p /tmp/gt && cp -r tests /tmp/gt/ && cp scripts/bench_tq_kernel.py scripts/bench_turboquant.py /tmp/gt/
cd /tmp/gt
timeout 200 python3 -m pytest -q -rs tests/test_cuda_ext.py -k "turboquant and gpu" 2>&1 | tail -4
timeout 200 python3 bench_tq_kernel.py --contexts 32768,131072 ${SPLITS:+--splits $SPLITS} --json $OUT/tq_kernel_h100_b1.json 2>&1 | tee $OUT/tq_kernel_h100_b1.log
if [ "${1:-}" = e2e ]; then
  timeout 400 python3 bench_turboquant.py --backend torch --shape 8b --contexts ${E2E_CONTEXTS:-32768} --steps 16 \
    --presets fp16,k4v3,k3v2${E2E_PRESETS:+,$E2E_PRESETS} --json "$OUT/bench_turboquant_gpu_8b.json" 2>&1 | tee "$OUT/bench_turboquant_gpu_8b.log" | tail -14
fi
