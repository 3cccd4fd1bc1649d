#!/usr/bin/env python3
"""The paged decode-attention kernel (cuda_ext/paged_attention.py) over an FP8 (e4m3) KV cache against the 16-bit
cache, on a CUDA GPU: Llama-3-8B attention shape (H=32, KVH=8, D=128), block size 64 (the server's default), every
sequence at the full context, block tables shuffled, under CUDA-graph replay (triton.testing.do_bench_cudagraph, as
decode runs).  For each batch it times the 16-bit kernel at its defaults, then the FP8 kernel over a sweep of
block_n / splits (x1 or x2 the default count; --wide adds num_warps / num_stages), and prints GB/s of KV read as a fraction of
the GPU's memory bound; every configuration is checked against the fp32 reference first (max abs error).

    python3 scripts/bench_fp8_kv_kernel.py --json /tmp/fp8_kv_kernel.json [--batches 1,8,32] [--context 32768]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from swiftlm.cuda_ext.paged_attention import default_splits, paged_decode_attention, paged_decode_attention_ref

H, KVH, D, BS = 32, 8, 128, 64
BOUND_GBS = {"H100": 3350.0, "H200": 4800.0}


def shape(B: int, ctx: int, fp8: bool) -> dict:
    nb = ctx // BS
    g = torch.Generator(device="cuda").manual_seed(B)
    k = torch.randn(B * nb + 1, KVH, BS, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B * nb + 1, KVH, BS, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        kw = {"k_scale": torch.full((KVH,), 0.5, device="cuda"), "v_scale": torch.full((KVH,), 0.25, device="cuda")}
    bt = torch.randperm(B * nb, device="cuda", generator=g).to(torch.int32).view(B, nb)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return {"q": q, "k": k, "v": v, "bt": bt, "lens": lens, "kw": kw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--wide", action="store_true", help="also sweep num_warps 8 and num_stages 3, 4")
    a = ap.parse_args()
    name = torch.cuda.get_device_name()
    bound = next((v for k, v in BOUND_GBS.items() if k in name), 3350.0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B in map(int, a.batches.split(",")):
        base_splits = default_splits(a.context, B, KVH, sms)
        for fp8 in (False, True):
            s = shape(B, a.context, fp8)
            ref = paged_decode_attention_ref(s["q"], s["k"], s["v"], s["bt"], s["lens"], D**-0.5, **s["kw"]).float()
            out = torch.empty_like(s["q"])
            grid = [(None, None, None, 1)]
            if fp8:
                grid += list(
                    itertools.product(
                        (64, 128, 256), (4, 8) if a.wide else (4,), (None, 3, 4) if a.wide else (None,), (1, 2)
                    )
                )
            for bn, warps, stages, mult in grid:
                splits = base_splits * mult

                def fn(bn=bn, warps=warps, stages=stages, splits=splits, s=s, out=out):
                    return paged_decode_attention(
                        s["q"],
                        s["k"],
                        s["v"],
                        s["bt"],
                        s["lens"],
                        D**-0.5,
                        num_splits=splits,
                        out=out,
                        block_n=bn,
                        num_warps=warps,
                        num_stages=stages,
                        **s["kw"],
                    )

                try:
                    err = (fn().float() - ref).abs().max().item()
                    ms = triton.testing.do_bench_cudagraph(fn, rep=200)
                except Exception as exc:  # noqa: BLE001 - a configuration that does not compile (registers)
                    print(f"B={B} fp8={fp8} bn={bn} w={warps} st={stages} x{mult}: {type(exc).__name__}")
                    continue
                nbytes = B * a.context * KVH * D * 2 * (1 if fp8 else 2)
                gbs = nbytes / ms / 1e6
                r = {
                    "batch": B,
                    "context": a.context,
                    "kv": "fp8" if fp8 else "16bit",
                    "block_n": bn,
                    "num_warps": warps,
                    "num_stages": stages,
                    "splits": splits,
                    "ms": round(ms, 4),
                    "gb_s": round(gbs, 1),
                    "of_bound": round(gbs / bound, 3),
                    "max_abs_err": err,
                }
                rows.append(r)
                print(
                    f"B={B:3d} {r['kv']:5s} bn={bn} w={warps} st={stages} splits={splits:3d}  {ms * 1e3:8.1f} us "
                    f"{gbs:7.0f} GB/s ({gbs / bound:.0%})  err {err:.2e}",
                    flush=True,
                )
    best = {}
    for r in rows:
        k = (r["batch"], r["kv"])
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    print("\nbatch  kv     best us   GB/s  of bound  fp8 vs 16-bit (default config)")
    for (B, kv), r in sorted(best.items()):
        base = next(x for x in rows if x["batch"] == B and x["kv"] == "16bit")
        print(
            f"{B:5d}  {kv:5s} {r['ms'] * 1e3:8.1f} {r['gb_s']:6.0f} {r['of_bound']:8.0%}  {base['ms'] / r['ms']:.2f}x  "
            f"(bn={r['block_n']} w={r['num_warps']} st={r['num_stages']} splits={r['splits']})"
        )
    json.dump({"gpu": name, "bound_gb_s": bound, "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
