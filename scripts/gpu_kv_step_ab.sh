#!/usr/bin/env bash
# Decode-step variants A/B on the lent GPU, in process (scripts/profile_kv_step.py: one streamed request at LENGTH,
# the kernels on the step's critical path and the inter-token p50), one process per variant started with its
# environment; then, with SERVE=1, the fastest variant and 16-bit through `swiftlm serve` (scripts/gpu_kv_formats.sh).
#   VARIANTS="base nw4:SWIFTLM_TQ_COMBINE=num_warps=4" FORMATS=k4v3 bash scripts/gpu_kv_step_ab.sh   (carry .whl .gpu)
# A variant is NAME[:VAR=VALUE...].  Results: $OUT/kv_step_ab_<NAME>.json, $OUT/kv_step_ab.log.
# LENGTH (131,100): the codes then span the tiles a 131,072-token serve run decodes over (2,047-2,048 of 64 rows;
# at 131,000 they are 2,045, which 66 splits share evenly whatever the range layout).
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
[ -f /tmp/m8b/config.json ] || /usr/bin/time -f "checkpoint 8b: %e s" python3 $REPO/scripts/make_checkpoint.py \
    /tmp/m8b --arch llama --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \
    --ctx ${CTX:-135168} --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok > /dev/null || exit 1
for v in ${VARIANTS:-base}; do
  name=${v%%:*}; envs=(); [ "$v" != "$name" ] && IFS=: read -ra envs <<< "${v#*:}"
  echo "=== variant $name: ${envs[*]:-defaults}" | tee -a $OUT/kv_step_ab.log
  env "${envs[@]}" timeout ${TIMEOUT:-200} python3 $REPO/scripts/profile_kv_step.py --model /tmp/m8b \
      --prompt-tokens ${LENGTH:-131100} --formats ${FORMATS:-k4v3} --top 8 --json $OUT/kv_step_ab_$name.json 2>&1 \
      | grep -v "^USDT\|profiler_st\|Warn\|warn" | tee -a $OUT/kv_step_ab.log
done
best=$(python3 - "$OUT" ${VARIANTS:-base} <<'PY'
import json, sys
out, names = sys.argv[1], [v.split(":")[0] for v in sys.argv[2:]]
itl = {}
for n in names:
    try:
        d = json.load(open(f"{out}/kv_step_ab_{n}.json"))
        itl[n] = max(f["itl_ms_p50"] for f in d["formats"].values())
    except (OSError, ValueError, KeyError):
        pass
print(min(itl, key=itl.get) if itl else "")
for n, t in sorted(itl.items(), key=lambda kv: kv[1]):
    print(f"# {n}: inter-token p50 {t:.3f} ms", file=sys.stderr)
PY
)
echo "=== fastest: ${best:-none}" | tee -a $OUT/kv_step_ab.log
if [ "${SERVE:-0}" = 1 ] && [ -n "$best" ]; then
  for v in ${VARIANTS:-base}; do [ "${v%%:*}" = "$best" ] && bv=$v; done
  envs=(); [ "$bv" != "$best" ] && IFS=: read -ra envs <<< "${bv#*:}"
  env "${envs[@]}" CTX=${CTX:-135168} LENGTHS=${SERVE_LENGTHS:-131072} STREAMS=1 FORMATS=${SERVE_FORMATS:-16bit,k4v3,k3v2} \
      TAG=ab_$best TIMEOUT=${SERVE_TIMEOUT:-300} NOTE="fastest step variant $best: ${envs[*]:-defaults}" \
      bash $REPO/scripts/gpu_kv_formats.sh serve 2>&1 | grep -v "^checkpoint\|^\[" | tail -8
  mv $OUT/kv_logs.tgz $OUT/kv_logs_$best.tgz 2>/dev/null
fi
