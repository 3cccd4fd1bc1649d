#!/usr/bin/env bash
# Idempotent install into .venv, with the extras this platform wants:
#   macOS arm64 -> mlx;  Linux with an NVIDIA GPU -> torch (CUDA);  Linux CPU -> pinned CPU torch + mlx[cpu].
# Usage: scripts/install.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
extras="mlx"
os="$(uname -s)"; arch="$(uname -m)"
if [ "$os" = "Darwin" ]; then
  extras="mlx"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras="torch,mlx"
  $PIP install -q torch
else
  # The CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
  $PIP install -q "torch==2.13.0"
  extras="torch,mlx"
fi
if [ "${1:-}" = "--dev" ]; then extras="$extras,vlm,dev"; fi
$PIP install -q -e ".[$extras]"
echo "installed swiftlm[$extras] into .venv ($os $arch)"
