#!/usr/bin/env bash
# Install everything the tests need (from PyPI), then run pytest.  Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra "$@"
