"""API keys (--api-key, --api-keys-file) and per-key rate limits (--rate-limit: a token bucket
per key, or per client address when no keys are set): one check shared by every route's guard."""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .errors import APIError
from .models import CURRENT


def load_keys(api_key: str | None, keys_file: str | None) -> dict[str, str]:
    """{key: name}.  The file has one key per line, optionally ``name: key``; # starts a comment."""
    keys: dict[str, str] = {}
    if api_key:
        keys[api_key] = "default"
    if keys_file:
        for n, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, key = line.partition(":")
            name, key = (name.strip(), key.strip()) if sep else (f"key{n}", name.strip())
            if not key:
                raise ValueError(f"{keys_file}:{n}: empty key")
            keys[key] = name
    return keys


class TokenBucket:
    def __init__(self, per_minute: float, burst: int):
        self.rate = per_minute / 60.0
        self.capacity = float(max(1, burst))
        self.buckets: dict[str, tuple[float, float]] = {}  # who -> (tokens, last refill time)
        self.lock = threading.Lock()

    def take(self, who: str) -> float:
        """0.0 when allowed, else the seconds until a request would be."""
        now = time.monotonic()
        with self.lock:
            tokens, last = self.buckets.get(who, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self.buckets[who] = (tokens - 1.0, now)
                return 0.0
            self.buckets[who] = (tokens, now)
            return (1.0 - tokens) / self.rate


class Gate:
    """Who is calling (by key) and whether they may now."""

    def __init__(self, settings: Any):
        self.keys = load_keys(settings.api_key, getattr(settings, "api_keys_file", None))
        rate = float(getattr(settings, "rate_limit", 0) or 0)
        burst = int(getattr(settings, "rate_burst", 0) or 0) or max(1, math.ceil(rate / 6))
        self.bucket = TokenBucket(rate, burst) if rate > 0 else None

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, request: Request) -> str | None:
        """The key's name, or None when no configured key was sent."""
        sent = [request.headers.get("x-api-key", "").strip()]
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            sent.append(token.strip())
        found = None
        for key, name in self.keys.items():  # compare against every key: no early exit on a match
            for s in sent:
                if s and hmac.compare_digest(s.encode(), key.encode()):
                    found = name
        return found

    def check(self, request: Request, need_key: bool) -> tuple[int, str, float] | None:
        """None if the request may go on, else (status, message, retry-after seconds)."""
        who = None
        if need_key and self.keys:
            who = self.identify(request)
            if who is None:
                return 401, "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key')", 0.0
        if self.bucket is not None:
            wait = self.bucket.take(who or f"addr:{request.client.host if request.client else '?'}")
            if wait > 0:
                return (
                    429,
                    f"rate limit exceeded for {'key ' + repr(who) if who else 'this client'}; retry in {wait:.1f} s",
                    wait,
                )
        return None


async def _releasing(body: Any, state: Any, entry: Any) -> Any:
    try:
        async for chunk in body:
            yield chunk
    finally:
        state.models.release(entry)


async def run_guarded(state: Any, request: Request, fn: Any, need_key: bool, render_error: Any) -> Any:
    """Every /v1 route: the key and rate-limit check, the route, errors in the route's shape
    (``render_error(exc, headers)``), and the request's model kept in use until its response
    (or its stream) ends."""
    streaming = False
    try:
        denied = state.gate.check(request, need_key)
        if denied is not None:
            status, message, wait = denied
            exc = APIError(status, message, code="invalid_api_key" if status == 401 else "rate_limited")
            exc.retry_after = wait  # type: ignore[attr-defined]
            raise exc
        resp = await fn(request)  # reading the body picks the request's model (state.select_model)
        if CURRENT.get() is not None and isinstance(resp, StreamingResponse):
            resp.body_iterator = _releasing(resp.body_iterator, state, CURRENT.get())
            streaming = True
        return resp
    except APIError as exc:
        state.metrics.errors.labels(str(exc.status)).inc()
        headers = None
        if exc.status in (429, 503):  # queue full, rate limited, loading
            headers = {"Retry-After": str(max(1, math.ceil(getattr(exc, "retry_after", 1.0))))}
        return render_error(exc, headers)
    finally:
        if not streaming and CURRENT.get() is not None:
            state.release_model()


def guard(
    state: Any,
    fn: Callable[[Request], Awaitable[Response]],
    needs_key: Callable[[], bool],
    render_error: Callable[[APIError, dict | None], Response],
) -> Callable[[Request], Awaitable[Response]]:
    """A route handler: ``fn`` behind ``run_guarded``, its errors rendered by ``render_error(exc, headers)``."""

    async def handler(request: Request) -> Response:
        return await run_guarded(state, request, fn, needs_key(), render_error)

    return handler
