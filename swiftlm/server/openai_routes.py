"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine import Event, QueueFull, TokenLogprob
from ..errors import InvalidRequest
from .chat_core import ChatRun
from .chat_service import ChatService
from .errors import APIError
from .schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from .wire import parse, read_json, sse

PROGRESS_HEADER = "x-swiftlm-prefill-progress"
PROGRESS_INTERVAL_S = 2.0


class _ProgressPacer:
    """``event: prefill_progress`` frames, at most one per PROGRESS_INTERVAL_S."""

    def __init__(self, t0: float):
        self.t0, self.last = t0, -1e9

    def frame(self, ev: Event) -> str | None:
        now = time.perf_counter()
        if now - self.last < PROGRESS_INTERVAL_S:
            return None
        self.last = now
        n_past, n_total = ev.progress
        return sse(
            {
                "n_past": n_past,
                "n_prompt_tokens": n_total,
                "fraction": n_past / n_total,
                "elapsed_seconds": round(now - self.t0, 3),
            },
            event="prefill_progress",
        )


def _stream_error(error: str) -> str:
    return sse(
        {"error": {"message": f"generation failed: {error}", "type": "server_error", "param": None, "code": None}}
    )


def _deltas(kind: str, val: Any, parser: Any) -> list[dict]:
    """OpenAI chat deltas for one parsed piece of output."""
    if kind == "content":
        return [{"content": val}]
    if kind == "reasoning":
        return [{"reasoning_content": val}]
    index = parser.calls.index(val)
    return [
        {
            "tool_calls": [
                {"index": index, "id": val.id, "type": "function", "function": {"name": val.name, "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": index, "function": {"arguments": val.arguments}}]},
    ]


def best_of(req: Any) -> int:
    """Choices to generate per prompt: ``best_of`` (checked against ``n``, the limit and ``stream``,
    as OpenAI does) or ``n``."""
    b = req.best_of
    if b is None:
        return req.n
    if b < req.n:
        raise APIError(400, f"'best_of' is {b} but must be at least 'n' ({req.n})", param="best_of")
    if b > MAX_CHOICES:
        raise APIError(400, f"'best_of' is {b}; at most {MAX_CHOICES}", param="best_of")
    if req.stream and b > req.n:
        raise APIError(
            400,
            "'best_of' greater than 'n' cannot be streamed: the best choices are known only at "
            "the end; set stream to false or best_of to n",
            param="best_of",
        )
    return b


def ranked(lps: list[list[TokenLogprob]], how: str) -> list[int]:
    """Candidate indices, best first: by the sum of their tokens' logprobs (``cumulative``, OpenAI's
    ranking) or by its mean per token (``mean``, length-normalised).  Ties keep generation order."""

    def score(i: int) -> float:
        total = sum(x.logprob for x in lps[i])
        return total / max(1, len(lps[i])) if how == "mean" else total

    return sorted(range(len(lps)), key=lambda i: -score(i))


def _usage(n_prompt: int, completion: int, cached: int | None = None) -> dict:
    out: dict[str, Any] = {
        "prompt_tokens": n_prompt,
        "completion_tokens": completion,
        "total_tokens": n_prompt + completion,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _chat_message(parser: Any, text: str, reason: str | None) -> tuple[dict, str | None]:
    content, reasoning, calls, reason = parser.result(text, reason)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message, reason


class OpenAIRoutes:
    def __init__(self, state: Any, chat: ChatService):
        self.state, self.service = state, chat  # state: settings, spec, metrics; chat: the ChatService

    @staticmethod
    def _chat_logprobs(lps: list[TokenLogprob]) -> dict:
        def item(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [{**item(x.text, x.logprob), "top_logprobs": [item(t, v) for _, t, v in x.top]} for x in lps]
        }

    @staticmethod
    def _completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for x in lps:
            out["tokens"].append(x.text)
            out["token_logprobs"].append(x.logprob)
            out["top_logprobs"].append({t: v for _, t, v in x.top})
            out["text_offset"].append(offset)
            offset += len(x.text)
        return out

    def _check_stream_opts(self, req: Any) -> bool:
        return bool(req.stream and req.stream_options and req.stream_options.include_usage)

    async def _chat_test_time(self, req: Any, job: Any, cid: str, created: int, model: str) -> Response:
        """The ``test_time`` extension: N chains of this request in one batch, a strategy over them
        (swiftlm.test_time), the chosen answer as the message and the votes / scores beside it."""
        from .. import test_time

        if req.stream:
            raise APIError(400, "test_time requests are not streamed: set stream to false", param="stream")
        if req.n != 1:
            raise APIError(400, "test_time chooses one answer from its own chains: leave n at 1", param="n")
        try:
            spec = test_time.check_request(req.test_time)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        kwargs = dict(req.chat_template_kwargs or {})
        if req.enable_thinking is not None:
            kwargs.setdefault("enable_thinking", req.enable_thinking)
        try:
            result = await asyncio.to_thread(
                test_time.run, self.service.engine, list(req.messages), job.params, spec, kwargs, job.prompt
            )
        except QueueFull as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        message, reason = _chat_message(job.plan.parser(), result.text, "stop")
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
                "system_fingerprint": "swiftlm",
                "test_time": result.to_dict(),
                "usage": _usage(len(job.prompt), result.completion_tokens),
            }
        )

    # ------------------------------------------------------------------ /v1/models
    async def models(self, request: Request) -> Response:
        if getattr(self.state, "models", None) is not None:  # every servable model, with its state
            return JSONResponse({"object": "list", "data": self.state.models.listing()})
        name = self.state.spec.name if self.state.spec else None
        data = (
            [{"id": name, "object": "model", "created": int(self.state.started), "owned_by": "swiftlm"}] if name else []
        )
        return JSONResponse({"object": "list", "data": data})

    # ------------------------------------------------------------------ chat
    async def chat(self, request: Request) -> Response:
        body = await read_json(request, self.service.body_limit())
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        job = await self.service.prepare(req)
        self.service.admit(job, "chat")
        cid = "chatcmpl-" + secrets.token_hex(12)
        created = int(time.time())
        model = self.state.spec.name
        if req.test_time is not None:
            return await self._chat_test_time(req, job, cid, created, model)
        k = best_of(req)
        if req.stream:
            run = self.service.start(job, req.n)
            return StreamingResponse(
                self._chat_stream(
                    req, run, cid, created, model, len(job.prompt), request.headers.get(PROGRESS_HEADER) == "1"
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        sink, q = self.service.sink()
        params = job.params
        if k > req.n and not params.logprobs:  # ranking needs the candidates' logprobs
            params = replace(params, logprobs=True)
        ids = self.service.submit(job.prompt, params, k, sink)
        texts, reasons, lps, completion, cached = await self.service.gather(ids, q)
        choices = []
        for i, c in enumerate(ranked(lps, req.best_of_rank)[: req.n] if k > req.n else range(req.n)):
            message, reason = _chat_message(job.plan.parser(), texts[c], reasons[c])
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._chat_logprobs(lps[c]) if req.logprobs else None,
                    "finish_reason": reason,
                }
            )
        n_prompt = len(job.prompt)
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "system_fingerprint": "swiftlm",
                "usage": _usage(n_prompt, completion, cached),
            }
        )

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        run: ChatRun,
        cid: str,
        created: int,
        model: str,
        n_prompt: int,
        progress: bool,
    ) -> AsyncIterator[str]:
        base = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": "swiftlm",
        }
        usage_on = self._check_stream_opts(req)
        started = [False] * req.n
        pacer = _ProgressPacer(time.perf_counter())

        def chunk(i: int, delta: dict, finish: str | None = None, logprobs: Any = None) -> str:
            c = {**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if usage_on:
                c["usage"] = None
            return sse(c)

        async for step in run.steps():
            i, ev = step.index, step.event
            if ev.progress is not None:
                frame = pacer.frame(ev) if progress else None
                if frame:
                    yield frame
                continue
            if ev.error:
                self.state.metrics.count_error(500, where="stream")
                yield _stream_error(ev.error)
                break
            if not started[i]:
                started[i] = True
                yield chunk(i, {"role": "assistant", "content": ""})
            lp = self._chat_logprobs(ev.logprobs) if req.logprobs and ev.logprobs else None
            deltas = [d for kind, val in step.pieces for d in _deltas(kind, val, run.parsers[i])]
            if lp is not None and not deltas:
                deltas = [{"content": ""}]
            for k, d in enumerate(deltas):
                yield chunk(i, d, logprobs=lp if k == 0 else None)
            if ev.finished:
                yield chunk(i, {}, finish=step.finish_reason)
        if usage_on:
            yield sse({**base, "choices": [], "usage": _usage(n_prompt, run.completion_tokens, run.cached_tokens)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.state.settings.max_body_bytes)
        req: CompletionRequest = parse(CompletionRequest, body)
        engine = self.service.engine
        if req.suffix:
            raise APIError(400, "'suffix' is not supported", param="suffix")
        if req.echo and req.logprobs:
            raise APIError(400, "'echo' together with 'logprobs' (prompt logprobs) is not supported yet", param="echo")
        raw = req.prompt
        if isinstance(raw, str):
            prompts: list[Any] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            prompts = [list(raw)]
        else:
            prompts = list(raw)
        if not prompts or len(prompts) > 16:
            raise APIError(400, "'prompt' must hold 1 to 16 prompts", param="prompt")
        if req.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes a single prompt", param="prompt")
        token_prompts = []
        for p in prompts:
            try:
                toks = engine.text_prompt(p) if isinstance(p, str) else list(p)
            except InvalidRequest as exc:
                raise APIError(400, str(exc), param="prompt") from None
            if not toks or any(not isinstance(t, int) or not 0 <= t < engine.info.vocab_size for t in toks):
                raise APIError(400, "'prompt' is empty or has token ids outside the vocabulary", param="prompt")
            token_prompts.append(toks)
        top = req.logprobs or 0
        k = best_of(req)  # choices generated per prompt; the best n of them are returned
        plans = [
            (toks, self.service.params(req, len(toks), req.max_tokens, req.logprobs is not None or k > req.n, top))
            for toks in token_prompts
        ]
        self.state.metrics.requests.labels("completions").inc()
        cid = "cmpl-" + secrets.token_hex(12)
        created = int(time.time())
        model = self.state.spec.name
        sink, q = self.service.sink()
        all_ids: list[int] = []
        try:
            for toks, params in plans:
                all_ids += self.service.submit(toks, params, k, sink)
                self.state.metrics.prompt_tokens.inc(len(toks))
        except APIError:
            for sid in all_ids:
                engine.cancel(sid)
            raise
        n_prompt = sum(len(t) for t, _ in plans)
        echo = [engine.tokenizer.decode(t) if req.echo else "" for t, _ in plans]
        if req.stream:
            return StreamingResponse(
                self._completion_stream(
                    req, all_ids, q, cid, created, model, n_prompt, echo[0], request.headers.get(PROGRESS_HEADER) == "1"
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        texts, reasons, lps, completion, _ = await self.service.gather(all_ids, q)
        picked = []  # (prompt, candidate) in output order: per prompt its best n of k (or its n)
        for j in range(len(plans)):
            cand = list(range(j * k, (j + 1) * k))
            order = ranked([lps[c] for c in cand], req.best_of_rank)[: req.n] if k > req.n else range(req.n)
            picked += [(j, cand[r]) for r in order]
        choices = [
            {
                "index": i,
                "text": echo[j] + texts[c],
                "logprobs": (self._completion_logprobs(lps[c], len(echo[j])) if req.logprobs is not None else None),
                "finish_reason": reasons[c],
            }
            for i, (j, c) in enumerate(picked)
        ]
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "system_fingerprint": "swiftlm",
                "usage": _usage(n_prompt, completion),
            }
        )

    async def _completion_stream(
        self,
        req: CompletionRequest,
        ids: list[int],
        q: asyncio.Queue,
        cid: str,
        created: int,
        model: str,
        n_prompt: int,
        echo: str,
        progress: bool,
    ) -> AsyncIterator[str]:
        base = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": "swiftlm",
        }
        usage_on = self._check_stream_opts(req)
        completion = 0
        t0 = time.perf_counter()
        pacer = _ProgressPacer(t0)
        offsets = [len(echo)] * len(ids)
        clock = {"start": t0}

        def chunk(i: int, text: str, finish: str | None = None, logprobs: Any = None) -> str:
            c = {**base, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if usage_on:
                c["usage"] = None
            return sse(c)

        if echo:
            for i in range(len(ids)):
                yield chunk(i, echo)
        async for i, ev in self.service.events(ids, q):
            if ev.progress is not None:
                frame = pacer.frame(ev) if progress else None
                if frame:
                    yield frame
                continue
            self.service.observe(ev, clock)
            if ev.error:
                self.state.metrics.count_error(500, where="stream")
                yield _stream_error(ev.error)
                break
            if ev.text or ev.logprobs:
                lp = self._completion_logprobs(ev.logprobs, offsets[i]) if req.logprobs is not None else None
                offsets[i] += len(ev.text)
                yield chunk(i, ev.text, logprobs=lp)
            if ev.finished:
                completion += ev.completion_tokens
                yield chunk(i, "", finish=ev.finish_reason)
        if usage_on:
            yield sse({**base, "choices": [], "usage": _usage(n_prompt, completion)})
        yield "data: [DONE]\n\n"
