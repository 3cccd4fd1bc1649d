"""The engine's intake: submitting (one prompt, or the choices of one request), the engine process's
already-checked submissions, embeddings, cancelling and ending requests.  These run in the caller's
thread and reach the engine thread only through its inbox; they touch no model state.  ``Live`` is
the engine's record of a request (the engine thread's from the moment it is in the inbox)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest
from .outputs import OutputWorker, Sink
from .prompts import Prompts, pooled
from .sampling import SamplerState, SamplingParams
from .scheduler import Sequence
from .slots import Lifecycle, Slots
from .turboquant.presets import KVFormat, admitted_format


@dataclass
class Live:
    seq: Sequence
    submitted: float
    first_token_at: float | None = None
    cached_tokens: int = 0
    prefix_pending: bool = False  # look the prompt cache up when the sequence is about to run
    commit_blocks: bool | None = None  # its full KV blocks join the prefix cache (paged pool; None: not decided)
    fork: Any = None  # a fork group member's prompt KV source, taken when it is admitted (fork.py)


def make_live(
    seq_id: int,
    prompt_tokens: list[int],
    params: SamplingParams,
    media: Any,
    submitted: float,
    *,
    tokenizer: Any,
    vocab_size: int,
    kv_default: KVFormat,
) -> Live:
    """A request's record, its sampler state (a grammar compiled here) and its KV format, decided here once."""
    state = SamplerState(seed=params.seed)
    if params.grammar is not None:
        from .chat.structured import Constraint

        state.constraint = Constraint(tokenizer, params.grammar, vocab_size)
    fmt = admitted_format(params.kv_request, kv_default)
    seq = Sequence(seq_id, list(prompt_tokens), params, state, media=media, kv_format=fmt)
    state.prompt_tokens = seq.prompt_tokens
    state.output_tokens = seq.output_tokens
    return Live(seq, submitted)


class Intake:
    """The caller's-thread side of ``engine.Engine``: checks (``prompts``), a queue slot (``slots``), the
    request's record, its stream opened on ``outputs``, then a command into ``inbox`` for the engine
    thread.  ``life``: the engine's lifecycle; ``on_dead``: called when a request went in after the loop
    died (the engine ends it and every other orphan then, not never)."""

    def __init__(
        self,
        model: Any,
        prompts: Prompts,
        slots: Slots,
        life: Lifecycle,
        inbox: queue.SimpleQueue,
        outputs: OutputWorker | None,
        kv_default: KVFormat,
        on_dead: Callable[[], None],
    ):
        self.model = model
        self.prompts = prompts
        self.slots = slots
        self.life = life
        self.inbox = inbox
        self.outputs = outputs  # None in an engine process: its parent's worker has the streams
        self.kv_default = kv_default
        self.on_dead = on_dead
        self.backend_name = "loaded"  # for error messages (make_engine sets it)

    def _make_live(
        self, seq_id: int, prompt_tokens: list[int], params: SamplingParams, media: Any, submitted: float
    ) -> Live:
        p = self.prompts
        return make_live(
            seq_id,
            prompt_tokens,
            params,
            media,
            submitted,
            tokenizer=p.tokenizer,
            vocab_size=p.info.vocab_size,
            kv_default=self.kv_default,
        )

    def _put(self, cmd: str, arg: Any) -> None:
        self.inbox.put((cmd, arg))
        if self.life.fatal is not None:  # the loop died after the checks: end it here, not never
            self.on_dead()

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> Future[list[Any]]:
        """Embeddings of token lists (one job for the batch, run by the engine thread between
        steps): a future of L2-normalised float32 vectors, pooled as ``info.pooling`` says."""
        if not self.model.can_embed:
            raise InvalidRequest(f"the {self.backend_name} backend does not compute embeddings")
        self.prompts.check_embed(prompts)
        return pooled(self.hidden_states(prompts), self.prompts.info.pooling, dimensions)

    def hidden_states(self, prompts: list[list[int]]) -> Future[list[Any]]:
        """The model's hidden states of checked token lists, computed by the engine thread between steps
        (``embed`` pools them; the engine process sends them to its parent to pool)."""
        raw: Future[list[Any]] = Future()
        self.inbox.put(("embed", (prompts, raw)))
        return raw

    def submit(self, prompt_tokens: list[int], params: SamplingParams, sink: Sink) -> int:
        self.prompts.check(prompt_tokens, params)
        seq_id = self.slots.take(params)
        try:
            live = self._make_live(
                seq_id, prompt_tokens, params, getattr(prompt_tokens, "media", None), time.perf_counter()
            )
        except BaseException:
            self.slots.give_back()
            raise
        self.outputs.open(seq_id, sink, params.stop, len(live.seq.prompt_tokens))
        self._put("add", live)
        return seq_id

    def submit_group(self, prompt_tokens: list[int], params: list[SamplingParams], sink: Sink) -> list[int]:
        """The choices of one request (``n`` / ``best_of``; one ``SamplingParams`` each, e.g.
        ``params.for_choice(i)``): one sequence id per choice, all on ``sink``.  The prompt is
        prefilled once and its KV forked into the others (fork.py)."""
        if len(params) == 1:
            return [self.submit(prompt_tokens, params[0], sink)]
        for p in params:
            self.prompts.check(prompt_tokens, p)
        ids = self.slots.take_all(params)
        now, media = time.perf_counter(), getattr(prompt_tokens, "media", None)
        try:
            lives = [self._make_live(sid, prompt_tokens, p, media, now) for sid, p in zip(ids, params)]
        except BaseException:
            self.slots.give_back(len(ids))
            raise
        for live in lives:
            self.outputs.open(live.seq.seq_id, sink, live.seq.params.stop, len(live.seq.prompt_tokens))
        self._put("group", lives)
        return ids

    def add_group_checked(self, items: list[tuple]) -> None:
        """``submit_group`` checked and counted in another process (``engine_process``): items of
        (seq_id, prompt, params, media, submitted)."""
        try:
            lives = [self._make_live(*it) for it in items]
        except Exception as exc:
            for it in items:
                self.inbox.put(("refused", (it[0], f"{type(exc).__name__}: {exc}")))
            return
        self.slots.add(len(lives))
        self._put("group", lives)

    def add_checked(
        self, seq_id: int, prompt_tokens: list[int], params: SamplingParams, media: Any, submitted: float
    ) -> None:
        """A request another process checked and counted already (``engine_process``): the engine
        process's side of ``submit``.  A grammar that fails to compile ends it with an error."""
        try:
            live = self._make_live(seq_id, prompt_tokens, params, media, submitted)
        except Exception as exc:
            self.inbox.put(("refused", (seq_id, f"{type(exc).__name__}: {exc}")))
            return
        self.slots.add()
        self._put("add", live)

    def cancel(self, seq_id: int) -> None:
        self.inbox.put(("cancel", seq_id))

    def stopped(self, seq_id: int) -> None:
        """The output worker found a stop string (it told the caller already): the engine drops the sequence."""
        self.inbox.put(("stopped", seq_id))

    def end_all(self, reason: str = "length") -> None:
        """End every live request now, as if it had reached its length limit: each stream gets
        its last chunk and its finish reason (the server's graceful shutdown, after the grace time)."""
        self.inbox.put(("end_all", reason))
