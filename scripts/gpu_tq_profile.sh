#!/usr/bin/env bash
# On the lent GPU machine: where the TurboQuant decode-attention kernels spend their time.  The one-layer benchmark
# (scripts/bench_tq_kernel.py), then Nsight Compute on the split and combine passes (scripts/ncu_tq_split.py) and on
# the 16-bit paged kernel at the same length, and the split kernel's SASS opcode counts.  Everything lands in
# $OUT/tq_profile.tgz.   bash scripts/gpu_tq_profile.sh        (carry .whl; N=32768 PRESETS="k4v3 k3v2" BENCH=1)
set -uo pipefail
source scripts/gpu_site.sh
P=$OUT/tq_profile && mkdir -p $P
rm -rf /tmp/gt && mkdir -p /tmp/gt && cp scripts/bench_tq_kernel.py scripts/ncu_tq_split.py /tmp/gt/ && cd /tmp/gt
export TRITON_CACHE_DIR=/tmp/gt/tcache
if [ "${BENCH:-1}" = 1 ]; then
  timeout 240 python3 bench_tq_kernel.py --presets k4v3,k3v2 --contexts ${CONTEXTS:-32768,131072} \
    --json $P/tq_kernel.json > $P/tq_kernel.log 2>&1
  tail -40 $P/tq_kernel.log
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats
     --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters"
for n in ${N:-32768}; do
  for p in ${PRESETS:-k4v3 k3v2}; do
    timeout 150 $NCU --clock-control none -k regex:_tq_ --launch-skip 3 --launch-count 3 $SEC \
      python3 ncu_tq_split.py $n $p full > $P/ncu_${p}_$n.txt 2>&1
    echo "ncu $p $n rc $?"; grep -E "^  _tq|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Issue Slots Busy|Executed Ipc A" $P/ncu_${p}_$n.txt | head -60
  done
  timeout 150 $NCU --clock-control none -k regex:paged --launch-skip 2 --launch-count 2 $SEC \
    python3 ncu_tq_split.py $n bf16 > $P/ncu_bf16_$n.txt 2>&1
  echo "ncu bf16 $n rc $?"; grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per" $P/ncu_bf16_$n.txt | head -30
done
for c in $(grep -rl "_tq_attn_kernel" --include=*.cubin tcache 2>/dev/null | head -4); do
  b=$(basename $(dirname $c))
  cuobjdump --dump-sass $c > $P/sass_$b.txt 2>&1
  echo "== $c"; grep -oE "^\s+/\*[0-9a-f]+\*/\s+[A-Z0-9_.]+" $P/sass_$b.txt | awk '{print $2}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -25
done
cd $OUT && tar czf tq_profile.tgz tq_profile && rm -rf tq_profile
