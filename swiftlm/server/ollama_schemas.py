"""Ollama's wire format: request bodies, and their translation into the internal chat request.

Nothing here runs a model.  ``ollama.py`` reads a body into one of the request models below, turns
it into a ``ChatCompletionRequest`` with ``chat_body`` (messages, tools, options, format, think)
and formats the chat path's output back into Ollama's NDJSON lines with ``tool_call`` and
``logprobs``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError
from .schemas import MAX_TOOLS

# The Ollama release whose API these routes follow (clients compare it to enable features).
OLLAMA_API_VERSION = "0.12.0"

_Scalar = Union[str, int, float]


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class OllamaOptions(_Req):
    """The runtime options SwiftLM maps onto its sampling parameters.  Load-time and other options
    (num_gpu, num_thread, mirostat, typical_p, ...) are accepted and ignored, as Ollama ignores
    options a model does not use."""

    num_predict: int | None = None
    num_ctx: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class _Generation(_Req):
    model: str | None = None
    options: OllamaOptions | None = None
    format: Union[str, dict[str, Any], None] = None
    stream: bool = True
    keep_alive: _Scalar | None = None
    think: Union[bool, str, None] = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


_HI = [{"role": "user", "content": "Hello"}]


class OllamaChatRequest(_Generation):
    # examples: valid bodies for the OpenAPI document (schema fuzzers start from them)
    model_config = ConfigDict(json_schema_extra={"examples": [{"messages": _HI, "stream": False}, {"messages": _HI}]})

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)


class OllamaGenerateRequest(_Generation):
    model_config = ConfigDict(json_schema_extra={"examples": [{"prompt": "Hello", "stream": False}, {"prompt": "Hi"}]})

    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class OllamaEmbedRequest(_Req):
    model_config = ConfigDict(json_schema_extra={"examples": [{"input": ["Hello", "world"]}]})

    model: str | None = None
    input: Union[str, list[str]]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: OllamaOptions | None = None
    keep_alive: _Scalar | None = None


class OllamaEmbeddingsRequest(_Req):
    model: str | None = None
    prompt: str | None = None
    options: OllamaOptions | None = None
    keep_alive: _Scalar | None = None


class OllamaModelRequest(_Req):
    """/api/show, /api/pull, /api/delete.  Older clients name the model 'name'."""

    model: str | None = None
    name: str | None = None
    stream: bool = True
    insecure: bool | None = None  # accepted, ignored (downloads go to the Hugging Face hub over HTTPS)
    verbose: bool | None = None

    def target(self) -> str:
        name = self.model or self.name
        if not name:
            raise APIError(400, "'model' is required")
        return name


def bad(message: str) -> APIError:
    return APIError(400, message)


# ---------------------------------------------------------------- keep_alive
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
FOREVER_S = 10 * 365 * 86400.0  # longer than this is "never unload"


def keep_alive_seconds(value: Any) -> float | None:
    """``keep_alive`` -> seconds (None: not given; negative: keep loaded; 0: unload after the request).
    A number is seconds; a string is a number of seconds or a Go duration ("5m", "1h30m", "-1s")."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad("'keep_alive' must be a duration such as \"5m\", a number of seconds, or -1")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            pos, total = 0, 0.0
            for m in _PART.finditer(body):
                if m.start() != pos:
                    break
                total += float(m.group(1)) * _UNITS[m.group(2)]
                pos = m.end()
            if not body or pos != len(body):
                raise bad(f'\'keep_alive\' {value!r} is not a duration (e.g. "5m", "1h30m", "30s", "-1")') from None
            seconds = sign * total
    if seconds != seconds:  # NaN from a string such as "nan"
        raise bad("'keep_alive' must be a number of seconds or a duration")
    if seconds < 0 or seconds > FOREVER_S:
        return -1.0
    return seconds


# ---------------------------------------------------------------- request -> chat request
# internal field -> the Ollama field a client set (for error messages)
OPTION_NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "response_format": "format",
    "enable_thinking": "think",
}


def ollama_names(exc: APIError) -> APIError:
    """``exc`` with the internal field names in its message replaced by the Ollama ones."""
    for internal, outside in OPTION_NAMES.items():
        exc.message = exc.message.replace(f"'{internal}'", f"'{outside}'")
    return exc


def _image_part(data: Any, where: str) -> dict:
    """A base64 image -> an image part; always inline (a string is never read as a path or URL)."""
    if not isinstance(data, str) or not data:
        raise bad(f"{where} must be a non-empty base64 string")
    url = data if data[:5].lower() == "data:" else "data:image/*;base64," + data
    return {"type": "image_url", "image_url": {"url": url}}


def chat_messages(messages: list, where: str = "messages") -> list[dict]:
    """Ollama messages -> chat messages: ``images`` become image parts, ``thinking`` the reasoning,
    ``tool_calls`` (arguments as objects) get ids, and a ``tool`` message is tied to its call by
    ``tool_name`` (else to the next unanswered call)."""
    out: list[dict] = []
    pending: list[tuple[str, Any]] = []  # (id, name) of assistant tool calls not answered yet
    for i, m in enumerate(messages):
        w = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{w} must be an object")
        role = m.get("role")
        msg = {k: v for k, v in m.items() if k not in ("images", "thinking", "tool_calls", "tool_name")}
        images = m.get("images")
        if images is not None:
            if not isinstance(images, list):
                raise bad(f"{w}.images must be a list of base64 strings")
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise bad(f"{w}.content must be a string")
            parts = [_image_part(x, f"{w}.images[{j}]") for j, x in enumerate(images)]
            msg["content"] = parts + ([{"type": "text", "text": content}] if content else [])
        if m.get("thinking") is not None:
            if not isinstance(m["thinking"], str):
                raise bad(f"{w}.thinking must be a string")
            msg["reasoning_content"] = m["thinking"]
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise bad(f"{w}.tool_calls: only an assistant message carries tool calls")
            if not isinstance(calls, list):
                raise bad(f"{w}.tool_calls must be a list")
            converted = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise bad(f"{w}.tool_calls[{j}] must have a 'function' object")
                cid = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"call_{i}_{j}"
                converted.append(
                    {
                        "id": cid,
                        "type": "function",
                        "function": {"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                    }
                )
                pending.append((cid, fn.get("name")))
            msg["tool_calls"] = converted
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            name = m.get("tool_name")
            k = next((k for k, (_, n) in enumerate(pending) if n == name), 0 if pending else None)
            msg["tool_call_id"] = pending.pop(k)[0] if k is not None else f"call_{i}"
        out.append(msg)
    return out


def response_format(fmt: Any) -> dict | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"schema": fmt}}
    raise bad("'format' must be \"json\" or a JSON schema object")


def thinking(think: Any) -> tuple[bool | None, dict]:
    """``think`` -> (the chat request's enable_thinking, template arguments)."""
    if think is None or isinstance(think, bool):
        return think, {}
    if think in ("low", "medium", "high"):
        return True, {"reasoning_effort": think}
    raise bad(f'\'think\' must be true, false, "low", "medium" or "high", got {think!r}')


def sampling_fields(opts: OllamaOptions | None, ctx_size: int) -> dict:
    """Options -> the chat request's sampling fields (range checks happen there, as on /v1)."""
    if opts is None:
        return {}
    out: dict[str, Any] = {
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "top_k": opts.top_k,
        "min_p": opts.min_p,
        "seed": opts.seed,
        "stop": opts.stop,
        "repetition_penalty": opts.repeat_penalty,
        "presence_penalty": opts.presence_penalty,
        "frequency_penalty": opts.frequency_penalty,
    }
    n = opts.num_predict
    if n is not None:
        if n in (-1, -2):  # until the context is full
            out["max_tokens"] = max(1, ctx_size - 1)
        elif n < 1:
            raise bad("'options.num_predict' must be a positive integer, or -1 (up to the context)")
        else:
            out["max_tokens"] = n
    if opts.num_ctx is not None and opts.num_ctx < 1:
        raise bad("'options.num_ctx' must be a positive integer")
    if opts.repeat_last_n is not None and opts.repeat_last_n < -1:
        raise bad("'options.repeat_last_n' must be -1 (the whole context), 0 (off) or a positive integer")
    return {k: v for k, v in out.items() if v is not None}


def chat_body(req: Any, messages: list[dict], ctx_size: int) -> dict:
    """The fields of the internal chat request for an Ollama chat or generate request."""
    enable, kwargs = thinking(req.think)
    body: dict[str, Any] = {
        "messages": messages,
        "response_format": response_format(req.format),
        "enable_thinking": enable,
        "chat_template_kwargs": kwargs or None,
        "tools": getattr(req, "tools", None),
        "logprobs": bool(req.logprobs or req.top_logprobs),
        "top_logprobs": req.top_logprobs,
        **sampling_fields(req.options, ctx_size),
    }
    return {k: v for k, v in body.items() if v is not None}


# ---------------------------------------------------------------- output
def tool_call(call: Any, index: int) -> dict:
    """A parsed tool call in Ollama's shape: arguments as an object."""
    try:
        args = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        args = {}
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": args}}


def logprobs(items: list) -> list[dict]:
    return [
        {
            "token": x.text,
            "logprob": x.logprob,
            "bytes": list(x.text.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for _, t, v in x.top],
        }
        for x in items
    ]


def done_reason(finish: str | None) -> str:
    """The chat path's finish reason -> Ollama's done_reason (a tool call ends the turn: stop)."""
    return "stop" if finish in (None, "stop", "tool_calls") else finish


# ---------------------------------------------------------------- OpenAPI
def openapi_paths(post: Callable[[type, str], dict], get: Callable[[str], dict]) -> dict:
    """The /api routes for the app's OpenAPI document (``post``/``get``: the app's path builders)."""
    return {
        "/api/chat": post(OllamaChatRequest, "Ollama chat (NDJSON stream unless stream is false)"),
        "/api/generate": post(OllamaGenerateRequest, "Ollama completion (NDJSON stream unless stream is false)"),
        "/api/embed": post(OllamaEmbedRequest, "Ollama embeddings"),
        "/api/embeddings": post(OllamaEmbeddingsRequest, "Ollama embeddings (older route)"),
        "/api/show": post(OllamaModelRequest, "Ollama model details"),
        "/api/pull": post(OllamaModelRequest, "Download a model from the Hugging Face hub (Ollama status lines)"),
        "/api/delete": {"delete": post(OllamaModelRequest, "Delete a model from the Hugging Face cache")["post"]},
        "/api/tags": get("Ollama: models served"),
        "/api/ps": get("Ollama: models loaded"),
        "/api/version": get("Ollama API version"),
    }
