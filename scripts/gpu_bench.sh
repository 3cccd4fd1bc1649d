#!/usr/bin/env bash
# `swiftlm bench` matrices on the lent GPU machine (no network): an 8B-shape dense checkpoint (vanilla and every
# TurboQuant preset, contexts up to 100K) and a MoE checkpoint (vanilla / --stream-experts / both / TurboQuant).
# Carries: .whl/ (wheels for the device's python), .gpu/tok (SmolLM2 tokenizer files).  Results go to $OUT.
#   bash scripts/gpu_bench.sh test 8b moe
# Env: CTX8B (contexts of the 8B run), CTXMOE, DECODE (tokens per request), TIMEOUT (seconds per configuration).
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
mkdir -p /tmp/gb && cd /tmp/gb  # import the installed copy, not the source tree
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
for what in "$@"; do
  case $what in
    8b)
      [ -f /tmp/m8b/config.json ] || /usr/bin/time -f "checkpoint 8b: %e s" python3 $REPO/scripts/make_checkpoint.py \
          /tmp/m8b --arch llama --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \
          --ctx 131072 --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok \
          > /dev/null || exit 1
      python3 -m swiftlm.cli bench --model /tmp/m8b --backend torch --configs ${CONFIGS8B:-vanilla,turbo} \
          --contexts ${CTX8B:-512,4096,16384,40960,102400} --decode-tokens ${DECODE:-128} --batch-sizes 1,8,32 \
          --batch-context 512 --timeout ${TIMEOUT:-300} --out "$OUT" --name bench_h100_8b > "$OUT/bench_h100_8b.log" 2>&1; tail -40 "$OUT/bench_h100_8b.log" ;;
    moe)
      # 16 layers x 32 experts x 17.3 MB (bf16, hidden 2048, expert intermediate 1408) = 8.9 GB of experts
      [ -f /tmp/moe9g/config.json ] || /usr/bin/time -f "checkpoint moe: %e s" python3 $REPO/scripts/make_checkpoint.py \
          /tmp/moe9g --arch qwen3_moe --hidden 2048 --layers 16 --heads 16 --kv-heads 4 --experts 32 \
          --experts-per-token 8 --moe-intermediate 1408 --ctx 32768 --shard-mb 2000 --reuse-layers --force \
          --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
      python3 -m swiftlm.cli bench --model /tmp/moe9g --backend torch \
          --configs ${CONFIGSMOE:-vanilla,turbo:k4v3,experts,experts+turbo:k4v3} --contexts ${CTXMOE:-512,4096,16384} \
          --decode-tokens ${DECODE_MOE:-32} --batch-sizes 1,8 --batch-context 512 --timeout ${TIMEOUT:-300} \
          --out "$OUT" --name bench_h100_moe > "$OUT/bench_h100_moe.log" 2>&1; tail -40 "$OUT/bench_h100_moe.log" ;;
    test)  # the CUDA variants of the kernel-level tests this script's runs depend on
      python3 -m pytest -p no:cacheprovider -q $REPO/tests/test_chunk_attention.py > "$OUT/test_chunk_attention_gpu.log" 2>&1
      tail -3 "$OUT/test_chunk_attention_gpu.log" ;;
    *) echo "gpu_bench.sh: unknown run '$what' (8b, moe, test)"; exit 2 ;;
  esac
done
