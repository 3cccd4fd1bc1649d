"""Behaviour of the core modules (sampling helpers, chat messages / templates / plan) that the
mutation check (scripts/mutation.sh) found untested."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from swiftlm.chat import plan as plan_mod
from swiftlm.chat.messages import ROLES, normalize_messages
from swiftlm.chat.plan import (
    INJECTED_TOOLS_PROMPT,
    ChatOutputParser,
    ChatPlan,
    _args_schema,
    _call_schema,
    _inject,
    forced_call_grammar,
    parse_tool_choice,
    plan_chat,
    validate_tools,
)
from swiftlm.chat.reasoning import ReasoningSplitter
from swiftlm.chat.template import ChatTemplate, TemplateError
from swiftlm.chat.tool_calls import ToolCallParser
from swiftlm.errors import InvalidRequest
from swiftlm.media.processor import MARKER
from swiftlm.sampling import (
    MAX_TOP_LOGPROBS,
    NumpyOps,
    SamplerState,
    SamplingParams,
    apply_penalties,
    masked_logits,
    truncate,
)
from swiftlm.turboquant.presets import GROUP_SIZES


def _err(fn, *args, **kwargs) -> tuple[str, str | None]:
    with pytest.raises(InvalidRequest) as e:
        fn(*args, **kwargs)
    return str(e.value), e.value.param


# ---------------------------------------------------------------- chat.messages


def test_messages_must_be_a_non_empty_list():
    for bad in (None, [], {"role": "user"}, "hi"):
        assert _err(normalize_messages, bad) == ("'messages' must be a non-empty list", "messages")
    assert _err(normalize_messages, [{"role": "user", "content": "a"}, "x"]) == (
        "messages[1] must be an object",
        "messages",
    )


def test_roles_are_checked_and_developer_becomes_system():
    assert ROLES == {"system", "developer", "user", "assistant", "tool"}
    msg, param = _err(normalize_messages, [{"role": "bot", "content": "x"}])
    assert (
        msg == ("messages[0].role must be one of ['assistant', 'developer', 'system', 'tool', 'user'], got 'bot'")
        and param == "messages[0].role"
    )
    out = normalize_messages(
        [{"role": "developer", "content": "be brief", "name": None}, {"role": "user", "content": None, "name": "bob"}]
    )
    assert out == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "", "name": "bob"}]


def test_content_parts_are_flattened():
    parts = ["a", {"type": "text", "text": "b"}, {"type": "input_text", "text": "c"}]
    assert normalize_messages([{"role": "user", "content": parts}])[0]["content"] == "abc"
    assert normalize_messages([{"role": "user", "content": []}])[0]["content"] == ""
    where = "messages[0].content"
    assert _err(normalize_messages, [{"role": "user", "content": [{"text": "x"}]}]) == (
        "messages[0].content[0] must be an object with a 'type'",
        where,
    )
    assert _err(normalize_messages, [{"role": "user", "content": ["ok", 5]}]) == (
        "messages[0].content[1] must be an object with a 'type'",
        where,
    )
    assert _err(normalize_messages, [{"role": "user", "content": [{"type": "text", "text": 3}]}]) == (
        "messages[0].content[0].text must be a string",
        where,
    )
    assert _err(normalize_messages, [{"role": "user", "content": [{"type": "text"}]}]) == (
        "messages[0].content[0].text must be a string",
        where,
    )
    assert _err(normalize_messages, [{"role": "user", "content": [{"type": "video"}]}]) == (
        "messages[0].content[0] has unsupported type 'video'",
        where,
    )
    assert _err(normalize_messages, [{"role": "user", "content": 7}]) == (
        "messages[0].content must be a string, a list of parts or null",
        where,
    )


def test_media_parts_without_media_support_are_refused():
    img = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert _err(normalize_messages, [{"role": "user", "content": [img]}]) == (
        "messages[0].content[0] is an image, but this model/server takes text only (start with --vision and a "
        "vision-language model)",
        "messages[0].content[0]",
    )
    assert _err(normalize_messages, [{"role": "user", "content": ["x", {"type": "input_image"}]}])[0].startswith(
        "messages[0].content[1] is an image,"
    )
    assert _err(normalize_messages, [{"role": "user", "content": [{"type": "input_audio"}]}]) == (
        "messages[0].content[0] is audio, but this model/server takes text only (start with --audio and an "
        "audio-language model)",
        "messages[0].content[0]",
    )


def test_media_parts_are_collected_with_markers_and_limits(monkeypatch):
    import swiftlm.media as media

    seen = []

    def fake_collect(part, where, policy):
        seen.append((part["type"], where, policy))
        return SimpleNamespace(kind="audio" if part["type"] == "input_audio" else "image")

    monkeypatch.setattr(media, "collect_part", fake_collect)
    policy = SimpleNamespace(max_images=2, max_audio_clips=1)
    bag: list = []
    content = ["see ", {"type": "image_url"}, {"type": "input_audio"}, {"type": "input_image"}]
    out = normalize_messages([{"role": "user", "content": content}], media=(policy, bag))
    assert out[0]["content"] == "see " + MARKER.format(0) + MARKER.format(1) + MARKER.format(2)
    assert [it.kind for it in bag] == ["image", "audio", "image"]
    assert seen == [
        ("image_url", "messages[0].content[1]", policy),
        ("input_audio", "messages[0].content[2]", policy),
        ("input_image", "messages[0].content[3]", policy),
    ]
    assert _err(normalize_messages, [{"role": "user", "content": [{"type": "image_url"}]}], media=(policy, bag)) == (
        "messages[0].content[0]: too many images in one request (the limit is 2, --max-images)",
        "messages[0].content[0]",
    )
    assert _err(normalize_messages, [{"role": "user", "content": [{"type": "input_audio"}]}], media=(policy, bag)) == (
        "messages[0].content[0]: too many audio clips in one request (the limit is 1, --max-audio-clips)",
        "messages[0].content[0]",
    )
    bag2: list = [SimpleNamespace(kind="image")]  # one image so far: one more fits under a limit of 2
    normalize_messages([{"role": "user", "content": [{"type": "image_url"}]}], media=(policy, bag2))
    assert len(bag2) == 2


def test_assistant_tool_calls_are_checked_and_parsed():
    calls = [
        {"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"function": {"name": "g", "arguments": "  "}},
        {"function": {"name": "h", "arguments": {"b": 2}}},
        {"function": {"name": "k"}},
    ]
    out = normalize_messages([{"role": "assistant", "content": None, "tool_calls": calls}])[0]
    assert out["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": {}}},
        {"id": "call_2", "type": "function", "function": {"name": "h", "arguments": {"b": 2}}},
        {"id": "call_3", "type": "function", "function": {"name": "k", "arguments": {}}},
    ]
    assert out["content"] == ""
    where = "messages[0].tool_calls"

    def bad(tc):
        return _err(normalize_messages, [{"role": "assistant", "content": "", "tool_calls": tc}])

    assert bad({"function": {}}) == ("messages[0].tool_calls must be a list", where)
    assert bad(["x"]) == ("messages[0].tool_calls[0] must have a 'function' with a 'name'", where)
    assert bad([{"function": {"name": 1}}]) == ("messages[0].tool_calls[0] must have a 'function' with a 'name'", where)
    assert bad([{"function": "f"}]) == ("messages[0].tool_calls[0] must have a 'function' with a 'name'", where)
    assert bad([{"function": {"name": "f", "arguments": "{oops"}}]) == (
        "messages[0].tool_calls[0].function.arguments is not valid JSON",
        where,
    )
    assert bad([{"function": {"name": "f", "arguments": "[1]"}}]) == (
        "messages[0].tool_calls[0].function.arguments must be a JSON object",
        where,
    )
    assert bad([{"function": {"name": "f", "arguments": 3}}]) == (
        "messages[0].tool_calls[0].function.arguments must be a JSON object",
        where,
    )
    # tool_calls on a user message, or null ones, are not touched
    assert normalize_messages([{"role": "user", "content": "x", "tool_calls": "junk"}])[0]["tool_calls"] == "junk"
    assert "tool_calls" not in normalize_messages([{"role": "assistant", "content": "x", "tool_calls": None}])[0]


def test_tool_messages_and_reasoning_content():
    assert _err(normalize_messages, [{"role": "tool", "content": "42"}]) == (
        "messages[0] has role 'tool' but no 'tool_call_id' string",
        "messages[0].tool_call_id",
    )
    assert (
        _err(normalize_messages, [{"role": "tool", "content": "42", "tool_call_id": 1}])[1]
        == "messages[0].tool_call_id"
    )
    assert normalize_messages([{"role": "tool", "content": "42", "tool_call_id": "c"}]) == [
        {"role": "tool", "content": "42", "tool_call_id": "c"}
    ]
    assert _err(normalize_messages, [{"role": "assistant", "content": "", "reasoning_content": 5}]) == (
        "messages[0].reasoning_content must be a string",
        "messages[0].reasoning_content",
    )
    assert (
        normalize_messages([{"role": "assistant", "content": "", "reasoning_content": "hm"}])[0]["reasoning_content"]
        == "hm"
    )


# ---------------------------------------------------------------- chat.template


def test_template_renders_with_trim_blocks_and_loop_controls():
    t = ChatTemplate(
        "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "[{{ m.role }}]{{ m.content }}\n{% endfor %}\n"
        "{% if add_generation_prompt %}>{{ extra }}{% endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert t.source.startswith("{% for m in messages %}")
    assert t.render(msgs, extra="!") == "[user]a\n[assistant]b\n>!"
    assert t.render(msgs, add_generation_prompt=False) == "[user]a\n[assistant]b\n"


def test_template_tojson_and_strftime():
    t = ChatTemplate(
        "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ w | tojson(sort_keys=true) }}|"
        "{{ u | tojson(ensure_ascii=true) }}|{{ strftime_now('%Y') }}"
    )
    import datetime

    out = t.render([], v={"b": "é", "a": 1}, w={"b": 1, "a": 2}, u="é")
    assert out == (
        '{"b": "é", "a": 1}|{\n  "b": "é",\n  "a": 1\n}|{"a": 2, "b": 1}|"\\u00e9"|' + str(datetime.datetime.now().year)
    )


def test_template_errors_are_request_errors():
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
    assert str(e.value) == "chat template: no system role" and e.value.param == "messages"
    assert isinstance(e.value, InvalidRequest)
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ messages.append(1) }}").render([])  # the sandbox is immutable
    assert str(e.value).startswith("chat template failed to render these messages: ") and e.value.param == "messages"
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"content": "x"}])
    assert str(e.value).startswith("chat template failed to render these messages: ") and e.value.param == "messages"
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ x | tojson }}").render([], x=object())
    assert str(e.value).startswith("chat template failed to render these messages: ")
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ '%d' | format('x') }}").render([])
    assert str(e.value).startswith("chat template failed to render these messages: ")


# ---------------------------------------------------------------- chat.plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {"type": "function", "function": {"name": "search"}}


def test_validate_tools():
    out = validate_tools([WEATHER, {"function": {"name": "a.b-c_1"}}])
    assert out[0] == WEATHER
    assert out[1] == {
        "type": "function",
        "function": {"name": "a.b-c_1", "parameters": {"type": "object", "properties": {}}},
    }
    assert validate_tools([]) == []
    assert _err(validate_tools, {"x": 1}) == ("'tools' must be a list", "tools")
    shape = "tools[1] must be {'type': 'function', 'function': {...}}"
    assert _err(validate_tools, [WEATHER, "f"]) == (shape, "tools")
    assert _err(validate_tools, [WEATHER, {"type": "code", "function": {"name": "f"}}]) == (shape, "tools")
    assert _err(validate_tools, [WEATHER, {"type": "function", "function": "f"}]) == (shape, "tools")
    name_msg = "tools[0].function.name must be 1-64 letters, digits, '_', '-' or '.'"
    for name in (None, 3, "", "a b", "x" * 65, "é"):
        assert _err(validate_tools, [{"function": {"name": name}}]) == (name_msg, "tools")
    assert validate_tools([{"function": {"name": "x" * 64}}])[0]["function"]["name"] == "x" * 64
    assert _err(validate_tools, [WEATHER, WEATHER]) == (
        "tools[1].function.name 'get_weather' is declared twice",
        "tools",
    )
    assert _err(validate_tools, [{"function": {"name": "f", "parameters": []}}]) == (
        "tools[0].function.parameters must be a JSON schema object",
        "tools",
    )
    assert _err(validate_tools, [{"function": {"name": "f", "description": 1}}]) == (
        "tools[0].function.description must be a string",
        "tools",
    )


def test_parse_tool_choice():
    assert parse_tool_choice(None, ["f"]) == ("auto", None)
    assert parse_tool_choice(None, []) == ("none", None)
    for c in ("none", "auto", "required"):
        assert parse_tool_choice(c, ["f"]) == (c, None)
    assert parse_tool_choice("none", []) == ("none", None)
    assert _err(parse_tool_choice, "always", ["f"]) == (
        "'tool_choice' must be none, auto, required or a function, got 'always'",
        "tool_choice",
    )
    assert _err(parse_tool_choice, "required", []) == (
        "'tool_choice' is 'required' but no 'tools' were given",
        "tool_choice",
    )
    assert parse_tool_choice({"type": "function", "function": {"name": "f"}}, ["g", "f"]) == ("required", "f")
    assert _err(parse_tool_choice, {"type": "function", "function": {"name": "h"}}, ["f"]) == (
        "'tool_choice' names function 'h', which is not in 'tools'",
        "tool_choice",
    )
    generic = (
        "'tool_choice' must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )
    assert _err(parse_tool_choice, {"type": "tool", "function": {"name": "f"}}, ["f"]) == generic
    assert _err(parse_tool_choice, {"type": "function", "function": "f"}, ["f"]) == generic
    assert _err(parse_tool_choice, 3, ["f"]) == generic


def test_call_schemas():
    obj = {"type": "object", "properties": {"a": {}}}
    assert _args_schema(obj) == {**obj, "additionalProperties": False}
    assert obj == {"type": "object", "properties": {"a": {}}}  # not modified in place
    assert _args_schema({"type": "object", "additionalProperties": True}) == {
        "type": "object",
        "additionalProperties": True,
    }
    assert _args_schema({"type": "string"}) == {"type": "string"}
    tools = validate_tools([WEATHER, SEARCH])
    one = _call_schema(tools, "search", "arguments")
    assert one == {
        "type": "object",
        "properties": {
            "name": {"const": "search"},
            "arguments": {"type": "object", "properties": {}, "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    both = _call_schema(tools, None, "parameters")
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["get_weather", "search"]
    assert both["anyOf"][0]["required"] == ["name", "parameters"]
    assert both["x-guidance"] == {"whitespace_flexible": False}


def test_forced_call_grammar_shapes(monkeypatch):
    import llguidance

    seen = []
    real = llguidance.LLMatcher.grammar_from_lark

    def spy(lark):
        seen.append(lark)
        return real(lark)

    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_lark", spy)
    tools = validate_tools([WEATHER, SEARCH])
    g, fmt = forced_call_grammar("hermes", tools, None)
    assert fmt == "hermes" and isinstance(g, str) and g
    lark = seen[-1]
    assert lark.startswith('start: tc ("\\n" tc)*\ntc: "<tool_call>\\n" %json {')
    assert lark.endswith(' "\\n</tool_call>"\n')
    call = json.loads(lark.split("%json ", 1)[1].rsplit(' "\\n</tool_call>"', 1)[0])
    assert call == _call_schema(tools, None, "arguments")
    forced_call_grammar("hermes", tools, "search")
    assert seen[-1].startswith("start: tc\ntc: ")
    forced_call_grammar("hermes", tools, None, parallel=False)
    assert seen[-1].startswith("start: tc\ntc: ")
    g, fmt = forced_call_grammar("llama3", tools, None)
    assert fmt == "llama3"
    arr = json.loads(seen[-1][len("start: %json ") :])
    assert seen[-1].startswith("start: %json ") and seen[-1].endswith("\n")
    assert arr == {
        "type": "array",
        "items": {"anyOf": _call_schema(tools, None, "parameters")["anyOf"]},
        "minItems": 1,
        "x-guidance": {"whitespace_flexible": False},
    }
    forced_call_grammar("mistral", tools, "get_weather")
    arr = json.loads(seen[-1][len("start: %json ") :])
    assert arr["maxItems"] == 1 and arr["items"]["properties"]["name"] == {"const": "get_weather"}
    assert "arguments" in arr["items"]["properties"] and "x-guidance" not in arr["items"]
    forced_call_grammar("gemma", tools, None, parallel=False)
    assert json.loads(seen[-1][len("start: %json ") :])["maxItems"] == 1
    forced_call_grammar("gemma", tools, None, parallel=True)
    assert "maxItems" not in json.loads(seen[-1][len("start: %json ") :])


def test_forced_call_grammar_rejects_unusable_parameters(monkeypatch):
    import llguidance

    params = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
    bad = validate_tools([{"function": {"name": "f", "parameters": params}}])
    msg, param = _err(forced_call_grammar, "hermes", bad, None)
    assert msg.startswith("a tool's 'parameters' is not a usable JSON schema: ") and param == "tools"

    def boom(lark):
        raise ValueError("kaput")

    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_lark", boom)
    assert _err(forced_call_grammar, "hermes", validate_tools([SEARCH]), None) == (
        "a tool's 'parameters' is not a usable JSON schema: kaput",
        "tools",
    )
    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_lark", lambda lark: "g")
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", lambda g: (True, ["w1", "w2"]))
    assert _err(forced_call_grammar, "hermes", validate_tools([SEARCH]), None) == (
        "a tool's 'parameters' is not a usable JSON schema: w1",
        "tools",
    )
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", lambda g: (True, []))
    assert _err(forced_call_grammar, "hermes", validate_tools([SEARCH]), None) == (
        "a tool's 'parameters' is not a usable JSON schema: ",
        "tools",
    )
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", lambda g: (False, ["warn"]))
    assert forced_call_grammar("hermes", validate_tools([SEARCH]), None) == ("g", "hermes")


def test_inject_describes_tools_and_renders_past_calls():
    tools = validate_tools([SEARCH])
    text = INJECTED_TOOLS_PROMPT.format(tools=json.dumps(tools[0], ensure_ascii=False))
    msgs = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "é?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"function": {"name": "search", "arguments": {"q": "é"}}},
                {"function": {"name": "search", "arguments": {}}},
            ],
        },
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c"},
    ]
    out = _inject(msgs, tools)
    assert out[0] == {"role": "system", "content": "Be kind.\n\n" + text}
    assert out[1] == msgs[1]
    assert out[2] == {
        "role": "assistant",
        "content": 'Looking.\n<tool_call>\n{"name": "search", "arguments": '
        '{"q": "é"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
    }
    assert out[3] == {"role": "assistant", "content": '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'}
    assert out[4] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>", "tool_call_id": "c"}
    assert msgs[0]["content"] == "Be kind." and "tool_calls" in msgs[2]  # the caller's messages are untouched
    out = _inject([{"role": "user", "content": "hi"}], tools + validate_tools([WEATHER]))
    assert out[0] == {
        "role": "system",
        "content": INJECTED_TOOLS_PROMPT.format(
            tools=json.dumps(tools[0]) + "\n" + json.dumps(validate_tools([WEATHER])[0])
        ),
    }
    assert out[1] == {"role": "user", "content": "hi"}
    assert _inject([{"role": "user", "content": "hi"}], []) == [{"role": "user", "content": "hi"}]
    assert INJECTED_TOOLS_PROMPT.startswith("# Tools\n\nYou can call functions")
    assert text.endswith(
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>'
    )


class _Tok:
    def __init__(self, source):
        self.chat_template = SimpleNamespace(source=source) if source is not None else None
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt=False, **kwargs):
        self.calls.append((messages, add_generation_prompt, kwargs))
        return "PROMPT:" + "|".join(f"{m['role']}={m['content']}" for m in messages)


def test_plan_chat_without_tools():
    tok = _Tok("{{ messages }}")
    p = plan_chat(tok, [{"role": "user", "content": "hi"}], template_kwargs={"x": 1})
    assert p == ChatPlan("PROMPT:user=hi", None, None, set(), False)
    assert tok.calls == [([{"role": "user", "content": "hi"}], True, {"x": 1, "enable_thinking": False})]
    p = plan_chat(tok, [{"role": "user", "content": "hi"}], thinking=True, response_format_grammar="G")
    assert (p.grammar, p.thinking, tok.calls[-1][2]) == ("G", True, {"enable_thinking": True})
    assert p.media == [] and p.tool_names == set()


def test_plan_chat_with_a_native_tool_template():
    tok = _Tok("{% if tools %}<tool_call>{% endif %}")
    msgs = [{"role": "user", "content": "weather?"}]
    p = plan_chat(tok, msgs, tools=[WEATHER, SEARCH])
    assert p.tool_format == "hermes" and p.grammar is None and p.tool_names == {"get_weather", "search"}
    assert tok.calls[-1][0] == msgs and tok.calls[-1][2]["tools"] == validate_tools([WEATHER, SEARCH])
    p = plan_chat(tok, msgs, tools=[WEATHER], tool_choice="required")
    assert p.tool_format == "hermes" and p.grammar
    p = plan_chat(tok, msgs, tools=[WEATHER], tool_choice="none")
    assert (p.tool_format, p.grammar, p.tool_names) == (None, None, {"get_weather"})
    assert "tools" not in tok.calls[-1][2]
    p = plan_chat(tok, msgs, tools=[WEATHER], tool_parser="none")
    assert (p.tool_format, p.grammar) == (None, None) and "tools" not in tok.calls[-1][2]
    p = plan_chat(tok, msgs, tools=[WEATHER], tool_parser="mistral")
    assert p.tool_format == "mistral"
    p = plan_chat(tok, msgs, tools=[WEATHER], tool_parser="llama3", tool_choice="required")
    assert p.tool_format == "llama3" and p.grammar
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        plan_chat(tok, msgs, tools=[WEATHER], tool_parser="xml")
    assert _err(plan_chat, tok, msgs, tools=[WEATHER], tool_choice="required", response_format_grammar="G") == (
        "'response_format' and a required tool call cannot be combined",
        "tool_choice",
    )
    p = plan_chat(tok, msgs, tools=[WEATHER], response_format_grammar="G")
    assert p.grammar == "G" and p.tool_format == "hermes"


def test_plan_chat_forced_grammar_follows_parallel_tool_calls(monkeypatch):
    seen = []
    monkeypatch.setattr(
        plan_mod,
        "forced_call_grammar",
        lambda fmt, tools, only, parallel: seen.append((fmt, only, parallel)) or ("G", "P"),
    )
    tok = _Tok("[TOOL_CALLS]")
    p = plan_chat(
        tok,
        [{"role": "user", "content": "x"}],
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "function", "function": {"name": "search"}},
        parallel_tool_calls=False,
    )
    assert seen == [("mistral", "search", False)] and (p.grammar, p.tool_format) == ("G", "P")
    plan_chat(tok, [{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice="required")
    assert seen[-1] == ("mistral", None, True)


def test_plan_chat_injects_tools_for_templates_without_them():
    tok = _Tok("plain")
    msgs = [{"role": "user", "content": "hi"}]
    p = plan_chat(tok, msgs, tools=[SEARCH])
    sent = tok.calls[-1][0]
    assert sent[0]["role"] == "system" and sent[0]["content"].startswith("# Tools") and sent[1] == msgs[0]
    assert "tools" not in tok.calls[-1][2] and p.tool_format == "hermes"
    # past tool traffic is rendered in the Hermes convention even with no tools declared
    hist = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "s", "arguments": {}}}]},
        {"role": "tool", "content": "r", "tool_call_id": "c"},
    ]
    plan_chat(tok, hist)
    assert [m["role"] for m in tok.calls[-1][0]] == ["user", "assistant", "user"]
    assert tok.calls[-1][0][2]["content"] == "<tool_response>\nr\n</tool_response>"
    plan_chat(_Tok(None), hist[1:2])
    plan_chat(tok, hist[:1])
    assert tok.calls[-1][0] == hist[:1]
    native = _Tok("<tool_call>")
    plan_chat(native, hist)
    assert native.calls[-1][0] == hist  # a template that knows tools renders them itself


def test_chat_plan_parser_and_output_parser():
    plan = ChatPlan("<think>\n", None, "hermes", {"search"}, thinking=True)
    p = plan.parser()
    assert isinstance(p.reasoning, ReasoningSplitter) and isinstance(p.tools, ToolCallParser)
    content, reasoning, calls, reason = p.result(
        'hmm</think>ok <tool_call>{"name": "search", "arguments": {"q": 1}}</tool_call>', "stop"
    )
    assert (content, reasoning, reason) == ("ok ", "hmm", "tool_calls")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"q": 1})]
    p = ChatPlan("x", None, None, set(), thinking=False).parser()
    assert p.reasoning is None and p.tools is None
    assert p.result("<think>a</think>b", "stop") == ("<think>a</think>b", None, [], "stop")
    # only tool calls: content is None; a cut-off call is dropped and the reason stays 'length'
    p = ChatPlan("x", None, "hermes", {"search"}).parser()
    assert p.result('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "stop")[0] is None
    p = ChatPlan("x", None, "hermes", {"search"}).parser()
    out = p.result('<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{"na', "length")
    assert out[0] is None and len(out[2]) == 1 and out[3] == "length"
    p = ChatPlan("x", None, "hermes", {"search"}).parser()
    out = p.result('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "length")
    assert out[3] == "tool_calls"
    p = ChatPlan("x", None, "hermes", {"search"}).parser()
    assert p.result("plain", "length") == ("plain", None, [], "length")
    p = ChatPlan("x", None, "hermes", {"search"}).parser()
    assert p.result('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "abort")[3] == "abort"
    p = ChatPlan("x", None, "hermes", {"search"}).parser()
    assert p.result('<tool_call>{"name": "search", "arguments": {}}</tool_call>', None)[3] is None


def test_output_parser_streams_reasoning_then_calls():
    p = ChatOutputParser(ReasoningSplitter(("<think>", "</think>")), ToolCallParser("hermes", {"f"}))
    got = p.feed("a") + p.feed("b</think>\n\nc<tool_") + p.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    got += p.finish()
    kinds = [(k, v if isinstance(v, str) else v.name) for k, v in got]
    assert kinds == [("reasoning", "a"), ("reasoning", "b"), ("content", "c"), ("tool_call", "f")]
    assert [c.name for c in p.calls] == ["f"] and p.finish_reason("stop") == "tool_calls"
    p = ChatOutputParser(None, ToolCallParser("hermes", {"f"}))
    assert p.feed("x <tool_call>{") == [("content", "x ")]
    assert p.finish(cut=True) == [] and p.calls == [] and p.tools.dropped
    assert p.finish_reason("length") == "length"
    p = ChatOutputParser(None, ToolCallParser("hermes", {"f"}))
    assert p.feed("x <tool_call>{") == [("content", "x ")]
    assert p.finish() == [("content", "<tool_call>{")]
    p = ChatOutputParser(ReasoningSplitter(), None)
    assert p.feed("<think>r") == [("reasoning", "r")] and p.finish() == []
    assert p.finish_reason("stop") == "stop"


# ---------------------------------------------------------------- sampling (1-D helpers of speculative decoding)

OPS = NumpyOps()


def _x(*vals):
    return np.asarray(vals, dtype=np.float32)


def test_apply_penalties_bias_and_repetition():
    st = SamplerState(seed=0, prompt_tokens=[0, 1], output_tokens=[1, 3])
    x = _x(2.0, -2.0, 1.0, 4.0)
    assert np.array_equal(apply_penalties(OPS, x, SamplingParams(), st), x)
    got = apply_penalties(OPS, x, SamplingParams(logit_bias={2: 1.5, 0: -1.0}), st)
    assert np.allclose(got, [1.0, -2.0, 2.5, 4.0]) and np.array_equal(x, _x(2.0, -2.0, 1.0, 4.0))
    got = apply_penalties(OPS, x, SamplingParams(repetition_penalty=2.0), st)
    assert np.allclose(got, [1.0, -4.0, 1.0, 2.0])  # positive divided, negative multiplied; 2 not seen
    got = apply_penalties(OPS, x, SamplingParams(repetition_penalty=2.0, repetition_context_size=2), st)
    assert np.allclose(got, [2.0, -4.0, 1.0, 2.0])  # only the last two tokens (1, 3)
    got = apply_penalties(
        OPS, _x(0.0, 3.0), SamplingParams(repetition_penalty=0.5), SamplerState(seed=0, prompt_tokens=[0, 1, 1])
    )
    assert np.allclose(got, [0.0, 6.0])
    assert np.array_equal(apply_penalties(OPS, x, SamplingParams(repetition_penalty=2.0), SamplerState(seed=0)), x)


def test_apply_penalties_presence_and_frequency():
    x = _x(1.0, 1.0, 1.0)
    st = SamplerState(seed=0, prompt_tokens=[2], output_tokens=[0, 0, 1])
    got = apply_penalties(OPS, x, SamplingParams(presence_penalty=0.5), st)
    assert np.allclose(got, [0.5, 0.5, 1.0])
    got = apply_penalties(OPS, x, SamplingParams(frequency_penalty=0.25), st)
    assert np.allclose(got, [0.5, 0.75, 1.0])
    got = apply_penalties(OPS, x, SamplingParams(frequency_penalty=0.25, presence_penalty=-1.0), st)
    assert np.allclose(got, [1.5, 1.75, 1.0])
    assert np.array_equal(
        apply_penalties(OPS, x, SamplingParams(presence_penalty=1.0), SamplerState(seed=0, prompt_tokens=[0])), x
    )


def test_truncate_top_k_top_p_min_p():
    x = _x(3.0, 1.0, 2.0, 0.0)
    assert np.array_equal(truncate(OPS, x, SamplingParams()), x)
    assert np.array_equal(truncate(OPS, x, SamplingParams(top_k=-1)), x)
    got = truncate(OPS, x, SamplingParams(top_k=2))
    assert np.isneginf(got[[1, 3]]).all() and np.array_equal(got[[0, 2]], [3.0, 2.0])
    assert np.array_equal(truncate(OPS, x, SamplingParams(top_k=9)), x)
    p = np.exp(x) / np.exp(x).sum()  # 0.644, 0.087, 0.237, 0.032
    got = truncate(OPS, x, SamplingParams(top_p=0.7))
    assert np.isneginf(got[[1, 3]]).all() and np.array_equal(got[[0, 2]], [3.0, 2.0])
    got = truncate(OPS, x, SamplingParams(top_p=float(p[0])))  # the top token alone reaches p exactly
    assert np.isfinite(got).tolist() == [True, False, False, False]
    got = truncate(OPS, x, SamplingParams(top_p=float(p[0]) + 1e-3))
    assert np.isfinite(got).tolist() == [True, False, True, False]
    got = truncate(OPS, x, SamplingParams(top_p=1e-40))
    assert np.isfinite(got).tolist() == [True, False, False, False]
    got = truncate(OPS, x, SamplingParams(top_p=0.99))
    assert np.isfinite(got).tolist() == [True, True, True, True]
    got = truncate(OPS, x, SamplingParams(min_p=float(p[2] / p[0]) - 1e-3))
    assert np.isfinite(got).tolist() == [True, False, True, False]
    got = truncate(OPS, x, SamplingParams(min_p=float(p[2] / p[0]) + 1e-3))
    assert np.isfinite(got).tolist() == [True, False, False, False]
    got = truncate(OPS, x, SamplingParams(top_k=3, min_p=0.2))
    assert np.isfinite(got).tolist() == [True, False, True, False]


def test_masked_logits_applies_penalties_and_the_grammar():
    raw = [1.0, 2.0, 3.0]
    st = SamplerState(seed=0)
    got = masked_logits(OPS, raw, SamplingParams(logit_bias={0: 1.0}), st)
    assert got.dtype == np.float32 and np.allclose(got, [2.0, 2.0, 3.0])
    st.constraint = SimpleNamespace(allowed=lambda: np.array([True, False, True]))
    got = masked_logits(OPS, raw, SamplingParams(), st)
    assert got[0] == 1.0 and np.isneginf(got[1]) and got[2] == 3.0


def test_numpy_ops_one_dimensional():
    x = _x(1.0, 3.0, 2.0)
    a = OPS.asarray([1, 2], "int32")
    assert a.dtype == np.int32 and a.tolist() == [1, 2]
    y = OPS.float32([1, 2])
    assert y.dtype == np.float32
    src = np.ones(2, np.float32)
    assert OPS.float32(src) is not src
    ls = OPS.log_softmax(x)
    assert np.allclose(ls, np.log(np.exp(x) / np.exp(x).sum()), atol=1e-6)
    ls = OPS.log_softmax(_x(0.0, float("-inf")))
    assert ls[0] == 0.0 and np.isneginf(ls[1])
    assert np.allclose(OPS.exp(_x(0.0, 1.0)), [1.0, math.e])
    assert OPS.argmax(x) == 1 and isinstance(OPS.argmax(x), int)
    assert OPS.argsort_desc(_x(1.0, 3.0, 3.0, 2.0)).tolist() == [1, 2, 3, 0]  # stable on ties
    assert OPS.take(x, [2, 0]).tolist() == [2.0, 1.0]
    put = OPS.put(x, [0], [9.0])
    assert put.tolist() == [9.0, 3.0, 2.0] and x.tolist() == [1.0, 3.0, 2.0]
    assert OPS.cumsum(x).tolist() == [1.0, 4.0, 6.0]
    w = OPS.where(np.array([True, False, True]), x, 0.0)
    assert w.dtype == np.float32 and w.tolist() == [1.0, 0.0, 2.0]
    assert OPS.kth_largest(x, 1) == 3.0 and OPS.kth_largest(x, 2) == 2.0 and OPS.kth_largest(x, 3) == 1.0
    assert OPS.kth_largest(x, 7) == 1.0
    arr = np.zeros(2)
    assert OPS.from_numpy(arr) is arr
    assert OPS.max(x) == 3.0
    assert OPS.item(np.float32(2.5)) == 2.5 and isinstance(OPS.item(np.float32(2.5)), float)
    assert OPS.tolist(x) == [1.0, 3.0, 2.0] and isinstance(OPS.tolist(x), list)


def test_numpy_ops_batched_helpers():
    m = np.array([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]], np.float32)
    assert OPS.count_below(np.array([[0.1, 0.5, 0.9]]), np.array([[0.5]])).tolist() == [1]
    assert OPS.cumsum_rows(m).tolist() == [[1.0, 4.0, 6.0], [0.0, 0.0, 5.0]] and OPS.cumsum_rows(m).dtype == np.float32
    s = OPS.softmax_rows(m)
    assert s.dtype == np.float32 and np.allclose(s.sum(-1), 1.0)
    assert np.allclose(s[0], np.exp(m[0]) / np.exp(m[0]).sum())
    assert OPS.softmax_rows(np.array([[1000.0, 1000.0]], np.float32)).tolist() == [[0.5, 0.5]]
    w = OPS.where_int(np.array([True, False]), np.array([1, 2]), np.array([3, 4]))
    assert w.dtype == np.int64 and w.tolist() == [1, 4]
    assert OPS.one_row(np.arange(3)).shape == (1, 3) and OPS.one_row([1, 2]).tolist() == [[1, 2]]
    assert OPS.as_f32([1, 2]).dtype == np.float32
    assert OPS.vec([1, 2]).tolist() == [1, 2]
    assert OPS.to_host([1]).tolist() == [1] and OPS.wait(np.array([2])).tolist() == [2]
    assert OPS.start_copy(m) is m
    assert OPS.end_thread() is None


# ---------------------------------------------------------------- sampling params and state


def test_params_post_init_and_greedy():
    p = SamplingParams(stop="END", logit_bias=None, top_logprobs=2)
    assert p.stop == ["END"] and p.logit_bias == {} and p.logprobs is True
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().logprobs is False and SamplingParams(logprobs=True).logprobs is True
    assert SamplingParams().max_tokens == 256 and SamplingParams().top_k == 0
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy


def test_for_choice_copies_and_offsets_the_seed():
    p = SamplingParams(seed=10, n=3, stop=["x"], logit_bias={1: 2.0}, stop_token_ids=[5], temperature=0.3)
    q = p.for_choice(2)
    assert (q.seed, q.n, q.temperature) == (12, 1, 0.3)
    assert q.stop == ["x"] and q.stop is not p.stop and q.logit_bias == {1: 2.0} and q.logit_bias is not p.logit_bias
    assert q.stop_token_ids == [5] and q.stop_token_ids is not p.stop_token_ids
    assert (p.seed, p.n) == (10, 3)
    assert SamplingParams(n=2).for_choice(1).seed is None


def test_sampler_state_draws_its_own_seed():
    seeds = {SamplerState().seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert SamplerState(seed=5).seed == 5 and SamplerState(seed=0).seed == 0
    st = SamplerState()
    assert (st.prompt_tokens, st.output_tokens, st.draws, st.constraint) == ([], [], 0, None)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"max_tokens": True}, "'max_tokens' must be a positive integer, got True"),
        ({"max_tokens": 1.5}, "'max_tokens' must be a positive integer, got 1.5"),
        ({"max_tokens": 0}, "'max_tokens' must be a positive integer, got 0"),
        ({"temperature": True}, "'temperature' must be a finite number, got True"),
        ({"top_p": "1"}, "'top_p' must be a finite number, got '1'"),
        ({"min_p": float("inf")}, "'min_p' must be a finite number, got inf"),
        ({"repetition_penalty": None}, "'repetition_penalty' must be a finite number, got None"),
        ({"presence_penalty": float("nan")}, "'presence_penalty' must be a finite number, got nan"),
        ({"frequency_penalty": "x"}, "'frequency_penalty' must be a finite number, got 'x'"),
        ({"temperature": -0.01}, "'temperature' must be >= 0"),
        ({"top_p": 0}, "'top_p' must be in (0, 1]"),
        ({"top_p": 1.01}, "'top_p' must be in (0, 1]"),
        ({"min_p": -0.1}, "'min_p' must be in [0, 1]"),
        ({"min_p": 1.1}, "'min_p' must be in [0, 1]"),
        ({"top_k": -2}, "'top_k' must be an integer >= -1 (0 or -1 disable it)"),
        ({"top_k": True}, "'top_k' must be an integer >= -1 (0 or -1 disable it)"),
        ({"top_k": 2.0}, "'top_k' must be an integer >= -1 (0 or -1 disable it)"),
        ({"repetition_penalty": 0.009}, "'repetition_penalty' must be in [0.01, 10]"),
        ({"repetition_penalty": 10.5}, "'repetition_penalty' must be in [0.01, 10]"),
        ({"repetition_context_size": 0}, "'repetition_context_size' must be a positive integer"),
        ({"repetition_context_size": 2.0}, "'repetition_context_size' must be a positive integer"),
        ({"presence_penalty": 2.1}, "'presence_penalty' must be in [-2, 2]"),
        ({"frequency_penalty": -2.1}, "'frequency_penalty' must be in [-2, 2]"),
        ({"seed": True}, "'seed' must be an integer"),
        ({"seed": 1.0}, "'seed' must be an integer"),
        ({"n": 17}, "'n' must be an integer in [1, 16]"),
        ({"n": True}, "'n' must be an integer in [1, 16]"),
        ({"n": 2.0}, "'n' must be an integer in [1, 16]"),
        ({"top_logprobs": 21}, "'top_logprobs' must be an integer in [0, 20]"),
        ({"top_logprobs": -1}, "'top_logprobs' must be an integer in [0, 20]"),
        ({"top_logprobs": 1.0}, "'top_logprobs' must be an integer in [0, 20]"),
        ({"stop": ["a"] * 17}, "'stop' must be up to 16 non-empty strings"),
        ({"stop": ["a", ""]}, "'stop' must be up to 16 non-empty strings"),
        ({"stop": [1]}, "'stop' must be up to 16 non-empty strings"),
        ({"logit_bias": {True: 1.0}}, "'logit_bias' has an invalid token id True"),
        ({"logit_bias": {"3": 1.0}}, "'logit_bias' has an invalid token id '3'"),
        ({"logit_bias": {-1: 1.0}}, "'logit_bias' has an invalid token id -1"),
        ({"logit_bias": {100: 1.0}}, "'logit_bias' has an invalid token id 100"),
        ({"logit_bias": {3: "x"}}, "'logit_bias' must be a finite number, got 'x'"),
        ({"logit_bias": {3: -100.5}}, "'logit_bias' values must be in [-100, 100]"),
        ({"kv_bits": 3}, "'kv_bits' must be 4 or 8, got 3"),
        ({"kv_bits": True}, "'kv_bits' must be 4 or 8, got True"),
        ({"kv_bits": 4, "turbo_kv": "k4v3"}, "'kv_bits' cannot be combined with turbo_kv: choose one KV-cache format"),
        ({"kv_group_size": 48}, f"'kv_group_size' must be one of {list(GROUP_SIZES)}, got 48"),
        ({"kv_group_size": True}, f"'kv_group_size' must be one of {list(GROUP_SIZES)}, got True"),
        ({"turbo_kv": 4}, "'turbo_kv' must be a string: a preset name such as 'k4v3', or 'off'"),
    ],
)
def test_validation_messages(kwargs, msg):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs).validate(100)
    assert str(e.value) == msg and e.value.param == msg.split("'")[1]


def test_validation_accepts_the_edges():
    edge = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_p=1,
        min_p=1,
        top_k=-1,
        repetition_penalty=10,
        repetition_context_size=1,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=-3,
        n=16,
        top_logprobs=MAX_TOP_LOGPROBS,
        stop=["s"] * 16,
        logit_bias={0: -100, 99: 100.0},
        kv_bits=8,
        turbo_kv="off",
        kv_group_size=GROUP_SIZES[0],
    )
    assert edge.validate(100) is edge
    SamplingParams(
        max_tokens=None,
        min_p=0,
        repetition_penalty=0.01,
        presence_penalty=2,
        frequency_penalty=-2,
        n=1,
        top_logprobs=0,
        kv_bits=4,
        turbo_kv="none",
    ).validate(100)
    SamplingParams(kv_bits=4, turbo_kv=None).validate(None)
    SamplingParams(logit_bias={10**6: 1.0}).validate(None)  # no vocabulary known: any id
    SamplingParams(turbo_kv="k4v3").validate(100)
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(turbo_kv="zzz").validate(100)
    assert e.value.param == "turbo_kv" and str(e.value).startswith("'turbo_kv' ")
    assert SamplingParams(top_k=100).validate(100).top_k == 0  # every token: the same as no top-k
    assert SamplingParams(top_k=99).validate(100).top_k == 99
    assert SamplingParams(top_k=500).validate(None).top_k == 500
