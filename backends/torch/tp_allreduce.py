"""The tensor-parallel all-reduce (``parallel.RowParallelLinear``, ``parallel.VocabParallelEmbedding``): NCCL's
(gloo on the CPU), or, opted into with ``SWIFTLM_TP_ALLREDUCE=symm``, a one-shot all-reduce over symmetric memory.

Why the option exists and why it is off: a decode step of an 8B model at one stream does 65 all-reduces of 8 KB
(two per layer, one for the embedding), and the TP=2 step on two H100s is 4.35 ms where half the weights need
2.4 ms, so NCCL's latency inside the CUDA graph was the suspect.  Measured (docs/benchmarks.md, issue 26, session
12): the one-shot path gives the same tokens (16/16 prompts) and the same speed (bs1 217.7 vs 222.2 tok/s, N=64
4,986 vs 4,627), i.e. NCCL's small all-reduce over NVLink was not what the step waits for.  It stays available
for other topologies (with more ranks a ring's latency grows, a one-shot's does not), not measured there.

With the option, small messages go through a *one-shot* all-reduce over
symmetric memory (``torch.distributed._symmetric_memory``): every rank copies its partial sums into a buffer that
all ranks map, a barrier over the buffer's signal pad, then each rank reads the others' buffers over NVLink and
adds them (peer loads only: no NVLink multicast, which this project leaves off).  For two ranks a sum of two
values is the same whichever rank adds them, so the result is bit-for-bit NCCL's; ``setup`` checks that on random
data on every rank before using it, and falls back to NCCL (with a log line) on any disagreement or error.
Messages larger than the buffer (long prompt chunks), sizes that are not a multiple of 8 elements, other dtypes
and CPU tensors (gloo) take ``dist.all_reduce``.  Every rank takes the same path for the same call (the
choice depends only on the message's size and dtype), so the collectives stay matched.
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
        # (torch refuses sizes that are not a multiple of 4 bytes: measured, "at least 4-byte aligned")
        return y.dtype == self.dtype and y.is_cuda and y.numel() <= self.n and y.numel() % 8 == 0

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        inp = self.buf[: y.numel()]
        inp.copy_(y.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(inp, "sum", self.group_name).view(y.shape)


_impl: OneShot | None = None
_mode = "nccl"


def mode() -> str:
    """"symm_mem" when small all-reduces go through ``OneShot``, else "nccl" (or gloo on the CPU)."""
    return _mode


def all_reduce(y: torch.Tensor) -> torch.Tensor:
    """The sum of ``y`` over the ranks (``y`` contiguous; may be summed in place and returned)."""
    if _impl is not None and _impl.fits(y):
        return _impl(y)
    dist.all_reduce(y)
    return y


def setup(device: torch.device, dtype: torch.dtype) -> str:
    """Choose the all-reduce for this process group (every rank calls it at load, in the same order).
    Returns the mode; the reason for a fallback is logged."""
    global _impl, _mode
    _impl, _mode = None, "nccl"
    want = os.environ.get("SWIFTLM_TP_ALLREDUCE", "nccl")
    if device.type != "cuda" or want != "symm" or dtype not in (torch.bfloat16, torch.float16):
        return _mode
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
        log.warning("tensor-parallel all-reduce: NCCL only (the symmetric-memory one-shot %s)",
                    err or "disagreed with NCCL on this or another rank")
    return _mode


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
