"""Python's cyclic garbage collector in a serving process: its pauses, measured, and kept short.

A full (generation 2) collection walks every tracked object of the process.  After torch, transformers
and a model are loaded that is hundreds of thousands of objects, so a full collection stops the step loop
for tens of milliseconds (``scripts/gc_pause.py`` measures it), and a busy server allocates enough
short-lived objects (events, dicts, tuples per token) to trigger one every few seconds: a stall of every
stream at once, seen as the ITL tail.  ``freeze()`` moves everything alive after loading into the
permanent generation (``gc.freeze``), which collections skip; what the server allocates while serving is
still collected as before.  ``GcPauses`` times every collection through ``gc.callbacks`` (read by
``/health`` and ``/metrics``).  ``SWIFTLM_GC_FREEZE=0`` turns the freeze off (for A/B runs).
"""

from __future__ import annotations

import gc
import os
import threading
import time

from .stats import LatencyHistogram

GC_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


_collected = False
_frozen = 0  # objects frozen by the last freeze(): gc.get_freeze_count() walks them all (ms per call)


def freeze() -> int:
    """Freeze every object alive now (call after a model is loaded), collecting garbage first on the
    process's first call only, and after an ``unfreeze`` (a full collection costs what this module avoids; later
    calls, e.g. the next model of a multi-model server, freeze what is there).  Returns the number of frozen objects
    (0 when ``SWIFTLM_GC_FREEZE=0``)."""
    global _collected, _frozen
    if os.environ.get("SWIFTLM_GC_FREEZE", "1") == "0":
        return 0
    if not _collected:
        gc.collect()
        _collected = True
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


def unfreeze() -> None:
    """Give frozen objects back to the collector (an engine shut down: its model's objects, if they sit in
    reference cycles, can only be freed by a collection that sees them); the next ``freeze`` collects first."""
    global _collected, _frozen
    gc.unfreeze()
    _collected, _frozen = False, 0


class GcPauses:
    """Times every collection of this process, per generation (installed once per process)."""

    _installed: GcPauses | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.hist = {g: LatencyHistogram(GC_BUCKETS) for g in (0, 1, 2)}
        self._t0: float | None = None

    @classmethod
    def install(cls) -> GcPauses:
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls()
                gc.callbacks.append(cls._installed._callback)
            return cls._installed

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.hist[info.get("generation", 2)].observe(time.perf_counter() - self._t0)
            self._t0 = None

    def snapshot(self) -> dict:
        # not gc.get_freeze_count(): it walks a linked list of every frozen object, and the engine process
        # snapshots its stats every SNAPSHOT_EVERY seconds on the step loop, which would pay that walk
        out = {"frozen_objects": _frozen}
        for g, h in self.hist.items():
            out[f"gen{g}"] = {"collections": h.count, "seconds": round(h.sum, 6), "max_ms": round(1e3 * h.max, 3)}
        return out
