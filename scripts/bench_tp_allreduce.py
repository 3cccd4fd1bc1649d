#!/usr/bin/env python3
"""The latency of one tensor-parallel sum + residual add + RMSNorm inside a CUDA graph, two GPUs: a graph of
``--calls`` (default 64: one 8B decode step) of

- nccl:  ``dist.all_reduce`` then the ``add_rmsnorm`` kernel (the fused decode step's default),
- symm:  torch's one-shot all-reduce over symmetric memory then ``add_rmsnorm``,
- peer:  ``PeerSum.add_rmsnorm`` (cuda_ext/peer_sum.py: peer stores + the sum inside the add + RMSNorm),
- local: ``add_rmsnorm`` alone (no communication: the floor),

for rows x hidden in ``--shapes``; microseconds per call (median of ``--reps`` graph replays), and whether
peer's result equals nccl's bit for bit.  Prints a table; ``--json`` writes it.

    python scripts/bench_tp_allreduce.py --json docs/results/tp_allreduce_graph.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics


def _rank(rank: int, a: argparse.Namespace, port: int, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    from swiftlm.backends.torch import tp_allreduce as tp
    from swiftlm.cuda_ext.decode_kernels import add_rmsnorm

    dt = torch.bfloat16
    rows_out = []
    impls = {}
    os.environ["SWIFTLM_TP_ALLREDUCE"] = "peer"
    impls["peer"] = tp.setup(dev, dt) == "peer" and tp._peer
    os.environ["SWIFTLM_TP_ALLREDUCE"] = "symm"
    impls["symm"] = tp.setup(dev, dt) == "symm_mem" and tp._impl
    tp._impl = tp._peer = None
    for shape in a.shapes.split(","):
        R, N = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cpu").manual_seed(3)
        x0 = torch.randn(R, N, generator=g).to(dev, dt)
        w = torch.randn(N, generator=g).to(dev, dt)
        y = (torch.randn(R, N, generator=torch.Generator().manual_seed(10 + rank)) * 0.01).to(dev, dt)
        x = x0.clone()

        def call(mode: str) -> torch.Tensor:
            if mode == "nccl":
                s = y.clone()
                dist.all_reduce(s)
                return add_rmsnorm(x, s, w, 1e-5)
            if mode == "symm":
                return add_rmsnorm(x, impls["symm"](y.clone()), w, 1e-5)
            if mode == "peer":
                return impls["peer"].add_rmsnorm(x, y, w, 1e-5)
            return add_rmsnorm(x, y, w, 1e-5)

        row = {"rows": R, "hidden": N}
        outs = {}
        for mode in ("local", "nccl", "symm", "peer"):
            if mode in impls and not impls[mode]:
                row[mode + "_us"] = None
                continue
            x.copy_(x0)
            outs[mode] = call(mode).clone()  # eager, once: the result to compare
            x.copy_(x0)
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                for _ in range(2):
                    call(mode)
            torch.cuda.current_stream().wait_stream(st)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(a.calls):
                    call(mode)
            times = []
            for _ in range(a.reps):
                dist.barrier()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3 / a.calls)
            row[mode + "_us"] = round(statistics.median(times), 2)
            del graph
        row["peer_equals_nccl"] = bool("peer" in outs and torch.equal(outs["peer"], outs["nccl"]))
        rows_out.append(row)
    if rank == 0:
        q.put(
            {
                "gpu": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "calls_per_graph": a.calls,
                "reps": a.reps,
                "dtype": "bfloat16",
                "rows": rows_out,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x4096,1x5120,8x4096,64x4096,128x4096")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(_rank, args=(a, port, q), nprocs=2, join=True)
    res = q.get()
    print(f"{'rows x hidden':>14} {'local':>7} {'nccl':>7} {'symm':>7} {'peer':>7}  us per call; peer == nccl")
    for r in res["rows"]:
        print(
            f"{r['rows']:>6} x {r['hidden']:<6} "
            + " ".join(f"{r[m + '_us']:>7}" for m in ("local", "nccl", "symm", "peer"))
            + f"  {r['peer_equals_nccl']}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
