#!/usr/bin/env python3
"""Batched decode attention on a CUDA GPU: the paged / slotted Triton kernel
(cuda_ext/paged_attention.py) against today's path in backends/torch/graphs.py
(``decode_batch_static``: gather ``K[slots, :, :L]`` and ``V[...]``, then masked SDPA).

Llama-3-8B attention shape (H=32, KVH=8, D=128, bf16), B in 1..128, context 256..32768, every
sequence at the full context.  Columns (median of triton.testing.do_bench, eager launches;
"graph" columns: CUDA-graph replay via do_bench_cudagraph, which is what decode runs under; the
baseline's graph column only for shapes of <= 1 GB of KV; note do_bench flushes L2 between calls,
do_bench_cudagraph does not, so tiny shapes (< 50 MB of KV) can read from L2 there):

- paged: block_size 16 pool, block tables shuffled, the default split count for this shape;
- slot:  the existing [S + 1, KVH, capacity, D] pool read in place (block = whole capacity);
- mixed: paged, lengths uniform in [1, context] (bytes counted for the lengths actually held);
- base:  gather + F.scaled_dot_product_attention(attn_mask, enable_gqa) as graphs.py does it;
- best splits: the fastest of num_splits in 1..64 under graph replay (does default_splits pick well?);
- bcast: the broadcast-multiply-sum inner product instead of tl.dot on the 16-row padded group;
- mixed %: e(ager) / g(raph) fraction of peak for the bytes actually held.

GB/s = KV bytes that must be read (B * len * KVH * D * 2 tensors * 2 bytes) / time, and that as
a fraction of 3.35 TB/s (H100 SXM HBM3).  Every shape also checks kernel (paged, slot) and
baseline against the fp32 reference on the GPU (max abs error).  ``--tune`` adds a small
block_n / num_warps / num_stages sweep on four shapes.

    python3 scripts/bench_paged_attention.py --json /tmp/paged_attn.json [--tune] [--quick]

Needs only torch, triton and numpy: the kernel file is loaded by path (the package is not installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("paged_attention", ROOT / "cuda_ext" / "paged_attention.py")
pa = importlib.util.module_from_spec(_spec)
sys.modules["paged_attention"] = pa
_spec.loader.exec_module(pa)

H, KVH, D = 32, 8, 128
DT = torch.bfloat16
PEAK = 3.35e12
BATCHES = [1, 8, 32, 64, 128]
CONTEXTS = [256, 1024, 4096, 32768]
LIMIT = 40e9
SCALE = D**-0.5


def ms(fn, graph=False, rep=100):
    if graph:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def err(a, b):
    return float((a.float() - b.float()).abs().max())


def try_ms(fn, **kw):
    try:
        return ms(fn, **kw)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def paged_cache(B, ctx, gen, BS=16, kvh=KVH):
    MB = ctx // BS
    NB = B * MB + 8
    k = torch.randn(NB, kvh, BS, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(NB, kvh, BS, D, device="cuda", dtype=DT, generator=gen)
    bt = torch.randperm(NB, device="cuda", generator=gen)[: B * MB].view(B, MB).to(torch.int32)
    return k, v, bt


def bench_shape(B, ctx, sm, args):
    gen = torch.Generator(device="cuda").manual_seed(B * 100003 + ctx)
    kv_bytes = B * ctx * KVH * D * 2 * 2
    row = dict(B=B, ctx=ctx, kv_gb=kv_bytes / 1e9)
    q = torch.randn(B, H, D, device="cuda", dtype=DT, generator=gen)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    ns = pa.default_splits(ctx, B, KVH, sm_count=sm)
    row["splits"] = ns
    small = kv_bytes <= 1e9

    # ---- slot layout: [B + 1, KVH, ctx, D]; the same tensors feed the baseline
    K = torch.randn(B + 1, KVH, ctx, D, device="cuda", dtype=DT, generator=gen)
    V = torch.randn(B + 1, KVH, ctx, D, device="cuda", dtype=DT, generator=gen)
    slots = torch.randperm(B, device="cuda", generator=gen)
    bt_slot = slots.view(B, 1).to(torch.int32)
    out = torch.empty(B, H, D, device="cuda", dtype=DT)
    f_slot = lambda: pa.paged_decode_attention(q, K, V, bt_slot, lens, SCALE, num_splits=ns, out=out)  # noqa: E731
    ref = pa.paged_decode_attention_ref(q, K, V, bt_slot, lens, SCALE)
    row["err_slot"] = err(f_slot(), ref)
    row["slot_ms"] = ms(f_slot)
    row["slot_graph_ms"] = ms(f_slot, graph=True)

    arange = torch.arange(ctx, device="cuda")
    pos = lens.long() - 1

    def f_base():
        valid = (arange.view(1, ctx) <= pos.view(B, 1)).view(B, 1, 1, ctx)
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), K[slots, :, :ctx], V[slots, :, :ctx], attn_mask=valid, enable_gqa=True
        ).squeeze(2)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base_mem0 = torch.cuda.memory_allocated()
    try:
        row["err_base"] = err(f_base(), ref)
        torch.cuda.synchronize()
        row["base_extra_gb"] = (torch.cuda.max_memory_allocated() - base_mem0) / 1e9
        row["base_ms"] = try_ms(f_base)
        if small:
            row["base_graph_ms"] = try_ms(f_base, graph=True)
    except torch.cuda.OutOfMemoryError:
        row["base_ms"] = None
        row["base_note"] = "OOM"
    del K, V, ref
    torch.cuda.empty_cache()

    # ---- paged layout: block_size 16, blocks shuffled
    k, v, bt = paged_cache(B, ctx, gen)
    f_paged = lambda n=ns, **kw: pa.paged_decode_attention(q, k, v, bt, lens, SCALE, num_splits=n, out=out, **kw)  # noqa: E731
    ref = pa.paged_decode_attention_ref(q, k, v, bt, lens, SCALE)
    row["err_paged"] = err(f_paged(), ref)
    row["paged_ms"] = ms(f_paged)
    row["paged_graph_ms"] = ms(f_paged, graph=True)
    try:
        row["err_bcast"] = err(f_paged(use_dot=False), ref)
        row["bcast_ms"] = ms(lambda: f_paged(use_dot=False))
    except Exception as exc:  # a config that does not compile on this GPU is a result, not a crash
        row["bcast_ms"], row["bcast_note"] = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    if not args.quick:
        sweep = {}
        for n in (1, 2, 4, 8, 16, 32, 64):
            if n == 1 or (ctx // n) >= 16:
                sweep[n] = ms(lambda n=n: f_paged(n), graph=True, rep=50)
        row["split_sweep_ms"] = sweep
        best = min(sweep, key=sweep.get)
        row["best_splits"], row["best_ms"] = best, sweep[best]
    # mixed lengths (the same pool / tables)
    mlens = torch.randint(1, ctx + 1, (B,), device="cuda", generator=gen, dtype=torch.int32)
    mixed_bytes = int(mlens.sum()) * KVH * D * 2 * 2
    f_mixed = lambda: pa.paged_decode_attention(q, k, v, bt, mlens, SCALE, num_splits=ns, out=out)  # noqa: E731
    row["err_mixed"] = err(f_mixed(), pa.paged_decode_attention_ref(q, k, v, bt, mlens, SCALE))
    row["mixed_ms"] = ms(f_mixed)
    row["mixed_graph_ms"] = ms(f_mixed, graph=True)
    row["mixed_graph_frac"] = mixed_bytes / (row["mixed_graph_ms"] * 1e-3) / PEAK
    row["mixed_gbps"] = mixed_bytes / (row["mixed_ms"] * 1e-3) / 1e9
    del k, v, bt, ref
    torch.cuda.empty_cache()

    for key in ("paged", "slot", "base", "paged_graph", "slot_graph", "base_graph"):
        t = row.get(f"{key}_ms")
        row[f"{key}_gbps"] = kv_bytes / (t * 1e-3) / 1e9 if t else None
        row[f"{key}_frac"] = kv_bytes / (t * 1e-3) / PEAK if t else None
    row["mixed_frac"] = row["mixed_gbps"] * 1e9 / PEAK
    if row.get("base_ms"):
        row["speedup_paged_vs_base"] = row["base_ms"] / row["paged_ms"]
        row["speedup_slot_vs_base"] = row["base_ms"] / row["slot_ms"]
    return row


def tune(sm, args):
    """block_n x num_warps x num_stages for the tl.dot path and a few broadcast-sum configs (GQA rep 4);
    then, for MHA (rep 1, H = KVH = 32), tl.dot on the 16-row padded query vs broadcast-sum."""
    res = []
    dot_cfgs = [
        dict(use_dot=True, block_n=bn, num_warps=w, num_stages=st)
        for bn in (32, 64, 128)
        for w in (2, 4, 8)
        for st in (2, 3)
    ]
    bc_cfgs = [dict(use_dot=False, block_n=bn, num_warps=w) for bn in (16, 32) for w in (4, 8)]
    mha_cfgs = [dict(use_dot=d_, block_n=bn, num_warps=w) for d_ in (True, False) for bn in (32, 64) for w in (4, 8)]
    plan = [(B, ctx, H, KVH, dot_cfgs + bc_cfgs) for B, ctx in [(1, 32768), (8, 4096), (64, 4096), (128, 1024)]]
    plan += [(B, ctx, 32, 32, mha_cfgs) for B, ctx in [(1, 32768), (32, 4096)]]
    for B, ctx, h, kvh, cfgs in plan:
        gen = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(B, h, D, device="cuda", dtype=DT, generator=gen)
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        k, v, bt = paged_cache(B, ctx, gen, kvh=kvh)
        ns = pa.default_splits(ctx, B, kvh, sm_count=sm)
        kv_bytes = B * ctx * kvh * D * 4
        ref = pa.paged_decode_attention_ref(q, k, v, bt, lens, SCALE)
        for cfg in cfgs:
            entry = dict(B=B, ctx=ctx, H=h, KVH=kvh, splits=ns, **cfg)
            try:
                f = lambda: pa.paged_decode_attention(q, k, v, bt, lens, SCALE, num_splits=ns, **cfg)  # noqa: E731
                entry["err"] = err(f(), ref)
                entry["ms"] = ms(f, rep=50)
                entry["graph_ms"] = ms(f, graph=True, rep=50)
                entry["frac"] = kv_bytes / (entry["graph_ms"] * 1e-3) / PEAK
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            res.append(entry)
            print("  tune", json.dumps(entry), flush=True)
        del k, v, bt
        torch.cuda.empty_cache()
    return res


def fmt(x, spec="{:.1f}"):
    return "-" if x is None else spec.format(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--tune", action="store_true", help="also sweep block_n / num_warps / num_stages")
    ap.add_argument("--quick", action="store_true", help="skip the per-shape num_splits sweep")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    sm = props.multi_processor_count
    print(
        f"{props.name}, {sm} SMs, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
        f"triton {triton.__version__}; H={H} KVH={KVH} D={D} bf16; peak {PEAK / 1e12:.2f} TB/s",
        flush=True,
    )
    rows, t0 = [], time.time()
    for B in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            need = 2 * B * ctx * KVH * D * 2 * 2  # the pool plus its gathered copy (or the second layout)
            if need > LIMIT:
                print(f"skip B={B} ctx={ctx}: needs {need / 1e9:.0f} GB", flush=True)
                continue
            row = bench_shape(B, ctx, sm, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    hdr = (
        f"{'B':>4} {'ctx':>6} {'KV GB':>6} {'ns':>3} | {'paged us':>9} {'%peak':>5} | {'slot us':>9} {'%peak':>5} | "
        f"{'mixed % e/g':>11} | {'base us':>9} {'%peak':>5} {'x base':>6} | {'best ns':>7} {'us':>8} | {'bcast us':>9} | "
        f"{'graph p/s/b us':>20} {'g %pk':>5} | {'max err p/s/b':>20}"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        g = "/".join(
            fmt(r.get(k) and r[k] * 1e3, "{:.0f}") for k in ("paged_graph_ms", "slot_graph_ms", "base_graph_ms")
        )
        e = "/".join(fmt(r.get(k), "{:.0e}") for k in ("err_paged", "err_slot", "err_base"))
        print(
            f"{r['B']:>4} {r['ctx']:>6} {r['kv_gb']:>6.2f} {r['splits']:>3} | "
            f"{r['paged_ms'] * 1e3:>9.1f} {100 * r['paged_frac']:>5.1f} | {r['slot_ms'] * 1e3:>9.1f} "
            f"{100 * r['slot_frac']:>5.1f} | {100 * r['mixed_frac']:>5.1f}/{100 * r['mixed_graph_frac']:<5.1f} | "
            f"{fmt(r.get('base_ms') and r['base_ms'] * 1e3):>9} {fmt(r.get('base_frac') and 100 * r['base_frac']):>5} "
            f"{fmt(r.get('speedup_paged_vs_base'), '{:.2f}'):>6} | {fmt(r.get('best_splits'), '{:d}'):>7} "
            f"{fmt(r.get('best_ms') and r['best_ms'] * 1e3):>8} | {fmt(r.get('bcast_ms') and r['bcast_ms'] * 1e3):>9} | "
            f"{g:>20} {fmt(r.get('paged_graph_frac') and 100 * r['paged_graph_frac']):>5} | {e:>20}"
        )
    result = dict(
        device=props.name,
        sm_count=sm,
        torch=torch.__version__,
        triton=triton.__version__,
        shape=dict(H=H, KVH=KVH, D=D, dtype="bfloat16"),
        peak_bytes_per_s=PEAK,
        rows=rows,
    )
    if args.tune:
        result["tune"] = tune(sm, args)
        best = {}
        for e in result["tune"]:
            key = (e["B"], e["ctx"], e["H"], e["KVH"], e["use_dot"])
            if "graph_ms" in e and (key not in best or e["graph_ms"] < best[key]["graph_ms"]):
                best[key] = e
        print("\nbest config per tuning shape and inner-product path (CUDA-graph replay times):")
        for (B, ctx, h, kvh, dot), e in best.items():
            print(
                f"  B={B} ctx={ctx} H={h} KVH={kvh} use_dot={dot}: {e['graph_ms'] * 1e3:.1f} us "
                f"({100 * e['frac']:.1f}% of peak) block_n={e['block_n']} num_warps={e['num_warps']} "
                f"num_stages={e.get('num_stages')}"
            )
    bad = [
        (r["B"], r["ctx"], k, r[k])
        for r in rows
        for k in ("err_paged", "err_slot", "err_mixed", "err_bcast")
        if r.get(k) is not None and not r[k] <= 0.05
    ]
    result["errors_over_0.05"] = bad
    print(f"\nkernel vs fp32 reference: {'all max abs errors <= 0.05 (bf16 output)' if not bad else bad}")
    print(f"total {time.time() - t0:.0f} s")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
