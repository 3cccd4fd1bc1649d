#!/usr/bin/env bash
# Two source trees on a lent GPU machine (no network): this checkout ("a") and another carried in .gpu/b ("b"), e.g.
#   rm -rf .gpu/b && mkdir -p .gpu/b && git archive <rev> swiftlm backends cuda_ext metal_kernels pyproject.toml \
#       README.md scripts tests | tar -x -C .gpu/b
# Carry .whl .gpu/tok .gpu/b (scripts/gpu_prepare.sh makes the first two).
#   bash scripts/gpu_ab_checks.sh checks          # each tree's CUDA equivalence checks (TREES, default "a")
#   bash scripts/gpu_ab_checks.sh serve8b serve1b # throughput through HTTP, both trees' servers in turn
# checks: scripts/gpu_archs.py (every architecture against transformers), check_paged_cuda.py,
# check_code_pages_cuda.py, check_mixed_step.py, check_packed_prefill.py, check_streaming_exact.py, and pytest on the
# test files that use CUDA (CUDA_TESTS), each tree's own copies, with per-check time limits (CHECKS: which); logs,
# JSON and JUnit XML packed into $OUT/checks_<trees>.tgz (<tree>/...).
# serveNN: the random-weight Llama shape behind `swiftlm serve` (engine process, prompt cache off), measured by
# `swiftlm bench serve` (~40-token prompts, TOK new tokens, EOS banned, several client processes) at NS concurrent
# streams; $OUT/serve_<tree>_<shape>_n<N>.json and a summary line per run.
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh  # wheels + this tree -> /tmp/site
if [ -d .gpu/b ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site_b .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site_b \
      .gpu/b || exit 1
fi
export PYTHONPATH=
TREES=${TREES:-a}
NS=${NS:-"1 64 128"}
TOK=${TOK:-256}
CUDA_TESTS=${CUDA_TESTS:-"test_paged_attention.py test_fp8_kv.py test_prompt_stage.py test_chunk_attention.py
  test_tq_paged.py"}
CHECKS=${CHECKS:-"pytest_cuda gpu_archs paged code_pages mixed_step packed_prefill streaming_exact"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

site() { [ "$1" = b ] && echo /tmp/site_b || echo /tmp/site; }
root() { [ "$1" = b ] && echo "$REPO/.gpu/b" || echo "$REPO"; }

ckpt() {  # name hidden layers heads kv head_dim inter [extra]
  [ -d /tmp/m$1 ] && return
  /usr/bin/time -f "checkpoint $1: %e s" env PYTHONPATH=/tmp/site python3 $REPO/scripts/make_checkpoint.py /tmp/m$1 \
      --arch llama --hidden $2 --layers $3 --heads $4 --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 \
      --dtype bfloat16 --no-tie --shard-mb 4000 --tokenizer-from $REPO/.gpu/tok ${8:-} > /dev/null || exit 1
}

check() {  # tree name seconds command...
  local t=$1 name=$2 secs=$3; shift 3
  [[ " $(echo $CHECKS) " == *" $name "* ]] || return 0
  local t0=$(date +%s)
  (cd /tmp/run_$t && env PYTHONPATH=$(site $t) timeout $secs "$@" > "$OUT/$t/$name.log" 2>&1)
  local rc=$?
  echo "[$t] $name: exit $rc in $(( $(date +%s) - t0 )) s; $(grep -E 'passed|failed|OK|FAIL|max|equal|identical' \
      "$OUT/$t/$name.log" | tail -1 | cut -c1-200)"
}

checks() {
  [[ " $(echo $CHECKS) " =~ " "(paged|code_pages|mixed_step|packed_prefill)" " ]] && ckpt 1b 2048 16 32 8 64 8192
  env PYTHONPATH=/tmp/site python3 $REPO/scripts/make_checkpoint.py /tmp/moe_small --arch qwen3_moe --hidden 256 \
      --layers 3 --experts 16 --experts-per-token 4 --moe-intermediate 128 --shard-mb 2 --force \
      --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
  for t in $TREES; do
    mkdir -p "$OUT/$t" && rm -rf /tmp/run_$t && mkdir -p /tmp/run_$t
    cp -r "$(root $t)/scripts" "$(root $t)/tests" "$(root $t)/pyproject.toml" /tmp/run_$t/
    local tests=$(for f in $CUDA_TESTS; do [ -f /tmp/run_$t/tests/$f ] && printf 'tests/%s ' $f; done)
    check $t pytest_cuda ${PYTEST_TIMEOUT:-240} python3 -m pytest -q -rA -p no:cacheprovider --rootdir /tmp/run_$t \
        --junitxml "$OUT/$t/pytest_cuda.xml" $tests
    check $t gpu_archs 200 python3 scripts/gpu_archs.py --tokenizer-from $REPO/.gpu/tok --out "$OUT/$t/gpu_archs.json"
    check $t paged 120 python3 scripts/check_paged_cuda.py --model /tmp/m1b --json "$OUT/$t/paged.json"
    check $t code_pages 150 python3 scripts/check_code_pages_cuda.py --model /tmp/m1b --json "$OUT/$t/code_pages.json"
    check $t mixed_step 90 python3 scripts/check_mixed_step.py --model /tmp/m1b --json "$OUT/$t/mixed_step.json"
    check $t packed_prefill 90 python3 scripts/check_packed_prefill.py --model /tmp/m1b --json "$OUT/$t/packed.json"
    check $t streaming_exact 60 python3 scripts/check_streaming_exact.py /tmp/moe_small
  done
  tar -czf "$OUT/checks_$(echo $TREES | tr -d " ").tgz" -C "$OUT" $TREES && rm -rf $(for t in $TREES; do echo "$OUT/$t"; done)
}

serve() {  # shape
  local m=/tmp/m$1
  for t in $TREES; do
    local port=$((6000 + RANDOM % 1000))
    env PYTHONPATH=$(site $t) python3 -m swiftlm.cli serve --model $m --backend torch --parallel 256 --max-queue 1024 \
        --ctx-size 1024 --prompt-cache-bytes 0 --port $port > "$OUT/serve_${t}_$1.log" 2>&1 &
    local pid=$!
    for i in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
      kill -0 $pid 2>/dev/null || { echo "server $t $1 died:"; tail -5 "$OUT/serve_${t}_$1.log"; continue 2; }
      sleep 1
    done
    for n in $NS; do
      local reqs=$(( n < 8 ? 8 : 2 * n ))
      env PYTHONPATH=/tmp/site timeout 200 python3 -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$port" \
          --concurrency $n --num-requests $reqs --workers $(( n >= 32 ? 4 : 1 )) --warmup $(( n < 32 ? n : 32 )) \
          --prompt-tokens 40 --output-tokens $TOK --ignore-eos --tokenizer $REPO/.gpu/tok --no-progress \
          --label "${t}_$1_n$n" --json "$OUT/serve_${t}_$1_n$n.json" 2>&1 | grep -E "output tok/s|ITL|failed" \
          | sed "s/^/[$t $1 N=$n] /"
    done
    kill $pid; wait $pid 2>/dev/null
  done
}

mkdir -p /tmp/run && cd /tmp/run
for what in "$@"; do
  case $what in
    checks) checks ;;
    serve8b) ckpt 8b 4096 32 32 8 128 14336 --reuse-layers; serve 8b ;;
    serve1b) ckpt 1b 2048 16 32 8 64 8192; serve 1b ;;
  esac
done
