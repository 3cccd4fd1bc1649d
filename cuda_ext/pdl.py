"""Programmatic dependent launch (Hopper and newer) for the decode kernels.

Inside a decode step's CUDA graph each kernel normally starts only after the previous one has finished and
its launch has gone through: for a one-row step of ~110 small kernels that gap is a large share of the step.
Launched with PDL, a kernel's programs may start while the previous kernel's last programs still run; each
of our kernels waits (``gdc_wait``, in ``GDC`` builds) before it reads anything an earlier kernel wrote, and
signals its dependents (``gdc_launch_dependents``) once its own work is done.  The GEMV reads its first weight
tile before the wait (weights never change during a step), so that load overlaps the previous kernel's tail.
Each kernel waits for the full completion of the one before it, which waited for its own predecessor: every
earlier write is visible.  ``SWIFTLM_PDL=0`` turns it off (A/B runs); a device or Triton build that cannot
launch with PDL is detected once by a probe launch and runs without it.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
_STATE: dict[int, bool] = {}


@triton.jit
def _probe_kernel(x, GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
    v = tl.load(x)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x, v + 1.0)


def enabled(t: torch.Tensor) -> bool:
    """Launch kernels on ``t``'s device with PDL?"""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _STATE.get(idx)
    if ok is None and torch.cuda.is_current_stream_capturing():
        return False  # no probe (a host sync) inside a graph capture: this launch goes without PDL
    if ok is None:
        ok = os.environ.get("SWIFTLM_PDL", "1") != "0" and torch.cuda.get_device_capability(idx)[0] >= 9
        if ok:
            try:
                x = torch.zeros(1, device=t.device)
                for _ in range(2):
                    _probe_kernel[(1,)](x, GDC=True, launch_pdl=True)
                ok = float(x.item()) == 2.0
            except Exception as exc:  # an older Triton or driver: no PDL
                log.info("programmatic dependent launch unavailable (%s: %s)", type(exc).__name__, exc)
                ok = False
        _STATE[idx] = ok
    return ok


def launch_kw(t: torch.Tensor) -> dict:
    """The kernel-launch keyword for ``t``'s device (empty where PDL is off), plus the kernels' GDC flag."""
    return {"launch_pdl": True, "GDC": True} if enabled(t) else {"GDC": False}
