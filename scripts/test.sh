#!/usr/bin/env bash
# Install everything the tests need (from PyPI), then run pytest.  Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
# Ruby, to syntax-check the Homebrew formula (tests/test_install.py): Debian's package, where apt-get works
if ! command -v ruby >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -qq ruby >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 &&
    apt-get install -y -qq ruby >/dev/null 2>&1; } || echo "test.sh: ruby could not be installed; the formula's Ruby syntax check is skipped" >&2
fi
# The suite writes up to ~13 GB under the temp dir at its peak (checkpoints, a wheelhouse, fresh venvs): say so early
# rather than fail half-way with "No space left on device".
free_gb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "${free_gb:-0}" -lt 16 ]; then
  echo "test.sh: only ${free_gb} GB free under ${TMPDIR:-/tmp}; the suite needs ~13 GB (old /tmp/pytest-of-* runs can go)" >&2
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra "$@"
