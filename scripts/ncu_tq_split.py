#!/usr/bin/env python3
"""One TurboQuant split pass (8B shape: 32 query / 8 KV heads, head_dim 128) on random codes, launched a few
times, for Nsight Compute to profile on the GPU machine:

    ncu -k regex:_tq_attn --launch-skip 2 --launch-count 1 --section ... python3 scripts/ncu_tq_split.py 131072 k4v3

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


def main() -> None:
    N, preset = int(sys.argv[1]), sys.argv[2]
    H, KVH, D = 32, 8, 128
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fmt = parse_turbo(preset, window=64)
    kcod = TurboCodec(D, fmt.key_bits, 1, dev, qjl=fmt.key_qjl)
    vcod = TurboCodec(D, fmt.value_bits, 2, dev)
    kb, vb = kcod.mse_bits, vcod.bits

    kp, vp = random_planes(kb, N, g, dev, KVH, D), random_planes(vb, N, g, dev, KVH, D)
    kn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
    vn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
    q = (torch.randn(H, D, device=dev) @ kcod.R.T) * D**-0.5
    for _ in range(4):
        tk._split_pass(
            q, kp, kn, kcod.centroids, kb, vp, vn, vcod.centroids, vb, None, H // KVH, None, None, True, None
        )
    torch.cuda.synchronize()
    k = tk._LAST["split"]
    print(f"{preset} N={N}: registers {getattr(k, 'n_regs', None)}, spills {getattr(k, 'n_spills', None)}")


if __name__ == "__main__":
    main()
