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
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra "$@"
