#!/usr/bin/env bash
# Tensor and data parallel runs on a lent 2-GPU machine (nvidia-h100-x2 or nvidia-h200-x2), no network.  Stages,
# in the order given:
#   env    the GPUs, how they are linked (nvidia-smi topo -m), torch / NCCL versions
#   tp8b   random bf16 Llama-3-8B shape served with --tensor-parallel 1 and 2 (--engine-process off for both:
#          TP=2 cannot use it, so the comparison is like for like): greedy tokens of 16 prompts one at a time
#          (scripts/greedy_probe.py), then `swiftlm bench serve` at N=1/64/128 (~40-token prompts, 128 new
#          tokens, EOS banned, prompt cache off); then, on the TP=2 server, one rank killed with 8 open
#          streams (scripts/tp_rank_kill.py): what the clients get and when the server exits
#   tpar   TP=1, TP=2 with NCCL only, TP=2 with the one-shot symmetric-memory all-reduce (8B; greedy + N=1/64);
#          TPAR_CFGS="tp1 tp2nccl tp2peer" for the peer-store sum fused into add + RMSNorm (SWIFTLM_TP_ALLREDUCE=peer),
#          TPAR_REPS=n rounds, TPAR_N128=1 adds N=128, TPAR_NO64=1 drops N=64, TPAR_NOPROBE1=1 skips TP=1's greedy
#          probe, TPAR_KILL=1 kills a rank of the tp2peer server at the end; cfg tp2peerpush: tp2peer with
#          SWIFTLM_TP_PEER_GEMV=0 (a switch this tree does not read: the push kernel always sends the sums)
#   tpprof torch.profiler on rank 0 of TP=2 at one stream, NCCL vs SWIFTLM_TP_ALLREDUCE=peer (kernel tables, gaps)
#   tp8b-ep  TP=1 once more with the engine in its own process (the default on CUDA), N=1/64/128
#   dp     scripts/bench_data_parallel.py --replicas 1,2 (N=128; 8 shared system prompts: prefix-affinity hits)
#   dpscale  where dp's ratio comes from: one replica at N=64/128/256, two at N=128/256 (256-token prompts),
#          the server process sampled by py-spy (carry py-spy's wheel in .whl) and top while two replicas serve
#   tp32bpar  the 32B shape (as tp32b) with TP=1, TP=2 NCCL-only and TP=2 with the peer-store sums
#   tp32b  a 32B shape (Qwen2.5-32B-like: hidden 5120, 64 layers, 40/8 heads, MLP 27648), TP=1 vs TP=2,
#          --parallel 64 --ctx-size 256 (65 GB of weights leave ~10 GB on one 80 GB H100), N=1 and N=64
#   bash scripts/gpu_issue26.sh env tp8b dp tp32b
# Needs carried: .whl and .gpu (scripts/gpu_prepare.sh).  Everything goes to /tmp/r26 and is packed into
# $OUT/r26.tgz after every stage (a call cut at its limit still returns what was measured); the table so
# far is $OUT/summary.txt.  NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the two others below).
#   LOCAL=1 PY=.venv/bin/python bash scripts/gpu_issue26.sh tiny    # a dry run of the mechanics on a CPU
set -uo pipefail
REPO=$(pwd)
if [ -z "${LOCAL:-}" ]; then
  PY=python3
  source scripts/gpu_site.sh                     # swiftlm + wheels -> /tmp/site, PYTHONPATH set
else
  PY=${PY:-.venv/bin/python}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=/tmp/r26
mkdir -p $R
cd $R  # never the checkout: `python -m swiftlm...` there would import the source tree (no swiftlm.backends)
exec > >(tee -a $R/run.log) 2>&1
pack() { "$PY" $REPO/scripts/gpu_issue26_summary.py $R > $R/summary.txt 2>&1; cp $R/summary.txt "$OUT/";
         tar czf "$OUT/r26.tgz" -C /tmp r26 2>/dev/null; }
TOK=$REPO/.gpu/tok

CK=/tmp; [ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -gt 100 ] 2>/dev/null && CK=/dev/shm
ckpt() {  # name hidden layers heads kv head_dim inter  (scripts/make_shape_checkpoint.py: one layer repeated)
  [ -d $CK/m$1 ] && return 0
  local t0=$SECONDS
  "$PY" $REPO/scripts/make_shape_checkpoint.py $CK/m$1 --layers $3 -- --arch llama --hidden $2 --heads $4 \
      --kv-heads $5 --head-dim $6 --intermediate $7 --ctx 8192 --dtype bfloat16 --no-tie --reuse-layers \
      --tokenizer-from $TOK > /dev/null || { echo "checkpoint $1 failed"; return 1; }
  echo "[ckpt $1] $((SECONDS - t0)) s, $(du -sh $CK/m$1 | cut -f1) in $CK"
}

SPID= PORT=
start_server() {  # name model serve-args...  -> SPID, PORT (returns 1 when it died or did not come up)
  local name=$1 model=$2; shift 2
  PORT=$((6000 + RANDOM % 2000))
  local t0=$SECONDS
  "$PY" -m swiftlm.cli serve --model $model --backend torch --port $PORT --prompt-cache-bytes 0 --max-queue 1024 \
      "$@" > $R/serve_$name.log 2>&1 &
  SPID=$!
  for i in $(seq 1 ${LOAD_TIMEOUT:-300}); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SPID 2>/dev/null || { echo "[$name] server died:"; tail -15 $R/serve_$name.log; return 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "[$name] not up in time"; kill -9 $SPID; return 1; }
  echo "[$name] up in $((SECONDS - t0)) s"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader 2>/dev/null | sed "s/^/[$name memory] /" \
      | tee $R/memory_$name.txt
  return 0
}

stop_server() {
  kill $SPID 2>/dev/null; timeout 60 tail --pid=$SPID -f /dev/null; kill -9 $SPID 2>/dev/null; wait $SPID 2>/dev/null
}

bench() {  # name N requests warmup
  timeout ${BENCH_TIMEOUT:-240} "$PY" -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$PORT" \
      --concurrency $2 --num-requests $3 --warmup $4 --workers $(( $2 >= 32 ? 4 : 1 )) \
      --prompt-tokens 40 --output-tokens 128 --ignore-eos --tokenizer $TOK --no-progress \
      --label "$1_n$2" --json $R/bench_$1_n$2.json 2>&1 | grep -E "output tok/s|ITL|TTFT|failed" | sed "s/^/[$1 N=$2] /"
}

probe() {  # name prompts
  timeout 300 "$PY" $REPO/scripts/greedy_probe.py --base-url "http://127.0.0.1:$PORT" --prompts $2 \
      --json $R/greedy_$1.json | sed "s/^/[$1 greedy] /"
}

for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  case $stage in
    env)
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
      nvidia-smi topo -m 2>&1 | head -8
      "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, torch.cuda.device_count(), 'GPUs')"
      env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)" | sort ;;
    tiny)  # LOCAL dry run: the same steps on a tiny model (gloo ranks on the CPU)
      ckpt tiny 128 2 4 2 32 256
      for tp in 1 2; do
        start_server tp${tp}_tiny $CK/mtiny --tensor-parallel $tp --parallel 8 --ctx-size 1024 --engine-process off || continue
        probe tp${tp}_tiny 4; bench tp${tp}_tiny 1 4 1; bench tp${tp}_tiny 8 16 4
        if [ $tp = 2 ]; then
          timeout 200 "$PY" $REPO/scripts/tp_rank_kill.py --base-url "http://127.0.0.1:$PORT" --server-pid $SPID \
              --json $R/rank_kill_tiny.json | cut -c1-600
          wait $SPID; echo "[tp2_tiny] server exit code $?" | tee $R/rank_kill_tiny_exit.txt
        else stop_server; fi
      done
      "$PY" $REPO/scripts/greedy_probe.py --compare $R/greedy_tp1_tiny.json $R/greedy_tp2_tiny.json \
          --json $R/greedy_equal_tiny.json ;;
    tp8b)
      ckpt 8b 4096 32 32 8 128 14336 || continue
      for tp in 1 2; do
        start_server tp${tp}_8b $CK/m8b --tensor-parallel $tp --parallel 128 --ctx-size 1024 --engine-process off \
          || continue
        probe tp${tp}_8b 16
        bench tp${tp}_8b 1 8 1; bench tp${tp}_8b 64 128 32; bench tp${tp}_8b 128 256 32
        if [ $tp = 2 ]; then
          timeout 200 "$PY" $REPO/scripts/tp_rank_kill.py --base-url "http://127.0.0.1:$PORT" --server-pid $SPID \
              --json $R/rank_kill_8b.json | cut -c1-600
          timeout 120 tail --pid=$SPID -f /dev/null; wait $SPID; echo "[tp2_8b] server exit code $?" \
              | tee $R/rank_kill_8b_exit.txt
          tail -4 $R/serve_tp2_8b.log
        else stop_server; fi
        pack
      done
      [ -f $R/greedy_tp2_8b.json ] && "$PY" $REPO/scripts/greedy_probe.py --compare $R/greedy_tp1_8b.json \
          $R/greedy_tp2_8b.json --json $R/greedy_equal_8b.json ;;
    tpar)  # the TP all-reduce (backends/torch/tp_allreduce.py): TP=1, then TP=2 with NCCL only, then TP=2 with the
           # one-shot symmetric-memory path; greedy tokens of the two TP=2 servers must be identical
      ckpt 8b 4096 32 32 8 128 14336 || continue
      for cfg in ${TPAR_CFGS:-tp1 tp2nccl tp2symm}; do
        tp=2; [ $cfg = tp1 ] && tp=1
        export SWIFTLM_TP_ALLREDUCE=${cfg#tp2} SWIFTLM_TP_PEER_GEMV=1; [ $cfg = tp1 ] && export SWIFTLM_TP_ALLREDUCE=nccl
        # tp2peerpush: the peer-store sums with the one-row GEMV's result sent by a push kernel of its own
        [ $cfg = tp2peerpush ] && export SWIFTLM_TP_ALLREDUCE=peer SWIFTLM_TP_PEER_GEMV=0
        start_server ${cfg}_8b $CK/m8b --tensor-parallel $tp --parallel 128 --ctx-size 1024 --engine-process off \
          || continue
        grep -h "all-reduce" $R/serve_${cfg}_8b.log | tail -2
        [ $cfg != tp1 ] || [ -z "${TPAR_NOPROBE1:-}" ] && probe ${cfg}_8b 16
        for rep in $(seq 1 ${TPAR_REPS:-1}); do
          bench ${cfg}_8b 1 8 1; [ -z "${TPAR_NO64:-}" ] && bench ${cfg}_8b 64 128 32
          [ -n "${TPAR_N128:-}" ] && bench ${cfg}_8b 128 256 32
          [ $rep -lt ${TPAR_REPS:-1} ] && for f in $R/bench_${cfg}_8b_n*.json; do mv $f ${f%.json}_r$rep.json; done
        done
        if [ $cfg = tp2peer ] && [ -n "${TPAR_KILL:-}" ]; then  # a rank killed with streams open, peer sums on
          timeout 200 "$PY" $REPO/scripts/tp_rank_kill.py --base-url "http://127.0.0.1:$PORT" --server-pid $SPID \
              --json $R/rank_kill_peer_8b.json | cut -c1-600
          timeout 120 tail --pid=$SPID -f /dev/null; wait $SPID; echo "[tp2peer_8b] server exit code $?" \
              | tee $R/rank_kill_peer_8b_exit.txt
        else stop_server; fi
        pack
      done
      unset SWIFTLM_TP_ALLREDUCE SWIFTLM_TP_PEER_GEMV
      [ -f $R/greedy_tp2peer_8b.json ] && [ -f $R/greedy_tp2nccl_8b.json ] && "$PY" $REPO/scripts/greedy_probe.py \
          --compare $R/greedy_tp2nccl_8b.json $R/greedy_tp2peer_8b.json --json $R/greedy_equal_peer_vs_nccl_8b.json
      [ -f $R/greedy_tp2peer_8b.json ] && [ -f $R/greedy_tp2peerpush_8b.json ] && "$PY" $REPO/scripts/greedy_probe.py \
          --compare $R/greedy_tp2peerpush_8b.json $R/greedy_tp2peer_8b.json --json $R/greedy_equal_gemv_vs_push_8b.json
      [ -f $R/greedy_tp2symm_8b.json ] && "$PY" $REPO/scripts/greedy_probe.py --compare $R/greedy_tp2nccl_8b.json \
          $R/greedy_tp2symm_8b.json --json $R/greedy_equal_symm_vs_nccl_8b.json
      [ -f $R/greedy_tp2symm_8b.json ] && "$PY" $REPO/scripts/greedy_probe.py --compare $R/greedy_tp1_8b.json \
          $R/greedy_tp2symm_8b.json --json $R/greedy_equal_symm_vs_tp1_8b.json ;;
    tpprof)  # rank 0 of TP=2 (8B, one stream, 128 tokens) under torch.profiler, NCCL vs the peer-store sums:
             # kernel tables ($R/prof_*.txt) and the device's idle gaps (scripts/trace_gaps.py)
      ckpt 8b 4096 32 32 8 128 14336 || continue
      mkdir -p /tmp/run && cp $REPO/scripts/profile_engine.py /tmp/run/  # (from the checkout it would import its sources)
      for m in nccl peer; do
        SWIFTLM_TP_ALLREDUCE=$m timeout 240 "$PY" /tmp/run/profile_engine.py --model $CK/m8b --tensor-parallel 2 \
            --streams 1,1 --tokens 128 --ctx-size 1024 --torch-profile $R/prof_tp2$m.txt --trace /tmp/trace_$m.json \
            --json $R/prof_tp2$m.json 2>&1 | tail -4
        "$PY" $REPO/scripts/trace_gaps.py /tmp/trace_$m.json --json $R/gaps_tp2$m.json 2>&1 | head -12
        rm -f /tmp/trace_$m.json; pack
      done ;;
    tp8b-ep)
      ckpt 8b 4096 32 32 8 128 14336 || continue
      start_server tp1ep_8b $CK/m8b --parallel 128 --ctx-size 1024 --engine-process on || continue
      bench tp1ep_8b 1 8 1; bench tp1ep_8b 64 128 32; bench tp1ep_8b 128 256 32; stop_server ;;
    dp)
      ckpt 8b 4096 32 32 8 128 14336 || continue
      timeout ${DP_TIMEOUT:-420} "$PY" $REPO/scripts/bench_data_parallel.py --model $CK/m8b --replicas 1,2 \
          --num-requests ${DP_REQUESTS:-256} --out $R/dp --load-timeout 300 --run-timeout 200 2>&1 | tail -8 ;;
    dpscale)  # where --data-parallel 2's ratio comes from: one replica at N=64 and N=128, two at N=128 and N=256
              # (random 256-token prompts, the completions endpoint, as `dp`), the server process's threads sampled
              # by py-spy and top while two replicas serve N=128
      ckpt 8b 4096 32 32 8 128 14336 || continue
      "$PY" -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('$REPO/.whl/py_spy-*.whl')[0]); \
open('/tmp/py-spy', 'wb').write(z.read([n for n in z.namelist() if n.endswith('scripts/py-spy')][0]))" \
          && chmod +x /tmp/py-spy
      dpbench() {  # name N requests
        timeout ${BENCH_TIMEOUT:-240} "$PY" -m swiftlm.cli bench serve --base-url "http://127.0.0.1:$PORT" \
            --endpoint completions --concurrency $2 --num-requests $3 --warmup 16 --workers 4 --prompt-tokens 256 \
            --output-tokens 128 --ignore-eos --temperature 0 --tokenizer $TOK --no-progress --label "$1_n$2" \
            --json $R/bench_$1_n$2.json 2>&1 | grep -E "output tok/s|ITL|TTFT|failed" | sed "s/^/[$1 N=$2] /"
      }
      for r in 1 2; do
        start_server dp${r} $CK/m8b --data-parallel $r --parallel 128 --ctx-size 2048 || continue
        if [ $r = 1 ]; then dpbench dp1 64 256; dpbench dp1 128 256; dpbench dp1 256 512; dpbench dp1b 64 256
        else
          (sleep 8; timeout 30 /tmp/py-spy record --pid $SPID --duration 8 --rate 250 --nonblocking --threads \
              --format raw -o $R/pyspy_dp2_parent.txt > /dev/null 2>&1) & SPY=$!
          (sleep 9; top -b -d 2 -n 3 -H > $R/top_dp2.txt 2>&1) & TOP=$!
          dpbench dp2 128 512; wait $SPY $TOP; dpbench dp2 256 512; dpbench dp2b 128 512
        fi
        stop_server; pack
      done ;;
    archs-bg)  # scripts/gpu_archs.py on the second GPU while tp32b's TP=1 uses the first; its
               # swiftlm is $ARCHS_SITE's (installed by the caller), waited for at the end
      [ -n "${ARCHS_ROOT:-}" ] && (cd /tmp && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=${ARCHS_SITE:-/tmp/site2}:/tmp/site \
          timeout ${ARCHS_TIMEOUT:-400} python3 $ARCHS_ROOT/scripts/gpu_archs.py --tokenizer-from $TOK \
          --out $R/gpu_archs.json > $R/gpu_archs.log 2>&1; echo "exit $?" >> $R/gpu_archs.log) &
      ARCHS_PID=$! ;;
    tp32bpar)  # the 32B shape: TP=1, TP=2 with NCCL only, TP=2 with the peer-store sums (N=1 and N=64, greedy)
      rm -rf $CK/m8b
      ckpt 32b 5120 64 40 8 128 27648 || continue
      for cfg in tp1 tp2nccl tp2peer; do
        tp=2; [ $cfg = tp1 ] && tp=1
        export SWIFTLM_TP_ALLREDUCE=${cfg#tp2}; [ $cfg = tp1 ] && export SWIFTLM_TP_ALLREDUCE=nccl
        start_server ${cfg}_32b $CK/m32b --tensor-parallel $tp --parallel 64 --ctx-size 256 --engine-process off \
          || continue
        probe ${cfg}_32b 8
        bench ${cfg}_32b 1 4 1; bench ${cfg}_32b 64 128 32
        stop_server; pack
      done
      unset SWIFTLM_TP_ALLREDUCE
      [ -f $R/greedy_tp2peer_32b.json ] && "$PY" $REPO/scripts/greedy_probe.py --compare \
          $R/greedy_tp2nccl_32b.json $R/greedy_tp2peer_32b.json --json $R/greedy_equal_peer_vs_nccl_32b.json
      [ -f $R/greedy_tp2peer_32b.json ] && "$PY" $REPO/scripts/greedy_probe.py --compare \
          $R/greedy_tp1_32b.json $R/greedy_tp2peer_32b.json --json $R/greedy_equal_32b.json ;;
    tp32b)
      rm -rf $CK/m8b
      ckpt 32b 5120 64 40 8 128 27648 || continue
      for tp in 1 2; do
        start_server tp${tp}_32b $CK/m32b --tensor-parallel $tp --parallel 64 --ctx-size 256 --engine-process off \
          || continue
        probe tp${tp}_32b 8
        bench tp${tp}_32b 1 4 1; bench tp${tp}_32b 64 128 32
        stop_server; pack
      done
      [ -f $R/greedy_tp2_32b.json ] && "$PY" $REPO/scripts/greedy_probe.py --compare $R/greedy_tp1_32b.json \
          $R/greedy_tp2_32b.json --json $R/greedy_equal_32b.json ;;
  esac
  pack
done
[ -n "${ARCHS_PID:-}" ] && { timeout 200 tail --pid=$ARCHS_PID -f /dev/null; tail -25 $R/gpu_archs.log; pack; }
cat $R/summary.txt
