#!/usr/bin/env bash
# Each KV format through `swiftlm serve` on the lent GPU (8B Llama shape, random weights): time to first token and
# inter-token latency at 8K and 32K for one stream, and 8 concurrent 32K streams (scripts/bench_kv_formats_serve.py),
# plus one layer's prompt chunk profiled per format (scripts/profile_prompt_attention.py).
# Carries: .whl/ (wheels for the device's python), .gpu/tok (SmolLM2 tokenizer files): scripts/gpu_prepare.sh.
#   bash scripts/gpu_kv_formats.sh profile serve
# Env: FORMATS (default 16bit,k4v3,k3v2,fp8; fp8 = serve --kv-cache-dtype fp8), LENGTHS (8000,32000), STREAMS (8; 1:
# no concurrent run), CTX (the checkpoint's context, 40960; 140000 for 128K prompts), TAG (JSON name: kv_formats_serve_<TAG>),
# PROFILE_FORMATS, TIMEOUT (seconds for the serve part).  Results: $OUT/kv_formats_serve_<gpu>.json, $OUT/prompt_attention_profile.json,
# $OUT/kv_logs.tgz (servers' logs, step timelines, bench JSON).
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
mkdir -p /tmp/kvf && cd /tmp/kvf  # import the installed copy, not the source tree
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
for what in "$@"; do
  case $what in
    profile)
      timeout 240 python3 $REPO/scripts/profile_prompt_attention.py --formats ${PROFILE_FORMATS:-16bit,k4v3,k3v2,kv8} \
          --prefix 4096,16384,31744 --reps 10 --json $OUT/prompt_attention_profile.json 2>&1 | tail -60 ;;
    serve)
      [ -f /tmp/m8b/config.json ] || /usr/bin/time -f "checkpoint 8b: %e s" python3 $REPO/scripts/make_checkpoint.py \
          /tmp/m8b --arch llama --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \
          --ctx ${CTX:-40960} --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok \
          > /dev/null || exit 1
      timeout ${TIMEOUT:-420} python3 $REPO/scripts/bench_kv_formats_serve.py --model /tmp/m8b --device cuda \
          --formats ${FORMATS:-16bit,k4v3,k3v2,fp8} --prompt-tokens ${LENGTHS:-8000,32000} --streams ${STREAMS:-8} \
          --streams-output-tokens ${STREAMS_OUT:-768} --step-log --logs /tmp/kvf/logs --out $OUT \
          --max-ttft-ratio 1.3 --min-decode-ratio 1.0 --note "${NOTE:-}" ${TAG:+--tag $TAG} 2>&1 | tail -40
      tar czf $OUT/kv_logs.tgz -C /tmp/kvf logs ;;
    *) echo "gpu_kv_formats.sh: unknown part '$what' (profile, serve)"; exit 2 ;;
  esac
done
