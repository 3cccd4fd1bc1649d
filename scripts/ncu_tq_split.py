#!/usr/bin/env python3
"""One layer's decode attention (8B shape: 32 query / 8 KV heads, head_dim 128) on random data, launched a few
times, for Nsight Compute to profile on the GPU machine:

    ncu -k regex:_tq_ --launch-skip 2 --launch-count 1 --section ... python3 scripts/ncu_tq_split.py 131072 k4v3
    python3 scripts/ncu_tq_split.py N PRESET [split|full]   # full: q rotation, split pass and combine pass
    python3 scripts/ncu_tq_split.py N bf16                  # the 16-bit paged decode kernel, for comparison

(run it from scripts/, or a copy beside bench_tq_kernel.py, whose random planes it uses)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tq_kernel import random_planes  # noqa: E402

from swiftlm.backends.torch.kv_quant import TurboCodec  # noqa: E402
from swiftlm.cuda_ext import turboquant_kernels as tk  # noqa: E402
from swiftlm.turboquant.presets import parse_turbo  # noqa: E402

H, KVH, D = 32, 8, 128  # the Llama-3-8B attention shape


def bf16(N: int, dev: torch.device) -> None:
    from swiftlm.cuda_ext.paged_attention import default_splits, paged_decode_attention

    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(1, KVH, N, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.zeros(1, 1, device=dev, dtype=torch.int32)
    lens = torch.full((1,), N, device=dev, dtype=torch.int32)
    for _ in range(4):
        paged_decode_attention(q, kc, vc, bt, lens, D**-0.5, num_splits=default_splits(N, 1, KVH))


def main() -> None:
    N, preset = int(sys.argv[1]), sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "split"
    dev = torch.device("cuda")
    if preset == "bf16":
        bf16(N, dev)
        torch.cuda.synchronize()
        return
    g = torch.Generator(device=dev).manual_seed(0)
    fmt = parse_turbo(preset, window=64)
    kcod = TurboCodec(D, fmt.key_bits, 1, dev, qjl=fmt.key_qjl)
    vcod = TurboCodec(D, fmt.value_bits, 2, dev)
    kb, vb = kcod.mse_bits, vcod.bits

    kp, vp = random_planes(kb, N, g, dev, KVH, D), random_planes(vb, N, g, dev, KVH, D)
    kn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
    vn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
    q = (torch.randn(H, D, device=dev) @ kcod.R.T) * D**-0.5
    qb = torch.randn(H, D, device=dev, dtype=torch.bfloat16)
    rt = (kcod.R.T * D**-0.5).float().contiguous()
    dk = torch.randn(KVH, 64, D, device=dev, dtype=torch.bfloat16)
    dv = torch.randn_like(dk)
    for _ in range(4):
        if mode == "full":
            tk.tq_decode_attention_full(
                qb, tk.rotate_rows(qb, rt), kp, kn, kcod.centroids, kb, vp, vn, vcod.centroids, vb, vcod.R, dk, dv,
                D**-0.5, rep=H // KVH,
            )  # fmt: skip
        else:
            tk._split_pass(
                q, kp, kn, kcod.centroids, kb, vp, vn, vcod.centroids, vb, None, H // KVH, None, None, True, None
            )
    torch.cuda.synchronize()
    for name, k in tk._LAST.items():
        print(f"{preset} N={N} {name}: registers {getattr(k, 'n_regs', None)}, spills {getattr(k, 'n_spills', None)}")


if __name__ == "__main__":
    main()
