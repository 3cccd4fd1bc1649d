"""The loading line: a rich progress bar on stderr while a model loads or converts.

Drawn only when stderr is a terminal and ``--quiet`` is off, so logs, pipes and the machine-readable
``{"event": "ready", ...}`` line on stdout are never touched.  The backends report no progress of their
own, so the bar pulses and the clock counts; the line ends with the time it took.  While it is drawn,
whatever else is written to stderr (Python's ``sys.stderr`` and logging handlers bound to it, e.g.
uvicorn's start-up lines) is printed above the bar instead of through it."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def wanted(quiet: bool = False, stream: Any = None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return not quiet and bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def _handlers_on(stream: Any) -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler) and h.stream is stream]


@contextmanager
def loading_line(label: str, done: str | None = None, quiet: bool = False) -> Iterator[None]:
    """``label`` (e.g. "loading smollm2-135m-instruct") with a pulsing bar and a clock while the body runs;
    then ``done`` ("loaded ...") and the seconds, unless the body raised (its error says what happened)."""
    if not wanted(quiet):
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    real = sys.stderr
    console = Console(file=real)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=True,
    )
    progress.add_task(label, total=None)
    t0 = time.perf_counter()
    moved: list[tuple[logging.StreamHandler, Any]] = []
    with progress:
        for h in _handlers_on(real):  # logging bound to the terminal writes above the bar while it is drawn
            moved.append((h, h.setStream(sys.stderr)))
        try:
            yield
        finally:
            for h, old in moved:
                h.setStream(old)
    console.print(f"[green]✓[/] {done or label} in {time.perf_counter() - t0:.1f} s", highlight=False)
