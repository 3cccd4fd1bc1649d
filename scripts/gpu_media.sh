#!/usr/bin/env bash
# On the lent GPU machine (no network): the torch multimodal path on CUDA.  Carries .whl/ (pydantic
# & co., transformers 5.23, soundfile + cffi for the device's python 3.12) and .gpuck/tok (tokenizer
# files).  Results go to $OUT.
set -uo pipefail
source scripts/gpu_site.sh
rm -rf /tmp/gm && mkdir -p /tmp/gm && cp scripts/make_checkpoint.py scripts/make_multimodal.py scripts/bench_media.py \
  scripts/check_multimodal_device.py /tmp/gm/
cd /tmp/gm  # import the installed copy, not the source tree
python3 -c "import torch, transformers, swiftlm; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
python3 make_checkpoint.py /tmp/g4 --arch gemma4 --force --tokenizer-from "$OLDPWD/.gpuck/tok" | tail -1
python3 check_multimodal_device.py /tmp/g4 --json "$OUT/multimodal_gpu.json" 2>&1 | tee "$OUT/multimodal_gpu.log" | grep -v Warn | tail -8
python3 bench_media.py --model /tmp/g4 --backends torch --json "$OUT/media_bench_gpu.json" 2>&1 | tee "$OUT/media_bench_gpu.log" | tail -4
