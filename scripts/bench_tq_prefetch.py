#!/usr/bin/env python3
"""Does the TurboQuant split pass leave memory bandwidth that the next weights could use?  A decode step's
shape on the GPU, 32 layers of (attention over the cache -> o_proj -> gate_up -> SiLU * up -> down -> the next
layer's qkv), the Llama-3-8B matrices (random bf16, one copy per layer: each GEMV reads HBM as in a real
step), one CUDA graph per variant, median of replays:

- ``bf16``: the 16-bit paged decode kernel over a 16-bit cache (the baseline the issue compares with);
- ``<preset> pf=0``: the TurboQuant kernels as committed;
- ``<preset> pf=M``: the split pass also asks L2 for the first ``--pf-mb`` MB of that layer's o_proj weight
  (``turboquant_kernels.PREFETCH``; M: 1 every program evict_last, 2 every program normal, 3 / 4 the later
  splits only, normal / evict_last).

At 128K the split pass is bound by its arithmetic and shared memory, not by DRAM (Nsight, docs/benchmarks.md
session 19): what it reads into L2 for the o_proj GEMV is read from HBM during time the step spends anyway.

    python scripts/bench_tq_prefetch.py --contexts 32768,131072 --presets k4v3,k3v2 --modes 1,2,3,4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, KVH, D, HID, INTER, LAYERS = 32, 8, 128, 4096, 14336, 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--presets", default="k4v3,k3v2")
    ap.add_argument("--modes", default="1,2,3,4")
    ap.add_argument("--pf-mb", default="33.5", help="MB of o_proj to prefetch (comma list: each a variant)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from swiftlm.backends.torch.kv_quant import TurboCodec
    from swiftlm.cuda_ext import turboquant_kernels as tk
    from swiftlm.cuda_ext.decode_kernels import silu_mul
    from swiftlm.cuda_ext.gemv import linear_small_m
    from swiftlm.cuda_ext.paged_attention import default_splits, paged_decode_attention
    from swiftlm.turboquant.presets import parse_turbo

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_tq_kernel import random_planes

    dev = torch.device("cuda")
    torch.manual_seed(0)
    g = torch.Generator(device=dev).manual_seed(0)
    L = a.layers
    W = [dict(qkv=torch.randn(6144, HID, device=dev, dtype=torch.bfloat16) * 0.02,
              o=torch.randn(HID, HID, device=dev, dtype=torch.bfloat16) * 0.02,
              gu=torch.randn(2 * INTER, HID, device=dev, dtype=torch.bfloat16) * 0.02,
              down=torch.randn(HID, INTER, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(L + 1)]
    wbytes = sum(w.numel() * 2 for k, w in W[0].items()) * L
    x0 = torch.randn(1, HID, device=dev, dtype=torch.bfloat16)

    def mlp(i: int, att: torch.Tensor) -> torch.Tensor:
        y = linear_small_m(att.reshape(1, HID), W[i]["o"])
        d = linear_small_m(silu_mul(linear_small_m(y, W[i]["gu"])), W[i]["down"])
        return linear_small_m(d, W[i + 1]["qkv"])

    def timed(step) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            step()
        gr.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(a.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            gr.replay()
            e1.record()
            torch.cuda.synchronize()
            out.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(out)  # us per step

    rows = []
    print(f"# {torch.cuda.get_device_name(0)}; {L} layers, weights {wbytes / 1e9:.2f} GB", flush=True)
    base_w = timed(lambda: [mlp(i, x0) for i in range(L)])
    print(f"weights only (no attention): {base_w:9.1f} us/step", flush=True)
    rows.append({"variant": "weights only", "us": base_w})
    for N in [int(x) for x in a.contexts.split(",")]:
        q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(1, KVH, N, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.zeros(1, 1, device=dev, dtype=torch.int32)
        lens = torch.full((1,), N, device=dev, dtype=torch.int32)
        ns = default_splits(N, 1, KVH)
        t16 = timed(lambda: [mlp(i, paged_decode_attention(q, kc, vc, bt, lens, D ** -0.5, num_splits=ns))
                             for i in range(L)])
        print(f"{N:>7} bf16            {t16:9.1f} us/step  1.000x", flush=True)
        rows.append({"context": N, "variant": "bf16", "us": t16, "vs_bf16": 1.0})
        del kc, vc
        torch.cuda.empty_cache()
        for name in filter(None, a.presets.split(",")):
            fmt = parse_turbo(name, window=64)
            kcod = TurboCodec(D, fmt.key_bits, 1, dev, qjl=fmt.key_qjl)
            vcod = TurboCodec(D, fmt.value_bits, 2, dev)
            kb, vb = kcod.mse_bits, vcod.bits
            kp, vp = random_planes(kb, N, g, dev), random_planes(vb, N, g, dev)
            kn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
            vn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
            dk = torch.randn(KVH, 64, D, device=dev, dtype=torch.bfloat16)
            dv = torch.randn_like(dk)
            n_rows = torch.tensor([N], device=dev)
            rt = (kcod.R.T * D ** -0.5).float().contiguous()
            q1 = q[0]

            def step():
                for i in range(L):
                    if tk.PREFETCH.get("mode"):
                        tk.PREFETCH["target"] = W[i]["o"]
                    att = tk.tq_decode_attention_full(q1, tk.rotate_rows(q1, rt), kp, kn, kcod.centroids, kb, vp, vn,
                                                      vcod.centroids, vb, vcod.R, dk, dv, D ** -0.5, rep=H // KVH,
                                                      n_rows=n_rows)
                    mlp(i, att)
            variants = [(0, None)] + [(int(m), float(mb)) for m in filter(None, a.modes.split(","))
                                      for mb in a.pf_mb.split(",")] + [("trig", None), (0, "again")]
            for mode, mb in variants:
                tk.PREFETCH.clear()
                tk._TUNE.clear()
                if mode == "trig":  # the split pass lets its dependents launch at its start, not after its loop
                    tk._TUNE.update(TRIG=1)
                elif mode:
                    tk.PREFETCH.update(mode=mode, bytes=int(mb * 1e6))
                try:
                    t = timed(step)
                except Exception as exc:  # a variant that does not compile or run
                    print(f"{N:>7} {name} pf={mode}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                finally:
                    tk.PREFETCH.clear()
                    tk._TUNE.clear()
                label = (f"{name} dependents at the split's start" if mode == "trig" else
                         f"{name} pf={mode}" + (f" {mb:g} MB" if mode else "") + (" (again)" if mb == "again" else ""))
                print(f"{N:>7} {label:<22} {t:9.1f} us/step  {t16 / t:5.3f}x bf16", flush=True)
                rows.append({"context": N, "variant": label, "preset": name, "mode": mode, "pf_mb": mb, "us": t,
                             "vs_bf16": t16 / t})
            del kp, vp, kn, vn
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "layers": L, "rows": rows},
                                           indent=1))


if __name__ == "__main__":
    main()
