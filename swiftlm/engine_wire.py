"""The messages between the server and an engine process (engine_process.py, engine_child.py).

Each message is one typed dataclass, pickled (protocol 5) and written with ``send_bytes`` on a
``multiprocessing`` connection (a socketpair).  A receiver dispatches on the class.  Outputs inside
``Step`` stay plain tuples (an ``Out``'s fields in order): one step of 256 streams is 256 of them, and
a tuple pickles in a fraction of a dataclass's time.

Server -> engine: ``Setup`` (first, on the owner's connection only), ``Add``, ``Group``, ``Cancel``,
``Stopped``, ``EndAll``, ``Embed``, ``Stop`` (the owner's connection only).
Engine -> server: ``Ready`` or ``LoadError`` (once), then ``Step`` per engine step, ``Embedded``,
``Fatal``, ``Bye``.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from .outputs import Out
from .stats import EngineStats, LatencyHistogram

PROTOCOL = pickle.HIGHEST_PROTOCOL  # 5 on every supported Python


def dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def picklable(exc: BaseException) -> BaseException:
    """``exc`` itself when it pickles, else a RuntimeError carrying its type and text."""
    try:
        pickle.dumps(exc, protocol=PROTOCOL)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------- server -> engine
@dataclass(slots=True)
class Setup:
    """What the engine process loads; ``conns``: how many connections it serves (1 + API workers)."""

    settings: Any
    backend: str
    spec: Any
    conns: int = 1


@dataclass(slots=True)
class Add:
    seq_id: int
    prompt: list[int]
    params: Any  # SamplingParams
    media: Any
    t: float  # time.perf_counter() at submit (the queue-time clock)


@dataclass(slots=True)
class Group:
    """The choices of one request (n > 1): prefilled once in the engine process."""

    adds: list[Add]


@dataclass(slots=True)
class Cancel:
    seq_id: int


@dataclass(slots=True)
class Stopped:
    """The server's output worker found a stop string: the engine ends the sequence, telling nobody."""

    seq_id: int


@dataclass(slots=True)
class EndAll:
    """End every live sequence of the engine (the drain's deadline) with ``reason``."""

    reason: str


@dataclass(slots=True)
class Embed:
    job: int
    prompts: list[list[int]]


@dataclass(slots=True)
class Stop:
    grace: float


# ---------------------------------------------------------------------------------- engine -> server
@dataclass(slots=True)
class Ready:
    """Start-up facts (info, ctx_size, max_running, ...) and the first stats snapshot; ``conn``: the
    index of the connection it came on (its sequence ids' owner)."""

    facts: dict[str, Any]
    conn: int = 0


@dataclass(slots=True)
class LoadError:
    error: BaseException


@dataclass(slots=True)
class Step:
    """One engine step's outputs for this connection's sequences, those that ended, and (at most every
    ``SNAPSHOT_EVERY`` seconds, and when a request ended or the engine went idle) a stats snapshot."""

    outs: list[tuple] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    snap: dict[str, Any] | None = None


@dataclass(slots=True)
class Embedded:
    job: int
    ok: bool
    payload: Any


@dataclass(slots=True)
class Fatal:
    why: str


@dataclass(slots=True)
class Bye:
    pass


def enc_out(o: Out) -> tuple:
    return (o.seq_id, o.token, o.logprob, o.top, o.reason, o.error, o.progress, o.cached_tokens)


# ---------------------------------------------------------------------------------- stats snapshots
_HISTS = ("ttft", "queue_time", "duration", "tpot")


def _hist_state(h: LatencyHistogram) -> tuple:
    return (h.buckets, list(h.counts), h.count, h.sum, h.max)


def _hist_from(state: tuple) -> LatencyHistogram:
    h = LatencyHistogram(state[0])
    h.counts, h.count, h.sum, h.max = state[1], state[2], state[3], state[4]
    return h


def stats_state(st: EngineStats) -> dict:
    d = {k: v for k, v in vars(st).items() if k not in _HISTS}
    d["finished"] = dict(st.finished)
    for k in _HISTS:
        d[k] = _hist_state(getattr(st, k))
    return d


def stats_from(d: dict) -> EngineStats:
    st = EngineStats()
    for k, v in d.items():
        setattr(st, k, _hist_from(v) if k in _HISTS else v)
    return st
