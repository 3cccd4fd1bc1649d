"""Ollama's model routes and model state: /api/tags, /api/show, /api/ps, /api/version, /api/pull,
/api/delete, and ``keep_alive``.

/api/tags lists the models this server is configured to serve (the --model flags or the
--models-file entries), /api/ps the loaded ones, /api/show one model's details (without loading it).
/api/pull downloads a Hugging Face repo into the cache the registry reads (``swiftlm.hub.download``,
``owner/name``, or ``hf.co/owner/name:QUANT`` for the GGUF files of one quantization) and streams
Ollama's status lines; a pulled model is served once it is configured.  /api/delete removes a repo
from that cache (``swiftlm.hub.remove``, as ``swiftlm rm``), never a model this server serves.

``keep_alive`` acts on the model manager's entries: 0 unloads the model once its requests are
done, a duration unloads it after that much idle time, a negative value keeps it loaded, and
leaving it out keeps the server's own policy (--model-ttl).  A model pinned by the server's
configuration (the start-up --model, --pin, ``pin = true`` in a models file) stays loaded whatever a
client asks: one client cannot make every other one wait for a reload.  An explicit unload of it
(no prompt, keep_alive 0) is a 409; on a generation request keep_alive is a hint it ignores.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import SwiftLMError
from .errors import APIError
from .models import CURRENT, ModelNotFound
from .ollama_schemas import OLLAMA_API_VERSION, OllamaModelRequest
from .wire import parse, read_json

NDJSON = "application/x-ndjson"
NEVER = "9999-12-31T23:59:59Z"  # expires_at of a model kept loaded
PULL_PROGRESS_S = 0.5  # a progress line at most this often while a pull downloads
_TAG = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def line(obj: dict) -> str:
    """One NDJSON line."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def iso(ts: float | None = None) -> str:
    t = datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _wall(mono: float) -> str:
    return iso(time.time() + (mono - time.monotonic()))


class _BodyOnly:
    """The app state as ``read_json`` sees it here: the settings (size and nesting limits) without
    the model manager, so reading the body does not pick the model; the routes pick it after
    normalising the Ollama name (``name:latest``), or never (show, pull, delete)."""

    def __init__(self, settings: Any):
        self.settings, self.models = settings, None


# ---------------------------------------------------------------- model facts
def _params_size(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.1f}B"
    if n >= 10**6:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e3:.0f}K" if n else ""


def _quant(spec: Any) -> str:
    q = str(spec.quantization or "")
    return q.split()[1] if q.startswith("gguf ") and len(q.split()) > 1 else q


def details(spec: Any) -> dict:
    return {
        "parent_model": "",
        "format": "gguf" if spec.format == "gguf" else "safetensors",
        "family": spec.arch,
        "families": [spec.arch],
        "parameter_size": _params_size(spec.num_params),
        "quantization_level": _quant(spec),
    }


def _mtime(spec: Any) -> float:
    try:
        return os.stat(spec.path).st_mtime
    except OSError:
        return time.time()


def _digest(spec: Any) -> str:
    """An identity for the model's files (path, size, modification time): not a content hash."""
    key = f"{spec.path}:{spec.size_bytes}:{_mtime(spec)}"
    return hashlib.sha256(key.encode()).hexdigest()


def _listing(name: str, spec: Any) -> dict:
    if spec is None:  # servable, not resolvable yet (a hub model not downloaded)
        return {"name": name, "model": name, "modified_at": iso(), "size": 0, "digest": "", "details": {}}
    return {
        "name": name,
        "model": name,
        "modified_at": iso(_mtime(spec)),
        "size": spec.size_bytes,
        "digest": _digest(spec),
        "details": details(spec),
    }


def _hub_status(exc: BaseException) -> int:
    """HTTP status for a failed download (swiftlm.hub.HubError and what it wraps)."""
    from huggingface_hub import errors as e

    from ..registry import _offline

    chain: list[BaseException] = [exc]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 6:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    names = {type(x).__name__ for x in chain}
    if "OfflineModeIsEnabled" in names:
        return 404  # not in the cache, and this server may not download
    for x in chain:
        if isinstance(x, e.LocalEntryNotFoundError):  # not cached, and offline or the hub unreachable
            return 404 if _offline() else 502
        if isinstance(x, e.GatedRepoError):
            return 403
        if isinstance(x, (e.RepositoryNotFoundError, e.RevisionNotFoundError, e.EntryNotFoundError)):
            return 404
        if isinstance(x, e.HfHubHTTPError) and getattr(getattr(x, "response", None), "status_code", 0) in (401, 403):
            return 403
    network = {"ConnectError", "ConnectTimeout", "ReadTimeout", "ConnectionError", "NetworkError"}
    if not names & network and any(isinstance(x, OSError) for x in chain[1:]):
        return 507  # writing to the cache failed
    return 502  # the hub could not be reached or answered an error


def hub_target(name: str) -> tuple[str, str | None]:
    """An Ollama-style model name -> (Hugging Face repo id, tag).  ``hf.co/`` and ``huggingface.co/``
    prefixes are dropped; the tag after ':' picks a GGUF quantization (``:Q4_K_M``), ``latest`` none."""
    n = name.strip()
    for scheme in ("https://", "http://"):
        if n.lower().startswith(scheme):
            n = n[len(scheme) :]
    for host in ("hf.co/", "huggingface.co/"):
        if n.lower().startswith(host):
            n = n[len(host) :]
    repo, _, tag = n.partition(":")
    return repo, (None if tag in ("", "latest") else tag)


def _is_bundled(name: str) -> bool:
    from ..registry import _BUNDLED, _BUNDLED_ALIASES

    key = name.lower().removesuffix(":latest")
    return key in _BUNDLED or key in _BUNDLED_ALIASES


def _dir_bytes(path: Any) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


class _PullError(SwiftLMError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- keep_alive
class KeepAlive:
    """Ollama's keep_alive over the model manager (see the module docstring)."""

    def __init__(self, state: Any):
        self.state = state
        self.seconds: dict[str, float] = {}  # entry -> the keep_alive its last request set
        self.gen: dict[str, int] = {}  # entry -> a counter: a newer keep_alive cancels an older timer
        self.pinned: set[str] = set()  # entries pinned here for a negative keep_alive
        self.tasks: set[asyncio.Task] = set()

    def _bump(self, e: Any) -> int:
        if e.name in self.pinned:
            e.pin = False
            self.pinned.discard(e.name)
        self.gen[e.name] = g = self.gen.get(e.name, 0) + 1
        return g

    def apply(self, seconds: float | None) -> None:
        """The current request's keep_alive, for its model (``models.CURRENT``)."""
        e = CURRENT.get()
        if e is None or self.state.models is None:
            return
        g = self._bump(e)
        if seconds is None:
            self.seconds.pop(e.name, None)
            return
        self.seconds[e.name] = seconds
        if seconds < 0:
            if not e.pin:
                e.pin = True
                self.pinned.add(e.name)
        elif not e.pin:
            self._spawn(e, seconds, g)

    async def unload(self, e: Any) -> None:
        """keep_alive 0 without a request: now if idle, else when its requests are done."""
        g = self._bump(e)
        self.seconds.pop(e.name, None)
        if e.pin:
            raise APIError(409, f"model {e.name!r} is pinned by the server's configuration: it stays loaded")
        if e.state == "loaded" and e.in_flight == 0:
            await self.state.models.unload(e, reason="unloaded (keep_alive 0)")
        elif e.state == "loaded":
            self._spawn(e, 0.0, g)

    def _spawn(self, e: Any, seconds: float, g: int) -> None:
        task = asyncio.get_running_loop().create_task(self._expire(e, seconds, g))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _expire(self, e: Any, seconds: float, g: int) -> None:
        while self.gen.get(e.name) == g and e.state == "loaded":
            idle = time.monotonic() - e.last_used
            if e.in_flight == 0 and idle >= seconds:
                self.seconds.pop(e.name, None)
                await self.state.models.unload(e, reason=f"unloaded (keep_alive {seconds:g} s)")
                return
            await asyncio.sleep(0.05 if e.in_flight or seconds - idle < 0.05 else seconds - idle)

    def expires_at(self, e: Any) -> str:
        s = self.seconds.get(e.name)
        if s is None:
            ttl = self.state.models.ttl if self.state.models is not None else 0
            return _wall(e.last_used + ttl) if ttl > 0 and not e.pin else NEVER
        if s < 0 or e.pin:
            return NEVER
        return _wall(e.last_used + s)


# ---------------------------------------------------------------- routes
class OllamaModels:
    """The model side of the Ollama routes: reading bodies, picking models, keep_alive, and the
    model routes."""

    def __init__(self, state: Any):
        self.state = state
        self.keep = KeepAlive(state)
        self._specs: dict[str, Any] = {}  # entry name -> its resolved spec (for unloaded entries)

    async def read(self, request: Request, limit: int | None = None) -> dict:
        """The request's JSON body, with every check of the /v1 routes (``read_json``), the model not picked."""
        scope = {**request.scope, "app": SimpleNamespace(state=SimpleNamespace(swiftlm=_BodyOnly(self.state.settings)))}
        return await read_json(Request(scope, request.receive), limit or self.state.settings.max_body_bytes)

    def canonical(self, requested: Any) -> Any:
        """``name:latest`` is the configured ``name`` (Ollama clients add the tag)."""
        m = self.state.models
        if m is None or not isinstance(requested, str) or not requested.endswith(":latest"):
            return requested
        known = {n for e in m.entries for n in (e.name, *e.aliases)} | set(m.adapters)
        return requested[: -len(":latest")] if requested not in known and requested[:-7] in known else requested

    async def select(self, requested: Any) -> int:
        """Pick (and load if need be) the request's model; the nanoseconds that took."""
        t = time.perf_counter_ns()
        await self.state.select_model(self.canonical(requested))
        return time.perf_counter_ns() - t

    def entry(self, requested: str | None) -> Any:
        """The manager's entry for a model name, without loading it."""
        m = self.state.models
        try:
            base = m.split_adapter(self.canonical(requested))[0] if requested is not None else None
            return m.entry(base)
        except ModelNotFound as exc:
            raise APIError(404, str(exc)) from None

    async def spec(self, e: Any) -> Any:
        if e.spec is not None:
            return e.spec
        if e.name not in self._specs:
            from ..registry import resolve

            try:
                self._specs[e.name] = await asyncio.to_thread(resolve, e.model, allow_download=False)
            except (SwiftLMError, OSError):  # not downloaded (yet): listed without details
                return None
        return self._specs[e.name]

    # ------------------------------------------------------------------ models
    async def tags(self, request: Request) -> Response:
        m = self.state.models
        if m is None:
            spec = self.state.spec
            return JSONResponse({"models": [_listing(spec.name, spec)] if spec else []})
        return JSONResponse({"models": [_listing(e.name, await self.spec(e)) for e in m.entries]})

    async def ps(self, request: Request) -> Response:
        from .metrics import memory_figures

        m = self.state.models
        if m is None:  # one model, outside `swiftlm serve` (an app built in-process)
            eng, spec = self.state.engine, self.state.spec
            loaded = [(SimpleNamespace(name=spec.name), eng, spec)] if eng is not None and spec is not None else []
        else:
            loaded = [(e, e.engine, e.spec) for e in m.entries if e.state == "loaded" and e.engine is not None]
        out = []
        for e, engine, spec in loaded:
            mem = await asyncio.to_thread(memory_figures, engine)
            size = int(mem["weights"] + mem["kv_allocated"]) or spec.size_bytes
            out.append(
                {
                    **_listing(e.name, spec),
                    "expires_at": self.keep.expires_at(e) if m is not None else NEVER,
                    "size": size,
                    "size_vram": size if mem["device"] != "cpu" else 0,
                    "context_length": engine.ctx_size,
                }
            )
            del out[-1]["modified_at"]
        return JSONResponse({"models": out})

    async def show(self, request: Request) -> Response:
        req: OllamaModelRequest = parse(OllamaModelRequest, await self.read(request))
        name = req.target()
        if self.state.models is None:
            spec, engine = self.state.spec, self.state.engine
            served = spec.name if spec is not None else name
        else:
            e = self.entry(name)
            spec, engine, served = await self.spec(e), e.engine, e.name
        if spec is None:
            raise APIError(404, f"model {name!r} is configured but not downloaded (see /api/pull)")
        from ..embeddings import is_embedding_only

        st = self.state.settings
        tmpl = getattr(engine.tokenizer, "chat_template", None) if engine is not None else None
        source = getattr(tmpl, "source", None) or (spec.gguf_meta or {}).get("tokenizer.chat_template") or ""
        embedding_only = engine.info.embedding_only if engine is not None else is_embedding_only(spec.config or {})
        caps = ["embedding"] if embedding_only else ["completion", "tools"]
        if not embedding_only and ("enable_thinking" in source or "<think>" in source):
            caps.append("thinking")
        vision = "image" in engine.info.modalities if engine is not None else spec.vision
        if vision and st.vision:
            caps.append("vision")
        ctx = engine.ctx_size if engine is not None else spec.context_length
        cfg = spec.config or {}
        info = {
            "general.architecture": spec.arch,
            "general.parameter_count": spec.num_params,
            f"{spec.arch}.context_length": ctx,
            f"{spec.arch}.block_count": cfg.get("num_hidden_layers"),
            f"{spec.arch}.embedding_length": cfg.get("hidden_size"),
            f"{spec.arch}.vocab_size": engine.info.vocab_size if engine is not None else cfg.get("vocab_size"),
        }
        params = {
            "temperature": st.temp,
            "top_p": st.top_p,
            "top_k": st.top_k,
            "min_p": st.min_p,
            "repeat_penalty": st.repeat_penalty,
            "repeat_last_n": st.repeat_last_n,
            "num_predict": st.max_tokens,
            "num_ctx": ctx,
        }
        lines = "\n".join(f"{k:<30} {v}" for k, v in params.items())
        modelfile = f"# SwiftLM serves this model; these are the server's defaults.\nFROM {served}\n" + "".join(
            f"PARAMETER {k} {v}\n" for k, v in params.items()
        )
        return JSONResponse(
            {
                "modelfile": modelfile,
                "parameters": lines,
                "template": source,
                "details": details(spec),
                "model_info": {k: v for k, v in info.items() if v is not None},
                "capabilities": caps,
                "modified_at": iso(_mtime(spec)),
            }
        )

    async def version(self, request: Request) -> Response:
        from .. import __version__

        return JSONResponse({"version": OLLAMA_API_VERSION, "swiftlm": __version__})

    # ------------------------------------------------------------------ pull / delete
    def _hub_repo(self, name: str) -> tuple[str, str | None]:
        from ..registry import _looks_like_repo_id

        repo, tag = hub_target(name)
        if not _looks_like_repo_id(repo):
            raise APIError(
                400,
                f"{name!r} is not a Hugging Face repo id; give it as owner/name (or hf.co/owner/name:QUANT for "
                "one GGUF quantization)",
            )
        if tag is not None and not _TAG.match(tag):
            raise APIError(400, f"tag {tag!r} is not a quantization name such as Q4_K_M")
        return repo, tag

    @staticmethod
    def _download(repo: str, tag: str | None) -> None:
        from .. import hub

        include = sorted({f"*{t}*.gguf" for t in (tag, tag.upper(), tag.lower())}) if tag else None
        path = hub.download(repo, include=include)
        if tag and not any(tag.lower() in p.name.lower() for p in path.rglob("*.gguf")):
            raise _PullError(404, f"{repo} has no GGUF file whose name contains {tag!r}")

    @staticmethod
    def _pull_error(exc: BaseException) -> APIError:
        from ..hub import HubError

        if isinstance(exc, _PullError):
            return APIError(exc.status, str(exc))
        if isinstance(exc, HubError):
            return APIError(_hub_status(exc), str(exc))
        if isinstance(exc, SwiftLMError):
            return APIError(400, str(exc))
        raise exc

    async def pull(self, request: Request) -> Response:
        req: OllamaModelRequest = parse(OllamaModelRequest, await self.read(request))
        name = req.target()
        if _is_bundled(name):  # installed with swiftlm: nothing to download
            return JSONResponse({"status": "success"}) if not req.stream else self._ndjson([{"status": "success"}])
        repo, tag = self._hub_repo(name)
        if req.stream:
            return StreamingResponse(self._pull_lines(repo, tag), media_type=NDJSON)
        try:
            await asyncio.to_thread(self._download, repo, tag)
        except SwiftLMError as exc:
            raise self._pull_error(exc) from None
        return JSONResponse({"status": "success"})

    @staticmethod
    def _ndjson(objs: list[dict]) -> Response:
        return Response("".join(line(x) for x in objs), media_type=NDJSON)

    async def _pull_lines(self, repo: str, tag: str | None) -> AsyncIterator[str]:
        from ..registry import _hf_cache_dir

        yield line({"status": "pulling manifest"})
        fut = asyncio.get_running_loop().run_in_executor(None, self._download, repo, tag)
        blobs = _hf_cache_dir() / f"models--{repo.replace('/', '--')}" / "blobs"
        last = -1
        while True:
            done, _ = await asyncio.wait({fut}, timeout=PULL_PROGRESS_S)
            n = await asyncio.to_thread(_dir_bytes, blobs)  # what is on disk so far, partial files included
            if n != last and n > 0:
                yield line({"status": f"pulling {repo}", "completed": n})
                last = n
            if done:
                break
        try:
            fut.result()
        except SwiftLMError as exc:
            self.state.metrics.count_error(self._pull_error(exc).status, where="stream")
            yield line({"error": self._pull_error(exc).message})
            return
        yield line({"status": "success"})

    async def delete(self, request: Request) -> Response:
        from .. import hub
        from ..registry import _hf_cache_dir, _looks_like_repo_id

        req: OllamaModelRequest = parse(OllamaModelRequest, await self.read(request))
        name = req.target()
        if _is_bundled(name):
            raise APIError(400, f"{name} is the bundled model, part of the installation; it is not in the cache")
        repo, tag = hub_target(name)
        if tag is not None:
            raise APIError(400, "give the repo id without a tag: delete removes the whole cached repo")
        for e in self.state.models.entries if self.state.models is not None else []:
            if (e.model or "").lower() == repo.lower():
                raise APIError(409, f"{repo} is served by this server (model {e.name!r}); it cannot be deleted")
        cache = _hf_cache_dir()
        folder = f"models--{repo.replace('/', '--')}".lower()
        present = (
            _looks_like_repo_id(repo) and cache.is_dir() and any(p.name.lower() == folder for p in cache.iterdir())
        )
        if not present:
            raise APIError(404, f"model {name!r} not found in the Hugging Face cache")
        try:
            await asyncio.to_thread(hub.remove, repo)
        except SwiftLMError as exc:
            raise APIError(500, str(exc)) from None
        return Response(status_code=200)
