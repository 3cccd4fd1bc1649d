"""POST /v1/responses, GET/DELETE /v1/responses/{id}: the OpenAI Responses API.

The request is translated into the internal chat request (``ChatCompletionRequest``) and runs
through the chat service shared with /v1/chat/completions (``chat_service``); this module only maps
the Responses API's items onto chat messages and the parsed output back onto output items and
the typed stream events.

Stored responses (``store``, default true) live in a bounded in-memory LRU of
``RESPONSES_STORE_SIZE`` entries (``settings.responses_store_size`` when that setting exists):
``previous_response_id`` continues from one, GET returns one, DELETE forgets one.
"""

from __future__ import annotations

import copy
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .auth import guard
from .chat_core import ChatRun
from .chat_service import ChatService
from .errors import APIError, render_error
from .schemas import ChatCompletionRequest, ResponsesRequest
from .wire import parse, read_json, sse

RESPONSES_STORE_SIZE = 256  # stored responses kept for previous_response_id / GET (least recently used go)

_EFFORT_ON = {"low", "medium", "high", "xhigh"}
_EFFORT_OFF = {"none", "minimal"}
_RENAME = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens"}


def _bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


class ResponseStore:
    """Stored responses: id -> (response object, the conversation's items up to and including it)."""

    def __init__(self, size: int):
        self.size = max(0, int(size))
        self._d: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, resp: dict, items: list[dict]) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._d[resp["id"]] = (resp, items)
            self._d.move_to_end(resp["id"])
            while len(self._d) > self.size:
                self._d.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            hit = self._d.get(rid)
            if hit is not None:
                self._d.move_to_end(rid)
            return hit

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._d.pop(rid, None) is not None


# ---------------------------------------------------------------- request -> chat request
def _text_of(part: dict, where: str) -> str:
    text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise _bad(f"'{where}.text' must be a string", where)
    return text


def _content(content: Any, where: str) -> Any:
    """A message item's content -> chat content (a string, or parts the chat path knows)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or a list of content parts", where)
    parts: list[dict] = []
    for j, p in enumerate(content):
        w = f"{where}[{j}]"
        if not isinstance(p, dict):
            raise _bad(f"'{w}' must be an object with a 'type'", w)
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": _text_of(p, w)})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"'{w}.image_url' must be a URL or data: URL string (file_id is not supported)", w)
            parts.append({"type": "input_image", "image_url": url})
        elif kind == "input_audio":
            parts.append(p)
        else:
            raise _bad(f"'{w}.type' {kind!r} is not supported (input_text, output_text, input_image)", w)
    return parts


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for j, p in enumerate(output):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise _bad(f"'{where}[{j}]' must be an input_text part", where)
            texts.append(_text_of(p, f"{where}[{j}]"))
        return "".join(texts)
    raise _bad(f"'{where}' must be a string or a list of input_text parts", where)


def input_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Responses input items -> chat messages (the same a chat-completions client would send)."""
    msgs: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    reasoning: str | None = None  # a reasoning item, waiting for the assistant turn it belongs to
    open_assistant: dict | None = None  # the assistant message that function_call items join
    for i, it in enumerate(items):
        w = f"input[{i}]"
        if not isinstance(it, dict):
            raise _bad(f"'{w}' must be an object", w)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"'{w}.role' must be user, system, developer or assistant, got {role!r}", f"{w}.role")
            if "content" not in it:
                raise _bad(f"'{w}.content' is required", f"{w}.content")
            m: dict[str, Any] = {"role": role, "content": _content(it["content"], f"{w}.content")}
            open_assistant = None
            if role == "assistant":
                if reasoning:
                    m["reasoning_content"], reasoning = reasoning, None
                open_assistant = m
            msgs.append(m)
        elif kind == "function_call":
            name, args, call_id = it.get("name"), it.get("arguments", "{}"), it.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise _bad(f"'{w}' (function_call) needs string 'name' and 'call_id'", w)
            if not isinstance(args, str):
                raise _bad(f"'{w}.arguments' must be a JSON string", f"{w}.arguments")
            try:
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                raise _bad(f"'{w}.arguments' must be a JSON object (as a string)", f"{w}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if open_assistant is None:
                open_assistant = {"role": "assistant", "content": ""}
                if reasoning:
                    open_assistant["reasoning_content"], reasoning = reasoning, None
                msgs.append(open_assistant)
            open_assistant.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = it.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"'{w}.call_id' must be a string", f"{w}.call_id")
            if "output" not in it:
                raise _bad(f"'{w}.output' is required", f"{w}.output")
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(it["output"], f"{w}.output")})
            open_assistant = None
        elif kind == "reasoning":
            texts = []
            for key in ("content", "summary"):
                for p in it.get(key) or []:
                    if isinstance(p, dict) and isinstance(p.get("text"), str):
                        texts.append(p["text"])
                if texts:
                    break
            reasoning = "\n".join(texts) or None
        else:
            raise _bad(
                f"'{w}.type' {kind!r} is not supported (message, function_call, function_call_output, reasoning)",
                f"{w}.type",
            )
    if not msgs:
        raise _bad("'input' holds no messages", "input")
    return msgs


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for j, t in enumerate(tools):
        if t.get("type") != "function":
            raise _bad(f"'tools[{j}].type' {t.get('type')!r} is not supported: only 'function' tools are", "tools")
        if isinstance(t.get("function"), dict):  # the chat-completions shape, accepted as well
            out.append({"type": "function", "function": t["function"]})
            continue
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise _bad(
                f"'tool_choice' must be auto, none, required or {{'type': 'function', 'name': ...}}, got {choice!r}",
                "tool_choice",
            )
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be auto, none, required or {'type': 'function', 'name': ...}", "tool_choice")


def _response_format(text: Any) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("'text.format.schema' must be a JSON schema object", "text.format.schema")
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": schema, "strict": fmt.get("strict")},
        }
    raise _bad(f"'text.format.type' must be text, json_object or json_schema, got {kind!r}", "text.format.type")


def _thinking(req: ResponsesRequest) -> bool | None:
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return None  # the server's default (--thinking)
    if effort in _EFFORT_ON:
        return True
    if effort in _EFFORT_OFF:
        return False
    raise _bad(
        f"'reasoning.effort' must be one of none, minimal, low, medium, high, xhigh, got {effort!r}", "reasoning.effort"
    )


def to_chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "messages": messages,
        "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "enable_thinking": _thinking(req),
    }
    rf = _response_format(req.text)
    if rf is not None:
        body["response_format"] = rf
    return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


# ---------------------------------------------------------------- output -> items and events
def _rid(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


class OutputBuilder:
    """Parsed pieces -> output items, with the stream events that build them (one sequence)."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item receiving text
        self.text = ""

    def event(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def feed(self, kind: str, val: Any) -> list[dict]:
        if kind == "tool_call":
            out = self.close()
            item = {
                "id": _rid("fc_"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": val.id,
                "name": val.name,
                "arguments": "",
            }
            idx = len(self.items)
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=idx, item=dict(item)))
            out.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=val.arguments
                )
            )
            item.update(arguments=val.arguments, status="completed")
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    name=val.name,
                    arguments=val.arguments,
                )
            )
            out.append(self.event("response.output_item.done", output_index=idx, item=dict(item)))
            return out
        want = "reasoning" if kind == "reasoning" else "message"
        out = []
        if self.open is None or self.open["type"] != want:
            out += self.close()
            out += self.start(want)
        self.text += val
        idx, iid = len(self.items) - 1, self.open["id"]
        if want == "message":
            out.append(
                self.event(
                    "response.output_text.delta", item_id=iid, output_index=idx, content_index=0, delta=val, logprobs=[]
                )
            )
        else:
            out.append(
                self.event("response.reasoning_text.delta", item_id=iid, output_index=idx, content_index=0, delta=val)
            )
        return out

    def start(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": _rid("msg_"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _rid("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        idx = len(self.items)
        self.items.append(item)
        self.open, self.text = item, ""
        return [
            self.event("response.output_item.added", output_index=idx, item=copy.deepcopy(item)),
            self.event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=part),
        ]

    def close(self, status: str = "completed") -> list[dict]:
        item = self.open
        if item is None:
            return []
        self.open = None
        idx, iid = len(self.items) - 1, item["id"]
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            done = self.event(
                "response.output_text.done", item_id=iid, output_index=idx, content_index=0, text=self.text, logprobs=[]
            )
        else:
            part = {"type": "reasoning_text", "text": self.text}
            done = self.event(
                "response.reasoning_text.done", item_id=iid, output_index=idx, content_index=0, text=self.text
            )
        item.update(content=[part], status=status)
        return [
            done,
            self.event("response.content_part.done", item_id=iid, output_index=idx, content_index=0, part=dict(part)),
            self.event("response.output_item.done", output_index=idx, item=copy.deepcopy(item)),
        ]


# ---------------------------------------------------------------- routes
class ResponsesRoutes:
    def __init__(self, state: Any, chat: ChatService):
        self.state, self.service = state, chat
        size = getattr(state.settings, "responses_store_size", None)
        self.store = ResponseStore(RESPONSES_STORE_SIZE if size is None else size)

    def _skeleton(self, rid: str, req: ResponsesRequest, model: str) -> dict:
        tools = [dict(t) for t in req.tools or []]
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": model,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": tools,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
        }

    async def create(self, request: Request) -> Response:
        body = await read_json(request, self.service.body_limit())
        req: ResponsesRequest = parse(ResponsesRequest, body)
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(req.input)
        history: list[dict] = []
        if req.previous_response_id is not None:
            hit = self.store.get(req.previous_response_id)
            if hit is None:
                raise APIError(
                    404,
                    f"previous response with id {req.previous_response_id!r} not found",
                    param="previous_response_id",
                    code="not_found",
                )
            history = hit[1]
        chat_req = to_chat_request(req, input_messages(history + items, req.instructions))
        job = await self.service.prepare(chat_req, clamp_max_tokens=True, rename=_RENAME)
        self.service.admit(job, "responses")
        run = self.service.start(job)
        resp = self._skeleton(_rid("resp_"), req, self.state.spec.name)
        events = self._events(run, resp, history + items, len(job.prompt))
        if req.stream:

            def counted(ev: dict) -> dict:  # an error inside a stream whose 200 went out already
                if ev["type"] == "response.failed":
                    self.state.metrics.count_error(500, where="stream")
                return ev

            return StreamingResponse(
                (sse(counted(ev), event=ev["type"]) async for ev in events),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        last = None
        async for ev in events:
            last = ev
        assert last is not None
        if last["type"] == "response.failed":
            raise APIError(500, last["response"]["error"]["message"])
        return JSONResponse(last["response"])

    async def _events(self, run: ChatRun, resp: dict, items: list[dict], n_prompt: int) -> AsyncIterator[dict]:
        out = OutputBuilder()
        yield out.event("response.created", response=copy.deepcopy(resp))
        yield out.event("response.in_progress", response=copy.deepcopy(resp))
        reason = None
        async for step in run.steps():
            ev = step.event
            if ev is None or ev.progress is not None:
                continue
            if ev.error:
                out.close("incomplete")
                resp.update(
                    status="failed",
                    output=out.items,
                    error={"code": "server_error", "message": f"generation failed: {ev.error}"},
                )
                yield out.event("response.failed", response=resp)
                return
            for kind, val in step.pieces:
                for e in out.feed(kind, val):
                    yield e
            if step.finish_reason is not None:
                reason = step.finish_reason
        cut = reason == "length"
        if not out.items:  # nothing generated: an empty message, so output[0] is always there
            for e in out.start("message"):
                yield e
        for e in out.close("incomplete" if cut else "completed"):
            yield e
        completion = run.completion_tokens
        resp.update(
            status="incomplete" if cut else "completed",
            output=out.items,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={
                "input_tokens": n_prompt,
                "input_tokens_details": {"cached_tokens": run.cached_tokens},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens[0]},
                "total_tokens": n_prompt + completion,
            },
        )
        if resp["store"]:
            self.store.put(copy.deepcopy(resp), items + copy.deepcopy(out.items))
        yield out.event("response.incomplete" if cut else "response.completed", response=resp)

    async def item(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            if not self.store.delete(rid):
                raise APIError(404, f"response with id {rid!r} not found", param="response_id", code="not_found")
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
        hit = self.store.get(rid)
        if hit is None:
            raise APIError(404, f"response with id {rid!r} not found", param="response_id", code="not_found")
        return JSONResponse(hit[0])


def routes(state: Any, chat: ChatService, needs_key: Callable[[], bool]) -> list[Route]:
    impl = ResponsesRoutes(state, chat)
    return [
        Route("/v1/responses", guard(state, impl.create, needs_key, render_error), methods=["POST"]),
        Route(
            "/v1/responses/{response_id}", guard(state, impl.item, needs_key, render_error), methods=["GET", "DELETE"]
        ),
    ]
