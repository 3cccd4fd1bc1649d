"""Tool calls in model output: the common formats, parsed while streaming.

Formats (picked from the chat template, or ``--tool-parser``):

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``llama3``: ``<|python_tag|>`` or a bare leading ``{"name": ..., "parameters": {...}}``, several
  separated by ``;``
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or the newer
  ``[TOOL_CALLS]name[ARGS]{...}``
- ``gemma``: a ```` ```tool_code ```` block (or a bare ``[f(a=1), g(b="x")]``) of Python-style calls

The parser hands out content until a call begins, holds back text that may be the start of
a call marker, and emits a call once its text is complete.  Text that looks like a call but
does not parse (bad JSON, unknown function, cut off by max_tokens) comes back as content.
"""

from __future__ import annotations

import ast
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

FORMATS = ("hermes", "llama3", "mistral", "gemma")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's API carries)
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = tuple[str, Union[str, ToolCall]]  # ("content", text) | ("reasoning", text) | ("tool_call", call)


def detect_format(template_source: str | None) -> str | None:
    """The tool-call format a chat template teaches its model (None: the template has no tools)."""
    src = template_source or ""
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or ("ipython" in src and "parameters" in src):
        return "llama3"
    if "tool_code" in src or "start_function_call" in src:
        return "gemma"
    return None


def _call_from_obj(obj: Any, names: set[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments already serialised
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    if names is not None and name not in names:
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_objects(text: str) -> list[Any] | None:
    """Parse ``text`` as one or more JSON values, separated by whitespace, ',' or ';'."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)


def _parse_json_calls(body: str, names: set[str] | None) -> list[ToolCall] | None:
    values = _json_objects(body)
    if not values:
        return None
    flat: list[Any] = []
    for v in values:
        flat.extend(v if isinstance(v, list) else [v])
    calls = [_call_from_obj(v, names) for v in flat]
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def _parse_mistral(body: str, names: set[str] | None) -> list[ToolCall] | None:
    if "[ARGS]" not in body:
        return _parse_json_calls(body, names)
    calls = []
    for part in body.split("[TOOL_CALLS]"):  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        if not part.strip():
            continue
        name, sep, args = part.partition("[ARGS]")
        if not sep:
            return None
        call = _call_from_obj({"name": name.strip(), "arguments": _json_one(args)}, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _json_one(text: str) -> Any:
    values = _json_objects(text)
    return values[0] if values and len(values) == 1 else None


def _parse_python_calls(body: str, names: set[str] | None) -> list[ToolCall] | None:
    text = body.strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        call = _call_from_obj({"name": node.func.id, "arguments": args}, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


@dataclass(frozen=True)
class _Syntax:
    starts: tuple[str, ...]  # markers that open a call block
    end: str | None  # marker that closes it (None: the rest of the output)
    parse: Callable[[str, set[str] | None], list[ToolCall] | None]
    leading: tuple[str, ...] = ()  # openings recognised only at the very start of the output


SYNTAX = {
    "hermes": _Syntax(("<tool_call>",), "</tool_call>", _parse_json_calls),
    "llama3": _Syntax(("<|python_tag|>",), None, _parse_json_calls, leading=("{", "[{")),
    "mistral": _Syntax(("[TOOL_CALLS]",), None, _parse_mistral),
    "gemma": _Syntax(("```tool_code",), "```", _parse_python_calls, leading=("[",)),
}


class ToolCallParser:
    """Streaming parser: ``feed(text)`` and ``finish()`` return content and tool-call pieces."""

    def __init__(self, fmt: str, tool_names: set[str] | None = None):
        if fmt not in SYNTAX:
            raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")
        self.syntax = SYNTAX[fmt]
        self.names = tool_names
        self.buf = ""  # text not yet handed out
        self.in_call: str | None = None  # the opening marker of the call being read
        self.at_start = True  # nothing but whitespace handed out so far
        self.calls = 0
        self.dropped = False  # an incomplete call was cut off by the token limit and left out

    def _hold(self, text: str, markers: tuple[str, ...]) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
        best = 0
        for m in markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    best = max(best, k)
                    break
        return best

    def _emit_calls(self, opener: str, body: str, closer: str, out: list[Piece]) -> None:
        calls = self.syntax.parse(body, self.names)
        if calls:
            for c in calls:
                out.append(("tool_call", c))
            self.calls += len(calls)
        else:  # malformed: give the text back untouched
            out.append(("content", opener + body + closer))
        self.at_start = False

    def _content(self, text: str, out: list[Piece]) -> None:
        if text.strip() or (text and not self.calls):  # whitespace between calls is layout
            out.append(("content", text))
            if text.strip():
                self.at_start = False

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf:
            if self.in_call is not None:
                end = None if self.in_call == "" else self.syntax.end  # "": a leading opening
                if end is None:
                    return out  # the call runs to the end of the output
                j = self.buf.find(end)
                if j < 0:
                    return out
                body, self.buf = self.buf[:j], self.buf[j + len(end) :]
                opener, self.in_call = self.in_call, None
                self._emit_calls(opener, body, end, out)
                continue
            if self.at_start:
                stripped = self.buf.lstrip()
                if not stripped:
                    return out
                lead = next((m for m in self.syntax.leading if stripped.startswith(m)), None)
                if lead is not None:
                    self.in_call, self.buf = "", stripped  # the opening text is part of the body
                    continue
                if any(m.startswith(stripped) for m in self.syntax.leading):
                    return out  # could still become a leading opening
            hits = [(self.buf.find(m), m) for m in self.syntax.starts]
            hits = [(i, m) for i, m in hits if i >= 0]
            if hits:
                i, m = min(hits)
                self._content(self.buf[:i], out)
                self.buf = self.buf[i + len(m) :]
                self.in_call = m
                self.at_start = False
                continue
            hold = self._hold(self.buf, self.syntax.starts)
            emit, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
            self._content(emit, out)
            return out
        return out

    def finish(self, cut: bool = False) -> list[Piece]:
        """``cut``: the output ended at the token limit, so an open call is incomplete: it is
        dropped (never handed out as content markup); complete calls before it stand."""
        out: list[Piece] = []
        if self.in_call is not None:
            opener, self.in_call = self.in_call, None
            if cut:
                # a call that expects a closing marker and never got it is incomplete; one that runs
                # to the end of the output stands if what came parses as whole calls
                expects_end = opener != "" and self.syntax.end is not None
                calls = [] if expects_end else self.syntax.parse(self.buf, self.names)
                for c in calls:
                    out.append(("tool_call", c))
                self.calls += len(calls)
                self.dropped = not calls
            elif self.syntax.end is None or opener == "":
                self._emit_calls(opener, self.buf, "", out)
            else:  # never closed, and not cut off: the text is content
                out.append(("content", opener + self.buf))
        else:
            self._content(self.buf, out)
        self.buf = ""
        return out


def parse_all(fmt: str, text: str, tool_names: set[str] | None = None) -> list[Piece]:
    p = ToolCallParser(fmt, tool_names)
    return merge(p.feed(text) + p.finish())


def merge(pieces: list[Piece]) -> list[Piece]:
    """Join neighbouring text pieces of the same kind."""
    out: list[Piece] = []
    for kind, val in pieces:
        if out and kind != "tool_call" and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + val)  # type: ignore[operator]
        elif kind == "tool_call" or val:
            out.append((kind, val))
    return out
