#!/usr/bin/env bash
# Fused decode kernels (backends/torch/fused_decode.py) and the step token budget (--max-batched-tokens)
# A/B on the GPU: one server per (shape, mode), each measured by `swiftlm bench serve` at N
# concurrent streams (~40-token prompts, OUTTOK new tokens, EOS banned, prompt cache off), the same way
# as scripts/gpu_engine_process.sh; then the in-process engine's step phases (scripts/profile_engine.py)
# for both kernel settings.
#
#   bash scripts/gpu_fused.sh 1b 8b            # on the lent GPU; carry .whl .gpu
#   MODES="unfused fused" NS="1 64" REPS=2 bash scripts/gpu_fused.sh 1b
# Every mode's server is up at once on the GPU and the runs alternate between them, REPS times (the 8B shape: at
# most two modes fit an 80 GB GPU at once).
#
# STEPLOG=1: each server writes the engine's step log (SWIFTLM_STEP_LOG) to $OUT/fd_steps_<shape>_<mode>.jsonl
# (scripts/step_timeline.py reads it).
# Modes: unfused (SWIFTLM_FUSED_DECODE=0), fused (the default), nofreeze (fused, SWIFTLM_GC_FREEZE=0: the
# garbage collector walks the whole heap, swiftlm/gc_pauses.py), fused4k (+ --max-batched-tokens 4096),
# base (cuBLAS for one-row matmuls and SDPA attention: no Triton GEMV, no paged kernel), noprefillgraph (prompt chunks
# eager: SWIFTLM_PREFILL_GRAPHS=0), novarlen (packed prompts' attention by masked SDPA), nomixed
# (a step's decode rows and prompts in two forwards: SWIFTLM_MIXED_STEP=0), swNN (GIL switch interval 0.NN ms),
# torchsample (the sampler's captured torch graph instead of its Triton kernels: SWIFTLM_SAMPLE_KERNEL=0),
# slots (one KV block per sequence, a slot pool's layout: --kv-block-size 1024), bsNN (--kv-block-size NN),
# old (the servers of another checkout, OLD_TREE=path: e.g. `git archive <rev> | tar -x -C .gpu/old`, carried),
# memSIZE (--kv-cache-memory SIZE, e.g. mem2GB).  CTX=8192: the servers' --ctx-size (default 1024).
# Results: $OUT/fd_<shape>_<mode>_n<N>.json, $OUT/fd_prof_<shape>_<mode>.json, $OUT/fused_<shape>.json.
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
source scripts/gpu_site.sh                     # swiftlm + wheels -> /tmp/site, $OUT
SITE=/tmp/site
TOK="--tokenizer $REPO/.gpu/tok"
NS=${NS:-"1 64 128"}
PARALLEL=${PARALLEL:-128}
OUTTOK=${OUTTOK:-128}
MODES=${MODES:-"unfused nofreeze fused fused4k"}
PROFILE=${PROFILE:-1}
if [ -n "${OLD_TREE:-}" ]; then  # mode "old": the same servers from another checkout (a baseline build)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site_old \
      "$OLD_TREE" || exit 1
fi
mkdir -p /tmp/run && cd /tmp/run                 # import the installed copies, not the source tree

ckpt() {  # name hidden layers heads kv head_dim inter
  [ -d /tmp/m$1 ] && return
  /usr/bin/time -f "checkpoint $1: %e s" env PYTHONPATH=$SITE $PY $REPO/scripts/make_checkpoint.py /tmp/m$1 --arch llama \
      --hidden $2 --layers $3 --heads $4 --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 --dtype bfloat16 \
      --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
}

mode_env() {  # the environment of a mode's server
  case $1 in
    unfused) echo "SWIFTLM_FUSED_DECODE=0" ;;
    nofreeze) echo "SWIFTLM_GC_FREEZE=0" ;;
    base) echo "SWIFTLM_GEMV=0 SWIFTLM_PAGED_ATTENTION=0" ;;  # cuBLAS + SDPA: no Triton GEMV or paged kernel
    nopdl) echo "SWIFTLM_PDL=0" ;;                            # kernels launched without PDL (cuda_ext/pdl.py)
    noprefillgraph) echo "SWIFTLM_PREFILL_GRAPHS=0" ;;        # prompt chunks eager (backends/torch/prefill_graphs.py)
    novarlen) echo "SWIFTLM_VARLEN_ATTENTION=0" ;;            # packed prompts' attention masked SDPA (packed_attention.py)
    nomixed) echo "SWIFTLM_MIXED_STEP=0" ;;                   # prompt steps as two forwards (mixed_step.py)
    torchsample) echo "SWIFTLM_SAMPLE_KERNEL=0" ;;            # the sampler's torch graph, not its Triton kernels
    sw*) echo "SWIFTLM_GIL_SWITCH_MS=0.${1#sw}" ;;              # sw05: GIL switch interval 0.5 ms (swiftlm/gil.py)
    *) echo "SWIFTLM_FUSED_DECODE=1" ;;
  esac
}
mode_args() {
  case $1 in
    fused4k) echo "--max-batched-tokens 4096" ;;
    slots) echo "--kv-block-size 1024" ;;   # one KV block per sequence (the context): the slot pool's layout
    bs*) echo "--kv-block-size ${1#bs}" ;;   # bs16: 16-position KV blocks (default 64)
    mem*) echo "--kv-cache-memory ${1#mem}" ;; # mem2GB: a 2 GB paged KV pool
    *) echo "" ;;
  esac
}

start_server() {  # shape model-argument mode -> sets $pid $port
  port=$((6000 + RANDOM % 1000))
  local log=""; [ "${STEPLOG:-0}" = 1 ] && log="SWIFTLM_STEP_LOG=$OUT/fd_steps_${1}_$3.jsonl"
  local pp=$SITE; [ $3 = old ] && pp=/tmp/site_old:$SITE  # old: a reference build (OLD_TREE) installed there
  env PYTHONPATH=$pp $(mode_env $3) $log \
      $PY -m swiftlm.cli serve $2 --backend torch --parallel $PARALLEL --max-queue 512 --ctx-size ${CTX:-1024} \
      --prompt-cache-bytes 0 --port $port $(mode_args $3) > "$OUT/fd_serve_${1}_$3.log" 2>&1 &
  pid=$!
}

wait_ready() {  # shape mode pid port
  local t
  for t in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$4/health" > /dev/null && return 0
    kill -0 $3 2>/dev/null || { echo "server $1 $2 died:"; tail -5 "$OUT/fd_serve_${1}_$2.log"; return 1; }
    sleep 1
  done
}

interleaved() {  # shape model-argument: every mode's server up at once, the runs alternate between them
  # (one machine's state drifts between runs: alternating, REPS times, keeps the comparison fair)
  local pids=() ports=() m i n r
  for m in $MODES; do start_server $1 "$2" $m; pids+=($pid); ports+=($port); done
  i=0; for m in $MODES; do wait_ready $1 $m ${pids[$i]} ${ports[$i]} || return; i=$((i + 1)); done
  for n in $NS; do
    for r in $(seq 1 ${REPS:-2}); do
      i=0
      for m in $MODES; do
        local reqs=$(( n < 8 ? 8 : ${REQ_MULT:-2} * n )) workers=$(( n >= 32 ? 4 : 1 ))
        PYTHONPATH=$SITE timeout 300 $PY -m swiftlm.cli bench serve --base-url "http://127.0.0.1:${ports[$i]}" \
            --concurrency $n --num-requests $reqs --workers $workers --warmup $(( n < 32 ? n : 32 )) \
            --prompt-tokens 40 --output-tokens $OUTTOK --ignore-eos $TOK --no-progress --label "${1}_${m}_n${n}_r$r" \
            --json "$OUT/fd_${1}_${m}_n${n}_r$r.json" 2>&1 | grep -E "output tok/s|ITL" | tr -s ' ' \
            | sed "s/^/[$1 $m N=$n rep $r] /"
        i=$((i + 1))
      done
    done
  done
  i=0
  for m in $MODES; do
    curl -s "http://127.0.0.1:${ports[$i]}/health" > "$OUT/fd_health_${1}_$m.json"
    $PY -c "import json,sys; d=json.load(open(sys.argv[1]))['stats']; print({k: v['mean_ms'] for k, v in d['step_phases'].items()}, 'gc', {k: d.get('gc', {}).get(k) for k in ('gen1', 'gen2')}, 'preemptions', d.get('preemptions'), 'kv_blocks', d.get('kv_blocks'))" \
        "$OUT/fd_health_${1}_$m.json" 2>/dev/null | sed "s/^/[$1 $m health] /"
    i=$((i + 1))
  done
  kill ${pids[@]}; wait ${pids[@]} 2>/dev/null
  sleep 2; pgrep -f "swiftlm.engine_process" > /dev/null && echo "WARNING: an engine process outlived its server"
}

profile() {  # shape model-dir: the in-process engine's step phases, unfused then fused
  [ "$PROFILE" = 1 ] || return
  cp $REPO/scripts/profile_engine.py /tmp/run/  # a copy outside the checkout: it imports the installed swiftlm
  for mode in unfused fused; do
    env PYTHONPATH=$SITE $(mode_env $mode) timeout 240 $PY /tmp/run/profile_engine.py \
        --model $2 --streams ${PROF_STREAMS:-1,64} --tokens 128 --ctx-size 1024 \
        --json "$OUT/fd_prof_${1}_$mode.json" 2>&1 | tail -4 | sed "s/^/[profile $1 $mode] /"
  done
}

table() {  # shape
  $PY - "$OUT" "$1" <<'PYEOF'
import glob, json, os, sys
out, shape = sys.argv[1], sys.argv[2]
rows = []
for f in sorted(glob.glob(os.path.join(out, f"fd_{shape}_*_n*.json"))):
    r = json.load(open(f))["results"]
    parts = os.path.basename(f)[3:-5].split("_")
    mode, n = parts[1:3]
    rep = int(parts[3][1:]) if len(parts) > 3 else 1
    rows.append({"mode": mode, "concurrency": int(n[1:]), "rep": rep, "output_tok_per_s": round(r["output_throughput"], 2),
                 "requests_ok": r["requests_ok"], "requests_failed": r["requests_failed"],
                 "ttft_ms_p50": r["ttft_ms"]["p50"], "itl_ms_p50": r["itl_ms"]["p50"], "itl_ms_p99": r["itl_ms"]["p99"],
                 "tpot_ms_mean": r["tpot_ms"]["mean"]})
prof = {}
for f in sorted(glob.glob(os.path.join(out, f"fd_prof_{shape}_*.json"))):
    prof[os.path.basename(f)[len(f"fd_prof_{shape}_"):-5]] = json.load(open(f))
json.dump({"shape": shape, "runs": rows, "profile": prof}, open(os.path.join(out, f"fused_{shape}.json"), "w"), indent=1)
for r in sorted(rows, key=lambda r: (r["concurrency"], r["mode"], r["rep"])):
    print(r["concurrency"], r["mode"], r["rep"], r["output_tok_per_s"], "ITL p50/p99", round(r["itl_ms_p50"], 2),
          round(r["itl_ms_p99"], 2), "TTFT p50", round(r["ttft_ms_p50"], 1))
PYEOF
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
for what in "$@"; do
  case $what in
    tiny) ckpt tiny 128 2 4 2 32 256; shape=tiny ;;
    1b) ckpt 1b 2048 16 32 8 64 8192; shape=1b ;;
    8b) ckpt 8b 4096 32 32 8 128 14336; shape=8b ;;
    *) echo "unknown shape $what"; continue ;;
  esac
  interleaved $shape "--model /tmp/m$shape"
  profile $shape /tmp/m$shape
  table $shape
  tar -czf $OUT/fused_${shape}.tgz -C $OUT $(cd $OUT && ls fd_*${shape}* 2>/dev/null) 2>/dev/null
  rm -f $OUT/fd_*${shape}*
done
