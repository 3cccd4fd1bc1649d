#!/usr/bin/env bash
# Run on the lent GPU machine (no network): reassemble the bundled SmolLM2 GGUF carried in two
# parts (/tmp/part00 copied there by an earlier call, .gg/part01), install the carried wheels and swiftlm itself into /tmp/site,
# then run the GPU benchmarks, writing JSON and logs under $OUT.
set -uo pipefail
cat /tmp/part00 .gg/part01 > /tmp/smollm2.gguf || exit 1
source scripts/gpu_site.sh
cp scripts/bench_speculative.py scripts/bench_batching.py scripts/profile_torch_gpu.py /tmp/ && cd /tmp  # import the installed copy
python3 -c "import torch, swiftlm; print(torch.__version__, torch.cuda.get_device_name(0))"
timeout 120 python3 /tmp/profile_torch_gpu.py --model /tmp/smollm2.gguf > "$OUT/profile.log" 2>&1; head -8 "$OUT/profile.log"
timeout 280 python3 /tmp/bench_speculative.py --model /tmp/smollm2.gguf --tokens 256 \
    --json "$OUT/bench_speculative_gpu.json" 2>&1 | tee "$OUT/bench_speculative_gpu.log"
timeout 280 python3 /tmp/bench_batching.py --model /tmp/smollm2.gguf --streams 1,4,8,16,64 --tokens 64 \
    --json "$OUT/bench_batching_gpu.json" 2>&1 | tee "$OUT/bench_batching_gpu.log"
