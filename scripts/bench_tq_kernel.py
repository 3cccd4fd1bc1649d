#!/usr/bin/env python3
"""TurboQuant and affine ``kv_bits`` decode-attention kernels against the 16-bit paged decode kernel, one layer.

    python scripts/bench_tq_kernel.py [--contexts 32768,131072] [--batch 1] [--json out.json]
    python scripts/bench_tq_kernel.py --presets "" --kv-bits 8,4 [--group 64]   # the affine kernel only

For the Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128) and each context, the
time of one layer's decode attention for one row per sequence: the 16-bit cache through
``paged_decode_attention`` (bf16) and each TurboQuant preset through ``tq_decode_attention_full``
(split pass over packed codes + combine pass with a 64-row 16-bit window), both replayed from a CUDA
graph (no launch overhead), median of several replays.  Bytes are the fewest the kernel must read
(codes, norms, the window, the query); the ceiling is a device-to-device copy measured here
(bytes read + written over time).  Ratios are against the 16-bit kernel timed in the same run.

``--kv-bits``: the affine kernel (``cuda_ext/affine_kv_kernels.py``: split pass over the codes with
fp16 scales / biases per group, combine pass attending one 16-bit row, the graph step's new row),
and the fused encoder writing that row's codes (what a graphed decode step adds per layer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, KVH, D = 32, 8, 128
WINDOW = 64  # 16-bit rows beside the codes (--window; a static cache's buffer holds 160 with the default preset)


def random_planes(bits: int, N: int, g, dev, kvh: int = KVH, d: int = D) -> list:
    """Random packed code planes [kvh, N, d * w / 8] (uint8) for ``bits``-bit codes (swiftlm.turboquant.packing)."""
    import torch

    from swiftlm.cuda_ext.tq_codes import _PLANES

    return [
        torch.randint(0, 256, (kvh, N, d * w // 8), generator=g, device=dev, dtype=torch.uint8)
        for w in _PLANES[bits]
        if w
    ]


def timed(fn, reps: int = 20, inner: int = 10) -> float:
    """Median seconds per call of ``fn`` captured in a CUDA graph ``inner`` times."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(out)


def copy_bandwidth() -> float:
    import torch

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), reps=10, inner=5)
    return 2 * x.numel() / t


def affine_row(q, N: int, B: int, bits: int, group: int, t16: float, bw: float, g) -> dict:
    """One affine format at N rows: attention (split + combine with the step's 16-bit row) and the encoder."""
    import torch

    from swiftlm.cuda_ext.affine_kv_kernels import affine_decode_attention, affine_encode_rows, affine_split_pass

    dev = q.device
    G = D // group
    seqs = []
    for _ in range(B):
        codes = [
            torch.randint(0, 256, (KVH, N + 1, D * bits // 8), generator=g, device=dev, dtype=torch.uint8)
            for _ in range(2)
        ]
        sc = [(torch.rand(KVH, N + 1, G, generator=g, device=dev) * 0.05).half() for _ in range(2)]
        bi = [(torch.randn(KVH, N + 1, G, generator=g, device=dev)).half() for _ in range(2)]
        row = torch.randn(2, KVH, 1, D, device=dev, dtype=torch.bfloat16)
        seqs.append((codes, sc, bi, row))
    n_rows = torch.tensor([N], device=dev)
    scale = D**-0.5

    def run():
        for b, (codes, sc, bi, row) in enumerate(seqs):
            affine_decode_attention(
                q[b],
                codes[0],
                sc[0],
                bi[0],
                codes[1],
                sc[1],
                bi[1],
                bits,
                group,
                scale,
                rep=H // KVH,
                n_rows=n_rows,
                dk=row[0],
                dv=row[1],
            )

    t = timed(run)
    codes, sc, bi, row = seqs[0]
    parts = {
        "split pass (one sequence)": timed(
            lambda: affine_split_pass(
                q[0], codes[0], sc[0], bi[0], codes[1], sc[1], bi[1], bits, group, scale, H // KVH, n_rows
            )
        ),
        "encode the new row (one sequence)": timed(
            lambda: affine_encode_rows(
                row[0], row[1], codes[0], sc[0], bi[0], codes[1], sc[1], bi[1], bits, group, n_rows
            )
        ),
    }
    name = f"kv_bits={bits}/g{group}"
    for what, tv in parts.items():
        print(f"        {name}: {what}: {tv * 1e6:8.1f} us", flush=True)
    nbytes = B * (2 * KVH * N * (D * bits // 8 + 4 * G) + 2 * KVH * D * 2)
    print(
        f"{N:>7} {name:<10} {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.0f} GB/s  {nbytes / t / bw:5.1%}  "
        f"{t16 / t:5.2f}x bf16",
        flush=True,
    )
    return {
        "context": N,
        "batch": B,
        "format": name,
        "us": t * 1e6,
        "bytes": nbytes,
        "parts_us": {k: v * 1e6 for k, v in parts.items()},
        "GB_s": nbytes / t / 1e9,
        "of_copy_bw": nbytes / t / bw,
        "vs_16bit": t16 / t,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--presets", default="k4v3,k3v2,k3qjl-v3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--splits", default="", help="split counts per KV head to time the split pass with")
    ap.add_argument("--sweep", default="", help="block_n:num_warps:num_stages,... variants timed per preset")
    ap.add_argument("--kv-bits", default="", help="affine kv_bits formats to time (e.g. 8,4)")
    ap.add_argument("--group", type=int, default=64, help="affine group size")
    ap.add_argument("--window", type=int, default=64, help="16-bit rows the combine pass attends")
    ap.add_argument("--whole-splits", default="", help="split counts per KV head to time the whole path with")
    ap.add_argument("--windows", default="", help="16-bit window rows to time the whole path with (e.g. 0,64,160)")
    ap.add_argument("--maxnreg", default="", help="register caps to time the split pass with (e.g. 96,112)")
    a = ap.parse_args()
    global WINDOW
    WINDOW = a.window
    import torch

    from swiftlm.backends.torch.kv_quant import TurboCodec
    from swiftlm.cuda_ext import turboquant_kernels as tk
    from swiftlm.cuda_ext.paged_attention import default_splits, paged_decode_attention
    from swiftlm.cuda_ext.turboquant_kernels import rotate_rows, tq_decode_attention_full
    from swiftlm.turboquant.presets import parse_turbo

    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}; device-to-device copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for N in [int(x) for x in a.contexts.split(",")]:
        B = a.batch
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(B, KVH, N, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.arange(B, device=dev, dtype=torch.int32)[:, None]
        lens = torch.full((B,), N, device=dev, dtype=torch.int32)
        ns = default_splits(N, B, KVH)
        t16 = timed(lambda: paged_decode_attention(q, kc, vc, bt, lens, D**-0.5, num_splits=ns))
        b16 = 2 * B * KVH * N * D * 2
        rows.append(
            {
                "context": N,
                "batch": B,
                "format": "bf16 (paged kernel)",
                "us": t16 * 1e6,
                "bytes": b16,
                "GB_s": b16 / t16 / 1e9,
                "of_copy_bw": b16 / t16 / bw,
                "vs_16bit": 1.0,
            }
        )
        print(f"{N:>7} bf16        {t16 * 1e6:8.1f} us  {b16 / t16 / 1e9:7.0f} GB/s  {b16 / t16 / bw:5.1%}", flush=True)
        del kc, vc
        for bits in [int(x) for x in filter(None, a.kv_bits.split(","))]:
            rows.append(affine_row(q, N, B, bits, a.group, t16, bw, g))
        for name in filter(None, a.presets.split(",")):
            fmt = parse_turbo(name, window=WINDOW)
            kcod = TurboCodec(D, fmt.key_bits, 1, dev, qjl=fmt.key_qjl)
            vcod = TurboCodec(D, fmt.value_bits, 2, dev)
            kb, vb = kcod.mse_bits, vcod.bits
            seqs = []
            for _ in range(B):
                kp, vp = random_planes(kb, N, g, dev), random_planes(vb, N, g, dev)
                kn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
                vn = (torch.rand(KVH, N, generator=g, device=dev) * 4 + 1).half()
                ks = random_planes(1, N, g, dev)[0] if fmt.key_qjl else None
                kr = (torch.rand(KVH, N, generator=g, device=dev)).half() if fmt.key_qjl else None
                dk = torch.randn(KVH, WINDOW, D, device=dev, dtype=torch.bfloat16)
                dv = torch.randn_like(dk)
                seqs.append((kp, vp, kn, vn, ks, kr, dk, dv))
            qf = q.float()
            scale = D**-0.5
            rt = (kcod.R.T * scale).float().contiguous()  # what the cache's rows pass to rotate_rows
            st = (kcod.S.T * scale).float().contiguous() if fmt.key_qjl else None

            def run(bn=None, sp=None, rows=None):
                for b, (kp, vp, kn, vn, ks, kr, dk, dv) in enumerate(seqs):
                    if rows is not None:  # a window of another size (rows of a larger buffer, all valid)
                        dk, dv = dks[:, :rows], dvs[:, :rows]
                    qjl = (rotate_rows(q[b], st), ks, kr, kcod.qjl_scale) if fmt.key_qjl else None
                    tq_decode_attention_full(
                        q[b],
                        rotate_rows(q[b], rt),
                        kp,
                        kn,
                        kcod.centroids,
                        kb,
                        vp,
                        vn,
                        vcod.centroids,
                        vb,
                        vcod.R,
                        dk,
                        dv,
                        scale,
                        rep=H // KVH,
                        qjl=qjl,
                        block_n=bn,
                        splits=sp,
                    )

            dks = torch.randn(KVH, 256, D, device=dev, dtype=torch.bfloat16)
            dvs = torch.randn_like(dks)

            t = timed(run)
            kp, vp, kn, vn, ks, kr, dk, dv = seqs[0]
            qjl0 = ((qf[0] @ kcod.S.T) * scale, ks, kr, kcod.qjl_scale) if fmt.key_qjl else None
            split = lambda: tk._split_pass(
                (qf[0] @ kcod.R.T) * scale,
                kp,
                kn,
                kcod.centroids,
                kb,
                vp,
                vn,  # noqa: E731
                vcod.centroids,
                vb,
                None,
                H // KVH,
                qjl0,
                None,
                True,
                None,
            )
            parts = {"split pass (one sequence)": timed(split)}
            import os

            os.environ["SWIFTLM_TQ_PRMT"] = "0"
            parts["split pass, select trees, no prmt"] = timed(split)
            os.environ.pop("SWIFTLM_TQ_PRMT")
            tk._TUNE.update(DIAG=2)
            parts["split pass, no value side (diagnostic: wrong result)"] = timed(split)
            tk._TUNE.clear()
            os.environ["SWIFTLM_TQ_SWAR"] = "0"
            parts["split pass, byte tiles (no SWAR words; 4-bit: prmt_asm)"] = timed(split)
            tk._TUNE.update(TRANS=1)
            parts["split pass, no SWAR, code tiles as first operands (TRANS)"] = timed(split)
            os.environ.pop("SWIFTLM_TQ_SWAR")
            parts["split pass, code tiles as first operands (TRANS)"] = timed(split)
            tk._TUNE.update(TRANS=0)
            parts["split pass, code tiles as second operands (TRANS=0)"] = timed(split)
            tk._TUNE.clear()
            split()
            regs = {k: (getattr(v, "n_regs", None), getattr(v, "n_spills", None)) for k, v in tk._LAST.items()}
            for cfg in (
                {"SB": 0},
                {"BLOCK_R": 32},
                {"BLOCK_R": 64},
                {"BLOCK_R": 64, "num_warps": 8},
                {"BLOCK_R": 32, "DS": 64},
                {"BLOCK_R": 64, "DS": 64, "num_warps": 8},
                {"BLOCK_R": 32, "DS": 128, "num_warps": 8},
                {"BLOCK_R": 32, "DS": 16},
            ):
                tk._COMBINE.clear()
                tk._COMBINE.update(cfg)
                try:
                    parts[f"whole, combine {cfg}"] = timed(run)
                except Exception as exc:  # a variant that does not compile
                    print(f"        combine {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            tk._COMBINE.clear()
            run()
            regs.update(
                {
                    f"{k} (after run)": (getattr(v, "n_regs", None), getattr(v, "n_spills", None))
                    for k, v in tk._LAST.items()
                }
            )
            print(f"        {name}: registers / spills per thread: {regs}", flush=True)
            for sp in filter(None, a.splits.split(",")):
                sp = int(sp)
                parts[f"split pass, {sp} splits per KV head"] = timed(
                    lambda: tk._split_pass(
                        (qf[0] @ kcod.R.T) * scale,
                        kp,
                        kn,
                        kcod.centroids,
                        kb,
                        vp,
                        vn,
                        vcod.centroids,
                        vb,
                        None,
                        H // KVH,
                        qjl0,
                        None,
                        True,
                        sp,
                    )
                )
            for what, tv in parts.items():
                print(f"        {name}: {what}: {tv * 1e6:8.1f} us", flush=True)
            for sp in filter(None, a.whole_splits.split(",")):  # the whole path (split + combine) at a split count
                parts[f"whole, {sp} splits per KV head"] = timed(lambda: run(sp=int(sp)))
                print(
                    f"        {name}: whole, {sp} splits per KV head: {parts[f'whole, {sp} splits per KV head'] * 1e6:8.1f} us",
                    flush=True,
                )
            for w in filter(None, a.windows.split(",")):  # the combine's 16-bit rows: what the window costs
                parts[f"whole, {w} window rows"] = timed(lambda: run(rows=int(w)))
                print(
                    f"        {name}: whole, {w} window rows: {parts[f'whole, {w} window rows'] * 1e6:8.1f} us",
                    flush=True,
                )
            for mr in filter(None, a.maxnreg.split(",")):  # register caps: more programs resident per SM
                tk._TUNE.clear()
                tk._TUNE.update(maxnreg=int(mr))
                try:
                    parts[f"split pass, maxnreg={mr}"] = timed(split)
                    split()
                    print(
                        f"        {name}: maxnreg={mr}: registers / spills {getattr(tk._LAST['split'], 'n_regs', None)}"
                        f" / {getattr(tk._LAST['split'], 'n_spills', None)}",
                        flush=True,
                    )
                except Exception as exc:
                    print(f"        {name}: maxnreg={mr}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                tk._TUNE.clear()
            for v in filter(None, a.sweep.split(",")):
                bn, nw, st = (int(x) for x in v.split(":"))
                tk._TUNE.clear()
                tk._TUNE.update(num_warps=nw, num_stages=st)
                try:
                    tv = timed(lambda: run(bn))
                    print(f"        sweep {name} block_n={bn} warps={nw} stages={st}: {tv * 1e6:8.1f} us", flush=True)
                except Exception as exc:  # a variant that does not compile (registers, shared memory)
                    print(f"        sweep {name} {v}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                tk._TUNE.clear()
            nbytes = B * (
                KVH * N * (D * (kb + vb + (1 if fmt.key_qjl else 0)) // 8 + 4 + (2 if fmt.key_qjl else 0))
                + 2 * KVH * WINDOW * D * 2
            )
            rows.append(
                {
                    "context": N,
                    "batch": B,
                    "format": name,
                    "us": t * 1e6,
                    "bytes": nbytes,
                    "parts_us": {k: v * 1e6 for k, v in parts.items()},
                    "GB_s": nbytes / t / 1e9,
                    "of_copy_bw": nbytes / t / bw,
                    "vs_16bit": t16 / t,
                }
            )
            print(
                f"{N:>7} {name:<10} {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.0f} GB/s  {nbytes / t / bw:5.1%}  "
                f"{t16 / t:5.2f}x bf16",
                flush=True,
            )
            del seqs
        torch.cuda.empty_cache()
    print(f"\n{'context':>8} | {'format':<22} | {'us':>8} | {'GB/s':>6} | {'of copy':>7} | vs bf16")
    for r in rows:
        print(
            f"{r['context']:>8} | {r['format']:<22} | {r['us']:8.1f} | {r['GB_s']:6.0f} | {r['of_copy_bw']:7.1%} | "
            f"{r['vs_16bit']:.2f}x"
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(0),
                    "copy_GB_s": bw / 1e9,
                    "shape": {"heads": H, "kv_heads": KVH, "head_dim": D, "window": WINDOW},
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
