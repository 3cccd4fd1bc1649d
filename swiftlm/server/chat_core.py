"""A submitted chat request, read as parsed pieces: the output side of the chat service.

``ChatService.start`` (chat_service.py) submits a ``ChatJob`` (the rendered request: plan, prompt
token ids, ``SamplingParams``) as a ``ChatRun``, whose ``steps()`` yield ``Step``s: the engine's events
with the output parsed into pieces (``("reasoning", text)``, ``("content", text)``, ``("tool_call",
ToolCall)``) and, on a choice's last step, its finish reason (``stop``, ``length``, ``tool_calls``, ...).

Each route only formats those pieces into its own wire events, so the routes generate the same text
for the same prompt, sampling and seed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine import Event, QueueFull
from ..errors import InvalidRequest
from ..sampling import SamplingParams
from .schemas import ChatCompletionRequest


@dataclass
class ChatJob:
    """A rendered chat request, ready to submit."""

    req: ChatCompletionRequest
    plan: Any  # chat.plan.ChatPlan: prompt text, grammar, tool format, thinking
    prompt: list[int]  # prompt token ids (a MediaPrompt with image/audio parts)
    params: SamplingParams


@dataclass
class Step:
    """One engine event of one choice, with its output parsed."""

    index: int  # the choice
    event: Event | None  # None: nothing arrived for ``idle`` seconds (a keep-alive slot)
    pieces: list = field(default_factory=list)  # chat.tool_calls.Piece: reasoning / content / tool_call
    finish_reason: str | None = None  # on the choice's last step: stop, length, tool_calls, cancelled, error


def _in_reasoning(parser: Any) -> bool:
    return parser.reasoning is not None and parser.reasoning.state == "reasoning"


class ChatRun:
    """Submit a prepared chat request and read its output as parsed pieces.

    ``reasoning_budget`` (single choice, no grammar): once the reasoning has taken that many
    tokens and is still open, the sequence is stopped and continued from a prompt that holds
    the output so far plus the closing marker (e.g. ``</think>``), so the model goes on with the
    answer; the answer's tokens count against the same ``max_tokens``."""

    def __init__(self, service: Any, job: ChatJob, n: int = 1, reasoning_budget: int | None = None):
        self.service, self.job, self.n = service, job, n  # service: the ChatService (chat_service.py)
        self.engine = service.engine
        self.parsers = [job.plan.parser() for _ in range(n)]
        self.reasoning_tokens = [0] * n  # output tokens produced while reasoning
        self.output_ids: list[list[int]] = [[] for _ in range(n)]
        self.text = [""] * n  # the raw output text (before parsing)
        self.completion_tokens = 0  # all choices, finished ones
        self.cached_tokens = 0  # prompt tokens served from the prompt cache
        self.budget = reasoning_budget if n == 1 and job.params.grammar is None else None
        self.budget_hit = False
        self._seq: dict[int, int] = {}  # live sequence id -> choice
        self._done_tokens = [0] * n  # tokens of sequences stopped for the budget
        self._q: asyncio.Queue | None = None
        self._buf: deque = deque()  # events taken from _q, not yet handled
        self._sink: Any = None

    def start(self) -> None:
        """Submit (APIError 429 when the queue is full, 400 on a request the engine refuses)."""
        self._sink, self._q = self.service.sink()
        ids = self.service.submit(self.job.prompt, self.job.params, self.n, self._sink)
        self._seq = {sid: i for i, sid in enumerate(ids)}

    def cancel(self) -> None:
        for sid in list(self._seq):
            self.engine.cancel(sid)
        self._seq.clear()

    async def steps(self, idle: float | None = None) -> AsyncIterator[Step]:
        """The output, one Step per engine event; an errored step ends the iteration."""
        assert self._q is not None, "start() first"
        clock = {"start": time.perf_counter()}
        try:
            while self._seq:
                if not self._buf:
                    if idle is None:
                        self._buf.append(await self._q.get())
                    else:
                        try:
                            self._buf.append(await asyncio.wait_for(self._q.get(), idle))
                        except asyncio.TimeoutError:
                            yield Step(-1, None)
                            continue
                ev = self._next_event()
                i = self._seq.get(ev.seq_id)
                if i is None:  # a sequence we stopped for the reasoning budget
                    continue
                if ev.progress is not None:
                    yield Step(i, ev)
                    continue
                self.service.observe(ev, clock)
                if not self.budget_hit:  # a continuation's cache hits are on its own, longer prompt
                    self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
                if ev.finished:
                    del self._seq[ev.seq_id]
                if ev.error:
                    yield Step(i, ev, finish_reason="error")
                    return
                parser = self.parsers[i]
                before = _in_reasoning(parser)
                pieces = parser.feed(ev.text) if ev.text else []
                if before or _in_reasoning(parser):
                    self.reasoning_tokens[i] += len(ev.token_ids)
                self.output_ids[i] += ev.token_ids
                self.text[i] += ev.text
                if (
                    self.budget is not None
                    and not ev.finished
                    and _in_reasoning(parser)
                    and self.reasoning_tokens[i] >= self.budget
                ):
                    pieces += self._close_reasoning(ev.seq_id, i)
                    if not self._seq:  # no room left for an answer
                        pieces += parser.finish(cut=True)
                        self.completion_tokens += self._done_tokens[i]
                        yield Step(i, ev, pieces, parser.finish_reason("length"))
                        return
                    yield Step(i, ev, pieces)
                    continue
                finish = None
                if ev.finished:
                    pieces += parser.finish(cut=ev.finish_reason == "length")
                    self.completion_tokens += ev.completion_tokens + self._done_tokens[i]
                    finish = parser.finish_reason(ev.finish_reason)
                yield Step(i, ev, pieces, finish)
        finally:
            self.cancel()  # client went away or we stopped early: free the slots

    def _next_event(self) -> Event:
        """The next event, merged with the token events of the same sequence already queued behind
        it: a client (or an event loop) that falls behind the engine gets one chunk with several
        tokens instead of a backlog of one chunk per token, so the loop's cost per step stops
        growing with its lag (the h11/ASGI send per chunk is a large share of the loop's time at
        many streams).  Without lag nothing merges.  Not with a reasoning budget, which counts
        tokens event by event."""
        q = self._q
        while not q.empty():
            self._buf.append(q.get_nowait())
        ev = self._buf.popleft()
        if self.budget is not None:
            return ev
        while self._buf and _mergeable(ev, self._buf[0]):
            nxt = self._buf.popleft()
            ev = replace(
                nxt,
                text=ev.text + nxt.text,
                token_ids=ev.token_ids + nxt.token_ids,
                logprobs=ev.logprobs + nxt.logprobs,
                cached_tokens=max(ev.cached_tokens, nxt.cached_tokens),
            )
        return ev

    def _close_reasoning(self, seq_id: int, i: int) -> list:
        """Stop sequence ``seq_id`` at the reasoning budget and continue it past the end marker."""
        self.budget_hit = True
        self.engine.cancel(seq_id)
        del self._seq[seq_id]
        parser = self.parsers[i]
        end = parser.reasoning.pair[1]
        self._done_tokens[i] = len(self.output_ids[i])
        pieces = parser.feed(end + "\n\n")  # the parser leaves reasoning; the blank lines are layout
        close = ("" if self.text[i].endswith("\n") else "\n") + end + "\n\n"
        tail = self.engine.tokenizer.encode(close, add_special_tokens=False)
        prompt = list(self.job.prompt) + self.output_ids[i] + tail
        params: SamplingParams = self.job.params
        room = min(params.max_tokens - len(self.output_ids[i]), self.engine.ctx_size - len(prompt))
        if room <= 0 or hasattr(self.job.prompt, "media"):  # media prompts carry arrays: not re-submitted
            return pieces
        try:
            sid = self.engine.submit(prompt, replace(params, max_tokens=room, stop=list(params.stop)), self._sink)
        except (QueueFull, InvalidRequest):
            return pieces  # the answer cannot start: the output ends here, as if cut by max_tokens
        self._seq[sid] = i
        return pieces

    def stop_sequence(self, i: int = 0) -> str | None:
        """Which of the request's stop strings ended choice ``i`` (None: EOS, or not a stop)."""
        stops = [s for s in self.job.params.stop if s]
        ids = self.output_ids[i]
        if not stops or not ids or ids[-1] in self.engine.tokenizer.eos_token_ids:
            return None
        full = self.engine.tokenizer.decode(ids)
        rest = full[len(self.text[i]) :] if full.startswith(self.text[i]) else full
        hits = [(rest.find(s), k, s) for k, s in enumerate(stops) if rest.find(s) >= 0]
        return min(hits)[2] if hits else None


def _mergeable(a: Event, b: Event) -> bool:
    """Two consecutive token events of one sequence, the first neither final nor an error."""
    return (
        a.seq_id == b.seq_id
        and a.progress is None
        and b.progress is None
        and not a.finished
        and a.error is None
        and b.error is None
    )
