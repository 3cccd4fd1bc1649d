"""Tool calls and reasoning through the running server with the OpenAI SDK.

The plumbing runs on a synthetic checkpoint (random weights) carrying a Qwen-style chat
template (tests/data/qwen_style.jinja), because the bundled SmolLM2's template has no tool
support; tool_choice 'required' makes even random weights produce a valid call (the grammar
admits nothing else), which is what lets the full SDK flow run here.  The last test uses the
real SmolLM2, where the server describes the tools in the system prompt itself.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from conftest import ROOT, needs_torch
from server_util import ServerProc

openai = pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
        },
    },
]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]

pytestmark = needs_torch


@pytest.fixture(scope="module")
def tool_server(tiny_llama, tmp_path_factory):
    ck = tmp_path_factory.mktemp("tools") / "ck"
    shutil.copytree(tiny_llama, ck)
    shutil.copy(ROOT / "tests" / "data" / "qwen_style.jinja", ck / "chat_template.jinja")
    s = ServerProc("--model", str(ck), "--backend", "torch", "--parallel", "4", "--max-tokens", "64")
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, names=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"]
    assert set(args) == set(schema["required"])
    for k, v in args.items():
        assert v in schema["properties"][k]["enum"]
    return args


def _stream_calls(stream):
    """Assemble streamed tool_calls deltas the way SDK users do; also return content and finish."""
    calls: dict[int, dict] = {}
    content, reasoning, finish = "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, reasoning, finish


def test_sdk_tool_flow_non_streamed(client):
    r = client.chat.completions.create(
        model="x", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, parallel_tool_calls=False
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.tool_calls and ch.message.content is None
    assert len(ch.message.tool_calls) == 1  # parallel_tool_calls=False
    _check_call(ch.message.tool_calls[0])
    # the tool result goes back; the model answers (random weights: any text) without crashing
    history = (
        ASK
        + [ch.message.model_dump(exclude_none=True)]
        + [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 18})} for c in ch.message.tool_calls]
    )
    r2 = client.chat.completions.create(model="x", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result were rendered
    # the same final leg streamed: the deltas add up to the non-streamed answer (greedy)
    _, content, _, finish = _stream_calls(
        client.chat.completions.create(
            model="x", messages=history, tools=TOOLS, max_tokens=8, temperature=0, stream=True
        )
    )
    assert finish == r2.choices[0].finish_reason and content == (r2.choices[0].message.content or "")


def test_streamed_tool_calls_equal_non_streamed(client):
    kw = dict(model="x", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.7, seed=3, max_tokens=200)
    r = client.chat.completions.create(**kw)
    calls, content, _, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
    # several calls (parallel) may end in one cut off by max_tokens: then finish_reason is 'length',
    # the complete calls stand and the cut one is left out (never leaked as markup into content)
    assert finish == r.choices[0].finish_reason in ("tool_calls", "length")
    assert content == (r.choices[0].message.content or "")
    assert "<tool_call>" not in content and '{"name"' not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)


def test_named_function_is_the_only_call(client):
    for name in ("get_time", "get_weather"):
        r = client.chat.completions.create(
            model="x",
            messages=ASK,
            tools=TOOLS,
            temperature=0.9,
            seed=1,
            tool_choice={"type": "function", "function": {"name": name}},
        )
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == name
        _check_call(calls[0], names=(name,))


def test_tool_choice_none_and_auto_with_random_weights(client):
    r = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages[1].tool_calls",
        ),
    ],
)
def test_bad_tool_requests_are_400(tool_server, patch, param):
    body = {"messages": ASK, "tools": TOOLS, **patch}
    r = httpx.post(tool_server.base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_required_without_tools_is_400(tool_server):
    r = httpx.post(tool_server.base + "/v1/chat/completions", json={"messages": ASK, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.fixture(scope="module")
def no_blank_tokens(tiny_llama):
    """logit_bias that bans whitespace-only tokens: this random model would otherwise answer
    with newlines only, which says nothing about the reasoning split."""
    from swiftlm.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(tiny_llama)
    return {str(i): -100 for i in range(tok.vocab_size) if not tok.decode([i]).strip()}


def test_reasoning_content_and_its_precedence(client, no_blank_tokens):
    # the template opens <think> when thinking is on, so the (random) output is all reasoning
    on = client.chat.completions.create(
        model="x",
        messages=ASK,
        max_tokens=16,
        temperature=1.0,
        seed=2,
        logit_bias=no_blank_tokens,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    msg = on.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert reasoning and not msg.content
    # enable_thinking (top level) wins over chat_template_kwargs
    off = client.chat.completions.create(
        model="x",
        messages=ASK,
        max_tokens=16,
        temperature=1.0,
        seed=2,
        logit_bias=no_blank_tokens,
        extra_body={"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}},
    )
    assert off.choices[0].message.content and "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert off.usage.prompt_tokens < on.usage.prompt_tokens  # no "<think>" opened in the prompt
    # streamed reasoning deltas add up to the non-streamed reasoning_content
    _, content, streamed, _ = _stream_calls(
        client.chat.completions.create(
            model="x",
            messages=ASK,
            max_tokens=16,
            temperature=1.0,
            seed=2,
            stream=True,
            logit_bias=no_blank_tokens,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    )
    assert streamed == reasoning and content == ""


def test_prior_reasoning_and_tool_turns_render(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I need the tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "assistant", "content": "18 C in Paris.", "reasoning_content": "Easy."},
        {"role": "user", "content": "And Oslo?"},
    ]
    r = client.chat.completions.create(
        model="x", messages=history, tools=TOOLS, max_tokens=4, extra_body={"enable_thinking": True}
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_smollm2_tool_call_through_injected_prompt(torch_llm):
    """The real model, whose template knows no tools: the server describes them (Hermes style)
    and a forced call is grammar-constrained; SmolLM2 fills in the city from the question."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    from swiftlm import SamplingParams

    out = torch_llm.chat(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        SamplingParams(max_tokens=40, temperature=0),
        tools=tools,
        tool_choice="required",
    )
    o = out.outputs[0]
    # the grammar allows parallel calls and SmolLM2 starts a second one, which max_tokens cuts:
    # finish_reason 'length', the complete first call kept, the cut one left out
    assert o.finish_reason in ("tool_calls", "length") and o.tool_calls
    assert json.loads(o.tool_calls[0].arguments) == {"city": "Paris"}
    if o.finish_reason == "length":
        assert o.text.count("<tool_call>") == len(o.tool_calls) + 1


@pytest.mark.parametrize("max_tokens", [3, 9, 17])
def test_tool_call_cut_by_max_tokens(client, max_tokens):
    """A call cut off by the token limit: no markup in content, finish_reason 'length', streamed
    and not; calls completed before the cut are kept."""
    kw = dict(model="x", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=max_tokens)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert r.usage.completion_tokens == max_tokens
    # 'length' when the limit cut a call off; 'tool_calls' only if every call had closed
    assert ch.finish_reason == "length" or (ch.finish_reason == "tool_calls" and ch.message.tool_calls)
    assert "<tool_call>" not in (ch.message.content or "") and "</tool_call>" not in (ch.message.content or "")
    for c in ch.message.tool_calls or []:
        _check_call(c)
    calls, content, _, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == ch.finish_reason and content == (ch.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in ch.message.tool_calls or []
    ]
