"""The tensor-parallel all-reduce (``parallel.RowParallelLinear``, ``parallel.VocabParallelEmbedding``, the fused
decode step's ``out_proj_add_rmsnorm``).  ``SWIFTLM_TP_ALLREDUCE`` picks it on CUDA:

- ``peer`` (the default with two ranks): the sums after ``o_proj`` / ``down_proj`` of a decode step are peer
  stores into the other GPU's memory, added inside the residual add + RMSNorm that follows
  (``PeerSum``, ``swiftlm.cuda_ext.peer_sum``); every other all-reduce is NCCL's.  A sum through peer stores is
  shorter than NCCL's all-reduce kernel followed by ``add_rmsnorm``, and the Triton kernels keep their
  programmatic dependent launches (``scripts/bench_tp_allreduce.py`` times the three paths; the tensor-parallel
  figures are on the benchmark page, docs/benchmarks.md).  Checked against NCCL bit for
  bit on every rank at load; any disagreement or error there falls back to NCCL with a log line.
- ``nccl``: NCCL's all-reduce everywhere (gloo on the CPU, always).
- ``symm``: a *one-shot* all-reduce over symmetric memory (``torch.distributed._symmetric_memory``) for
  messages up to ``MAX_BYTES``: every rank copies its partial sums into a buffer that all ranks map, a barrier
  over the buffer's signal pad, then each rank reads the others' buffers over NVLink and adds them (peer
  loads only: no NVLink multicast, which this project leaves off).  Slower than ``peer`` for two ranks; kept
  for other topologies (with more ranks a ring's latency grows, a one-shot's does not).
  Messages larger than the buffer, sizes that are not a multiple of 8 elements, other dtypes and CPU tensors
  take ``dist.all_reduce``.

For two ranks a sum of two values is the same whichever rank adds them, so every path gives NCCL's bits.  Every
rank takes the same path for the same call (the choice depends only on the message's shape and dtype), so the
collectives stay matched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_BYTES = int(os.environ.get("SWIFTLM_TP_SYMM_BYTES", str(4 << 20)))  # 4 MiB: decode rows of up to 256 x 8K bf16


class OneShot:
    """``torch.ops.symm_mem.one_shot_all_reduce`` over one symmetric buffer of ``MAX_BYTES``."""

    def __init__(self, device: torch.device, dtype: torch.dtype, group: Any):
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.n = MAX_BYTES // torch.finfo(dtype).bits * 8
        self.group_name = group.group_name
        self.buf = symm_mem.empty(self.n, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.group_name)

    def fits(self, y: torch.Tensor) -> bool:
        # the kernel loads 16-byte vectors: sizes that are not a multiple of 8 elements go to NCCL
        # (torch refuses sizes that are not a multiple of 4 bytes: "at least 4-byte aligned")
        return y.dtype == self.dtype and y.is_cuda and y.numel() <= self.n and y.numel() % 8 == 0

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        inp = self.buf[: y.numel()]
        inp.copy_(y.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(inp, "sum", self.group_name).view(y.shape)


class PeerSum:
    """Two ranks: the all-reduce after ``o_proj`` / ``down_proj`` fused into the residual add + RMSNorm that
    follows it (``swiftlm.cuda_ext.peer_sum``): a receive buffer of ``MAX_BYTES`` and per-row ``full`` /
    ``free`` flags in symmetric memory, each rank holding views of its peer's."""

    ROWS = 1024  # rows per call at most (decode rows of a step); more go to NCCL

    def __init__(self, device: torch.device, dtype: torch.dtype, group: Any):
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.n = MAX_BYTES // torch.finfo(dtype).bits * 8
        peer = 1 - dist.get_rank(group)
        mine, theirs = [], []
        for n, dt, init in ((self.n, dtype, 0), (self.ROWS, torch.int32, 0), (self.ROWS, torch.int32, 1)):
            buf = symm_mem.empty(n, dtype=dt, device=device)
            buf.fill_(init)
            hdl = symm_mem.rendezvous(buf, group.group_name)
            mine.append(buf)
            theirs.append(hdl.get_buffer(peer, (n,), dt))
        self.recv, self.full, self.free = mine
        self.peer_recv, self.peer_full, self.peer_free = theirs
        torch.cuda.synchronize(device)
        dist.barrier(group)  # both ranks' flags are set before either writes to the other's

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.dtype
            and x.is_cuda
            and x.dim() == 2
            and x.shape[0] <= self.ROWS
            and x.numel() <= self.n
            and x.shape[1] <= 16384
        )

    def add_rmsnorm(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += all_reduce(y)``; returns ``rmsnorm(x) * w`` (x, y: [rows, N] contiguous, this rank's partial y)."""
        from swiftlm.cuda_ext.peer_sum import push, recv_add_rmsnorm

        push(y, self.peer_recv, self.peer_full, self.free)
        return recv_add_rmsnorm(x, y, self.recv, self.full, self.peer_free, w, eps)


_impl: OneShot | None = None
_peer: PeerSum | None = None
_mode = "nccl"


def mode() -> str:
    """ "peer" when decode steps' sums go through ``PeerSum``, "symm_mem" when small all-reduces go through
    ``OneShot``, else "nccl" (or gloo on the CPU)."""
    return _mode


def all_reduce(y: torch.Tensor) -> torch.Tensor:
    """The sum of ``y`` over the ranks (``y`` contiguous; may be summed in place and returned)."""
    if _impl is not None and _impl.fits(y):
        return _impl(y)
    dist.all_reduce(y)
    return y


def out_proj_add_rmsnorm(lin: Any, inp: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``add_rmsnorm(x, out_proj(lin, inp))`` of a fused decode step (``fused_decode._after_attention``): for a
    tensor-parallel row layer under ``PeerSum`` the all-reduce happens inside the add + norm."""
    from swiftlm.cuda_ext.decode_kernels import add_rmsnorm

    from .linear_rows import lora_add, out_proj, rows_linear

    if _peer is not None and getattr(lin, "reduce", None) is not None and _peer.fits(x):
        return _peer.add_rmsnorm(x, lora_add(lin, inp, rows_linear(inp, lin.weight)).contiguous(), w, eps)
    return add_rmsnorm(x, out_proj(lin, inp).contiguous(), w, eps)


def setup(device: torch.device, dtype: torch.dtype, one_host: bool = True) -> str:
    """Choose the all-reduce for this process group (every rank calls it at load, in the same order;
    ``one_host``: every rank on this machine, as peer stores need).  Returns the mode; the reason for a
    fallback is logged."""
    global _impl, _peer, _mode
    _impl, _peer, _mode = None, None, "nccl"
    want = os.environ.get("SWIFTLM_TP_ALLREDUCE", "peer")
    if device.type != "cuda" or want not in ("symm", "peer") or dtype not in (torch.bfloat16, torch.float16):
        return _mode
    if want == "peer":
        if dist.get_world_size() != 2 or not one_host:  # built for two ranks of one machine
            log.info(
                "tensor-parallel all-reduce: NCCL (the peer-store sums are built for two ranks on one host; "
                "this group has %d%s)",
                dist.get_world_size(),
                "" if one_host else " over several hosts",
            )
            return _mode
        return _setup_peer(device, dtype)
    err = None
    try:
        impl = OneShot(device, dtype, dist.group.WORLD)
        ok = _agrees(impl, device, dtype)
    except Exception as exc:  # noqa: BLE001 - an older torch, no peer access, a driver without it
        impl, ok, err = None, False, f"{type(exc).__name__}: {exc}"
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # all ranks use it, or none
    if int(flag.item()) == 1:
        _impl, _mode = impl, "symm_mem"
        log.info("tensor-parallel all-reduce: one-shot over symmetric memory up to %d bytes, NCCL above", MAX_BYTES)
    else:
        log.warning(
            "tensor-parallel all-reduce: NCCL only (the symmetric-memory one-shot %s)",
            err or "disagreed with NCCL on this or another rank",
        )
    return _mode


def _setup_peer(device: torch.device, dtype: torch.dtype) -> str:
    global _peer, _mode
    err = None
    try:
        peer = PeerSum(device, dtype, dist.group.WORLD)
        ok = _peer_agrees(peer, device, dtype)
    except Exception as exc:  # noqa: BLE001 - an older torch or Triton, no peer access
        peer, ok, err = None, False, f"{type(exc).__name__}: {exc}"
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 1:
        _peer, _mode = peer, "peer"
        log.info(
            "tensor-parallel all-reduce: decode rows' sums by peer stores fused into the add + RMSNorm "
            "(up to %d rows), NCCL elsewhere",
            PeerSum.ROWS,
        )
    else:
        log.warning(
            "tensor-parallel all-reduce: NCCL only (the peer-store sum %s)",
            err or "disagreed with NCCL on this or another rank",
        )
    return _mode


def _peer_agrees(peer: PeerSum, device: torch.device, dtype: torch.dtype) -> bool:
    """``PeerSum.add_rmsnorm`` equals NCCL's all-reduce then ``add_rmsnorm``, bit for bit, on a few shapes (and
    a second round through the same flags)."""
    from swiftlm.cuda_ext.decode_kernels import add_rmsnorm

    g = torch.Generator(device="cpu").manual_seed(99)  # x and w the same on both ranks, y not
    gy = torch.Generator(device="cpu").manual_seed(7 + dist.get_rank())
    for rows, n in ((1, 4096), (3, 2048), (64, 5120), (1, 4096)):
        x = torch.randn(rows, n, generator=g).to(device=device, dtype=dtype)
        w = torch.randn(n, generator=g).to(device=device, dtype=dtype)
        y = torch.randn(rows, n, generator=gy).to(device=device, dtype=dtype)
        ref_y, ref_x = y.clone(), x.clone()
        dist.all_reduce(ref_y)
        ref = add_rmsnorm(ref_x, ref_y, w, 1e-5)
        got = peer.add_rmsnorm(x, y, w, 1e-5)
        torch.cuda.synchronize(device)
        if not (torch.equal(got, ref) and torch.equal(x, ref_x)):
            return False
    return True


def _agrees(impl: OneShot, device: torch.device, dtype: torch.dtype) -> bool:
    """The one-shot sum equals NCCL's, exactly for two ranks and within one rounding for more, on a few sizes."""
    g = torch.Generator(device="cpu").manual_seed(1234 + dist.get_rank())
    for n in (8, 4096, 3 * 4096 + 8, min(impl.n, 128 * 4096)):
        x = torch.randn(n, generator=g).to(device=device, dtype=dtype)
        ref = x.clone()
        dist.all_reduce(ref)
        got = impl(x)
        torch.cuda.synchronize(device)
        if dist.get_world_size() == 2:
            if not torch.equal(got, ref):
                return False
        elif not torch.allclose(got.float(), ref.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-3):
            return False
    return True
