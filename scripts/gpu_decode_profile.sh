#!/usr/bin/env bash
# Where a one-stream decode step's device time goes on the GPU, and A/B of what changes it (batch size 1):
#   gemv   the decode matmuls at one row, cuBLAS vs the Triton kernel of cuda_ext/gemv.py (scripts/bench_gemv.py)
#   1b 8b  the in-process engine (scripts/profile_engine.py, no HTTP) at N streams in each of $MODES, runs
#          alternating between modes (REPS rounds), then one run of the last mode under torch.profiler (kernel
#          table by device time) and its timeline's idle gaps (scripts/trace_gaps.py).
# Modes: base (SWIFTLM_GEMV=0 SWIFTLM_PAGED_ATTENTION=0: cuBLAS + SDPA), paged (cuBLAS, attention by the
# Triton decode kernel), gemv (Triton GEMV, SDPA), nopdl (the default without programmatic dependent launch,
# SWIFTLM_PDL=0), new (the default).
#
#   bash scripts/gpu_decode_profile.sh gemv 1b 8b      # on the lent GPU; carry .whl .gpu
# Results in $OUT: gemv.json, dp_<shape>.tgz (per-run JSON, profiler tables).
set -uo pipefail
REPO=$(pwd)
PY=${PY:-python3}
source scripts/gpu_site.sh
SITE=/tmp/site
NS=${NS:-"1"}
MODES=${MODES:-"base paged gemv new"}
REPS=${REPS:-2}
mkdir -p /tmp/run && cd /tmp/run
cp $REPO/scripts/profile_engine.py $REPO/scripts/bench_gemv.py /tmp/run/

ckpt() {  # name hidden layers heads kv head_dim inter
  [ -d /tmp/m$1 ] && return
  env PYTHONPATH=$SITE $PY $REPO/scripts/make_checkpoint.py /tmp/m$1 --arch llama --hidden $2 --layers $3 --heads $4 \
      --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 --dtype bfloat16 --no-tie --shard-mb 4000 \
      --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
}

mode_env() {
  case $1 in
    base) echo "SWIFTLM_GEMV=0 SWIFTLM_PAGED_ATTENTION=0" ;;
    paged) echo "SWIFTLM_GEMV=0" ;;
    gemv) echo "SWIFTLM_PAGED_ATTENTION=0" ;;
    nopdl) echo "SWIFTLM_PDL=0" ;;
    *) echo "SWIFTLM_GEMV=1" ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
for what in "$@"; do
  case $what in
    gemv) timeout 400 $PY /tmp/run/bench_gemv.py --json $OUT/gemv.json 2>&1 | grep -v "^  " ; continue ;;
    1b) ckpt 1b 2048 16 32 8 64 8192 ;;
    8b) ckpt 8b 4096 32 32 8 128 14336 ;;
    *) echo "unknown $what"; continue ;;
  esac
  streams=$(echo $NS | tr ' ' ',')
  for r in $(seq 1 $REPS); do
    for m in $MODES; do
      env $(mode_env $m) timeout 200 $PY /tmp/run/profile_engine.py --model /tmp/m$what --streams $streams \
          --tokens 128 --ctx-size 1024 --json $OUT/dp_${what}_${m}_r$r.json 2>&1 | tail -n +2 | grep -v "^ *N " \
          | sed "s/^/[$what $m r$r] /"
    done
  done
  last=${MODES##* }
  env $(mode_env $last) timeout 200 $PY /tmp/run/profile_engine.py --model /tmp/m$what --streams ${NS%% *} --tokens 128 \
      --ctx-size 1024 --torch-profile $OUT/dp_${what}_prof.txt --json $OUT/dp_${what}_prof.json \
      --trace /tmp/run/trace_$what.json 2>&1 | tail -1
  $PY $REPO/scripts/trace_gaps.py /tmp/run/trace_$what.json --json $OUT/dp_${what}_gaps.json
  awk '/Self CUDA %/{c++} c==2' $OUT/dp_${what}_prof.txt | cut -c1-58,118-200 | head -18
  (cd $OUT && tar czf dp_$what.tgz dp_${what}_* && rm -f dp_${what}_*)
done
