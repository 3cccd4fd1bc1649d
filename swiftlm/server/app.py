"""The Starlette app and ``serve``: wiring, auth, CORS, health, metrics, OpenAPI."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..config import Settings
from . import anthropic as anthropic_api
from . import embeddings as embeddings_api
from . import ollama as ollama_api
from . import responses as responses_api
from .access_log import AccessLog
from .auth import Gate, guard
from .chat_service import ChatService
from .embeddings import EmbeddingRequest
from .errors import error_response, render_error
from .metrics import Metrics, health_memory
from .models import AppState, ModelEntry, ModelManager, entries_from_toml
from .ollama_schemas import openapi_paths as ollama_paths
from .openai_routes import OpenAIRoutes
from .schemas import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)
from .webui_route import routes as webui_routes

log = logging.getLogger(__name__)


def _guard(
    state: Any, fn: Callable[[Request], Awaitable[Response]], needs_key: Callable[[], bool]
) -> Callable[[Request], Awaitable[Response]]:
    return guard(state, fn, needs_key, render_error)


def openapi_schema() -> dict:
    defs: dict[str, Any] = {}

    def ref(model: type) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.update(schema.pop("$defs", {}))
        defs[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    err = {
        "description": "OpenAI-style error",
        "content": {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "object"}}}}},
    }

    def post(model: type, summary: str) -> dict:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(model)}}},
                "responses": {
                    "200": {"description": "completion (JSON, or SSE when stream is true)"},
                    "400": err,
                    "401": err,
                    "413": err,
                    "429": err,
                    "503": err,
                },
            }
        }

    def get(summary: str) -> dict:
        return {"get": {"summary": summary, "responses": {"200": {"description": "ok"}, "503": err}}}

    paths = {
        "/v1/chat/completions": post(ChatCompletionRequest, "Chat completion"),
        "/v1/completions": post(CompletionRequest, "Text completion"),
        "/v1/responses": post(ResponsesRequest, "OpenAI Responses API"),
        "/v1/messages": post(AnthropicMessagesRequest, "Anthropic Messages API"),
        "/v1/messages/count_tokens": post(AnthropicCountTokensRequest, "Anthropic token count"),
        "/v1/embeddings": post(EmbeddingRequest, "Embeddings"),
        "/v1/models": get("Models served"),
        "/health": get("Health and stats"),
        "/metrics": get("Prometheus metrics"),
    }
    paths.update(ollama_paths(post, get))  # the Ollama API (/api/...)
    return {
        "openapi": "3.1.0",
        "info": {"title": "SwiftLM", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": defs},
    }


def create_app(settings: Settings, engine: Any = None, spec: Any = None, backend: str | None = None) -> Starlette:
    state = AppState(
        settings=settings,
        engine=engine,
        spec=spec,
        backend=backend,
        metrics=Metrics(),
        started=time.time(),
        load_error=None,
    )
    state.gate = Gate(settings)
    chat = ChatService(state)  # parameters and submission for every generation route
    routes_impl = OpenAIRoutes(state, chat)
    never = lambda: False  # noqa: E731

    async def health(request: Request) -> Response:
        eng = state.engine
        status = "ok" if eng is not None else ("error" if state.load_error else "loading")
        body: dict[str, Any] = {
            "status": status,
            "model": state.spec.name if state.spec else None,
            "backend": state.backend,
        }
        if state.load_error:
            body["error"] = state.load_error
        if settings.api_workers > 1:  # this answer is the whole server's; which worker gave it
            body["api_workers"] = {
                "workers": settings.api_workers,
                "pid": os.getpid(),
                "requests": state.metrics.requests_total(),
            }
        if eng is not None:
            st = eng.stats
            kv = eng.kv_stats()
            body["memory"] = health_memory(eng)  # measured; SwiftLM's *_mb fields too (docs/reference/health.md)
            body["stats"] = {
                "requests_total": st.requests_total,
                "requests_active": st.requests_active,
                "tokens_generated": st.tokens_generated,
                "avg_tokens_per_sec": round(st.avg_tokens_per_sec, 3),
                "busy_seconds": round(st.busy_wall_seconds(), 3),
                "requests_finished": dict(st.finished),
                "latency": {
                    "queue": st.queue_time.snapshot(),
                    "ttft": st.ttft.snapshot(),
                    "time_per_output_token": st.tpot.snapshot(),
                    "duration": st.duration.snapshot(),
                },
                "queue_depth": len(eng.scheduler.waiting),
                "running": len(eng.scheduler.running),
                "kv_tokens_in_use": eng.scheduler.kv_in_use(),
                "kv_bytes_in_use": kv["bytes"],
                "kv_cache": kv,
                "kv_budget_tokens": eng.scheduler.kv_budget,
                "preemptions": eng.scheduler.preemptions,
                "kv_blocks": eng.scheduler.block_stats(),
                "prompt_cache": {
                    "entries": len(eng.prefix_cache),
                    "bytes": eng.prefix_cache.bytes,
                    "hits": eng.prefix_cache.hits,
                    "misses": eng.prefix_cache.misses,
                    "hit_rate": round(eng.prefix_cache.hit_rate, 4),
                    "tokens_reused": eng.prefix_cache.tokens_reused,
                },
                "steps": st.steps,
                "overlapped_steps": st.overlapped_steps,
                "step_phases": eng.timers.snapshot(),
            }
            if hasattr(eng, "gc_stats"):  # the collector's pauses where the step loop runs (gc_pauses.py)
                body["stats"]["gc"] = eng.gc_stats()
            cap = eng.model.graph_capture  # torch on CUDA: graphs captured at start-up
            if cap:
                body["stats"]["graph_capture"] = cap
            es = eng.expert_stream_stats()
            if es is not None:
                body["stats"]["expert_streaming"] = es
            if hasattr(type(eng), "routing_stats"):  # --data-parallel: routing and each replica's figures
                body["stats"]["data_parallel"] = eng.routing_stats()
            if eng.speculator is not None:
                sp = eng.speculator.stats
                body["stats"]["speculative"] = {
                    "drafter": eng.speculator.drafter.name,
                    "num_draft_tokens": eng.speculator.k,
                    "verify_steps": sp.steps,
                    "drafted": sp.drafted,
                    "accepted": sp.accepted,
                    "acceptance_rate": round(sp.acceptance_rate, 4),
                    "tokens_per_target_step": round(sp.tokens_per_step, 3),
                }
        return JSONResponse(body, status_code=200 if eng is not None else 503)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(state.engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_schema())

    v1_key = lambda: state.gate.enabled  # noqa: E731
    metrics_key = lambda: state.gate.enabled and settings.metrics_need_key  # noqa: E731
    routes = [
        Route("/v1/chat/completions", _guard(state, routes_impl.chat, v1_key), methods=["POST"]),
        Route("/v1/completions", _guard(state, routes_impl.completions, v1_key), methods=["POST"]),
        Route("/v1/models", _guard(state, routes_impl.models, v1_key), methods=["GET"]),
        Route("/health", _guard(state, health, never), methods=["GET"]),
        Route("/metrics", _guard(state, metrics, metrics_key), methods=["GET"]),
        Route("/openapi.json", _guard(state, openapi, never), methods=["GET"]),
        *responses_api.routes(state, chat, v1_key),
        *anthropic_api.routes(state, chat, v1_key),
        *ollama_api.routes(state, chat, v1_key),
        *embeddings_api.routes(state, chat, v1_key, lambda fn: _guard(state, fn, v1_key)),
        *(webui_routes(state, lambda fn: _guard(state, fn, v1_key)) if settings.webui else []),  # the chat page
    ]
    middleware = []
    if settings.access_log:  # one line per request on stderr (access_log.py)
        middleware.append(Middleware(AccessLog, model_of=lambda: state.spec.name if state.spec else None))
    if settings.cors:
        origins = [o.strip() for o in settings.cors.split(",") if o.strip()]
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["*"],
                max_age=600,
            )
        )

    async def http_error(request: Request, exc: HTTPException) -> Response:
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        state.metrics.count_error(exc.status_code)
        return error_response(exc.status_code, msg.get(exc.status_code, exc.detail or "error"))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        state.metrics.count_error(500)
        return error_response(500, f"internal error: {type(exc).__name__}")

    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers={HTTPException: http_error, Exception: server_error}
    )
    app.state.swiftlm = state
    return app


def serve(
    settings: Settings,
    loading: Callable[[ModelEntry], Any] | None = None,
    worker: tuple[Any, Callable[[], Any], Callable[[], None]] | None = None,
) -> int:
    """Resolve the model (fail fast), start listening, load in the background (503 until
    ready), print the ready line, and run until SIGINT/SIGTERM.  With several API workers
    (--api-workers, server/workers.py) this hands over to their supervisor; in a worker,
    ``worker`` is (its listening socket, a function returning the attached engine, a function
    telling the supervisor that it listens)."""
    import uvicorn

    from ..backend import choose_backend
    from ..memory import tune_allocator
    from ..registry import resolve

    if tune_allocator():  # glibc: large freed blocks go back to the OS (see memory.tune_allocator)
        from ..memory import DEFAULT_MMAP_THRESHOLD

        # the same policy in the server's child processes (--engine-process), which glibc reads at their start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(DEFAULT_MMAP_THRESHOLD)
    offline = False if settings.offline else None
    if settings.models_file:  # several models, each loaded on demand (server/models.py)
        try:
            entries = entries_from_toml(settings.models_file)
        except (OSError, ValueError) as exc:
            print(f"swiftlm: error: --models-file: {exc}", file=sys.stderr)
            return 2
        spec = None
    else:
        spec = resolve(settings.model, allow_download=offline)
        entries = [ModelEntry(name=settings.served_model_name or spec.name, model=settings.model, pin=True)]
        for m in settings.extra_models:  # --model repeated: served side by side, loaded on demand
            entries.append(ModelEntry(name=resolve(m, allow_download=offline).name, model=m))
    pins = {n.strip() for n in (settings.pin or "").split(",") if n.strip()}
    for e in entries:
        e.pin = e.pin or bool(pins & {e.name, *e.aliases})
    backend, why = choose_backend(settings.backend)
    if worker is None:
        from .workers import resolve_count, serve_workers

        n = resolve_count(settings, backend)
        if n > 1:  # N HTTP processes in front of the engine process(es)
            return serve_workers(settings, n, loading)
    for flag, f in (
        ("--ssl-certfile", settings.ssl_certfile),
        ("--ssl-keyfile", settings.ssl_keyfile),
        ("--api-keys-file", settings.api_keys_file),
    ):
        if f and not os.path.isfile(f):
            print(f"swiftlm: error: {flag}: no such file {f}", file=sys.stderr)
            return 2
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        print("swiftlm: error: --ssl-certfile and --ssl-keyfile go together", file=sys.stderr)
        return 2
    try:
        app = create_app(settings, spec=spec, backend=backend.name)
    except ValueError as exc:  # a malformed keys file
        print(f"swiftlm: error: {exc}", file=sys.stderr)
        return 2
    state = app.state.swiftlm
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_timeout + 10,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
    draining = threading.Event()

    def drain() -> None:
        """Let in-flight requests generate for --shutdown-timeout, then end them (each stream gets
        its last chunk and [DONE]); uvicorn meanwhile refuses new connections and waits for these."""
        deadline = time.monotonic() + settings.shutdown_timeout
        engines = lambda: [e.engine for e in manager.entries if e.engine is not None]  # noqa: E731
        while time.monotonic() < deadline and any(eng.live_requests for eng in engines()):
            time.sleep(0.05)
        for eng in engines():
            eng.end_all("length")

    class _Server(uvicorn.Server):
        # SIGINT/SIGTERM: drain and shut down gracefully, then return (exit code 0) instead of
        # re-raising the signal as uvicorn does by default; a second Ctrl-C forces the exit.
        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
                for e in manager.entries:
                    if e.engine is not None:
                        e.engine.end_all("length")
            self.should_exit = True
            if not draining.is_set():
                draining.set()
                threading.Thread(target=drain, name="swiftlm-drain", daemon=True).start()

    server = _Server(config)
    outcome: dict[str, Any] = {}

    def fatal(msg: str) -> None:  # an engine loop died: stop serving, exit non-zero
        outcome["fatal"] = msg
        server.should_exit = True

    def load_entry(e: ModelEntry) -> tuple[Any, Any]:
        from ..llm import make_engine

        s = settings.model_copy(
            update={
                **e.overrides,
                "model": e.model,
                "models_file": None,
                "adapter": settings.adapter if e is entries[0] else [],
            }
        )  # LoRA: 1st model
        sp = spec if (spec is not None and e.model == settings.model) else resolve(s.model, allow_download=offline)
        be = backend if s.backend == settings.backend else choose_backend(s.backend)[0]
        engine = make_engine(s, be, sp) if worker is None else worker[1]()
        engine.on_fatal = fatal
        engine.model.ops.end_thread()  # this thread is done with the device (MLX: its streams)
        return engine, sp

    sizes: dict[str, int] = {}

    def size_of(e: ModelEntry) -> int:
        if e.name not in sizes:
            try:
                sizes[e.name] = int(resolve(e.model, allow_download=False).size_bytes or 0)
            except Exception:
                sizes[e.name] = 0
        return sizes[e.name]

    manager = ModelManager(
        entries,
        load_entry,
        max_loaded=settings.max_loaded_models,
        memory_budget=settings.models_memory_bytes,
        ttl=settings.model_ttl,
        strict=settings.strict_model_names,
        size_of=size_of,
    )

    def follow() -> None:  # health and metrics read the first loaded model
        state.engine = manager.default_engine()
        first = next((x for x in manager.entries if x.engine is not None), None)
        if first is not None or spec is None:
            state.spec = first.view if first is not None else None

    manager.adapters = {a.partition("=")[0].strip(): entries[0].name for a in settings.adapter}
    manager.on_change = follow
    state.models = manager

    def load() -> None:
        try:
            # at start-up: the one model, or the pinned ones of a models file (else its first)
            for e in [x for x in entries if x.pin] or entries[:1]:
                with loading(e) if loading is not None else contextlib.nullcontext():  # the CLI's loading line
                    engine, sp = load_entry(e)
                manager.adopt(e, engine, sp)
        except Exception as exc:
            state.load_error = str(exc)
            outcome["error"] = exc
            print(f"swiftlm: error: {exc}", file=sys.stderr)
            server.should_exit = True
            return
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if worker is not None:  # the supervisor prints the ready line once every worker listens
            if server.started:
                worker[2]()
            return
        print(
            json.dumps(
                {
                    "event": "ready",
                    "host": settings.host,
                    "port": settings.port,
                    "scheme": "https" if settings.ssl_certfile else "http",
                    "model": entries[0].name,
                    "models": manager.available(),
                    "backend": backend.name,
                    "backend_choice": why,
                }
            ),
            flush=True,
        )

    threading.Thread(target=load, name="swiftlm-load", daemon=True).start()
    server.run(sockets=[worker[0]] if worker is not None else None)
    for e in manager.entries:
        if e.engine is not None:
            e.engine.shutdown()
    code = getattr(outcome["error"], "exit_code", 1) if "error" in outcome else (1 if "fatal" in outcome else 0)
    if os.environ.get("SWIFTLM_FINALIZE") != "1":
        # Everything is shut down (the engine thread joined, streams ended): leave without the
        # interpreter's finalization, where a daemon thread still inside a C++ extension can be
        # killed mid-frame and abort the process ("terminate called without an active exception",
        # SIGABRT instead of exit 0, as the torch multimodal server can; the mechanism is
        # described in ml-explore/mlx#4110). SWIFTLM_FINALIZE=1 keeps the normal exit.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
