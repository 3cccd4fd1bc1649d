#!/usr/bin/env bash
# On the lent GPU machine (no network): torch expert streaming with the GPU memory capped below
# the MoE's size.  Carries: .whl/ (pydantic & co. for the device's python) and .gpuck/tok
# (a tiny checkpoint whose tokenizer files are copied; no GGUF needed).  Results go to $OUT.
#   bash scripts/gpu_experts.sh [CAP]      # CAP: --mem-limit for the streamed runs (default 4GB)
set -uo pipefail
CAP=${1:-4GB}
source scripts/gpu_site.sh
rm -rf /tmp/ge && mkdir -p /tmp/ge && cp scripts/bench_expert_streaming.py scripts/make_checkpoint.py /tmp/ge/
cp scripts/check_streaming_exact.py /tmp/ge/
cd /tmp/ge  # import the installed copy, not the source tree
python3 -c "import torch, swiftlm; print(torch.__version__, torch.cuda.get_device_name(0))"
df -h /tmp | tail -1
# 16 layers x 32 experts x 17.3 MB (bf16, hidden 2048, expert intermediate 1408) = 8.9 GB of experts
[ -f /tmp/moe9g/config.json ] || time python3 make_checkpoint.py /tmp/moe9g --arch qwen3_moe --hidden 2048 --layers 16 --heads 16 --kv-heads 4 \
  --experts 32 --experts-per-token 8 --moe-intermediate 1408 --shard-mb 2000 --force \
  --tokenizer-from "$OLDPWD/.gpuck/tok" 2>&1 | tail -2
python3 make_checkpoint.py /tmp/moe_small --arch qwen3_moe --hidden 256 --layers 3 --experts 16 \
  --experts-per-token 4 --moe-intermediate 128 --shard-mb 2 --force --tokenizer-from "$OLDPWD/.gpuck/tok" >/dev/null
python3 check_streaming_exact.py /tmp/moe_small 2>&1 | tee "$OUT/expert_streaming_gpu_exact.log" | tail -2
timeout 480 python3 bench_expert_streaming.py /tmp/moe9g --backend torch --tokens 16 --quick --mem-limit "$CAP" \
  --out "$OUT/expert_streaming_gpu.json" 2>&1 | tee "$OUT/expert_streaming_gpu.log" | tail -20
