"""What the ``swiftlm`` commands share: settings from the parsed flags (a bad value is one sentence),
the request defaults they imply, and byte sizes for people.

Exit codes, the same for every command: 0 success; 1 the run failed (network, hub, disk, a crash after
start-up, a lost rank); 2 the command line is wrong (a flag, a value, a combination, a model that is not
there or not usable); 130 interrupted."""

from __future__ import annotations

import argparse
from typing import Any

from .config import Settings, settings_from_args
from .errors import SwiftLMError


class RuntimeFailure(SwiftLMError):
    """A failure of the run, not of the command line (exit code 1)."""

    exit_code = 1


def setting_error(exc: Exception) -> str:
    """pydantic's multi-line report (with a URL) as one sentence naming the flag and the variable."""
    from pydantic import ValidationError

    from .config import flag_of

    if not isinstance(exc, ValidationError):
        return f"invalid setting: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err.get("loc") else ""
        msg = str(err.get("msg", "is invalid")).removeprefix("Value error, ")
        msg = msg[:1].lower() + msg[1:]
        where = f"{flag_of(name)} (SWIFTLM_{name.upper()})" if name in Settings.model_fields else name or "a setting"
        parts.append(f"{where} {msg}, got {err.get('input')!r}")
    return "invalid setting: " + "; ".join(parts)


def settings_of(args: argparse.Namespace) -> Settings:
    try:
        return settings_from_args(args)
    except SwiftLMError:
        raise
    except Exception as exc:  # pydantic validation of a flag or an env var
        raise SwiftLMError(setting_error(exc)) from None


def sampling_of(settings: Settings, **extra: Any) -> Any:
    """The request defaults the sampling flags set (a request's own fields override them on the server)."""
    from .sampling import SamplingParams

    return SamplingParams(
        max_tokens=settings.max_tokens,
        temperature=settings.temp,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repeat_penalty,
        repetition_context_size=settings.repeat_last_n,
        seed=settings.seed,
        **extra,
    )


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
