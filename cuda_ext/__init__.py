"""Triton kernels for the torch backend's decode step (installed as ``swiftlm.cuda_ext``).

Each kernel has a plain-torch reference next to it (``*_ref``) and an equivalence test that
runs in CI on CPU tensors under ``TRITON_INTERPRET=1`` and on a GPU where one exists.  On the
GPU, ``enabled()`` checks every kernel against its reference once on random data and falls
back to the references (with a warning) if Triton is missing or any check fails
(``SWIFTLM_TRITON_SELFCHECK=0`` skips that check: the test suite's interpreted runs, which compare the kernels
with their references themselves and where the check alone costs seconds per process).
"""

from __future__ import annotations

import importlib.util
import logging
import os

log = logging.getLogger(__name__)
_STATE: dict[str, bool] = {}

if os.environ.get("SWIFTLM_LOG_COMPILES", "0") not in ("", "0"):  # a log line per kernel compiled (compile_log.py)
    from .compile_log import install

    install()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def enabled(device_type: str) -> bool:
    """Use the Triton kernels on this device?  (Self-checked once per process.)"""
    if os.environ.get("SWIFTLM_TRITON", "1") == "0" or not triton_available():
        return False
    if device_type != "cuda" and not interpret():
        return False
    if device_type not in _STATE and os.environ.get("SWIFTLM_TRITON_SELFCHECK", "1") == "0":
        _STATE[device_type] = True
    if device_type not in _STATE:
        from .selfcheck import selfcheck

        ok, why = selfcheck(device_type)
        if not ok:
            log.warning("Triton kernels disagree with their references on %s (%s); using plain torch", device_type, why)
        _STATE[device_type] = ok
    return _STATE[device_type]
