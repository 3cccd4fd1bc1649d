"""A two-rank tensor-parallel all-reduce fused into the residual add + RMSNorm that follows it.

A decode step of an 8B model at one stream on two GPUs runs 64 all-reduces of one 8 KB row (after each layer's
``o_proj`` and ``down_proj``), each followed by ``add_rmsnorm``.  Inside a CUDA graph NCCL's all-reduce is a
kernel of its own with a fixed latency, and it breaks the chain of programmatic dependent launches (pdl.py)
of the Triton kernels around it.  Here the sum costs two Triton kernels, both PDL-launched:

- ``push``: each rank stores its partial rows straight into its peer's receive buffer (peer-mapped symmetric
  memory, over NVLink), then raises the peer's per-row ``full`` flag (a release at system scope).  A kernel of
  its own: sending from the one-row GEMV's last program would save this launch but slows the step down;
- ``recv_add_rmsnorm``: each rank waits for its own ``full`` flag (acquire), adds its partial and the
  received one (rounded to the model's dtype, as NCCL rounds its sum), then does what ``add_rmsnorm`` does
  (``x += sum``; returns ``rmsnorm(x) * w``), clears its ``full`` flag and raises the peer's ``free`` flag.

``push`` waits for its own ``free`` flag before writing: the peer has read the previous payload out of the
buffer.  Every rank makes the same calls in the same order (the tensor-parallel control plane keeps them in
step), so one buffer serves every call site, eager or replayed from any graph.  For two ranks ``a + b`` is
``b + a``: both ranks get the same bits, and the same bits as NCCL's sum followed by ``add_rmsnorm``
(``backends/torch/tp_allreduce.py`` checks that on every rank before using it).

The flags are int32: ``full`` starts at 0, ``free`` at 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_kernels import add_rmsnorm_row
from .pdl import launch_kw


@triton.jit
def send_row(y, peer_recv, peer_full, own_free, b, N, BLOCK: tl.constexpr):
    """Row ``b`` of ``y`` [rows, N] into the peer's receive buffer, then the peer's ``full`` flag for it (once the
    peer has read the last payload of that row: ``own_free``).  One program per row (``_push_kernel``)."""
    got = tl.atomic_cas(own_free + b, 1, 0, sem="acquire", scope="sys")
    while got != 1:
        got = tl.atomic_cas(own_free + b, 1, 0, sem="acquire", scope="sys")
    for i0 in range(0, N, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < N
        tl.store(peer_recv + b * N + i, tl.load(y + b * N + i, mask=m, other=0.0), mask=m)
    tl.debug_barrier()  # every thread's stores before the flag
    tl.atomic_xchg(peer_full + b, 1, sem="release", scope="sys")


@triton.jit
def _push_kernel(y, peer_recv, peer_full, own_free, N: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
    send_row(y, peer_recv, peer_full, own_free, tl.program_id(0), N, BLOCK)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _recv_add_rmsnorm_kernel(
    x, y, recv, own_full, peer_free, w, out, eps, N: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr
):
    b = tl.program_id(0)
    if GDC:
        tl.extra.cuda.gdc_wait()
    got = tl.atomic_add(own_full + b, 0, sem="acquire", scope="sys")  # the peer's row has landed
    while got != 1:
        got = tl.atomic_add(own_full + b, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    r0 = b * N
    i = tl.arange(0, BLOCK)
    m = i < N
    mine = tl.load(y + r0 + i, mask=m, other=0.0).to(tl.float32)
    theirs = tl.load(recv + r0 + i, mask=m, other=0.0, volatile=True).to(tl.float32)
    s = (mine + theirs).to(x.dtype.element_ty)  # the all-reduced row, rounded as NCCL rounds it
    add_rmsnorm_row(x + r0, s.to(tl.float32), w, out + r0, eps, i, m, N)  # what add_rmsnorm does with that sum
    tl.debug_barrier()  # every thread has read the received row
    tl.atomic_xchg(own_full + b, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(peer_free + b, 1, sem="release", scope="sys")
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()


def push(y: torch.Tensor, peer_recv: torch.Tensor, peer_full: torch.Tensor, own_free: torch.Tensor) -> None:
    """Send ``y`` [rows, N] (contiguous) into the peer's receive buffer and raise its flags for those rows."""
    rows, N = y.shape
    assert y.is_contiguous() and rows <= peer_full.numel() and rows * N <= peer_recv.numel()
    _push_kernel[(rows,)](
        y, peer_recv, peer_full, own_free, N=N, BLOCK=min(4096, triton.next_power_of_2(N)), **launch_kw(y)
    )


def recv_add_rmsnorm(
    x: torch.Tensor,
    y: torch.Tensor,
    recv: torch.Tensor,
    own_full: torch.Tensor,
    peer_free: torch.Tensor,
    w: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Wait for the peer's rows, then in place ``x += (y + peer's y)``; returns ``rmsnorm(x) * w`` per row."""
    rows, N = y.shape
    assert x.is_contiguous() and y.is_contiguous() and x.shape == y.shape
    out = torch.empty_like(x)
    _recv_add_rmsnorm_kernel[(rows,)](
        x, y, recv, own_full, peer_free, w, out, eps, N=N, BLOCK=triton.next_power_of_2(N), **launch_kw(x)
    )
    return out
