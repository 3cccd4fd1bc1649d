"""The chat service: the one object that builds a request's prompt and sampling parameters and submits it.

Each wire module (OpenAI, Anthropic, Responses, Ollama) parses its request into the internal chat request
(``ChatCompletionRequest``), calls ``prepare`` (template, tools, reasoning switch, grammar, ``params``;
an APIError 4xx on bad input) and ``start`` (a ``chat_core.ChatRun``: parsed pieces, finish reasons, token
counts), and renders the result in its own format, so every route generates the same text for the same
prompt, sampling and seed.  ``submit`` / ``gather`` serve unparsed output (``best_of``, /v1/completions).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ..chat.plan import ChatPlan
from ..chat.structured import grammar_for
from ..engine import Event, QueueFull, TokenLogprob
from ..errors import InvalidRequest
from ..sampling import SamplingParams
from .chat_core import ChatJob, ChatRun
from .errors import APIError
from .models import ADAPTER
from .schemas import ChatCompletionRequest


def renamed(exc: APIError, rename: dict[str, str] | None) -> APIError:
    """``exc`` with its ``param``'s leading field renamed (messages[2].content -> input[2].content)."""
    if rename and exc.param is not None:
        head, dot, rest = exc.param.partition(".")
        base, bracket, idx = head.partition("[")
        if base in rename:
            exc.param = rename[base] + bracket + idx + dot + rest
    return exc


class ChatService:
    def __init__(self, state: Any):
        self.state = state  # holds engine, settings, spec, metrics

    @property
    def engine(self) -> Any:
        eng = self.state.engine
        if eng is None:
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading")
        return eng

    def body_limit(self) -> int:
        """--max-body-bytes, raised to fit one full-size media part (base64) when media are on."""
        st = self.state.settings
        limit = st.max_body_bytes
        if st.vision or st.audio:
            limit = max(limit, st.max_media_bytes * 4 // 3 + (1 << 20))
        return limit

    # ------------------------------------------------------------------ request -> prompt and parameters
    async def prepare(
        self, req: ChatCompletionRequest, *, clamp_max_tokens: bool = False, rename: dict[str, str] | None = None
    ) -> ChatJob:
        """Template, grammar and sampling parameters of a chat request; APIError (4xx) on bad input.

        ``clamp_max_tokens``: a max_tokens at or beyond the context is cut to what fits instead of
        refused (Anthropic clients send large required values). ``rename`` maps the internal field
        names in an error's ``param`` (``messages``, ``response_format``...) to the route's own."""
        try:
            plan, prompt = await self.render(req)
            top = req.top_logprobs or 0
            if top and not req.logprobs:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return self._job(req, plan, prompt, clamp_max_tokens)
        except APIError as exc:
            raise renamed(exc, rename) from None

    def prepare_raw(self, text: str, req: ChatCompletionRequest) -> ChatJob:
        """A prompt tokenized as written, no chat template (Ollama's ``raw``), with ``req``'s sampling."""
        grammar = self._grammar(req)
        try:
            prompt = self.engine.text_prompt(text)
        except InvalidRequest as exc:
            raise APIError(400, str(exc)) from None
        plan = ChatPlan(text, grammar=grammar, thinking=bool(req.enable_thinking))
        return self._job(req, plan, prompt, clamp_max_tokens=True)

    def _job(self, req: ChatCompletionRequest, plan: Any, prompt: list[int], clamp_max_tokens: bool) -> ChatJob:
        max_tokens = req.max_completion_tokens or req.max_tokens
        if clamp_max_tokens and max_tokens is not None:
            max_tokens = min(max_tokens, self.engine.ctx_size - 1)
        params = self.params(req, len(prompt), max_tokens, req.logprobs, req.top_logprobs or 0)
        params.grammar = plan.grammar
        return ChatJob(req, plan, prompt, params)

    def _grammar(self, req: ChatCompletionRequest) -> str | None:
        if req.response_format is None:
            return None
        try:
            return grammar_for(req.response_format.model_dump())
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param="response_format") from None

    async def render(self, req: ChatCompletionRequest) -> tuple[Any, list[int]]:
        """The chat plan (template, tools, grammar, reasoning switch) and the prompt's token ids."""
        engine = self.engine
        grammar = self._grammar(req)
        kwargs = dict(req.chat_template_kwargs or {})
        thinking = (
            req.enable_thinking
            if req.enable_thinking is not None
            else kwargs.pop("enable_thinking", self.state.settings.thinking)
        )
        kwargs.pop("enable_thinking", None)

        def render() -> tuple[Any, list[int]]:  # media decoding and preprocessing run off the event loop
            plan = engine.plan_chat(
                req.messages,
                tools=req.tools,
                tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls,
                thinking=bool(thinking),
                template_kwargs=kwargs,
                response_format_grammar=grammar,
            )
            return plan, engine.encode_plan(plan)

        try:
            return await asyncio.to_thread(render)
        except InvalidRequest as exc:
            raise APIError(exc.status, str(exc), param=exc.param or "messages") from None

    def params(self, req: Any, prompt_len: int, max_tokens: int | None, logprobs: bool, top: int) -> SamplingParams:
        """A request's sampling fields (chat or completion request), the server's defaults for the rest."""
        s = self.state.settings
        ctx = self.engine.ctx_size
        if max_tokens is not None and max_tokens >= ctx:
            raise APIError(400, f"'max_tokens' is {max_tokens} but the context is {ctx} tokens", param="max_tokens")
        room = ctx - prompt_len
        if room <= 0:
            raise APIError(400, f"the prompt has {prompt_len} tokens but the context is {ctx}", param="messages")
        bias: dict[int, float] = {}
        for k, v in (req.logit_bias or {}).items():
            try:
                bias[int(k)] = float(v)
            except ValueError:
                raise APIError(400, f"'logit_bias' key {k!r} is not a token id", param="logit_bias") from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        p = SamplingParams(
            max_tokens=min(max_tokens or s.max_tokens, room),
            temperature=s.temp if req.temperature is None else req.temperature,
            top_p=s.top_p if req.top_p is None else req.top_p,
            top_k=s.top_k if req.top_k is None else req.top_k,
            min_p=s.min_p if req.min_p is None else req.min_p,
            repetition_penalty=s.repeat_penalty if req.repetition_penalty is None else req.repetition_penalty,
            repetition_context_size=s.repeat_last_n,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=bias,
            seed=req.seed if req.seed is not None else s.seed,
            stop=stop,
            logprobs=logprobs,
            top_logprobs=top,
            turbo_kv=req.turbo_kv,
            kv_bits=req.kv_bits,
            kv_group_size=req.kv_group_size,
            adapter=ADAPTER.get(),
        )  # a LoRA adapter named by the request's 'model' (server/models.py)
        try:
            return p.validate(self.engine.info.vocab_size)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    # ------------------------------------------------------------------ submission
    def admit(self, job: ChatJob, route: str) -> None:
        """Count an accepted request (``route``: its label in swiftlm_requests_total) and its prompt."""
        self.state.metrics.requests.labels(route).inc()
        self.state.metrics.prompt_tokens.inc(len(job.prompt))

    def start(self, job: ChatJob, n: int = 1, reasoning_budget: int | None = None) -> ChatRun:
        """Submit a prepared request: its output as parsed pieces (``ChatRun.steps``)."""
        run = ChatRun(self, job, n, reasoning_budget)
        run.start()
        return run

    def submit(self, prompt: list[int], params: SamplingParams, n: int, sink: Any) -> list[int]:
        """Submit n choices of one prompt: as one fork group (one prefill, swiftlm/fork.py) where the
        engine has them (the type's method: a wrapper's __getattr__, e.g. data-parallel replicas, does not
        count), else as n requests.  APIError 429 when the queue is full, 400 on a request the engine refuses."""
        ids: list[int] = []
        engine = self.engine
        try:
            if n > 1 and getattr(type(engine), "submit_group", None) is not None:
                ids = engine.submit_group(prompt, [params.for_choice(i) for i in range(n)], sink)
            for i in range(len(ids), n):
                ids.append(engine.submit(prompt, params.for_choice(i), sink))
        except (QueueFull, InvalidRequest) as exc:
            for sid in ids:
                engine.cancel(sid)
            if isinstance(exc, QueueFull):
                raise APIError(429, str(exc), code="queue_full") from None
            raise APIError(400, str(exc), param=exc.param) from None
        return ids

    def sink(self) -> tuple[Any, asyncio.Queue]:
        """An engine callback that puts its events on a queue of this event loop."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        return (lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)), q

    def observe(self, ev: Event, clock: dict) -> None:
        """Generated tokens, time to first token and inter-token latency into the metrics."""
        m = self.state.metrics
        if ev.token_ids:
            now = time.perf_counter()
            m.gen_tokens.inc(len(ev.token_ids))
            last = clock.get(ev.seq_id)
            if last is None:
                m.ttft.observe(now - clock["start"])
            else:
                m.itl.observe(now - last)
            clock[ev.seq_id] = now

    async def events(self, ids: list[int], q: asyncio.Queue) -> AsyncIterator[tuple[int, Event]]:
        """(choice, event) for the submitted sequences ``ids`` until each has finished."""
        index = {sid: i for i, sid in enumerate(ids)}
        left = set(ids)
        try:
            while left:
                ev = await q.get()
                if ev.seq_id not in index:
                    continue
                if ev.finished:
                    left.discard(ev.seq_id)
                yield index[ev.seq_id], ev
        finally:
            for sid in left:  # client went away or we stopped early: free the slots
                self.engine.cancel(sid)

    async def gather(
        self, ids: list[int], q: asyncio.Queue
    ) -> tuple[list[str], list[str | None], list[list[TokenLogprob]], int, int]:
        """Collect a non-streamed request: per choice text, finish reason and logprobs; total
        completion tokens; prompt tokens served from the prompt cache."""
        texts, reasons = [""] * len(ids), [None] * len(ids)
        lps: list[list[TokenLogprob]] = [[] for _ in ids]
        completion = cached = 0
        clock = {"start": time.perf_counter()}
        async for i, ev in self.events(ids, q):
            self.observe(ev, clock)
            cached = max(cached, ev.cached_tokens)
            texts[i] += ev.text
            lps[i] += ev.logprobs
            if ev.finished:
                if ev.error:
                    raise APIError(500, f"generation failed: {ev.error}")
                reasons[i] = ev.finish_reason
                completion += ev.completion_tokens
        return texts, reasons, lps, completion, cached
