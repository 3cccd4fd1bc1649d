"""What an engine's front (``engine.Engine`` and ``engine_process.EngineClient`` alike) counts before a
request goes in: whether it takes requests at all (``Lifecycle``) and the queue's slots and request ids
(``Slots``).  Both are shared by composition; ``delegated`` declares the attributes that an engine
forwards to the object that owns them."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

from .errors import SwiftLMError
from .sampling import SamplingParams


class QueueFull(SwiftLMError):
    pass


class Lifecycle:
    """Whether an engine takes requests.  ``fatal``: why its loop (or its process) died, set once by the
    owner (then new requests are a 503 and /health says so); ``stopping``: it is shutting down.  Written
    by the owner's thread, read by the checks on the callers' threads."""

    def __init__(self) -> None:
        self.fatal: str | None = None
        self.stopping = False

    def refusal(self) -> str | None:
        """Why a new request is refused now (QueueFull: a 503), or None."""
        if self.fatal or self.stopping:
            return self.fatal or "the server is shutting down"
        return None


class Slots:
    """The queue's slots: requests submitted and not finished (``pending``, guarded by ``lock``) against
    ``max_queue`` waiting plus ``max_running`` running, and the ids they get (``ids``: a data-parallel
    replica set numbers each engine's requests apart, distributed/replicas.py).  Callers' threads take
    slots; whoever sees a request end gives its slot back."""

    def __init__(self, max_queue: int, max_running: int, default_max_tokens: int, ids: Iterator[int] | None = None):
        self.max_queue = max_queue
        self.max_running = max_running
        self.default_max_tokens = default_max_tokens
        self.ids: Iterator[int] = ids if ids is not None else itertools.count(1)
        self.pending = 0
        self.lock = threading.Lock()

    def take(self, params: SamplingParams) -> int:
        """Count a new request against the queue (429 when full), give it an id and its default max_tokens."""
        with self.lock:
            if self.pending >= self.max_queue + self.max_running:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            self.pending += 1
        seq_id = next(self.ids)
        if params.max_tokens is None:
            params.max_tokens = self.default_max_tokens
        return seq_id

    def take_all(self, params: list[SamplingParams]) -> list[int]:
        """``take`` for each choice of one request, all or none (a full queue gives back the slots
        already taken)."""
        ids: list[int] = []
        try:
            for p in params:
                ids.append(self.take(p))
        except QueueFull:
            self.give_back(len(ids))
            raise
        return ids

    def add(self, n: int = 1) -> None:
        """``n`` requests counted elsewhere (the engine process's parent) come in."""
        with self.lock:
            self.pending += n

    def give_back(self, n: int = 1) -> None:
        with self.lock:
            self.pending -= n


def delegated(owner: str, name: str, doc: str = "") -> Any:
    """An attribute of an engine that lives on one of its parts: ``tool_parser = delegated("prompts",
    "tool_parser")`` reads and sets ``self.prompts.tool_parser``.  Settings that callers (make_engine, a
    replica set's broadcast) set on the engine reach the part that reads them."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, owner), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, put, doc=doc or f"``{owner}.{name}``")
