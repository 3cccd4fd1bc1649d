#!/usr/bin/env python3
"""Compiler report for the TurboQuant split kernel on a GPU: registers, spills, shared memory, the
layout conversions and shared-memory traffic in its TTGIR, and the load widths in its PTX.
    python scripts/tq_kernel_ir.py [--preset k4v3] [--out DIR]"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k4v3")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from swiftlm.backends.torch.kv_quant import TurboCodec
    from swiftlm.cuda_ext import turboquant_kernels as tk
    from swiftlm.turboquant.presets import parse_turbo

    fmt = parse_turbo(a.preset, window=64)
    D, KVH, H, N = 128, 8, 32, 4096
    dev = torch.device("cuda")
    kc, vc = TurboCodec(D, fmt.key_bits, 1, dev, qjl=fmt.key_qjl), TurboCodec(D, fmt.value_bits, 2, dev)
    planes = lambda bits: [
        torch.randint(0, 256, (KVH, N, D * w // 8), device=dev, dtype=torch.uint8)  # noqa: E731
        for w in tk._PLANES[bits]
        if w
    ]
    kp, vp = planes(kc.mse_bits), planes(vc.bits)
    kn = torch.rand(KVH, N, device=dev).half()
    vn = torch.rand(KVH, N, device=dev).half()
    q = torch.randn(H, D, device=dev)
    tk._split_pass(
        q, kp, kn, kc.centroids, kc.mse_bits, vp, vn, vc.centroids, vc.bits, None, H // KVH, None, None, True, None
    )
    torch.cuda.synchronize()
    cache = tk._tq_attn_kernel.device_caches if hasattr(tk._tq_attn_kernel, "device_caches") else None
    kernels = []
    if cache:
        for dc in cache.values():
            kernels += list(dc[0].values())
    else:
        kernels = list(tk._tq_attn_kernel.cache[0].values())
    for k in kernels:
        asm = k.asm
        ttgir, ptx = asm.get("ttgir", ""), asm.get("ptx", "")
        print(
            f"regs={k.n_regs} spills={k.n_spills} shared={k.metadata.shared} warps={k.metadata.num_warps} "
            f"stages={k.metadata.num_stages}"
        )
        for pat in (
            "convert_layout",
            "local_alloc",
            "local_load",
            "local_store",
            "tt.gather",
            "tt.dot",
            "ttng.warp_group_dot",
            "tt.load",
            "tt.reshape",
            "tt.join",
            "tt.trans",
        ):
            print(f"  ttgir {pat}: {ttgir.count(pat)}")
        for pat in (
            "ld.global.v4",
            "ld.global.v2",
            "ld.global.b32",
            "ld.global.b8",
            "ld.global.u8",
            "ld.global.b16",
            "ld.global.b64",
            "ld.shared",
            "st.shared",
            "ld.local",
            "st.local",
            "mma.sync",
            "wgmma",
            "shfl",
            "ld.global.nc",
            "ld.global",
        ):
            print(f"  ptx {pat}: {len(re.findall(re.escape(pat), ptx))}")
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / f"tq_split_{a.preset}.ttgir").write_text(ttgir)
            (Path(a.out) / f"tq_split_{a.preset}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
