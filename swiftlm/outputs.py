"""Turning sampled token ids into what callers receive, off the engine's step loop.

The engine thread only samples ids, checks the conditions that need no text (EOS, stop
token ids, max tokens, context) and hands each step's ids to the ``OutputWorker`` thread
in one message.  The worker detokenises incrementally, matches stop strings, decodes
logprob tokens and delivers ``Event``s: one wake-up of each asyncio loop per step for all
of that loop's requests (not one per token).  While it works, the engine thread is already
preparing and running the next step; torch and MLX release the GIL inside their kernels,
so the two overlap even on the CPU.

A stop string is found here, one or two steps after its token was sampled: the worker ends
the request (the caller sees exactly the text before the stop string) and asks the engine
to drop the sequence; tokens the engine sampled meanwhile are discarded.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .detokenizer import IncrementalDetokenizer, StopMatcher

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # what a -inf (or NaN) logprob is reported as: JSON has no infinities


def _finite(x: float) -> float:
    return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class TokenLogprob:
    token: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class Event:
    seq_id: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    progress: tuple[int, int] | None = None  # (prompt tokens processed, prompt tokens) during prefill
    cached_tokens: int = 0  # prompt tokens served from the prompt cache


Sink = Callable[[Event], None]


class SyncSink:
    def __init__(self) -> None:
        self.q: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def __call__(self, ev: Event) -> None:
        self.q.put(ev)

    def __iter__(self):
        while True:
            ev = self.q.get()
            yield ev
            if ev.finished:
                return


def submit_choices(engine: Any, prompt: list[int], params: list[Any]) -> list[SyncSink]:
    """Submit the choices of one prompt (``params``: one SamplingParams each) and return one
    blocking sink per choice.  Where the engine has ``submit_group`` the prompt is prefilled once
    and forked (fork.py): the group's events arrive on one queue and are routed here by sequence
    id; otherwise each choice is an ordinary request."""
    if len(params) > 1 and hasattr(engine, "submit_group"):
        shared = SyncSink()
        ids = engine.submit_group(prompt, params, shared)
        sinks = [SyncSink() for _ in ids]
        route = dict(zip(ids, sinks))

        left = [len(ids)]

        def pump() -> None:  # on the first read of any choice: until every choice has finished
            while left[0]:
                ev = shared.q.get()
                route[ev.seq_id].q.put(ev)
                left[0] -= ev.finished

        return [_Routed(s, pump) for s in sinks]
    sinks, ids = [], []
    try:
        for p in params:
            sink = SyncSink()
            ids.append(engine.submit(prompt, p, sink))
            sinks.append(sink)
    except Exception:
        for sid in ids:
            engine.cancel(sid)
        raise
    return sinks


class _Routed(SyncSink):
    """One choice's events of a group: the group's queue is drained into the choices' queues
    on the first read of any of them (the choices are read one after another)."""

    def __init__(self, sink: SyncSink, pump: Callable[[], None]) -> None:
        self.q, self._pump = sink.q, pump

    def __iter__(self):
        self._pump()
        return super().__iter__()


def _put_all(pairs: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, ev in pairs:
        q.put_nowait(ev)


class AsyncSink:
    """Events for coroutines of one event loop.  The worker delivers a step's events for
    every sink of a loop in one ``call_soon_threadsafe`` (``deliver``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.q: asyncio.Queue[Event] = asyncio.Queue()

    def __call__(self, ev: Event) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ev)

    async def __aiter__(self):
        while True:
            ev = await self.q.get()
            yield ev
            if ev.finished:
                return


def deliver(pairs: list[tuple[Sink, Event]]) -> None:
    """Hand events to their sinks: one wake-up per asyncio loop, direct calls otherwise."""
    by_loop: dict[Any, list[tuple[asyncio.Queue, Event]]] = {}
    for sink, ev in pairs:
        if isinstance(sink, AsyncSink):
            by_loop.setdefault(sink.loop, []).append((sink.q, ev))
        else:
            try:
                sink(ev)
            except Exception:  # pragma: no cover - a broken sink must not stop the others
                log.exception("event sink failed")
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop closed (the client's server is gone): nobody is listening
            pass


@dataclass
class Stream:
    """The worker's side of one request."""

    seq_id: int
    sink: Sink
    detok: IncrementalDetokenizer
    stop: StopMatcher
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    done: bool = False


@dataclass
class Out:
    """One sequence's share of a step: a token (or none), and how it ended if it did."""

    seq_id: int
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    reason: str | None = None  # set when the engine finished the sequence
    error: str | None = None
    progress: tuple[int, int] | None = None
    cached_tokens: int | None = None


class OutputWorker:
    def __init__(self, tokenizer: Any, on_stop: Callable[[int], None], timers: Any = None, thread: bool = True):
        """``thread=False``: no thread of its own; the caller runs ``process`` (the engine-process
        client's reader thread does, as each step's message arrives)."""
        self.tok = tokenizer
        self.timers = timers  # timers.StepTimers: the "output" phase
        self.on_stop = on_stop  # tell the engine a stop string ended this sequence
        self.streams: dict[int, Stream] = {}
        self.q: queue.SimpleQueue[list[Out] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="swiftlm-output", daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    def open(self, seq_id: int, sink: Sink, stops: list[str], prompt_tokens: int) -> None:
        self.streams[seq_id] = Stream(seq_id, sink, IncrementalDetokenizer(self.tok), StopMatcher(stops), prompt_tokens)

    def put(self, outs: list[Out]) -> None:
        if outs:
            self.q.put(outs)

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self.q.put(None)
            self._thread.join(timeout)

    def end_all(self, reason: str, error: str | None = None) -> None:
        """End every open stream now (the engine process died or was stopped)."""
        self.process([Out(sid, reason=reason, error=error) for sid in list(self.streams)])

    def _run(self) -> None:
        while True:
            outs = self.q.get()
            if outs is None:
                return
            self.process(outs)

    def process(self, outs: list[Out]) -> None:
        """One step's outputs: text, stop strings, events delivered (one wake-up per loop)."""
        if not outs:
            return
        t0 = time.perf_counter()
        pairs: list[tuple[Sink, Event]] = []
        for o in outs:
            try:
                self._one(o, pairs)
            except Exception as exc:  # pragma: no cover - one stream's failure is its own
                log.exception("output processing failed for sequence %d", o.seq_id)
                st = self.streams.pop(o.seq_id, None)
                if st is not None and not st.done:
                    st.done = True
                    pairs.append(
                        (
                            st.sink,
                            Event(o.seq_id, finished=True, finish_reason="error", error=f"{type(exc).__name__}: {exc}"),
                        )
                    )
                    self.on_stop(o.seq_id)
        deliver(pairs)
        if self.timers is not None:
            self.timers.add("output", time.perf_counter() - t0)

    def _one(self, o: Out, pairs: list[tuple[Sink, Event]]) -> None:
        st = self.streams.get(o.seq_id)
        if st is None or st.done:
            if o.reason is not None:
                self.streams.pop(o.seq_id, None)
            return
        if o.cached_tokens is not None:
            st.cached_tokens = o.cached_tokens
        if o.progress is not None:
            pairs.append((st.sink, Event(o.seq_id, progress=o.progress)))
            return
        text, ids, lps = "", [], []
        reason = o.reason
        if o.token is not None:
            st.completion_tokens += 1
            ids = [o.token]
            if o.logprob is not None:
                d = self.tok.decode
                lps.append(
                    TokenLogprob(
                        o.token, d([o.token]), _finite(o.logprob), [(i, d([i]), _finite(lp)) for i, lp in (o.top or [])]
                    )
                )
            if reason == "stop":  # EOS / stop token: not part of the text
                text = st.stop.feed(st.detok.flush())[0] + st.stop.flush()
            else:
                text, stopped = st.stop.feed(st.detok.add(o.token))
                if stopped:
                    reason = "stop"
                    self.on_stop(o.seq_id)
        if reason is not None:
            if reason == "length" or o.token is None:  # a token-less end (the engine's, e.g. json_close)
                text += st.stop.feed(st.detok.flush())[0] + st.stop.flush()
            st.done = True
            self.streams.pop(o.seq_id, None)
        ev = Event(
            o.seq_id,
            text,
            ids,
            lps,
            prompt_tokens=st.prompt_tokens,
            completion_tokens=st.completion_tokens,
            cached_tokens=st.cached_tokens,
        )
        if reason is not None:
            ev.finished, ev.finish_reason, ev.error = True, reason, o.error
        pairs.append((st.sink, ev))
