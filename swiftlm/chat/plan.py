"""From a chat request (messages, tools, tool_choice, thinking) to a prompt, an optional
grammar and an output parser.  Shared by the server and the Python API."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest
from .reasoning import ReasoningSplitter
from .tool_calls import FORMATS, Piece, ToolCall, ToolCallParser, detect_format, merge

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

INJECTED_TOOLS_PROMPT = """# Tools

You can call functions to help answer. The functions you can call are described by these JSON schemas:
<tools>
{tools}
</tools>

To call a function, answer with one JSON object per call, each inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def validate_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    seen: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.'", param="tools"
            )
        if name in seen:
            raise InvalidRequest(f"tools[{i}].function.name {name!r} is declared twice", param="tools")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequest(f"tools[{i}].function.description must be a string", param="tools")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def parse_tool_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    """-> (mode, forced function name): mode is none, auto or required."""
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"'tool_choice' must be none, auto, required or a function, got {choice!r}", param="tool_choice"
            )
        if choice == "required" and not names:
            raise InvalidRequest("'tool_choice' is 'required' but no 'tools' were given", param="tool_choice")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidRequest(f"'tool_choice' names function {name!r}, which is not in 'tools'", param="tool_choice")
        return "required", name
    raise InvalidRequest(
        "'tool_choice' must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def _args_schema(params: dict) -> dict:
    """A forced call takes the declared arguments only (as OpenAI's strict function calling)."""
    if params.get("type") == "object" and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def _call_schema(tools: list[dict], only: str | None, args_key: str) -> dict:
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                args_key: _args_schema(t["function"]["parameters"]),
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
        if only is None or t["function"]["name"] == only
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # compact JSON: with flexible whitespace a weak model can pad with spaces until max_tokens
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def forced_call_grammar(fmt: str, tools: list[dict], only: str | None, parallel: bool = True) -> tuple[str, str]:
    """A grammar that admits only tool calls (one when a function is named, one or more for
    'required'), and the parser format that reads them back."""
    import llguidance

    if fmt == "hermes":
        call = _call_schema(tools, only, "arguments")
        tc = (
            f"tc: {json.dumps('<tool_call>' + chr(10))} %json {json.dumps(call)} {json.dumps(chr(10) + '</tool_call>')}"
        )
        start = "start: tc" if only or not parallel else f"start: tc ({json.dumps(chr(10))} tc)*"
        lark, parse_fmt = f"{start}\n{tc}\n", "hermes"
    else:  # a bare JSON array of calls (read back by the llama3 parser, which accepts it)
        key = "parameters" if fmt == "llama3" else "arguments"
        call = _call_schema(tools, only, key)
        call.pop("x-guidance")
        arr = {"type": "array", "items": call, "minItems": 1, "x-guidance": {"whitespace_flexible": False}}
        if only or not parallel:
            arr["maxItems"] = 1
        lark, parse_fmt = f"start: %json {json.dumps(arr)}\n", "llama3"
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as exc:
        raise InvalidRequest(f"a tool's 'parameters' is not a usable JSON schema: {exc}", param="tools") from None
    is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_err:
        raise InvalidRequest(
            f"a tool's 'parameters' is not a usable JSON schema: {msgs[0] if msgs else ''}", param="tools"
        )
    return grammar, parse_fmt


def _inject(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For templates that know nothing of tools: describe them in the system message and
    render past calls and results in the same Hermes convention."""
    out = [dict(m) for m in messages]
    if tools:
        text = INJECTED_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + text
        else:
            out.insert(0, {"role": "system", "content": text})
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in m.pop("tool_calls")
            )
            m["content"] = (m["content"] + "\n" if m["content"] else "") + calls
        elif m["role"] == "tool":
            m["role"] = "user"
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    return out


@dataclass
class ChatPlan:
    text: str  # the rendered prompt
    grammar: str | None = None  # forced tool call (tool_choice required / a named function)
    tool_format: str | None = None  # parser for tool calls (None: no parsing)
    tool_names: set[str] = field(default_factory=set)
    thinking: bool = False
    media: list = field(default_factory=list)  # decoded image/audio items, in marker order (media.expand)

    def parser(self) -> ChatOutputParser:
        reasoning = ReasoningSplitter.for_prompt(self.text) if self.thinking else None
        tools = ToolCallParser(self.tool_format, self.tool_names) if self.tool_format else None
        return ChatOutputParser(reasoning, tools)


def plan_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    tools: Any = None,
    tool_choice: Any = None,
    thinking: bool = False,
    template_kwargs: dict | None = None,
    tool_parser: str = "auto",
    parallel_tool_calls: bool = True,
    response_format_grammar: str | None = None,
) -> ChatPlan:
    """``messages`` are already normalised (chat.messages.normalize_messages)."""
    template = tokenizer.chat_template
    kwargs = dict(template_kwargs or {})
    kwargs["enable_thinking"] = thinking
    tool_list = validate_tools(tools) if tools is not None else []
    names = [t["function"]["name"] for t in tool_list]
    mode, only = parse_tool_choice(tool_choice, names)
    source = getattr(template, "source", None)
    fmt = None if tool_parser == "auto" else tool_parser
    if fmt == "none":
        mode = "none"
    elif fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown tool parser {tool_parser!r}")
    native = detect_format(source)
    fmt = fmt or native or "hermes"
    grammar = None
    parse_fmt: str | None = None
    if mode != "none" and tool_list:
        if native is None:  # the template cannot render tools: describe them ourselves
            messages = _inject(messages, tool_list)
        else:
            kwargs["tools"] = tool_list
        parse_fmt = fmt
        if mode == "required":
            if response_format_grammar is not None:
                raise InvalidRequest(
                    "'response_format' and a required tool call cannot be combined", param="tool_choice"
                )
            grammar, parse_fmt = forced_call_grammar(fmt, tool_list, only, parallel_tool_calls)
    elif native is None and any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = _inject(messages, [])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    return ChatPlan(text, grammar or response_format_grammar, parse_fmt, set(names), thinking)


class ChatOutputParser:
    """Reasoning split first, then tool calls in the answer part."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallParser | None):
        self.reasoning, self.tools = reasoning, tools
        self.calls: list[ToolCall] = []
        self._cut = False

    def _route(self, pieces: list[Piece], final: bool) -> list[Piece]:
        out: list[Piece] = []
        for kind, val in pieces:
            if kind == "content" and self.tools is not None:
                out += self.tools.feed(val)  # type: ignore[arg-type]
            else:
                out.append((kind, val))
        if final and self.tools is not None:
            out += self.tools.finish(cut=self._cut)
        self.calls += [v for k, v in out if k == "tool_call"]  # type: ignore[misc]
        return merge(out)

    def feed(self, text: str) -> list[Piece]:
        pieces = self.reasoning.feed(text) if self.reasoning else [("content", text)]
        return self._route(pieces, final=False)

    def finish(self, cut: bool = False) -> list[Piece]:
        """``cut``: the output ended at its token limit (an open tool call is dropped, not leaked)."""
        self._cut = cut
        pieces = self.reasoning.finish() if self.reasoning else []
        return self._route(pieces, final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        """'tool_calls' when the answer ended with complete calls; 'length' when the token limit
        cut a call off (it was dropped; complete calls before it stand)."""
        cut_call = reason == "length" and self.tools is not None and self.tools.dropped
        return "tool_calls" if self.calls and reason in ("stop", "length") and not cut_call else reason

    def result(self, text: str, reason: str | None) -> tuple[str | None, str | None, list[ToolCall], str | None]:
        """A whole output at once -> (content, reasoning_content, tool_calls, finish_reason); content
        is None when the answer is only tool calls (as in OpenAI's API)."""
        pieces = self.feed(text) + self.finish(cut=reason == "length")
        content = "".join(v for k, v in pieces if k == "content")  # type: ignore[misc]
        reasoning = "".join(v for k, v in pieces if k == "reasoning")  # type: ignore[misc]
        return (
            (content if content or not self.calls else None),
            (reasoning or None),
            list(self.calls),
            self.finish_reason(reason),
        )
