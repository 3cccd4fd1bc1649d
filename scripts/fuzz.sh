#!/usr/bin/env bash
# The long fuzz run: schemathesis against a real server on each backend with many examples per API operation
# (the suite runs the same test with 10).  Usage: scripts/fuzz.sh [EXAMPLES] [PYTEST_ARGS ...]   (default 200)
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-200}"; [ $# -gt 0 ] && shift
export SWIFTLM_FUZZ_EXAMPLES="$n" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra -n 0 tests/test_server.py -k schemathesis "$@"
