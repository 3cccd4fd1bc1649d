#!/usr/bin/env bash
# Engine throughput on the lent GPU machine (no network), before vs after in one run:
# the old engine (a source tree of an earlier commit, carried in .gpu/old) and this tree, each
# serving random-weight Llama shapes through HTTP, measured by `swiftlm bench serve`
# (~40-token prompts, 128 new tokens, EOS banned, prompt cache off).
#   bash scripts/gpu_engine.sh 1b [8b] [kernel] [profile]
# Needs carried: .whl (wheels), .gpu/tok (SmolLM2 tokenizer files), .gpu/old (old source tree).
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
if [ -z "${LOCAL:-}" ]; then
  source scripts/gpu_site.sh                     # new swiftlm + wheels -> /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site_old .whl/*.whl || exit 1
else  # a dry run on a machine whose $PY has the dependencies
  OUT=${OUT:-/tmp/out}; mkdir -p $OUT
  $PY -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site_old \
    .gpu/old || exit 1
export PYTHONPATH=
NS=${NS:-"1 8 32 64 128"}
PYSPY=  # pip --target leaves a wheel's scripts out: take py-spy's binary from its wheel
for w in $REPO/.whl/py_spy-*.whl; do
  [ -f "$w" ] && python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
open('/tmp/py-spy', 'wb').write(z.read(next(n for n in z.namelist() if n.endswith('scripts/py-spy'))))" "$w" \
    && chmod +x /tmp/py-spy && PYSPY=/tmp/py-spy
done
mkdir -p /tmp/run && cd /tmp/run                 # import the installed copies, not the source tree
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"

ckpt() {  # name hidden layers heads kv head_dim inter
  [ -d /tmp/m$1 ] && return
  /usr/bin/time -f "checkpoint $1: %e s" env PYTHONPATH=/tmp/site $PY $REPO/scripts/make_checkpoint.py /tmp/m$1 --arch llama --hidden $2 --layers $3 \
      --heads $4 --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 --dtype bfloat16 --no-tie \
      --shard-mb 4000 --tokenizer-from $REPO/.gpu/tok ${CKPT_EXTRA:-} > /dev/null || exit 1
}

serve_and_bench() {  # version model
  local ver=$1 m=$2 port=$((6000 + RANDOM % 1000)) site=/tmp/site
  [ $ver = old ] && site=/tmp/site_old
  env PYTHONPATH=$site ${SERVE_ENV:-} $PY -m swiftlm.cli serve --model /tmp/m$m --backend torch --parallel 128 \
      --max-queue 512 --ctx-size 1024 --prompt-cache-bytes 0 --port $port > "$OUT/serve_${ver}_$m.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server $ver $m died:"; tail -5 "$OUT/serve_${ver}_$m.log"; return; }
    sleep 1
  done
  for n in $NS; do
    local reqs=$(( n < 8 ? 8 : ${REQ_MULT:-2} * n ))
    if [ "${PYSPY_N:-}" = "$n" ] && [ -n "$PYSPY" ]; then  # sampling profiles of the server under load
      (sleep 3; $PYSPY record --pid $pid -d 4 -r 250 --threads --nonblocking -f raw \
          -o "$OUT/pyspy_${ver}_${m}_n$n.txt" > "$OUT/pyspy_${ver}_${m}_n$n.log" 2>&1
       $PYSPY record --pid $pid -d 4 -r 250 --threads --gil --nonblocking -f raw \
          -o "$OUT/pyspy_gil_${ver}_${m}_n$n.txt" >> "$OUT/pyspy_${ver}_${m}_n$n.log" 2>&1) &
      reqs=$(( 8 * n ))
    fi
    PYTHONPATH=/tmp/site timeout 240 $PY -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$port" \
        --concurrency $n --num-requests $reqs --workers $(( n >= 32 ? 4 : 1 )) --warmup $(( n < 32 ? n : 32 )) --prompt-tokens 40 --output-tokens 128 --ignore-eos \
        --tokenizer $REPO/.gpu/tok --no-progress --label "${ver}_${m}_n$n" --json "$OUT/serve_${ver}_${m}_n$n.json" \
        2>&1 | grep -E "output tok/s|ITL|TTFT|failed" | sed "s/^/[$ver $m N=$n] /"
  done
  for f in "$OUT"/pyspy*_${ver}_${m}_n*.txt; do
    [ -f "$f" ] && $PY $REPO/scripts/pyspy_top.py "$f" --top 25 > "${f%.txt}.top.txt" && head -80 "${f%.txt}.top.txt"
  done
  curl -s "http://127.0.0.1:$port/health" > "$OUT/health_${ver}_$m.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^swiftlm_step_seconds_(sum|count)" > "$OUT/steps_${ver}_$m.txt"
  kill $pid; wait $pid 2>/dev/null
}

for what in "$@"; do
  case $what in
    tiny) ckpt tiny 128 2 4 2 32 256; for v in old new; do serve_and_bench $v tiny; done ;;  # a dry run
    1b) ckpt 1b 2048 16 32 8 64 8192; for v in ${VERS:-old new}; do serve_and_bench $v 1b; done ;;
    8b) CKPT_EXTRA=--reuse-layers ckpt 8b 4096 32 32 8 128 14336; for v in ${VERS:-old new}; do serve_and_bench $v 8b; done ;;
    engine1b) ckpt 1b 2048 16 32 8 64 8192; cp $REPO/scripts/profile_engine.py /tmp/run/
              PYTHONPATH=/tmp/site timeout 300 $PY /tmp/run/profile_engine.py --model /tmp/m1b --streams ${PNS:-1,64,128} \
                  --tokens 128 --ctx-size 1024 --json "$OUT/profile_engine_1b.json" 2>&1 | tail -8 ;;
    sync1b) ckpt 1b 2048 16 32 8 64 8192; cp $REPO/scripts/profile_engine.py /tmp/run/   # where the host blocks
              PYTHONPATH=/tmp/site timeout 300 $PY /tmp/run/profile_engine.py --model /tmp/m1b --streams 1,64 \
                  --tokens 64 --ctx-size 1024 --sync-debug --json "$OUT/sync_engine_1b.json" 2>&1 | tail -50 ;;
    ab1b) ckpt 1b 2048 16 32 8 64 8192; cp $REPO/scripts/profile_engine.py /tmp/run/  # A/B of an env knob
              for v in ${AB_VALUES:-0 1}; do echo "${AB_VAR:-SWIFTLM_PINNED_H2D}=$v"
                env ${AB_VAR:-SWIFTLM_PINNED_H2D}=$v PYTHONPATH=/tmp/site timeout 300 $PY /tmp/run/profile_engine.py --model /tmp/m1b \
                  --streams 1,128,64 --tokens 128 --ctx-size 1024 ${TPROF:+--torch-profile "$OUT/tprof_ab$v.txt"} \
                  --json "$OUT/profile_engine_1b_ab$v.json" 2>&1 | tail -5; done ;;
    native1b) ckpt 1b 2048 16 32 8 64 8192; cp $REPO/scripts/profile_engine.py /tmp/run/  # py-spy with C frames
              PYTHONPATH=/tmp/site timeout 300 $PYSPY record --native --threads -r 200 -f raw -o "$OUT/native_engine_1b.txt" -- \
                  $PY /tmp/run/profile_engine.py --model /tmp/m1b --streams 64 --tokens 512 --ctx-size 1024 2>&1 | tail -4
              $PY $REPO/scripts/pyspy_top.py "$OUT/native_engine_1b.txt" --top 30 > "$OUT/native_engine_1b.top.txt"
              head -120 "$OUT/native_engine_1b.top.txt" ;;
    kernel) PYTHONPATH=/tmp/site timeout 300 $PY $REPO/scripts/bench_paged_attention.py --quick \
              --json "$OUT/bench_paged_attention_gpu.json" 2>&1 | tail -40 ;;
  esac
done
