"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

The request is translated into the internal chat request (``ChatCompletionRequest``) and runs
through the chat service shared with /v1/chat/completions (``chat_service``); this module maps
Anthropic's content blocks onto chat messages and the parsed output back onto ``thinking`` /
``text`` / ``tool_use`` blocks and Anthropic's stream events.  Errors on these routes, auth
included, are in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

``thinking.budget_tokens`` caps the reasoning: when the model has reasoned that many tokens
and not closed its thinking block, the server closes it (``</think>``) and the model continues
with the answer (``chat_core.ChatRun``), within the same ``max_tokens``.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .auth import guard
from .chat_core import ChatRun
from .chat_service import ChatService, renamed
from .errors import APIError
from .schemas import AnthropicCountTokensRequest, AnthropicMessagesRequest, ChatCompletionRequest
from .wire import parse, read_json, sse

PING_INTERVAL_S = 5.0  # a `ping` event when nothing else was sent for this long (long prefills)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_RENAME = {"response_format": "output_config", "max_tokens": "max_tokens"}


def error_body(status: int, message: str) -> dict:
    return {
        "type": "error",
        "error": {
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error"),
            "message": message,
        },
    }


def _bad(message: str) -> APIError:
    return APIError(400, message)


# ---------------------------------------------------------------- request -> chat request
def _text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text: must be a string")
    return text


def _image(block: dict, where: str) -> dict:
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(f"{where}.source: must be an object")
    if src.get("type") == "base64":
        mt, data = src.get("media_type"), src.get("data")
        if not isinstance(mt, str) or not isinstance(data, str):
            raise _bad(f"{where}.source: a base64 source needs string 'media_type' and 'data'")
        return {"type": "image_url", "image_url": {"url": f"data:{mt};base64,{data}"}}
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise _bad(f"{where}.source.type: must be 'base64' or 'url'")


def _result_content(content: Any, where: str) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or a list of text/image blocks")
    parts = []
    for k, b in enumerate(content):
        w = f"{where}.content[{k}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(b, w)})
        elif kind == "image":
            parts.append(_image(b, w))
        else:
            raise _bad(f"{w}.type: {kind!r} is not supported in a tool_result (text, image)")
    return parts


def chat_messages(system: Any, messages: list[dict]) -> list[dict]:
    """Anthropic system + messages -> chat messages (the same a chat-completions client would send)."""
    out: list[dict] = []
    if isinstance(system, str):
        out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        texts = []
        for k, b in enumerate(system):
            if not isinstance(b, dict) or b.get("type") != "text":
                raise _bad(f"system[{k}]: must be a text block")
            texts.append(_text(b, f"system[{k}]"))
        out.append({"role": "system", "content": "\n".join(texts)})
    for i, m in enumerate(messages):
        w = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{w}.role: must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{w}.content: must be a string or a list of content blocks")
        parts: list[dict] = []
        calls: list[dict] = []
        thinking: list[str] = []

        def flush() -> None:
            if parts:
                out.append({"role": role, "content": list(parts)})
                parts.clear()

        for j, b in enumerate(content):
            wb = f"{w}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": _text(b, wb)})
            elif kind == "image" and role == "user":
                parts.append(_image(b, wb))
            elif kind == "tool_use" and role == "assistant":
                name, tid, inp = b.get("name"), b.get("id"), b.get("input", {})
                if not isinstance(name, str) or not isinstance(tid, str) or not isinstance(inp, dict):
                    raise _bad(f"{wb}: a tool_use block needs string 'id' and 'name' and an object 'input'")
                calls.append({"id": tid, "type": "function", "function": {"name": name, "arguments": inp}})
            elif kind == "tool_result" and role == "user":
                tid = b.get("tool_use_id")
                if not isinstance(tid, str):
                    raise _bad(f"{wb}.tool_use_id: must be a string")
                flush()
                out.append({"role": "tool", "tool_call_id": tid, "content": _result_content(b.get("content"), wb)})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if isinstance(b.get("thinking"), str):
                    thinking.append(b["thinking"])
            else:
                raise _bad(f"{wb}.type: {kind!r} is not supported in a {role} message")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": list(parts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
        else:
            flush()
    if not any(m["role"] != "system" for m in out):
        raise _bad("messages: at least one message is required")
    return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for j, t in enumerate(tools):
        kind = t.get("type", "custom")
        if kind not in ("custom", None):
            raise _bad(
                f"tools[{j}].type: {kind!r} is not supported; only custom tools (name, description, input_schema) are"
            )
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"tools[{j}].input_schema: must be a JSON schema object")
        fn = {"name": t.get("name"), "parameters": schema}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict | None) -> tuple[Any, bool]:
    """-> (chat tool_choice, parallel tool calls allowed)."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name: a {'type': 'tool'} choice needs the tool's name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")


def _thinking(req: AnthropicCountTokensRequest) -> tuple[bool | None, int | None]:
    """-> (thinking switch, reasoning token budget)."""
    t = req.thinking
    if t is None:
        return None, None
    kind = t.get("type")
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise _bad("thinking.budget_tokens: must be a positive integer")
        max_tokens = getattr(req, "max_tokens", None)
        if max_tokens is not None and budget >= max_tokens:
            raise _bad(f"thinking.budget_tokens: must be less than max_tokens ({max_tokens})")
        return True, budget
    raise _bad(f"thinking.type: must be enabled, disabled or adaptive, got {kind!r}")


def to_chat_request(req: AnthropicCountTokensRequest) -> tuple[ChatCompletionRequest, int | None]:
    choice, parallel = _tool_choice(req.tool_choice)
    thinking, budget = _thinking(req)
    body: dict[str, Any] = {
        "messages": chat_messages(req.system, req.messages),
        "tools": _tools(req.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "enable_thinking": thinking,
    }
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("output_config.format: must be {'type': 'json_schema', 'schema': {...}}")
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    if isinstance(req, AnthropicMessagesRequest):
        body.update(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=req.stop_sequences,
        )
    return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None}), budget


# ---------------------------------------------------------------- output -> blocks and events
class BlockBuilder:
    """Parsed pieces -> content blocks, with the stream events that build them."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self.open: dict | None = None

    def feed(self, kind: str, val: Any) -> list[tuple[str, dict]]:
        if kind == "tool_call":
            out = self.close()
            tid = "toolu_" + (val.id[5:] if val.id.startswith("call_") else val.id)
            try:
                args = json.loads(val.arguments)
            except json.JSONDecodeError:
                args = {}
            idx = len(self.blocks)
            self.blocks.append({"type": "tool_use", "id": tid, "name": val.name, "input": args})
            out.append(
                (
                    "content_block_start",
                    {"index": idx, "content_block": {"type": "tool_use", "id": tid, "name": val.name, "input": {}}},
                )
            )
            out.append(
                (
                    "content_block_delta",
                    {"index": idx, "delta": {"type": "input_json_delta", "partial_json": val.arguments}},
                )
            )
            out.append(("content_block_stop", {"index": idx}))
            return out
        want = "thinking" if kind == "reasoning" else "text"
        out = []
        if self.open is None or self.open["type"] != want:
            out += self.close()
            out += self.start(want)
        self.open[want] += val
        delta = (
            {"type": "thinking_delta", "thinking": val} if want == "thinking" else {"type": "text_delta", "text": val}
        )
        out.append(("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta}))
        return out

    def start(self, kind: str) -> list[tuple[str, dict]]:
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        self.blocks.append(block)
        self.open = block
        return [("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)})]

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"index": len(self.blocks) - 1})]


def _stop_reason(run: ChatRun, finish: str | None) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    seq = run.stop_sequence() if finish == "stop" else None
    return ("stop_sequence", seq) if seq is not None else ("end_turn", None)


# ---------------------------------------------------------------- routes
class MessagesRoutes:
    def __init__(self, state: Any, chat: ChatService):
        self.state, self.service = state, chat

    async def count_tokens(self, request: Request) -> Response:
        body = await read_json(request, self.service.body_limit())
        req: AnthropicCountTokensRequest = parse(AnthropicCountTokensRequest, body)
        chat_req, _ = to_chat_request(req)
        try:
            _, prompt = await self.service.render(chat_req)
        except APIError as exc:
            raise renamed(exc, _RENAME) from None
        return JSONResponse({"input_tokens": len(prompt)})

    async def create(self, request: Request) -> Response:
        body = await read_json(request, self.service.body_limit())
        req: AnthropicMessagesRequest = parse(AnthropicMessagesRequest, body)
        chat_req, budget = to_chat_request(req)
        job = await self.service.prepare(chat_req, clamp_max_tokens=True, rename=_RENAME)
        self.service.admit(job, "messages")
        run = self.service.start(job, reasoning_budget=budget)
        msg = {
            "id": "msg_" + secrets.token_hex(12),
            "type": "message",
            "role": "assistant",
            "model": self.state.spec.name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(job.prompt),
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        events = self._events(run, msg, len(job.prompt), bool(req.stream))
        if req.stream:
            return StreamingResponse(
                (sse(data, event=name) async for name, data in events),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        async for name, data in events:
            if name == "error":
                raise APIError(500, data["error"]["message"])
        return JSONResponse(msg)

    async def _events(self, run: ChatRun, msg: dict, n_prompt: int, stream: bool) -> AsyncIterator[tuple[str, dict]]:
        out = BlockBuilder()
        yield "message_start", {"type": "message_start", "message": copy.deepcopy(msg)}
        yield "ping", {"type": "ping"}
        finish = None
        async for step in run.steps(idle=PING_INTERVAL_S if stream else None):
            ev = step.event
            if ev is None:
                yield "ping", {"type": "ping"}
                continue
            if ev.progress is not None:
                continue
            if ev.error:
                if stream:  # inside a stream whose 200 went out already (non-streamed: counted as its 500)
                    self.state.metrics.count_error(500, where="stream")
                yield "error", error_body(500, f"generation failed: {ev.error}")
                return
            for name, data in (e for kind, val in step.pieces for e in out.feed(kind, val)):
                yield name, {"type": name, **data}
            if step.finish_reason is not None:
                finish = step.finish_reason
        if not out.blocks:  # nothing generated: one empty text block, so content[0] is always there
            for name, data in out.start("text"):
                yield name, {"type": name, **data}
        for name, data in out.close():
            yield name, {"type": name, **data}
        reason, seq = _stop_reason(run, finish)
        cached = run.cached_tokens
        usage = {
            "input_tokens": n_prompt - cached,
            "output_tokens": run.completion_tokens,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }
        msg.update(content=out.blocks, stop_reason=reason, stop_sequence=seq, usage=usage)
        yield (
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage},
        )
        yield "message_stop", {"type": "message_stop"}


def _error(exc: APIError, headers: dict | None) -> Response:
    return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status, headers=headers)


def routes(state: Any, chat: ChatService, needs_key: Callable[[], bool]) -> list[Route]:
    """The routes, with auth (x-api-key or Bearer) and errors in Anthropic's shape."""
    impl = MessagesRoutes(state, chat)
    return [
        Route("/v1/messages", guard(state, impl.create, needs_key, _error), methods=["POST"]),
        Route("/v1/messages/count_tokens", guard(state, impl.count_tokens, needs_key, _error), methods=["POST"]),
    ]
