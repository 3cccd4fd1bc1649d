#!/usr/bin/env bash
# Where a serving step's host time goes on the lent GPU: one server of a shape, the engine's step log
# (SWIFTLM_STEP_LOG) and py-spy (--native, sampling the engine process) over a `swiftlm bench serve` run at N
# streams (~40-token prompts, 128 new tokens, EOS banned, prompt cache off), after a warm-up run.
#
#   bash scripts/gpu_step_profile.sh 8b [N]      # on the lent GPU; carry .whl (with py-spy's wheel) and .gpu
#   SERVER_TOO=1 bash scripts/gpu_step_profile.sh 1b 1    # also the HTTP server's process
# Results: $OUT/sp_<shape>.tgz (step log, py-spy raw profile and its summary, bench JSON, server log).
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
source scripts/gpu_site.sh
SITE=/tmp/site
shape=${1:-8b}; N=${2:-128}
mkdir -p /tmp/run && cd /tmp/run
case $shape in
  1b) args="--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 8192" ;;
  8b) args="--hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336" ;;
esac
[ -d /tmp/m$shape ] || PYTHONPATH=$SITE $PY $REPO/scripts/make_checkpoint.py /tmp/m$shape --arch llama $args --ctx 8192 \
    --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
D=$OUT/sp_$shape; mkdir -p $D
port=6200
env PYTHONPATH=$SITE SWIFTLM_STEP_LOG=$D/steps.jsonl ${SERVE_ENV:-} $PY -m swiftlm.cli serve --model /tmp/m$shape \
    --backend torch --parallel 128 --max-queue 512 --ctx-size 1024 --prompt-cache-bytes 0 --port $port \
    > $D/serve.log 2>&1 &
pid=$!
for t in $(seq 1 300); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 1; done
bench() {  # label
  PYTHONPATH=$SITE timeout 300 $PY -m swiftlm.cli bench serve --base-url http://127.0.0.1:$port --concurrency $N \
      --num-requests $(( N < 8 ? 16 : 2 * N )) --workers $(( N >= 32 ? 4 : 1 )) --warmup $(( N < 32 ? 2 : 32 )) \
      --prompt-tokens 40 --output-tokens 128 --ignore-eos \
      --tokenizer $REPO/.gpu/tok --no-progress --json $D/bench_$1.json 2>&1 | grep -E "output tok/s|ITL|TTFT" | tr -s ' '
}
bench warm
$PY -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('$REPO/.whl/py_spy-*.whl')[0]); \
open('/tmp/py-spy', 'wb').write(z.read([n for n in z.namelist() if n.endswith('scripts/py-spy')][0]))" \
    && chmod +x /tmp/py-spy
epid=$(pgrep -f "swiftlm.engine_process" | head -1)
echo "engine process: $epid, server process: $pid"
/tmp/py-spy record --native --rate 250 --format raw -p $epid -d ${SECS:-8} -o $D/pyspy.txt > $D/pyspy.log 2>&1 &
spy=$!
spy2=""
if [ "${SERVER_TOO:-0}" = 1 ]; then  # the HTTP server's process as well (chat templates, tokenizer, SSE)
  /tmp/py-spy record --rate 250 --format raw -p $pid -d ${SECS:-8} -o $D/pyspy_server.txt > $D/pyspy_server.log 2>&1 &
  spy2=$!
fi
sleep 1
bench profiled
wait $spy $spy2
tail -3 $D/pyspy.log
$PY $REPO/scripts/pyspy_top.py $D/pyspy.txt --top 30 > $D/pyspy_top.txt 2>&1; head -80 $D/pyspy_top.txt
[ -n "$spy2" ] && $PY $REPO/scripts/pyspy_top.py $D/pyspy_server.txt --top 40 > $D/pyspy_server_top.txt 2>&1 \
    && head -90 $D/pyspy_server_top.txt
curl -s http://127.0.0.1:$port/health > $D/health.json
kill $pid; wait $pid 2>/dev/null
$PY $REPO/scripts/step_timeline.py $D/steps.jsonl --since-gap 0.5
tar -czf $OUT/sp_$shape.tgz -C $OUT sp_$shape && rm -rf $D
