#!/usr/bin/env bash
# On the lent GPU machine (no network): install the carried wheels (.whl/) and swiftlm into
# /tmp/site, run the Triton/CUDA tests, then the TurboQuant decode benchmarks.  Results go to $OUT.
#   bash scripts/gpu_turbo.sh tests      # GPU tests of cuda_ext (decode kernels, TurboQuant kernels, cache)
#   bash scripts/gpu_turbo.sh 8b         # 8B-shaped random model at 32K context
#   bash scripts/gpu_turbo.sh smollm2    # SmolLM2-shaped random model at 1K/4K/16K
#   bash scripts/gpu_turbo.sh e2e        # the real SmolLM2 through the engine (needs /tmp/part00 from an earlier
#                                        # call carrying .gg/part00, and .gg/part01 carried now: see gpu_session.sh)
set -uo pipefail
source scripts/gpu_site.sh
rm -rf /tmp/gt && mkdir -p /tmp/gt && cp -r tests /tmp/gt/ && cp scripts/bench_turboquant.py scripts/gpu_turbo_e2e.py /tmp/gt/
if [ -f /tmp/part00 ] && [ -f .gg/part01 ]; then cat /tmp/part00 .gg/part01 > /tmp/smollm2.gguf; fi
cd /tmp/gt  # import the installed copy, not the source tree
python3 -c "import torch, triton, swiftlm; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
for what in "$@"; do
  case $what in
    tests) timeout 400 python3 -m pytest -q -rs tests/test_cuda_ext.py 2>&1 | tee "$OUT/test_cuda_ext_gpu.log" | tail -15 ;;
    8b) timeout 500 python3 bench_turboquant.py --backend torch --shape 8b --contexts 32768 --steps 16 \
          --presets fp16,k3v2,k4v3,k3qjl-v3,kv_bits=8,kv_bits=4 --json "$OUT/bench_turboquant_gpu_8b.json" \
          2>&1 | tee "$OUT/bench_turboquant_gpu_8b.log" | tail -14 ;;
    smollm2) timeout 500 python3 bench_turboquant.py --backend torch --shape smollm2 --contexts 1024,4096,16384 \
          --steps 16 --json "$OUT/bench_turboquant_gpu_smollm2.json" 2>&1 | tee "$OUT/bench_turboquant_gpu_smollm2.log" \
          | tail -24 ;;
    e2e) timeout 300 python3 gpu_turbo_e2e.py --model /tmp/smollm2.gguf 2>&1 | tee "$OUT/gpu_turbo_e2e.log" | tail -30 ;;
  esac
done
