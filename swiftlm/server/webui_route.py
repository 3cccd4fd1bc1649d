"""The built-in chat page (``--no-webui`` turns it off).

Static files shipped in ``swiftlm/server/webui/``: the page at ``/``, its assets at ``/webui/<path>``.
They are served without an API key (the page is the same for everyone and holds no secret); the
page's own calls go to the API and carry the key the user types in.  ``/webui/info`` (key-guarded like
``/v1``) tells the page what ``/v1/models`` does not: which media each model takes and the server's
sampling defaults.  The files are read once, at app creation, into a fixed table: a request can only
name one of them, never a path on disk.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

WEBUI_DIR = Path(__file__).with_name("webui")

TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
    ".webmanifest": "application/manifest+json",
    ".txt": "text/plain; charset=utf-8",
    "": "text/plain; charset=utf-8",  # LICENSE files
}

# Everything the page loads or connects to comes from this server. Pictures and sounds the user
# attaches are previewed from data:/blob: URLs made in the browser (no host is contacted for them).
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' data: blob:; connect-src 'self'; font-src 'self'; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate (ETag), so an upgraded server's page is picked up
}


class _File:
    __slots__ = ("body", "etag", "media_type")

    def __init__(self, path: Path):
        self.body = path.read_bytes()
        self.etag = '"' + hashlib.sha256(self.body).hexdigest()[:20] + '"'
        self.media_type = TYPES.get(path.suffix.lower(), "application/octet-stream")


@functools.cache
def load_files(root: Path = WEBUI_DIR) -> dict[str, _File]:
    """{'index.html': ..., 'vendor/marked.esm.js': ...}: every file under ``root``, by its relative path
    (read once per process)."""
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): _File(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and "__pycache__" not in p.parts
    }


def _serve(f: _File, request: Request) -> Response:
    headers = {**HEADERS, "ETag": f.etag}
    if f.etag in [t.strip().removeprefix("W/") for t in request.headers.get("if-none-match", "").split(",")]:
        return Response(status_code=304, headers=headers)
    return Response(f.body, media_type=f.media_type, headers=headers)


def modalities(engine: Any) -> list[str] | None:
    """What a loaded model accepts (its media policy: the model's towers and the --vision /
    --audio flags); None while it is not loaded."""
    if engine is None:
        return None
    policy = getattr(engine, "media_policy", None)
    return ["text"] + [m for m in ("image", "audio") if policy is not None and getattr(policy, m, False)]


def routes(state: Any, keyed: Callable[[Callable[[Request], Awaitable[Response]]], Any]) -> list[Route]:
    """The page's routes; ``keyed`` wraps a handler in the /v1 key and rate-limit check."""
    files = load_files()

    async def index(request: Request) -> Response:
        f = files.get("index.html")
        if f is None:  # a broken install: say so instead of a bare 404
            raise HTTPException(404, "the web UI's files are missing from this installation")
        return _serve(f, request)

    async def asset(request: Request) -> Response:
        f = files.get(request.path_params["path"])
        if f is None:
            raise HTTPException(404)
        return _serve(f, request)

    async def info(request: Request) -> Response:
        s = state.settings
        models: dict[str, Any] = {}
        if state.models is not None:
            for e in state.models.entries:
                models[e.name] = {"modalities": modalities(e.engine)}
        elif state.spec is not None:
            models[state.spec.name] = {"modalities": modalities(state.engine)}
        return JSONResponse(
            {
                "models": models,
                # media the server was started to accept; a model not yet loaded is judged by these
                "media": {"image": bool(s.vision), "audio": bool(s.audio)},
                "defaults": {
                    "temperature": s.temp,
                    "top_p": s.top_p,
                    "max_tokens": s.max_tokens,
                    "thinking": s.thinking,
                },
            },
            headers={"Cache-Control": "no-store"},
        )

    return [
        Route("/", index, methods=["GET", "HEAD"]),
        Route("/webui/info", keyed(info), methods=["GET"]),
        Route("/webui/{path:path}", asset, methods=["GET", "HEAD"]),
    ]
