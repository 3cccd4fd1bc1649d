#!/usr/bin/env bash
# One stream's time to first token on the lent GPU, 1B shape: where the time to the first token goes,
# in-process (scripts/ttft_breakdown.py: engine step phases, the prefill alone, one prefill
# under torch.profiler) and through HTTP (`swiftlm bench serve` at one stream: 128-token and 1-token requests).
#
#   bash scripts/gpu_ttft.sh            # on the lent GPU; carry .whl .gpu (PARTS="inproc http" by default)
# Results: $OUT/ttft_inproc_1b.json, $OUT/ttft_http_1b_{128,1}.json, $OUT/ttft_serve_1b.log.
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
source scripts/gpu_site.sh
SITE=/tmp/site
mkdir -p /tmp/run && cd /tmp/run
PARTS=${PARTS:-"inproc http"}
[ -d /tmp/m1b ] || /usr/bin/time -f "checkpoint: %e s" env PYTHONPATH=$SITE $PY $REPO/scripts/make_checkpoint.py /tmp/m1b --arch llama \
    --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 8192 --ctx 8192 --dtype bfloat16 \
    --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
cp $REPO/scripts/ttft_breakdown.py /tmp/run/   # (its sys.path entry must not shadow the installed swiftlm)
case " $PARTS " in *" inproc "*)
  PYTHONPATH=$SITE timeout 240 $PY /tmp/run/ttft_breakdown.py --model /tmp/m1b --reps 20 --json $OUT/ttft_inproc_1b.json ;;
esac
case " $PARTS " in *" http "*) ;; *) exit 0 ;; esac
port=6123
PYTHONPATH=$SITE $PY -m swiftlm.cli serve --model /tmp/m1b --backend torch --parallel 128 --max-queue 512 --ctx-size 1024 \
    --prompt-cache-bytes 0 --port $port > $OUT/ttft_serve_1b.log 2>&1 &
pid=$!
for t in $(seq 1 180); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 1; done
for tok in 128 1 128 1; do
  PYTHONPATH=$SITE timeout 120 $PY -m swiftlm.cli bench serve --base-url http://127.0.0.1:$port --concurrency 1 \
      --num-requests 16 --warmup 2 --prompt-tokens 40 --output-tokens $tok --ignore-eos --tokenizer $REPO/.gpu/tok \
      --no-progress --json $OUT/ttft_http_1b_${tok}_$RANDOM.json 2>&1 | grep -E "output tok/s|TTFT|ITL" | tr -s ' '
done
curl -s http://127.0.0.1:$port/metrics | grep -E "^swiftlm_step_seconds_(sum|count)" > $OUT/ttft_metrics_1b.txt
kill $pid; wait $pid 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
