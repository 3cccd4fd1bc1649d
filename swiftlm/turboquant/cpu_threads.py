"""The thread settings of the CPU attention kernels (``cpu_attention``): whether numba runs them, on how many
threads, compiled with parallel loops or not, and how many tasks a KV head's rows split into."""

from __future__ import annotations

import os
import threading

try:  # optional (the torch extra installs it)
    import numba as nb
except ImportError:  # pragma: no cover - exercised where numba is absent
    nb = None

MIN_SPAN = 512  # rows per task at least
# one kernel at a time per process: numba's thread pool (workqueue/omp layers) does not take
# concurrent launches from two threads (two engines, e.g. two models served at once)
_LOCK = threading.Lock()


# numba threads a kernel runs on: numba's own count unless a backend sets one (``use_threads``)
_THREADS = [0]


def use_threads(n: int) -> None:
    """Run the kernels on ``n`` threads (the torch backend: torch's own count, on the OpenMP pool they share)."""
    _THREADS[0] = max(1, n)


_OMP = os.environ.get("OMP_NUM_THREADS", "")
_ENV_THREADS = int(_OMP) if _OMP.isdigit() else 0  # read once: threads() runs before every kernel launch


def threads() -> int:
    """Threads the kernels run on: ``use_threads``'s count, else OMP_NUM_THREADS, else numba's whole pool."""
    if nb is None:
        return 1
    want = _THREADS[0] or _ENV_THREADS or nb.config.NUMBA_NUM_THREADS
    return max(1, min(want, nb.config.NUMBA_NUM_THREADS))


def parallel() -> bool:
    """Whether the kernels are compiled with numba's parallel loops: not when they run on one thread (a parallel
    k4v3 kernel took ~11 s to compile against ~7 on the 2-core CI machine, and runs no faster on one thread).  Both compute each task alike; with fastmath LLVM may order a sum differently in each, so
    their outputs agree to fp32 rounding, not always bit for bit."""
    return threads() > 1


def _launch_threads() -> int:
    """The thread count for a kernel launched from this thread, set to ``threads()`` (numba keeps a count per
    calling thread, its full pool by default).  Called under _LOCK before each launch."""
    n = nb.get_num_threads()
    want = threads()
    if want != n:
        nb.set_num_threads(want)
    return want


def splits(n: int, kv_heads: int) -> int:
    """Tasks per KV head: enough for every thread, no task shorter than MIN_SPAN rows."""
    want = -(-4 * threads() // kv_heads)
    return max(1, min(want, -(-n // MIN_SPAN)))
