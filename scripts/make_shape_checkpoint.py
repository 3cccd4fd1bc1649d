#!/usr/bin/env python3
"""A large random-weight checkpoint of a given shape in seconds, for speed runs (values do not matter):
scripts/make_checkpoint.py writes the config, tokenizer, embeddings, head and ONE layer, then this script
repeats that layer's tensors under every other layer's names, one safetensors file per layer, and writes
the index: much faster for a large shape (a 32B one is 65 GB in bf16) than make_checkpoint.py --reuse-layers,
which converts and writes every layer from numpy.

    python scripts/make_shape_checkpoint.py /dev/shm/m32b --layers 64 -- --arch llama --hidden 5120 \
        --heads 40 --kv-heads 8 --head-dim 128 --intermediate 27648 --ctx 8192 --dtype bfloat16 --no-tie \
        --tokenizer-from .gpu/tok

Arguments after `--` go to make_checkpoint.py (without --layers).  Same on-disk format as a hub
checkpoint: config.json, model.safetensors.index.json, shards, tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    rest = argv[cut + 1 :]  # make_checkpoint.py's arguments
    out = Path(a.out)
    t0 = time.time()
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("make_checkpoint.py")),
            str(out),
            "--layers",
            "1",
            "--shard-mb",
            "100000",
            "--force",
            *rest,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    layer0 = {k: v for k, v in weight_map.items() if k.startswith("model.layers.0.")}
    tensors = {}
    for name, file in layer0.items():
        with safe_open(str(out / file), "pt") as f:
            tensors[name] = f.get_tensor(name)
    for i in range(1, a.layers):
        shard = f"layer-{i:05d}.safetensors"
        save_file(
            {k.replace("model.layers.0.", f"model.layers.{i}.", 1): t for k, t in tensors.items()},
            str(out / shard),
            metadata={"format": "pt"},
        )
        for k in layer0:
            weight_map[k.replace("model.layers.0.", f"model.layers.{i}.", 1)] = shard
    nbytes = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index_path.write_text(json.dumps({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, indent=1))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_hidden_layers"] = a.layers
    cfg_path.write_text(json.dumps(cfg, indent=1))
    print(f"{out}: {a.layers} layers, {nbytes / 1e9:.1f} GB in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
