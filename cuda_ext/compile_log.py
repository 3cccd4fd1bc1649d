"""A log line per Triton kernel compiled (or loaded from Triton's disk cache) in this process, with the time it took
and the kernel's specialisation (``SWIFTLM_LOG_COMPILES=1``).

A server compiles its kernels during the start-up warm-up; a compile after it happens under load, and every stream
of that step waits for it.  With this log a step that stalled can be matched to the kernel and argument
specialisation (integer arguments equal to 1 or divisible by 16 are specialised by Triton) that the warm-up missed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("swiftlm.compile")
_started: dict[tuple[str, str], float] = {}
_lock = threading.Lock()
COUNT = [0]  # compiles seen since install()


def _ident(kw: dict[str, Any]) -> tuple[str, str]:
    fn = kw.get("fn")
    return getattr(fn, "name", None) or str(fn), str(kw.get("key"))


def install() -> bool:
    """Chain the two hooks onto Triton's runtime knobs (any hooks already set still run).  False where this
    Triton has no such knobs."""
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = getattr(knobs, "runtime", None)
    if rt is None or not hasattr(rt, "jit_cache_hook") or not hasattr(rt, "jit_post_compile_hook"):
        return False
    prev_start, prev_done = rt.jit_cache_hook, rt.jit_post_compile_hook

    def started(**kw: Any) -> Any:
        with _lock:
            _started[_ident(kw)] = time.perf_counter()
        return prev_start(**kw) if prev_start else None  # a true value would skip the compile: only a chained hook's

    def done(**kw: Any) -> Any:
        ident = _ident(kw)
        with _lock:
            t0 = _started.pop(ident, None)
            COUNT[0] += 1
        now = time.perf_counter()
        ms = (now - t0) * 1e3 if t0 is not None else float("nan")
        # t: perf_counter seconds, the clock of the engine's step log (--step-log); key: the argument types and
        # specialisations (divisible by 16, equal to 1) and constexprs, which tell two compiles of a kernel apart
        # (some Triton versions' repr names the first argument only)
        log.warning(
            "triton compile %s: %.0f ms at t=%.3f (%s) key=%.600s", ident[0], ms, now, kw.get("repr", ""), ident[1]
        )
        return prev_done(**kw) if prev_done else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = started, done
    return True
