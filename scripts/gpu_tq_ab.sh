#!/usr/bin/env bash
# TurboQuant decode knobs A/B through `swiftlm serve` on the lent GPU: its CUDA kernel checks first, then one
# scripts/gpu_kv_formats.sh serve run per variant (8B Llama shape, one stream at LENGTHS), each variant's server
# started with its environment.  Carries: .whl/ and .gpu/tok (scripts/gpu_prepare.sh).
#   VARIANTS="base=16bit,k4v3 pps4=16bit,k4v3:SWIFTLM_TQ_PROGRAMS_PER_SM=4" bash scripts/gpu_tq_ab.sh
# A variant is NAME=FORMATS[:VAR=VALUE[:VAR=VALUE...]] (FORMATS includes 16bit, the baseline of each run).
# Results: $OUT/kv_formats_serve_ab_<NAME>.json, $OUT/tq_ab_checks.log (CHECKS: a pytest -k expression over
# tests/test_cuda_ext.py).  Env: LENGTHS (32000,131072), CTX (135168), STREAMS (1; 8: also 8 concurrent streams).
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
export PYTHONPATH=/tmp/site
rm -rf /tmp/run_ab && mkdir -p /tmp/run_ab && cp -r tests scripts pyproject.toml /tmp/run_ab/
(cd /tmp/run_ab && timeout ${CHECK_TIMEOUT:-180} python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/test_cuda_ext.py -k "${CHECKS:-turboquant and on_gpu}" 2>&1 | tail -40) | tee $OUT/tq_ab_checks.log
for v in ${VARIANTS:-"base=16bit,k4v3"}; do
  name=${v%%=*}; rest=${v#*=}; formats=${rest%%:*}
  envs=(); [ "$rest" != "$formats" ] && IFS=: read -ra envs <<< "${rest#*:}"
  echo "=== variant $name: formats $formats env ${envs[*]:-none}"
  env "${envs[@]}" CTX=${CTX:-135168} LENGTHS=${LENGTHS:-32000,131072} STREAMS=${STREAMS:-1} FORMATS=$formats \
      TAG=ab_$name TIMEOUT=${TIMEOUT:-200} NOTE="A/B variant $name: ${envs[*]:-defaults}" \
      bash $REPO/scripts/gpu_kv_formats.sh serve 2>&1 | grep -v "^checkpoint" | tail -12
  mv $OUT/kv_logs.tgz $OUT/kv_logs_$name.tgz 2>/dev/null
done
