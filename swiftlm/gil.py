"""How long the engine thread waits for the GIL when another thread of its process holds it.

CPython hands the GIL over on request only every ``sys.getswitchinterval()`` (5 ms by default): a thread
that releases it around a blocking call (each CUDA launch and copy through torch, a socket or pipe write)
and wants it back while another thread is running Python (the output worker detokenising and framing a
step's tokens, the HTTP loop) waits until that thread blocks or until the interval ends.  At many streams
the engine loop releases the GIL dozens of times per step, so these waits add up to a large share of a GPU
step.  ``SWIFTLM_GIL_SWITCH_MS`` sets the interval for the engine's process (the HTTP
server's too, when the engine runs in it); unset or empty leaves Python's default.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)
_DEFAULT_S = sys.getswitchinterval()


def tune_switch_interval() -> float:
    """Apply ``SWIFTLM_GIL_SWITCH_MS`` (milliseconds, > 0) to this process; returns the interval in seconds."""
    raw = os.environ.get("SWIFTLM_GIL_SWITCH_MS", "").strip()
    if raw:
        try:
            ms = float(raw)
            if not ms > 0 or ms > 1000:
                raise ValueError
            sys.setswitchinterval(ms / 1000.0)
        except ValueError:
            log.warning("SWIFTLM_GIL_SWITCH_MS=%r is not a number of milliseconds in (0, 1000]; ignored", raw)
    return sys.getswitchinterval()
