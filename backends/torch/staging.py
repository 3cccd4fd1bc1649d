"""Host -> device copies through page-locked memory, so that queuing one never waits for the device.

A copy from pageable memory may make the CUDA driver wait for the stream's queued work before it
stages the bytes; from page-locked memory ``cudaMemcpyAsync`` only queues.  Allocating page-locked
memory is slow, far too slow for every copy, so one arena is allocated per device and carved per copy:
two halves used in turn, and before a half is reused the event recorded when it was last left is
waited on (it is long done in practice: a half holds many steps' inputs).  Copies larger than a
quarter of the arena go the pageable way.  ``SWIFTLM_PINNED_H2D=0`` turns the arena off (the A/B
switch of scripts/profile_engine.py).
"""

from __future__ import annotations

import os
import threading

import torch

ARENA_BYTES = 8 << 20
_ALIGN = 64
_stagers: dict[str, Stager] = {}
_lock = threading.Lock()


class Stager:
    def __init__(self, device: torch.device, nbytes: int = ARENA_BYTES):
        self.device = device
        self.enabled = device.type == "cuda" and os.environ.get("SWIFTLM_PINNED_H2D", "1") != "0"
        self.half_bytes = nbytes // 2
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if self.enabled else None
        self.events: list = [None, None]
        self.half, self.offset = 0, 0
        self.lock = threading.Lock()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of the CPU tensor ``t``, queued without waiting for the device."""
        t = t.contiguous()
        n = t.numel() * t.element_size()
        if not self.enabled or n == 0 or 4 * n > 2 * self.half_bytes:
            return t.to(self.device, non_blocking=True)
        need = -(-n // _ALIGN) * _ALIGN
        with self.lock:
            if self.offset + need > self.half_bytes:  # leave this half, enter the other
                ev = torch.cuda.Event()
                ev.record()
                self.events[self.half] = ev
                self.half = 1 - self.half
                if self.events[self.half] is not None:
                    self.events[self.half].synchronize()
                self.offset = 0
            start = self.half * self.half_bytes + self.offset
            self.offset += need
        region = self.buf[start : start + n].view(t.dtype).view(t.shape)
        region.copy_(t)
        return region.to(self.device, non_blocking=True)


def stager(device: torch.device) -> Stager:
    key = str(device)
    with _lock:
        s = _stagers.get(key)
        if s is None:
            s = _stagers[key] = Stager(device)
        return s
