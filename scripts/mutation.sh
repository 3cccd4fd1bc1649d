#!/usr/bin/env bash
# Mutation testing of the core (mutmut): swiftlm/sampling.py, scheduler.py, detokenizer.py and swiftlm/chat/,
# against the fast unit tests named in pyproject.toml's [tool.mutmut].  Runs in a scratch copy of the checkout
# (mutmut writes its mutants/ next to the sources), prints the survival rate and writes it as JSON.
#
# Usage: scripts/mutation.sh [--max-survival PCT] [--out FILE] [--keep] [MUTANT_GLOB ...]
#   --max-survival PCT  exit 1 when more than PCT % of the tested mutants survive (default 20)
#   --out FILE          the JSON summary (default docs/results/mutation.json; "-" for none)
#   --keep              keep the scratch directory (its path is printed) for `mutmut results` / `mutmut show`
#   MUTANT_GLOB         only these mutants, e.g. 'swiftlm.detokenizer*' (default: every mutant)
# Survival = (survived + no tests) / (killed + survived + no tests + timeout + suspicious + segfault); a mutant that
# no selected test reaches counts as a survivor.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
max=20; out="docs/results/mutation.json"; keep=0; globs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --max-survival) max="${2:?--max-survival needs a percentage}"; shift ;;
    --out) out="${2:?--out needs a file}"; shift ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "mutation.sh: unknown option '$1' (see scripts/mutation.sh --help)" >&2; exit 2 ;;
    *) globs+=("$1") ;;
  esac
  shift
done
PY="$ROOT/.venv/bin/python"
MUTMUT="$ROOT/.venv/bin/mutmut"
[ -x "$MUTMUT" ] || { echo "mutation.sh: mutmut is not installed in .venv (scripts/install.sh --dev)" >&2; exit 2; }
work="$(mktemp -d "${TMPDIR:-/tmp}/swiftlm-mutation.XXXXXX")"
[ "$keep" = 1 ] || trap 'rm -rf "$work"' EXIT
cp -r swiftlm tests scripts pyproject.toml "$work"/
find "$work" -name __pycache__ -prune -exec rm -rf {} +
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
t0=$(date +%s)
(cd "$work" && "$MUTMUT" run ${globs[@]+"${globs[@]}"} 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -n 5)
(cd "$work" && "$MUTMUT" export-cicd-stats >/dev/null)
secs=$(( $(date +%s) - t0 ))
rc=0
"$PY" - "$work/mutants/mutmut-cicd-stats.json" "$out" "$max" "$secs" "$work" <<'PYEOF' || rc=$?
import json, subprocess, sys
stats_path, out, max_pct, secs, work = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
s = json.load(open(stats_path))
killed = s["killed"] + s["timeout"] + s["segfault"]
alive = s["survived"] + s["no_tests"] + s["suspicious"]
tested = killed + alive
rate = 100.0 * alive / tested if tested else 100.0
res = subprocess.run([sys.executable.replace("python", "mutmut"), "results"], cwd=work, capture_output=True, text=True)
survivors = sorted(ln.strip() for ln in res.stdout.splitlines()  # `results` lists every mutant not killed
                   if ln.strip().endswith((": survived", ": no tests", ": suspicious")))
by_module = {}
for ln in survivors:
    mod = ln.split(".x")[0].split("__mutmut")[0]
    mod = ".".join(mod.split(".")[:-1]) if "." in mod else mod
    by_module[mod] = by_module.get(mod, 0) + 1
summary = {"tool": "mutmut", "modules": ["swiftlm/sampling.py", "swiftlm/scheduler.py", "swiftlm/detokenizer.py",
           "swiftlm/chat/"], "tested": tested, "killed": killed, "survived": s["survived"], "no_tests": s["no_tests"],
           "suspicious": s["suspicious"], "timeout": s["timeout"], "skipped": s["skipped"],
           "survival_pct": round(rate, 2), "max_survival_pct": max_pct, "seconds": secs,
           "survivors": survivors}
print(f"mutation: {tested} mutants tested, {killed} killed, {alive} survived "
      f"(survived {s['survived']}, no tests {s['no_tests']}, suspicious {s['suspicious']}) in {secs} s")
print(f"mutation survival rate: {rate:.1f}% (limit {max_pct:g}%)")
if out != "-":
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
sys.exit(0 if rate <= max_pct else 1)
PYEOF
[ "$keep" = 0 ] || echo "mutation.sh: kept $work (cd there and run $MUTMUT results / show NAME)"
exit $rc
