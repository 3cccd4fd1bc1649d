"""Ollama's API on the same port as the OpenAI routes: the generation routes.

/api/chat and /api/generate stream NDJSON lines (one JSON object each; ``"stream": false`` gives one
object) and run through the chat service shared with /v1/chat/completions (``chat_service``), which
builds the parameters the same way, so greedy text is the same as there.  /api/embed and
/api/embeddings use the engine's embeddings (L2-normalised on both).  The model routes
(/api/tags, /api/show, /api/ps, /api/version, /api/pull, /api/delete) and ``keep_alive`` are in
``ollama_models``, the wire format in ``ollama_schemas``.  Errors are Ollama's ``{"error": "..."}``.

The response's durations are measured here, in nanoseconds: ``load_duration`` the time to get the
model (its load, when this request loaded it), ``prompt_eval_duration`` from submission to the
first token, ``eval_duration`` from the first token to the last, ``total_duration`` the whole
request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import InvalidRequest, SwiftLMError
from .auth import guard
from .chat_core import ChatJob, ChatRun
from .chat_service import ChatService
from .embeddings import token_inputs
from .errors import APIError
from .ollama_models import NDJSON, OllamaModels, iso, line
from .ollama_schemas import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    chat_body,
    chat_messages,
    done_reason,
    keep_alive_seconds,
    logprobs,
    ollama_names,
    tool_call,
)
from .schemas import ChatCompletionRequest
from .wire import parse


async def collect(lines: AsyncIterator[dict], kind: str) -> dict:
    """A non-streamed response: the streamed objects merged into the final one (an error line: a 500)."""
    merged: dict[str, Any] = {}
    text, thought, calls, lps = [], [], [], []
    async for x in lines:
        if "error" in x:
            raise APIError(500, x["error"])
        piece = x["message"] if kind == "chat" else {"content": x["response"], "thinking": x.get("thinking", "")}
        text.append(piece["content"])
        thought.append(piece.get("thinking", ""))
        calls += piece.get("tool_calls", [])
        lps += x.get("logprobs", [])
        merged = x
    out: dict[str, Any] = {"content": "".join(text)}
    if "".join(thought):
        out["thinking"] = "".join(thought)
    if calls:
        out["tool_calls"] = calls
    if kind == "chat":
        merged["message"] = {"role": "assistant", **out}
    else:
        merged.update(response=out.pop("content"), **out)
    if lps:
        merged["logprobs"] = lps
    return merged


# ---------------------------------------------------------------- routes
class OllamaRoutes:
    def __init__(self, state: Any, chat: ChatService | None):
        self.state, self.service = state, chat
        self.models = OllamaModels(state)

    def _model(self, requested: str | None) -> str:
        return requested or (self.state.spec.name if self.state.spec else "")

    async def _prepare(self, body: dict, raw: str | None = None) -> ChatJob:
        """The internal chat request of ``chat_body``'s fields, prepared by the chat service (``raw``: that
        prompt as written, no chat template); errors in Ollama's names."""
        try:
            req = parse(ChatCompletionRequest, body)
            if raw is not None:
                return self.service.prepare_raw(raw, req)
            return await self.service.prepare(req, clamp_max_tokens=True)
        except APIError as exc:
            if exc.param == "response_format" and not exc.message.startswith("'"):
                exc.message = f"'format': {exc.message}"
            raise ollama_names(exc) from None

    def _options(self, job: ChatJob, opts: OllamaOptions | None) -> None:
        """num_ctx (a smaller window for this request) and repeat_last_n, on the built parameters."""
        if opts is None:
            return
        ctx, n, params = self.service.engine.ctx_size, len(job.prompt), job.params
        if opts.num_ctx is not None:
            window = min(opts.num_ctx, ctx)
            if n >= window:
                raise APIError(400, f"the prompt has {n} tokens but 'options.num_ctx' is {opts.num_ctx}")
            params.max_tokens = min(params.max_tokens, window - n)
        if opts.repeat_last_n == 0:
            params.repetition_penalty = 1.0
        elif opts.repeat_last_n is not None:
            params.repetition_context_size = ctx if opts.repeat_last_n == -1 else opts.repeat_last_n

    async def _load_only(self, requested: str | None, keep: float | None, t0: int, chat: bool) -> Response:
        """A chat without messages / a generate without prompt: load the model, or unload it (keep_alive 0)."""
        if keep == 0:
            if self.state.models is None:
                raise APIError(400, "this server does not load or unload models on request")
            await self.models.keep.unload(self.models.entry(requested))
            body: dict[str, Any] = {"done_reason": "unload"}
        else:
            load_ns = await self.models.select(requested)
            self.models.keep.apply(keep)
            body = {"done_reason": "load", "total_duration": time.perf_counter_ns() - t0, "load_duration": load_ns}
        head = {"model": self._model(requested), "created_at": iso()}
        out = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return JSONResponse({**head, **out, "done": True, **body})

    # ------------------------------------------------------------------ chat / generate
    async def chat_route(self, request: Request) -> Response:
        t0 = time.perf_counter_ns()
        req: OllamaChatRequest = parse(OllamaChatRequest, await self.models.read(request, self.service.body_limit()))
        keep = keep_alive_seconds(req.keep_alive)
        if not req.messages:
            return await self._load_only(req.model, keep, t0, chat=True)
        load_ns = await self.models.select(req.model)
        ctx = self.service.engine.ctx_size
        job = await self._prepare(chat_body(req, chat_messages(req.messages), ctx))
        self._options(job, req.options)
        self.models.keep.apply(keep)  # a valid request: its keep_alive counts
        return await self._respond(job, req, "chat", t0, load_ns, context=False)

    async def generate(self, request: Request) -> Response:
        t0 = time.perf_counter_ns()
        req: OllamaGenerateRequest = parse(
            OllamaGenerateRequest, await self.models.read(request, self.service.body_limit())
        )
        keep = keep_alive_seconds(req.keep_alive)
        if req.suffix:
            raise APIError(400, "'suffix' (fill in the middle) is not supported")
        if req.template:
            raise APIError(400, "'template' is not supported: the model's own chat template is used (or raw: true)")
        if not req.prompt and not req.images:
            return await self._load_only(req.model, keep, t0, chat=False)
        load_ns = await self.models.select(req.model)
        engine = self.service.engine
        if req.raw:
            if req.images:
                raise APIError(400, "'images' need the chat template: they cannot be sent with raw: true")
            placeholder = [{"role": "user", "content": ""}]  # the raw prompt is tokenized as written
            job = await self._prepare(chat_body(req, placeholder, engine.ctx_size), req.prompt)
        else:
            user: dict[str, Any] = {"role": "user", "content": req.prompt or ""}
            if req.images:
                user["images"] = req.images
            msgs = ([{"role": "system", "content": req.system}] if req.system else []) + [user]
            job = await self._prepare(chat_body(req, chat_messages(msgs), engine.ctx_size))
        if req.context:
            if hasattr(job.prompt, "media"):
                raise APIError(400, "'context' cannot be combined with 'images'")
            if any(not 0 <= t < engine.info.vocab_size for t in req.context):
                raise APIError(400, "'context' has token ids outside the vocabulary")
            job.prompt = list(req.context) + list(job.prompt)
            room = engine.ctx_size - len(job.prompt)
            if room <= 0:
                raise APIError(
                    400, f"'context' and the prompt have {len(job.prompt)} tokens; the context is {engine.ctx_size}"
                )
            job.params.max_tokens = min(job.params.max_tokens, room)
        self._options(job, req.options)
        self.models.keep.apply(keep)
        return await self._respond(job, req, "generate", t0, load_ns, context=not req.raw)

    async def _respond(self, job: ChatJob, req: Any, kind: str, t0: int, load_ns: int, context: bool) -> Response:
        self.service.admit(job, f"ollama_{kind}")
        t_submit = time.perf_counter_ns()
        run = self.service.start(job)
        lines = self._lines(
            run,
            job,
            kind,
            self._model(req.model),
            (t0, load_ns, t_submit),
            bool(req.logprobs or req.top_logprobs),
            context,
        )
        if req.stream:
            return StreamingResponse(
                (line(x) async for x in lines), media_type=NDJSON, headers={"X-Accel-Buffering": "no"}
            )
        return JSONResponse(await collect(lines, kind))

    async def _lines(
        self, run: ChatRun, job: ChatJob, kind: str, model: str, clock: tuple, want_lp: bool, context: bool
    ) -> AsyncIterator[dict]:
        """The response's objects: one per parsed piece (content, thinking, tool call), then the final one."""
        t0, load_ns, t_submit = clock
        t_first = t_last = None
        finish = None

        def chunk(field: str, value: Any) -> dict:
            if kind == "chat":
                msg = {"role": "assistant", "content": ""}
                msg[field] = value
                return {"model": model, "created_at": iso(), "message": msg, "done": False}
            out = {"model": model, "created_at": iso(), "response": ""}
            out["response" if field == "content" else field] = value
            out["done"] = False
            return out

        async for step in run.steps():
            ev = step.event
            if ev is None or ev.progress is not None:
                continue
            now = time.perf_counter_ns()
            if ev.error:
                self.state.metrics.count_error(500, where="stream")
                yield {"error": f"generation failed: {ev.error}"}
                return
            if ev.token_ids or ev.finished:
                t_first = now if t_first is None else t_first
                t_last = now
            out = []
            for piece, val in step.pieces:
                if piece == "tool_call":
                    out.append(chunk("tool_calls", [tool_call(val, run.parsers[0].calls.index(val))]))
                else:
                    out.append(chunk("thinking" if piece == "reasoning" else "content", val))
            if want_lp and ev.logprobs:
                out = out or [chunk("content", "")]
                out[0]["logprobs"] = logprobs(ev.logprobs)
            for x in out:
                yield x
            if step.finish_reason is not None:
                finish = step.finish_reason
        end = time.perf_counter_ns()
        t_first = t_first or end
        final: dict[str, Any] = {"model": model, "created_at": iso()}
        final.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
        final.update(
            done=True,
            done_reason=done_reason(finish),
            total_duration=end - t0,
            load_duration=load_ns,
            prompt_eval_count=len(job.prompt),
            prompt_eval_duration=t_first - t_submit,
            eval_count=run.completion_tokens,
            eval_duration=(t_last or end) - t_first,
        )
        if context and not hasattr(job.prompt, "media"):
            final["context"] = list(job.prompt) + run.output_ids[0]
        yield final

    # ------------------------------------------------------------------ embeddings
    async def _embed(self, inputs: Any, truncate: bool, dimensions: int | None) -> tuple[list, int]:
        engine = self.service.engine
        prompts = token_inputs(engine, inputs)
        if truncate:
            prompts = [p[: engine.ctx_size] for p in prompts]
        try:
            vecs = await asyncio.wrap_future(engine.embed(prompts, dimensions))
        except InvalidRequest as exc:
            raise APIError(400, str(exc)) from None
        except SwiftLMError as exc:  # QueueFull: shutting down
            raise APIError(503, str(exc)) from None
        return [v.tolist() for v in vecs], sum(len(p) for p in prompts)

    async def embed(self, request: Request) -> Response:
        t0 = time.perf_counter_ns()
        req: OllamaEmbedRequest = parse(OllamaEmbedRequest, await self.models.read(request))
        keep = keep_alive_seconds(req.keep_alive)
        load_ns = await self.models.select(req.model)
        vecs, n = await self._embed(req.input, req.truncate, req.dimensions)
        self.models.keep.apply(keep)
        self.state.metrics.requests.labels("ollama_embed").inc()
        return JSONResponse(
            {
                "model": self._model(req.model),
                "embeddings": vecs,
                "total_duration": time.perf_counter_ns() - t0,
                "load_duration": load_ns,
                "prompt_eval_count": n,
            }
        )

    async def embeddings(self, request: Request) -> Response:
        req: OllamaEmbeddingsRequest = parse(OllamaEmbeddingsRequest, await self.models.read(request))
        keep = keep_alive_seconds(req.keep_alive)
        await self.models.select(req.model)
        self.models.keep.apply(keep)
        if not req.prompt:  # as Ollama: an empty prompt has an empty embedding
            return JSONResponse({"embedding": []})
        vecs, _ = await self._embed(req.prompt, True, None)
        self.state.metrics.requests.labels("ollama_embed").inc()
        return JSONResponse({"embedding": vecs[0]})


def _error(exc: APIError, headers: dict | None) -> Response:
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)


def routes(state: Any, chat: ChatService, needs_key: Callable[[], bool]) -> list[Route]:
    """The routes, with auth and rate limits as on /v1 and errors in Ollama's shape."""
    impl = OllamaRoutes(state, chat)
    models = impl.models

    def r(path: str, fn: Callable, method: str) -> Route:
        return Route(path, guard(state, fn, needs_key, _error), methods=[method])

    return [
        r("/api/chat", impl.chat_route, "POST"),
        r("/api/generate", impl.generate, "POST"),
        r("/api/embed", impl.embed, "POST"),
        r("/api/embeddings", impl.embeddings, "POST"),
        r("/api/show", models.show, "POST"),
        r("/api/pull", models.pull, "POST"),
        r("/api/delete", models.delete, "DELETE"),
        r("/api/tags", models.tags, "GET"),
        r("/api/ps", models.ps, "GET"),
        r("/api/version", models.version, "GET"),
    ]
