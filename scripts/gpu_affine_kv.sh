#!/usr/bin/env bash
# On the lent GPU machine: the affine kv_bits kernel tests on CUDA, the one-layer kernel benchmark
# (scripts/bench_tq_kernel.py --kv-bits) and, with "e2e", the 8B-shape decode benchmark at 32K
# (bench_turboquant.py: 16-bit and kv_bits 8 / 4, eager and CUDA-graph).
#   bash scripts/gpu_affine_kv.sh [e2e]        (carry .whl; see scripts/gpu_prepare.sh)
set -uo pipefail
source scripts/gpu_site.sh
rm -rf /tmp/ga && mkdir -p /tmp/ga && cp -r tests /tmp/ga/ && cp scripts/bench_tq_kernel.py scripts/bench_turboquant.py /tmp/ga/
cd /tmp/ga
if [ "${1:-}" = e2e ]; then
  timeout 540 python3 bench_turboquant.py --backend torch --shape 8b --contexts ${E2E_CONTEXTS:-32768} --steps 16 \
    --presets fp16,kv_bits=8,kv_bits=4${E2E_PRESETS:+,$E2E_PRESETS} --json "$OUT/bench_affine_gpu_8b.json" 2>&1 \
    | tee "$OUT/bench_affine_gpu_8b.log" | tail -14
else
  timeout 300 python3 -m pytest -q -rs tests/test_cuda_ext.py -k "gpu" 2>&1 | tail -6
  timeout 200 python3 bench_tq_kernel.py --contexts 32768,131072 --presets "" --kv-bits 8,4 \
    --json $OUT/affine_kernel_h100_b1.json 2>&1 | tee $OUT/affine_kernel_h100_b1.log
fi
