"""``--access-log``: one line per request on stderr.

    POST /v1/chat/completions 200 model=smollm2-135m-instruct tokens_in=31 tokens_out=8 ttft=0.042 duration=0.118

An ASGI middleware opens a ``Record`` for each request; the figures come from where the server already
counts them for /metrics (``Metrics`` notes its prompt-token, generated-token and time-to-first-token
observations on the current request's record, see metrics.py), so no route knows about this log.  The
line is written when the response has been sent (a stream's last chunk included); times are seconds,
``-`` where a request had no such figure (no model, no token)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("swiftlm.access")


@dataclass
class Record:
    model_of: Callable[[], str | None] = lambda: None
    model: str | None = None
    status: int | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    ttft: float | None = None
    start: float = field(default_factory=time.perf_counter)


# The request being handled; tasks the request starts (its stream) see the same record.
CURRENT: ContextVar[Record | None] = ContextVar("swiftlm_access_record", default=None)


def note_prompt(n: float) -> None:
    rec = CURRENT.get()
    if rec is not None:
        rec.tokens_in += int(n)
        if rec.model is None:  # the request's model is chosen by now (state.select_model)
            rec.model = rec.model_of()


def note_output(n: float) -> None:
    rec = CURRENT.get()
    if rec is not None:
        rec.tokens_out += int(n)


def note_ttft(seconds: float) -> None:
    rec = CURRENT.get()
    if rec is not None and rec.ttft is None:  # the first choice's first token
        rec.ttft = seconds


def line(method: str, path: str, rec: Record, end: float) -> str:
    ttft = f"{rec.ttft:.3f}" if rec.ttft is not None else "-"
    return (
        f"{method} {path} {rec.status or '-'} model={rec.model or '-'} tokens_in={rec.tokens_in} "
        f"tokens_out={rec.tokens_out} ttft={ttft} duration={end - rec.start:.3f}"
    )


def _stderr_logger() -> Callable[[str], None]:
    """``swiftlm.access`` at INFO, whatever the root logger's level: the flag asked for these lines; on stderr
    through a handler of its own unless one was configured."""
    log.setLevel(logging.INFO)
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s access: %(message)s"))
        log.addHandler(h)
        log.propagate = False
    return log.info


class AccessLog:
    """ASGI middleware: a ``Record`` per HTTP request, one line when its response has been sent."""

    def __init__(self, app: Any, model_of: Callable[[], str | None], emit: Callable[[str], None] | None = None):
        self.app, self.model_of = app, model_of
        self.emit = emit or _stderr_logger()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rec = Record(model_of=self.model_of)
        token = CURRENT.set(rec)

        async def send_noting(message: dict) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        except BaseException:
            rec.status = rec.status or 500  # the server's error handler answers 500 outside this middleware
            raise
        finally:
            CURRENT.reset(token)
            self.emit(line(scope.get("method", "-"), scope.get("path", "-"), rec, time.perf_counter()))
