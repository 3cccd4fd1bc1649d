"""What every route shares on the wire: reading and checking a JSON request body, parsing it into a
request model (a 400 naming the field), and server-sent-event framing."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from .errors import APIError


def sse(obj: Any, event: str | None = None) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")  # the latter: `curl -d` without -H


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise APIError(400, f"request body has the key {k!r} twice in one object")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise APIError(400, f"request body contains {name}, which is not valid JSON (numbers must be finite)")


def _check_shape(body: Any, max_depth: int, max_items: int) -> None:
    """Nesting depth and container sizes, walked without recursion."""
    stack = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise APIError(400, f"request body is nested deeper than {max_depth} levels (--max-json-depth)")
        items = node.values() if isinstance(node, dict) else node
        if len(node) > max_items:
            raise APIError(
                400, f"request body has a list or object of {len(node)} items; at most {max_items} (--max-json-items)"
            )
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))


async def read_json(request: Request, limit: int) -> dict:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype not in JSON_TYPES and not ctype.endswith("+json"):
        raise APIError(415, f"request body must be JSON (Content-Type: application/json), not {ctype!r}")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes")
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8") from None
    try:
        body = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise APIError(
            400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    st = getattr(getattr(request.app.state, "swiftlm", None), "settings", None) if "app" in request.scope else None
    _check_shape(body, getattr(st, "max_json_depth", 64), getattr(st, "max_json_items", 8192))
    try:  # JSON escapes can encode lone surrogates, which no tokenizer accepts
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains invalid Unicode (a lone surrogate escape)") from None
    state = getattr(request.app.state, "swiftlm", None) if "app" in request.scope else None
    if state is not None and getattr(state, "models", None) is not None:
        await state.select_model(body.get("model"))  # this request's engine from here on (server/models.py)
    return body


def parse(model_cls: type, body: dict) -> Any:
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        raise APIError(400, f"'{where}': {err.get('msg', 'invalid value')}", param=param) from None
