#!/usr/bin/env bash
# Here (the CPU machine, with network): prepare what a lent GPU machine (no network, python 3.12 with torch,
# transformers, numpy, httpx, rich, uvloop, prometheus-client) needs to run swiftlm from this checkout:
#   .whl/      wheels of the dependencies its image lacks, at the versions of this checkout's .venv
#   .gpu/tok   the SmolLM2 tokenizer files (from the bundled GGUF) for make_checkpoint.py --tokenizer-from
# Both are git-ignored through .git/info/exclude; name them in the device call's `carry`, then
# `source scripts/gpu_site.sh` there installs the wheels and swiftlm into /tmp/site.
#   bash scripts/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p .git/info
for p in /.whl/ /.gpu/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
names="pydantic pydantic_core pydantic-settings annotated-types typing-inspection python-dotenv gguf starlette
       uvicorn httptools llguidance ${EXTRA_WHEELS:-}"
pins=()
for n in $names; do
  v=$($PY -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "gpu_prepare.sh: $n is not installed in .venv (scripts/install.sh --dev first)" >&2; exit 2; }
  pins+=("$n==$v")
done
rm -rf .whl && mkdir -p .whl
for pin in "${pins[@]}"; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$pin"
done
rm -rf .gpu/tok && mkdir -p .gpu
HF_HUB_OFFLINE=1 $PY scripts/make_checkpoint.py /tmp/swiftlm-gpu-tok --arch llama --hidden 64 --layers 1 --heads 2 \
  --kv-heads 1 --intermediate 128 --force > /dev/null
mkdir -p .gpu/tok && cp /tmp/swiftlm-gpu-tok/{config.json,tokenizer.json,tokenizer_config.json} .gpu/tok/
du -sh .whl .gpu | tr '\n' ' '; echo
