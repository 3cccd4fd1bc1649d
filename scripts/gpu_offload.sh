#!/usr/bin/env bash
# --gpu-layers (partial offload) on the lent GPU machine: an 8B-shape llama (32 layers, bf16 random weights) with
# 32 (all, the plain path: CUDA graphs), 24, 16 and 8 layers on the GPU and the rest on the CPU (fp32; 16 also in
# bf16): load time, GPU memory held, bs1 decode tok/s, and greedy tokens vs the all-GPU run (equal, and the length
# of the common prefix).  With REAL=/path/to/model (e.g. the SmolLM2 GGUF) the same greedy check on real weights.
# Carries: .whl/ (wheels), .gpu/tok (SmolLM2 tokenizer files).  Results: $OUT/gpu_offload.json and .md.
#   bash scripts/gpu_offload.sh            # a few minutes on one GPU host (writing the checkpoint is a good part)
# Env: LAYERS (default "32 24 16 8"; empty: no 8B runs), TOKENS (decode tokens per run, default 32), REAL (optional model path).
set -uo pipefail
REPO=$(pwd)
source scripts/gpu_site.sh
mkdir -p /tmp/go && cd /tmp/go  # import the installed copy, not the source tree
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) threads, bf16 flags: $(lscpu | grep -o 'amx_bf16\|avx512_bf16' | sort -u | tr '\n' ' ')"
[ -z "${LAYERS-x}" ] || [ -f /tmp/m8b/config.json ] || /usr/bin/time -f "checkpoint 8b: %e s" python3 $REPO/scripts/make_checkpoint.py \
    /tmp/m8b --arch llama --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \
    --ctx 131072 --dtype bfloat16 --no-tie --shard-mb 4000 --reuse-layers --tokenizer-from $REPO/.gpu/tok \
    > /dev/null || exit 1
python3 -m pytest -p no:cacheprovider -q $REPO/tests/test_gpu_layers.py > "$OUT/test_gpu_layers_gpu.log" 2>&1
tail -3 "$OUT/test_gpu_layers_gpu.log"
python3 -m swiftlm.cli info --model /tmp/m8b --backend torch --gpu-layers 16 --ctx-size 2048 --json \
    > "$OUT/gpu_offload_info16.json" 2>&1
LAYERS=${LAYERS-32 24 16 8} TOKENS=${TOKENS:-32} REAL=${REAL:-} timeout ${TIMEOUT:-420} python3 - <<'PY'
import gc, json, os, time

import torch

from swiftlm import LLM, SamplingParams

OUT = os.environ["OUT"]
TOK = int(os.environ["TOKENS"])
PROMPT = "The history of the printing press begins"
rows: list[dict] = []


def run(model: str, n: int, dtype: str = "float32", tokens: int = TOK, gpu_dtype: str = "auto") -> dict:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(model, backend="torch", gpu_layers=n, offload_dtype=dtype, parallel=1, ctx_size=2048,
              prompt_cache_bytes=0, torch_dtype=gpu_dtype)
    load_s = time.perf_counter() - t0
    gpu_held = torch.cuda.memory_allocated()
    llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    stamps, ids = [], []
    for d in llm.stream(PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)):
        if d.token_ids:
            stamps.append((time.perf_counter(), len(ids), len(d.token_ids)))
            ids += d.token_ids
    (t_first, _, n_first), t_last = stamps[0], stamps[-1][0]
    tok_s = (len(ids) - n_first) / (t_last - t_first) if t_last > t_first else 0.0
    a = llm.engine.model.module.a
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"model": os.path.basename(model.rstrip("/")), "gpu_layers": min(n, a.layers), "layers": a.layers,
            "offload_dtype": dtype if n < a.layers else "-", "gpu_dtype": gpu_dtype, "load_s": round(load_s, 1),
            "gpu_bytes_after_load": gpu_held, "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
            "decode_tok_s": round(tok_s, 2), "tokens": ids}


def record(r: dict, ref: list[int] | None) -> None:
    ids = r.pop("tokens")
    if ref is not None:
        common = next((i for i, (x, y) in enumerate(zip(ids, ref)) if x != y), min(len(ids), len(ref)))
        r.update(equal_to_all_gpu=ids == ref, common_prefix=common)
    rows.append(r)
    print(json.dumps(r), flush=True)
    with open(f"{OUT}/gpu_offload.json", "w") as f:  # written as it goes: a timeout keeps what was measured
        json.dump(rows, f, indent=1)


layers = [int(x) for x in os.environ["LAYERS"].split()]
ref = None
for n in layers:
    r = run("/tmp/m8b", n)
    if ref is None:
        ref = list(r["tokens"])
        record(r, None)
    else:
        record(r, ref)
    if n == 16:
        record(run("/tmp/m8b", 16, "bfloat16"), ref)
real = os.environ.get("REAL")
if real:
    from swiftlm.registry import resolve

    cfg = resolve(real, allow_download=False).config
    L = int((cfg.get("text_config") or cfg).get("num_hidden_layers") or 0)
    for gd in os.environ.get("REAL_GPU_DTYPES", "auto float32").split():  # bf16 GPU, then fp32 on both sides
        rref = None
        for n in (L, 2 * L // 3, L // 3, 0):
            r = run(real, n, tokens=48, gpu_dtype=gd)
            if rref is None:
                rref = list(r["tokens"])
                record(r, None)
            else:
                record(r, rref)
lines = ["| model | GPU dtype | GPU layers | CPU layers (dtype) | GPU memory after load | bs1 decode tok/s | greedy = all-GPU "
         "(common prefix) |", "|---|---|---|---|---|---|---|"]
for r in rows:
    eq = "reference" if "equal_to_all_gpu" not in r else f"{'yes' if r['equal_to_all_gpu'] else 'no'} ({r['common_prefix']})"
    lines.append(f"| {r['model']} | {r.get('gpu_dtype', 'auto')} | {r['gpu_layers']} | {r['layers'] - r['gpu_layers']} ({r['offload_dtype']}) | "
                 f"{r['gpu_bytes_after_load'] / 2**30:.1f} GiB | {r['decode_tok_s']:.2f} | {eq} |")
open(f"{OUT}/gpu_offload.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
