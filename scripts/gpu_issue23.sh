#!/usr/bin/env bash
# On the lent GPU machine: the TurboQuant kernel tests on CUDA, the one-layer kernel benchmark with
# its variants (scripts/bench_tq_kernel.py) and the 8B-shape decode benchmark (bench_turboquant.py).
#   bash scripts/gpu_issue23.sh [kernel] [e2e] [e2e128] [e2eb8] [e2eb8rows]    (carry .whl; see scripts/gpu_prepare.sh)
# Knobs: E2E_PRESETS (default fp16,k4v3,k3v2), KCTX (kernel contexts), KPRESETS, KKVBITS, TAG (file-name suffix),
# NOTESTS=1 (no kernel tests first).
set -uo pipefail
source scripts/gpu_site.sh
rm -rf /tmp/gt && mkdir -p /tmp/gt && cp -r tests /tmp/gt/ && cp scripts/bench_tq_kernel.py scripts/bench_turboquant.py /tmp/gt/
cd /tmp/gt
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu_${TAG:-x}.txt"
if [ -z "${NOTESTS:-}" ]; then  # NOTESTS=1: skip the kernel tests (a second invocation in one device call)
  timeout 300 python3 -m pytest -q -rs tests/test_cuda_ext.py -k "turboquant" 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | cut -c1-300 | tail -14
  # the interpreted selector-word check on this machine's Triton, with its traceback if it fails
  python3 -c "import re; s=open('tests/test_cuda_ext.py').read(); print(eval(re.search(r'TQ_SWAR_CODE = (\"\"\".*?\"\"\")', s, re.S).group(1)).format(device='cpu'))" > /tmp/swar.py
  TRITON_INTERPRET=1 timeout 200 python3 /tmp/swar.py 2>&1 | grep -vE "^\s+\^+$" | tail -40 | cut -c1-300
fi
for stage in "$@"; do
  case $stage in
    kernel) timeout 400 python3 bench_tq_kernel.py ${KWINDOW:+--window $KWINDOW} ${KSWEEP:+--sweep $KSWEEP} ${KSPLITS:+--splits $KSPLITS} ${KMAXNREG:+--maxnreg $KMAXNREG} ${KKVBITS:+--kv-bits $KKVBITS} --contexts ${KCTX:-32768,131072} --presets ${KPRESETS:-k4v3,k3v2,k3qjl-v3} \
              --json "$OUT/tq_kernel_${TAG:-x}.json" 2>&1 | tee "$OUT/tq_kernel_${TAG:-x}.log" ;;
    e2e|e2e128)
      ctx=32768; [ "$stage" = e2e128 ] && ctx=131072
      timeout 500 python3 bench_turboquant.py --backend torch --shape 8b --contexts $ctx --steps 16 \
        --presets ${E2E_PRESETS:-fp16,k4v3,k3v2} ${PROFILE:+--profile} --json "$OUT/e2e_${ctx}_${TAG:-x}.json" 2>&1 \
        | tee "$OUT/e2e_${ctx}_${TAG:-x}.log" | grep -E "^#|^\{" | cut -c1-200 ;;
    e2eb8|e2eb8rows)  # eight sequences at 32K each; e2eb8rows: each row's own kernels (SWIFTLM_TQ_BATCHED=0)
      env=""; [ "$stage" = e2eb8rows ] && env="SWIFTLM_TQ_BATCHED=0"
      env $env timeout 500 python3 bench_turboquant.py --backend torch --shape 8b --batch 8 --contexts 32768 --steps 8 \
        --presets ${E2E_PRESETS:-fp16,k4v3,k3v2} --json "$OUT/${stage}_32768_${TAG:-x}.json" 2>&1 \
        | tee "$OUT/${stage}_32768_${TAG:-x}.log" | grep -E "^#|^\{" | cut -c1-200 ;;
  esac
done
