"""Many models behind one server: which names are servable, which are loaded, and when to load
or unload them.  Routes never hold a model; they ask the manager for the engine of a request's
``model`` field (``await manager.acquire(name)``) and release it when the request ends.

- Entries come from repeated ``--model`` flags or a ``--models-file`` (TOML): a name, what to load
  (path, hub id or .gguf), per-model setting overrides (backend, turbo_kv, stream_experts,
  draft_model, ctx_size, parallel ...), aliases, ``pin``.
- A request for an unloaded model loads it; concurrent requests for it wait on that one load.
- Before a load, the least recently used idle models (no request in flight, not pinned) are
  unloaded while the loaded set would exceed ``--max-loaded-models`` or the ``--models-memory``
  budget (estimated from each checkpoint's size on disk).
- ``--model-ttl`` unloads models idle for that long; unloading shuts the engine down, drops every
  reference, and returns the memory (gc, the device allocator's cache, glibc's free lists).
- With one model configured, any requested name is served by it (clients that hard-code a model
  name keep working) unless ``strict`` asks for 404s; with several, an unknown name is a 404
  ``model_not_found`` listing what is available.  Only configured entries are ever loaded.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Settings a models-file entry may override (the rest are server-wide: host, port, keys, limits)
PER_MODEL = frozenset(
    {
        "backend",
        "turbo_kv",
        "kv_bits",
        "kv_group_size",
        "stream_experts",
        "expert_top_k",
        "draft_model",
        "speculative",
        "num_draft_tokens",
        "ctx_size",
        "parallel",
        "prefill_size",
        "max_batched_tokens",
        "max_tokens",
        "temp",
        "top_p",
        "top_k",
        "min_p",
        "repeat_penalty",
        "vision",
        "audio",
        "thinking",
        "tool_parser",
        "prompt_cache_bytes",
        "max_queue",
        "kv_budget_bytes",
        "seed",
    }
)


class ModelNotFound(Exception):
    def __init__(self, requested: str, available: list[str]):
        super().__init__(f"model {requested!r} is not served here; available: {', '.join(available)}")
        self.requested, self.available = requested, available


class ModelLoadFailed(Exception):
    pass


@dataclass
class ModelEntry:
    name: str
    model: str | None  # what to load; None: the bundled default
    overrides: dict[str, Any] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)
    pin: bool = False
    # state
    engine: Any = None
    spec: Any = None
    state: str = "unloaded"  # unloaded | loading | loaded | failed
    error: str | None = None
    in_flight: int = 0
    last_used: float = 0.0
    loaded_at: float = 0.0  # monotonic
    created: int = 0  # unix time of the last load
    load_seconds: float = 0.0
    view: Any = None  # the spec as requests see it: named by the entry
    _loading: asyncio.Future | None = None


def _view(e: ModelEntry, spec: Any) -> Any:
    """The spec as requests see it: named by the entry (responses' 'model' field)."""
    if spec is None or getattr(spec, "name", e.name) == e.name:
        return spec
    import dataclasses

    return dataclasses.replace(spec, source=e.name, bundled=False)


def entries_from_toml(path: str | Path) -> list[ModelEntry]:
    """``[[models]]`` tables: name (default: the model string), model, aliases, pin, and any
    per-model setting (``turbo_kv = true``, ``draft_model = "..."``, ``ctx_size = 8192`` ...)."""
    import tomllib

    data = tomllib.loads(Path(path).read_text())
    raw = data.get("models")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: expected one or more [[models]] tables")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not (t.get("model") or t.get("path")):
            raise ValueError(f"{path}: [[models]] #{i + 1} needs 'model' (a path, hub id or .gguf file)")
        t = dict(t)
        model = str(t.pop("model", None) or t.pop("path"))
        name = str(t.pop("name", model))
        aliases = [str(a) for a in t.pop("aliases", [])]
        pin = bool(t.pop("pin", False))
        bad = sorted(set(t) - PER_MODEL)
        if bad:
            raise ValueError(
                f"{path}: model {name!r}: unknown or server-wide setting(s) {', '.join(bad)}; "
                f"per-model settings are {', '.join(sorted(PER_MODEL))}"
            )
        out.append(ModelEntry(name=name, model=model, overrides=t, aliases=aliases, pin=pin))
    return out


def release_memory() -> None:
    """Give freed memory back: Python's garbage, the device allocator's cache, glibc's free lists."""
    gc.collect()
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        try:
            mx.clear_cache()
        except Exception:  # pragma: no cover - older mlx
            pass
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS): the allocator returns pages itself
        pass


class ModelManager:
    def __init__(
        self,
        entries: list[ModelEntry],
        load: Callable[[ModelEntry], tuple[Any, Any]],
        *,
        max_loaded: int = 0,
        memory_budget: int = 0,
        ttl: float = 0.0,
        strict: bool = False,
        size_of: Callable[[ModelEntry], int] | None = None,
    ):
        names: dict[str, ModelEntry] = {}
        for e in entries:
            for n in [e.name, *e.aliases]:
                if n in names:
                    raise ValueError(f"model name {n!r} is used twice")
                names[n] = e
        self.entries, self._names = entries, names
        self._load, self._size_of = load, size_of or (lambda e: 0)
        self.max_loaded, self.memory_budget, self.ttl, self.strict = max_loaded, memory_budget, ttl, strict
        self.loads = self.unloads = 0
        self._lock = threading.Lock()  # guards state changes seen by the health/metrics threads
        self._ttl_task: asyncio.Task | None = None
        self.on_change: Callable[[], None] | None = None  # after a load or an unload
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> the entry it is served on (--adapter)

    def adopt(self, e: ModelEntry, engine: Any, spec: Any) -> None:
        """Register a model loaded outside the manager (the start-up load)."""
        e.engine, e.spec, e.view, e.state = engine, spec, _view(e, spec), "loaded"
        e.loaded_at = e.last_used = time.monotonic()
        e.created = int(time.time())
        if self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------------ lookup
    @property
    def single(self) -> bool:
        return len(self.entries) == 1

    def available(self) -> list[str]:
        return [e.name for e in self.entries] + list(self.adapters)

    def entry(self, requested: str | None) -> ModelEntry:
        e = self._names.get(requested) if requested else None
        if e is not None:
            return e
        if self.single and not (self.strict and requested):
            return self.entries[0]
        if requested is None and not self.strict:
            return self.entries[0]
        raise ModelNotFound(str(requested), self.available())

    def split_adapter(self, requested: str) -> tuple[str, str | None]:
        """'NAME' or 'BASE:NAME' naming a LoRA adapter -> (its base entry's name, NAME); any other
        name -> (name, None).  With adapters configured an unknown name is a 404 even with one model
        (a mistyped adapter must not be answered by the base)."""
        if not self.adapters or requested in self._names:
            return requested, None
        if requested in self.adapters:
            return self.adapters[requested], requested
        base, sep, name = requested.rpartition(":")
        if sep and base in self._names and self.adapters.get(name) == self._names[base].name:
            return base, name
        raise ModelNotFound(requested, self.available())

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.state == "loaded"]

    def default_engine(self) -> Any:
        """The first loaded model's engine (health and metrics of a one-model server)."""
        for e in self.entries:
            if e.engine is not None:
                return e.engine
        return None

    # ------------------------------------------------------------------ load / unload
    async def acquire(self, requested: str | None) -> ModelEntry:
        """The entry for ``requested``, loaded and marked in use; ``release`` it when done."""
        e = self.entry(requested)
        while True:
            if e.state == "loaded":
                e.in_flight += 1
                e.last_used = time.monotonic()
                return e
            if e._loading is None:
                e._loading = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().create_task(self._load_task(e))
            fut = e._loading
            await asyncio.shield(fut)  # raises ModelLoadFailed for every waiter when the load fails

    def release(self, e: ModelEntry) -> None:
        e.in_flight = max(0, e.in_flight - 1)
        e.last_used = time.monotonic()

    async def _load_task(self, e: ModelEntry) -> None:
        fut = e._loading
        assert fut is not None
        try:
            await self._make_room(e)
            with self._lock:
                e.state, e.error = "loading", None
            t0 = time.monotonic()
            engine, spec = await asyncio.to_thread(self._load, e)
            view = _view(e, spec)
            with self._lock:
                e.engine, e.spec, e.view, e.state = engine, spec, view, "loaded"
                e.loaded_at = e.last_used = time.monotonic()
                e.load_seconds = round(e.loaded_at - t0, 3)
                e.created = int(time.time())
            self.loads += 1
            if self.on_change is not None:
                self.on_change()
            log.info("loaded model %s in %.1f s", e.name, e.load_seconds)
            fut.set_result(None)
        except Exception as exc:
            with self._lock:
                e.state, e.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("loading model %s failed: %s", e.name, exc)
            fut.set_exception(ModelLoadFailed(f"model {e.name!r} failed to load: {exc}"))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
        finally:
            e._loading = None

    def _idle_lru(self, exclude: ModelEntry) -> list[ModelEntry]:
        idle = [x for x in self.loaded() if x is not exclude and x.in_flight == 0 and not x.pin]
        return sorted(idle, key=lambda x: x.last_used)

    async def _make_room(self, e: ModelEntry) -> None:
        need = self._size_of(e)
        for victim in self._idle_lru(e):
            over_count = self.max_loaded and len(self.loaded()) + 1 > self.max_loaded
            over_mem = self.memory_budget and sum(self._size_of(x) for x in self.loaded()) + need > self.memory_budget
            if not (over_count or over_mem):
                break
            await self.unload(victim, reason="evicted (least recently used)")

    async def unload(self, e: ModelEntry, reason: str = "unloaded") -> None:
        engine = e.engine
        if engine is None:
            return
        with self._lock:
            e.engine, e.spec, e.view, e.state = None, None, None, "unloaded"
        self.unloads += 1
        if self.on_change is not None:
            self.on_change()
        await asyncio.to_thread(engine.shutdown)
        del engine
        await asyncio.to_thread(release_memory)
        log.info("model %s %s", e.name, reason)

    # ------------------------------------------------------------------ TTL
    def start(self) -> None:
        if self.ttl > 0 and self._ttl_task is None:
            self._ttl_task = asyncio.get_running_loop().create_task(self._ttl_loop())

    async def _ttl_loop(self) -> None:
        period = max(0.05, min(self.ttl / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for e in self.loaded():
                if not e.pin and e.in_flight == 0 and now - e.last_used >= self.ttl:
                    await self.unload(e, reason=f"unloaded after {self.ttl:g} s idle")

    async def close(self) -> None:
        if self._ttl_task is not None:
            self._ttl_task.cancel()
        for e in self.loaded():
            await self.unload(e, reason="unloaded (shutdown)")

    # ------------------------------------------------------------------ listing
    def listing(self) -> list[dict[str, Any]]:
        out = []
        for e in self.entries:
            out.append(
                {
                    "id": e.name,
                    "object": "model",
                    "owned_by": "swiftlm",
                    "created": e.created,
                    "status": {
                        "value": e.state,
                        "in_flight": e.in_flight,
                        "pinned": e.pin,
                        **({"error": e.error} if e.error else {}),
                    },
                    "aliases": e.aliases,
                }
            )
            for name, base in self.adapters.items():  # LoRA adapters served on this entry
                if base == e.name:
                    out.append(
                        {
                            "id": name,
                            "object": "model",
                            "owned_by": "swiftlm",
                            "created": e.created,
                            "parent": e.name,
                            "kind": "lora_adapter",
                            "status": {"value": e.state, "in_flight": e.in_flight, "pinned": e.pin},
                        }
                    )
        return out


# ---------------------------------------------------------------------- the app's view
CURRENT: contextvars.ContextVar[ModelEntry | None] = contextvars.ContextVar("swiftlm_model", default=None)
ADAPTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("swiftlm_adapter", default=None)  # LoRA


class AppState:
    """The app's shared state.  ``engine`` and ``spec`` are the current request's model (chosen by
    ``select_model`` from the body's 'model' field, per request task) or, outside a request (health,
    metrics), the server's default model; so the routes need not know how many models there are."""

    def __init__(self, **kw: Any):
        self.__dict__.update(_engine=None, _spec=None, models=None)
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def engine(self) -> Any:
        e = CURRENT.get()
        return e.engine if e is not None and e.engine is not None else self._engine

    @engine.setter
    def engine(self, v: Any) -> None:
        self.__dict__["_engine"] = v

    @property
    def spec(self) -> Any:
        e = CURRENT.get()
        return e.view if e is not None and e.view is not None else self._spec

    @spec.setter
    def spec(self, v: Any) -> None:
        self.__dict__["_spec"] = v

    async def select_model(self, requested: Any) -> None:
        """Pick (and load, if need be) the request's model; once per request."""
        from .errors import APIError

        if self.models is None or CURRENT.get() is not None:
            return
        self.models.start()  # the TTL task, on the server's loop (idempotent)
        if requested is not None and not isinstance(requested, str):
            raise APIError(400, "'model' must be a string", param="model")
        adapter = None
        try:
            if requested is not None:
                requested, adapter = self.models.split_adapter(requested)
            e = await self.models.acquire(requested)
        except ModelNotFound as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from None
        except ModelLoadFailed as exc:
            raise APIError(503, str(exc), param="model", code="model_load_failed") from None
        CURRENT.set(e)
        ADAPTER.set(adapter)

    def release_model(self) -> None:
        e = CURRENT.get()
        if e is not None and self.models is not None:
            self.models.release(e)
            CURRENT.set(None)
            ADAPTER.set(None)
