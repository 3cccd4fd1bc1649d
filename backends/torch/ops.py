"""The sampler's array-ops shim over torch (logits stay on the device)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .staging import stager

_DT = {"int32": torch.long, "float32": torch.float32}
_GOMP: Any = None  # torch's libgomp (ctypes), False where there is none: release_omp_pool


def release_omp_pool() -> None:
    """Free the calling thread's OpenMP thread pool (libgomp's ``omp_pause_resource_all(omp_pause_soft)``;
    the next parallel region on this thread makes a new one).  The thread that loaded a CPU model calls it
    when it is done: while it keeps its pool, libgomp manages more threads than there are cores and
    throttles the spin-wait of the engine thread's team, so each of the many small GEMMs of a decode
    step waits for its worker to wake and runs at one thread's speed.  A no-op where torch does not use
    libgomp."""
    global _GOMP
    import os

    if os.environ.get("SWIFTLM_OMP_RELEASE", "1") == "0":  # for A/B measurements only
        return
    if _GOMP is None:
        import ctypes
        import glob

        lib = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
        try:
            _GOMP = ctypes.CDLL(lib[0]) if lib else False
            if _GOMP is not False and not hasattr(_GOMP, "omp_pause_resource_all"):
                _GOMP = False
        except OSError:
            _GOMP = False
    if _GOMP:
        _GOMP.omp_pause_resource_all(1)  # omp_pause_soft; fails (non-zero) only inside a parallel region


def sample_kernel_wanted(device: torch.device) -> bool:
    """Draw tokens with the Triton sampling kernels (``cuda_ext/sample_kernel.py``) on this device?  CUDA with
    the Triton kernels on (self-checked); ``SWIFTLM_SAMPLE_KERNEL=0`` keeps the torch operations (A/B runs)."""
    import os

    if device.type != "cuda" or os.environ.get("SWIFTLM_SAMPLE_KERNEL", "1") == "0":
        return False
    from swiftlm.cuda_ext import enabled

    return enabled("cuda")


class TorchOps:
    def __init__(self, device: torch.device, sample_kernel: bool | None = None):
        """``sample_kernel``: both sampling paths draw through the Triton kernels (default: on CUDA where
        they run, ``sample_kernel_wanted``; tests force it on CPU tensors under ``TRITON_INTERPRET=1``)."""
        self.device = device
        self._pinned: dict[tuple, list] = {}  # (shape, dtype) -> [ring of 3 page-locked buffers, next index]
        self._fused: Any = None  # fused_sampler.GraphedSampler, made on first use
        self.sample_kernel = sample_kernel_wanted(device) if sample_kernel is None else sample_kernel
        if not self.sample_kernel:
            self.draw_rows = None  # the sampler's torch operations (swiftlm.sampler._draw) draw instead

    def asarray(self, values, dtype):
        return torch.tensor(values, dtype=_DT[dtype], device=self.device)

    def float32(self, x):
        return x.float().clone()

    def log_softmax(self, x):
        return torch.log_softmax(x, dim=-1)

    def exp(self, x):
        return torch.exp(x)

    def argmax(self, x):
        return int(torch.argmax(x))

    def argsort_desc(self, x):
        return torch.argsort(x, descending=True, stable=True)

    def take(self, x, idx):
        return x[idx]

    def put(self, x, idx, values):
        x = x.clone()
        x[idx] = values
        return x

    def cumsum(self, x):
        return torch.cumsum(x, dim=-1)

    def where(self, cond, a, b):
        # Python scalars stay scalars: torch.tensor(scalar, device="cuda") would be a blocking copy
        # that waits for every queued kernel (it made the sampler wait for the forward pass)
        if not torch.is_tensor(a) and not torch.is_tensor(b):
            b = torch.tensor(b, dtype=torch.float32, device=cond.device)
        return torch.where(cond, a, b).float()

    def kth_largest(self, x, k):
        k = min(k, x.shape[-1])
        return torch.topk(x, k).values[-1]

    def from_numpy(self, a):
        return torch.from_numpy(a).to(self.device)

    def max(self, x):
        return torch.max(x)

    def item(self, x):
        return float(x)

    def tolist(self, x):
        return x.tolist()

    # ---- batched ops (swiftlm.sampler.BatchOps) on [rows, V] tensors
    def f32(self, x):
        return x.float() if x.dtype != torch.float32 else x.clone()

    def as_f32(self, x):
        return x if x.dtype == torch.float32 else x.float()

    def vec(self, a):
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type == "cpu":
            return t
        return stager(self.device).to_device(t)  # page-locked: queued, never waiting on the device

    def gather2(self, x, r, c):
        return x[r, c]

    def scatter2(self, x, r, c, v):
        x[r, c] = v  # x is the sampler's own float32 copy
        return x

    def log_softmax_rows(self, x):
        return torch.log_softmax(x, dim=-1)

    def softmax_rows(self, x):
        return torch.softmax(x, dim=-1)

    def argmax_rows(self, x):
        return torch.argmax(x, dim=-1)

    def sort_desc_rows(self, x):
        return torch.sort(x, dim=-1, descending=True, stable=True)

    def take_along(self, x, idx):
        return torch.take_along_dim(x, idx, dim=-1)

    def put_along(self, x, idx, v):
        return x.scatter(-1, idx, v)

    def cumsum_rows(self, x):
        return torch.cumsum(x, dim=-1)

    def topk_rows(self, x, k):
        return torch.topk(x, k, dim=-1)

    def max_rows(self, x):
        return x.amax(dim=-1, keepdim=True)

    def count_below(self, c, t):
        # c is a cumulative sum (non-decreasing): #(c < t) is the left insertion point, O(log V) per row
        return torch.searchsorted(c, t.to(c.dtype)).reshape(-1)

    def to_host(self, x):
        return x.cpu().numpy()

    def start_copy(self, x):
        """Queue the device-to-host copy now (before the next step's kernels are queued behind
        it): a page-locked buffer from a small ring and an event to wait on."""
        if self.device.type != "cuda":
            return x
        key = (tuple(x.shape), x.dtype)
        ring = self._pinned.get(key)
        if ring is None:  # allocated once per shape (a page-locked allocation is slow: never one per step)
            ring = self._pinned[key] = [[torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for _ in range(3)], 0]
        buf = ring[0][ring[1]]
        ring[1] = (ring[1] + 1) % 3  # at most two steps are in flight: a buffer is read before reuse
        buf.copy_(x, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return buf, ev

    def wait(self, handle):
        if not isinstance(handle, tuple):
            return self.to_host(handle)
        buf, ev = handle
        ev.synchronize()
        return buf.numpy()

    def pack(self, cols):
        return torch.cat([c.float().reshape(c.shape[0], -1) for c in cols], dim=1)

    def draw_rows(self, y, u):
        """The general path's draw (after its filters): token ids [n] of the inverse-CDF rule over the float32
        rows ``y`` with the rows' uniforms ``u`` (numpy), by the same kernels as ``sample_simple``, so that a row
        draws the same token whichever path its batch takes.  Set to None where the kernels are off."""
        from swiftlm.cuda_ext.sample_kernel import draw

        host = np.zeros((y.shape[0], 3), np.float32)
        host[:, 0], host[:, 1] = 1.0, u
        return draw(y, self.vec(host))

    def sample_simple(self, logits, host):
        """Temperature / logit bias / greedy rows in one call (``swiftlm.sampler.simple_inputs``): the Triton
        sampling kernels (two launches) where they are on, else a captured graph of torch operations."""
        if self.sample_kernel:
            from swiftlm.cuda_ext.sample_kernel import draw

            return draw(logits, self.vec(host))
        if self._fused is None:
            from .fused_sampler import GraphedSampler

            self._fused = GraphedSampler(self.device)
        return self._fused(logits, host)

    def where_int(self, cond, a, b):
        return torch.where(cond, a, b).long()  # scalars as scalars (no blocking copy)

    def one_row(self, x):
        return x.reshape(1, -1)

    def end_thread(self) -> None:
        """This thread is done with the model (a loading thread, or an engine loop ending): on the CPU its
        OpenMP pool goes, so that the engine thread's team runs unthrottled (``release_omp_pool``)."""
        if self.device.type == "cpu":
            release_omp_pool()
