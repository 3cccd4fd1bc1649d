"""The engine's request intake: submitting (one prompt, or the choices of one request), the engine
process's already-checked submissions, embeddings, cancelling and ending requests.  These run in the
caller's thread and reach the engine thread only through its inbox; they touch no model state.
``EngineRequests`` is a mixin of ``engine.Engine``; ``_Live`` is the engine's record of a request."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest
from .outputs import Sink
from .prompt_side import pooled
from .sampling import SamplerState, SamplingParams
from .scheduler import Sequence
from .turboquant.presets import admitted_format


@dataclass
class _Live:
    seq: Sequence
    submitted: float
    first_token_at: float | None = None
    cached_tokens: int = 0
    prefix_pending: bool = False  # look the prompt cache up when the sequence is about to run
    commit_blocks: bool | None = None  # its full KV blocks join the prefix cache (paged pool; None: not decided)
    fork: Any = None  # a fork group member's prompt KV source, taken when it is admitted (fork.py)


class EngineRequests:
    """The caller's-thread methods of ``engine.Engine``, which holds ``model``, ``tokenizer``, ``info``,
    ``outputs``, ``fatal``, ``_inbox`` and ``_lock``/``_pending``, and provides ``_end_orphans`` (and,
    through ``PromptSide``, ``_check``, ``_check_embed``, ``_take_slot`` and ``_take_slots``)."""

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> Future[list[Any]]:
        """Embeddings of token lists (one job for the batch, run by the engine thread between
        steps): a future of L2-normalised float32 vectors, pooled as ``info.pooling`` says."""
        if not self.model.can_embed:
            raise InvalidRequest(f"the {getattr(self, 'backend_name', 'loaded')} backend does not compute embeddings")
        self._check_embed(prompts)
        raw: Future[list[Any]] = Future()
        self._inbox.put(("embed", (prompts, raw)))
        return pooled(raw, self.info.pooling, dimensions)

    def submit(self, prompt_tokens: list[int], params: SamplingParams, sink: Sink) -> int:
        self._check(prompt_tokens, params)
        seq_id = self._take_slot(params)
        try:
            live = self._make_live(
                seq_id, prompt_tokens, params, getattr(prompt_tokens, "media", None), time.perf_counter()
            )
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        self.outputs.open(seq_id, sink, params.stop, len(live.seq.prompt_tokens))
        self._inbox.put(("add", live))
        if self.fatal is not None:  # the loop died after the checks above: end it here, not never
            self._end_orphans()
        return seq_id

    def submit_group(self, prompt_tokens: list[int], params: list[SamplingParams], sink: Sink) -> list[int]:
        """The choices of one request (``n`` / ``best_of``; one ``SamplingParams`` each, e.g.
        ``params.for_choice(i)``): one sequence id per choice, all on ``sink``.  The prompt is
        prefilled once and its KV forked into the others (fork.py)."""
        if len(params) == 1:
            return [self.submit(prompt_tokens, params[0], sink)]
        for p in params:
            self._check(prompt_tokens, p)
        ids = self._take_slots(params)
        now, media = time.perf_counter(), getattr(prompt_tokens, "media", None)
        try:
            lives = [self._make_live(sid, prompt_tokens, p, media, now) for sid, p in zip(ids, params)]
        except BaseException:
            with self._lock:
                self._pending -= len(ids)
            raise
        for live in lives:
            self.outputs.open(live.seq.seq_id, sink, live.seq.params.stop, len(live.seq.prompt_tokens))
        self._inbox.put(("group", lives))
        if self.fatal is not None:
            self._end_orphans()
        return ids

    def add_group_checked(self, items: list[tuple]) -> None:
        """``submit_group`` checked and counted in another process (``engine_process``): items of
        (seq_id, prompt, params, media, submitted)."""
        try:
            lives = [self._make_live(*it) for it in items]
        except Exception as exc:
            for it in items:
                self._inbox.put(("refused", (it[0], f"{type(exc).__name__}: {exc}")))
            return
        with self._lock:
            self._pending += len(lives)
        self._inbox.put(("group", lives))
        if self.fatal is not None:
            self._end_orphans()

    def add_checked(
        self, seq_id: int, prompt_tokens: list[int], params: SamplingParams, media: Any, submitted: float
    ) -> None:
        """A request another process checked and counted already (``engine_process``): the engine
        process's side of ``submit``.  A grammar that fails to compile ends it with an error."""
        try:
            live = self._make_live(seq_id, prompt_tokens, params, media, submitted)
        except Exception as exc:
            self._inbox.put(("refused", (seq_id, f"{type(exc).__name__}: {exc}")))
            return
        with self._lock:
            self._pending += 1
        self._inbox.put(("add", live))
        if self.fatal is not None:
            self._end_orphans()

    def _make_live(
        self, seq_id: int, prompt_tokens: list[int], params: SamplingParams, media: Any, submitted: float
    ) -> _Live:
        state = SamplerState(seed=params.seed)
        if params.grammar is not None:
            from .chat.structured import Constraint

            state.constraint = Constraint(self.tokenizer, params.grammar, self.info.vocab_size)
        fmt = admitted_format(params.kv_request, self.kv_default)  # the request's KV format, decided here once
        seq = Sequence(seq_id, list(prompt_tokens), params, state, media=media, kv_format=fmt)
        state.prompt_tokens = seq.prompt_tokens
        state.output_tokens = seq.output_tokens
        return _Live(seq, submitted)

    def cancel(self, seq_id: int) -> None:
        self._inbox.put(("cancel", seq_id))

    def end_all(self, reason: str = "length") -> None:
        """End every live request now, as if it had reached its length limit: each stream gets
        its last chunk and its finish reason (the server's graceful shutdown, after the grace time)."""
        self._inbox.put(("end_all", reason))
