#!/usr/bin/env bash
# Run the tests.  Installs everything the suite needs (from PyPI and Debian), then runs pytest.
#
# Usage: scripts/test.sh [--fast] [PYTEST_ARGS ...]
#   (no flag)  the whole suite, two pytest-xdist workers (files kept together: module-scoped servers are shared)
#   --fast     the fast tier: every test that starts no server process, loads no torch/MLX model, runs no
#              subprocess, interpreter or fresh venv (markers in tests/tiers.py); skips the install when .venv
#              already has swiftlm; a few minutes.  Run it after each change.
# Extra arguments go to pytest (e.g. -k, -m server, -x, -n 0 to run in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
if [ "$fast" = 1 ] && [ -x .venv/bin/python ] && .venv/bin/python -c 'import swiftlm, pytest, xdist' 2>/dev/null; then
  :
else
  bash scripts/install.sh --dev
fi
if [ "$fast" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # Ruby, to syntax-check the Homebrew formula (tests/test_install.py); Chromium, for the chat page's browser test
  # (tests/test_webui.py: Playwright drives the system Chromium; its own browser download is not used).
  need=()
  command -v ruby >/dev/null 2>&1 || need+=(ruby)
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  if [ ${#need[@]} -gt 0 ]; then
    apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 &&
      apt-get install -y -qq "${need[@]}" >/dev/null 2>&1; } ||
      echo "test.sh: could not install ${need[*]} with apt-get; the tests that need them will fail" >&2
  fi
fi
# The suite writes up to ~13 GB under the temp dir at its peak (checkpoints, a wheelhouse, fresh venvs): say so early
# rather than fail half-way with "No space left on device".
free_gb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$fast" = 0 ] && [ "${free_gb:-0}" -lt 16 ]; then
  echo "test.sh: only ${free_gb} GB free under ${TMPDIR:-/tmp}; the suite needs ~13 GB (old /tmp/pytest-of-* runs can go)" >&2
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two xdist workers on two cores, each starting servers and engines: one OpenMP thread per process.  With more,
# OpenMP's spinning threads of one process take the cores another is waiting for, and every token slows down.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode is written and reused (Python's default; __pycache__/ is ignored by git).  Where the environment sets
# PYTHONDONTWRITEBYTECODE, each of the suite's several hundred Python subprocesses (servers, the CLI, scripts,
# engine and rank processes) compiled every swiftlm module it imports again, ~0.3 s a start: ~10% of the time of
# the subprocess-heavy files.  (scripts/mutation.sh keeps it set: it rewrites sources within the same second.)
unset PYTHONDONTWRITEBYTECODE
if [ "$fast" = 1 ]; then
  fast_expr="$(cd tests && ../.venv/bin/python -c 'import tiers; print(tiers.FAST_EXPR)')"
  exec .venv/bin/python -m pytest -q -ra -n 2 --durations=25 -m "$fast_expr" "$@"
fi
# --no-loadscope-reorder: the files go to the workers in collection order, which tests/conftest.py makes longest
# first (tests/file_order.py); xdist's own order (most tests first) left files of one or two long tests for last.
exec .venv/bin/python -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder --durations=25 "$@"
