"""POST /v1/responses (the OpenAI Responses API) on a real server, driven by the official openai SDK.

Mechanics run on a tiny random checkpoint with a Qwen-style template (tools in the template, a
``<think>`` block opened when thinking is on; started with ``--temp 2`` so that random weights
sample varied, non-blank text); the real SmolLM2 checks the tool loop and the byte-for-byte
equality with chat completions on real answers.  A forced function (``tool_choice``) makes the
grammar admit only a call, so even random weights call the tool.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from conftest import ROOT, needs_torch
from server_util import ServerProc

openai = pytest.importorskip("openai")

pytestmark = needs_torch

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather now in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
    }
]
FORCE = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    ck = tmp_path_factory.mktemp("resp") / "ck"
    shutil.copytree(tiny_llama, ck)
    shutil.copy(ROOT / "tests" / "data" / "qwen_style.jinja", ck / "chat_template.jinja")
    s = ServerProc("--model", str(ck), "--backend", "torch", "--parallel", "4", "--max-tokens", "16", "--temp", "2")
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.fixture(scope="module")
def smol():
    s = ServerProc("--model", "smollm2-135m-instruct", "--backend", "torch", "--parallel", "2", "--max-tokens", "16")
    yield s
    assert s.stop() == 0, s.stderr_tail()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tc(tiny):
    return _client(tiny)


@pytest.fixture(scope="module")
def sc(smol):
    return _client(smol)


def _sse(server, body: dict) -> list[tuple[str, dict]]:
    """Raw SSE frames of a streamed request: (event name, data)."""
    frames = []
    with httpx.stream("POST", server.base + "/v1/responses", json={**body, "stream": True}, timeout=180) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                frames.append((name, json.loads(line[6:])))
                name = None
    return frames


def _check_stream(frames: list[tuple[str, dict]]) -> list[str]:
    """The typed event sequence: names match types, sequence numbers count up from 0, the
    lifecycle brackets everything, items open and close in order, nothing after the end."""
    types = [d["type"] for _, d in frames]
    assert [n for n, _ in frames] == types
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert sum(t in ("response.completed", "response.incomplete", "response.failed") for t in types) == 1
    open_item = None
    for t, (_, d) in zip(types, frames):
        if t == "response.output_item.added":
            assert open_item is None
            open_item = d["output_index"]
        elif t == "response.output_item.done":
            assert open_item == d["output_index"]
            open_item = None
        elif t.startswith("response.") and t.split(".")[1] in (
            "output_text",
            "content_part",
            "reasoning_text",
            "function_call_arguments",
        ):
            assert d["output_index"] == open_item
    assert open_item is None
    final = frames[-1][1]["response"]
    assert [d["item"] for t, (_, d) in zip(types, frames) if t == "response.output_item.done"] == final["output"]
    return types


# ---------------------------------------------------------------- basics and equality
def test_create_matches_chat_completions(tc):
    r = tc.responses.create(model="x", input="Hello", max_output_tokens=6, temperature=0)
    chat = tc.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.output[0].type == "message"
    assert r.output_text == chat.choices[0].message.content
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert u.output_tokens == 6
    else:
        assert r.status == "completed"


def test_items_translate_like_chat_messages(tc):
    """instructions, developer/assistant messages, input_text/output_text parts: the same prompt
    (token count) and the same sampled text (seeded) as the equivalent chat request."""
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]
    msgs = [
        {"role": "system", "content": "Be kind."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    r = tc.responses.create(
        model="x", instructions="Be kind.", input=items, max_output_tokens=8, temperature=1.5, extra_body={"seed": 11}
    )
    chat = tc.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=1.5, seed=11)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}], ids=["greedy", "seeded"]
)
def test_byte_for_byte_equal_to_chat_on_smollm2(sc, sampling):
    """Streamed here; the non-streamed Responses, Messages and chat answers are compared in
    test_anthropic_api (one SmolLM2 request costs seconds on a shared CPU)."""
    seed = sampling.get("seed")
    kw = {k: v for k, v in sampling.items() if k != "seed"}
    q = "Name a fruit and its color."
    chat = sc.chat.completions.create(
        model="x", messages=[{"role": "user", "content": q}], max_tokens=8, seed=seed, **kw
    )
    want = chat.choices[0].message.content
    assert want
    events = list(
        sc.responses.create(model="x", input=q, max_output_tokens=8, extra_body={"seed": seed}, stream=True, **kw)
    )
    deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    final = events[-1].response  # response.completed, or response.incomplete when cut at 8 tokens
    assert deltas == final.output_text == want
    assert final.usage.output_tokens == chat.usage.completion_tokens


# ---------------------------------------------------------------- streaming
def test_stream_event_order(tiny):
    frames = _sse(tiny, {"input": "Hello", "max_output_tokens": 5, "temperature": 0})
    types = _check_stream(frames)
    assert types[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(d["delta"] for _, d in frames if d["type"] == "response.output_text.delta")
    final = frames[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert frames[-1][1]["type"] == "response." + final["status"]
    if final["status"] == "incomplete":
        assert final["usage"]["output_tokens"] == 5 and final["incomplete_details"]["reason"] == "max_output_tokens"


def test_sdk_stream_helper(tc):
    # the helper's get_final_response() needs response.completed: a short constrained answer completes
    kw = dict(
        model="x",
        input="Yes or no?",
        temperature=0,
        text={"format": {"type": "json_schema", "name": "yn", "schema": {"enum": ["yes", "no"]}}},
    )
    with tc.responses.stream(**kw) as st:
        events = list(st)
        final = st.get_final_response()
    nums = [e.sequence_number for e in events]
    assert nums == sorted(nums) and events[0].type == "response.created" and events[-1].type == "response.completed"
    assert json.loads(final.output_text) in ("yes", "no")
    assert final.output_text == tc.responses.create(**kw).output_text


# ---------------------------------------------------------------- tools
def test_tool_loop_non_streamed(tc):
    r = tc.responses.create(
        model="x",
        input="What's the weather in Paris?",
        tools=TOOLS,
        tool_choice=FORCE,
        temperature=0,
        max_output_tokens=48,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    # stateless: the client sends the call back with its output
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp": 18})},
    ]
    r2 = tc.responses.create(model="x", input=history, tools=TOOLS, max_output_tokens=6, temperature=0)
    assert r2.output[-1].type in ("message", "function_call") and r2.usage.input_tokens > r.usage.input_tokens
    # the same turn through previous_response_id: the same prompt, the same answer
    r3 = tc.responses.create(
        model="x", previous_response_id=r.id, tools=TOOLS, max_output_tokens=6, temperature=0, input=[history[-1]]
    )
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.output_text == r2.output_text
    assert r3.previous_response_id == r.id


def test_tool_loop_streamed(tiny, tc):
    frames = _sse(
        tiny,
        {"input": "Weather in Oslo?", "tools": TOOLS, "tool_choice": FORCE, "temperature": 0, "max_output_tokens": 48},
    )
    types = _check_stream(frames)
    i = types.index("response.function_call_arguments.delta")
    assert types[i - 1] == "response.output_item.added" and types[i + 1 : i + 3] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert types[-1] == "response.completed"
    item = frames[-1][1]["response"]["output"][0]
    args = "".join(d["delta"] for _, d in frames if d["type"] == "response.function_call_arguments.delta")
    assert item["type"] == "function_call" and item["arguments"] == args and json.loads(args)["city"]
    events = list(
        tc.responses.create(
            model="x",
            previous_response_id=frames[-1][1]["response"]["id"],
            tools=TOOLS,
            max_output_tokens=6,
            temperature=0,
            stream=True,
            input=[{"type": "function_call_output", "call_id": item["call_id"], "output": "-3 C"}],
        )
    )
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and final.output
    assert final.usage.input_tokens > frames[-1][1]["response"]["usage"]["input_tokens"]


def test_smollm2_tool_loop(sc):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    r = sc.responses.create(
        model="x",
        input="What is the weather in Paris?",
        tools=tools,
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    call = r.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    r2 = sc.responses.create(
        model="x",
        previous_response_id=r.id,
        tools=tools,
        temperature=0,
        max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 degrees"}],
    )
    assert r2.output[-1].type == "message" and r2.output_text.strip()  # the final answer arrives


# ---------------------------------------------------------------- store
def test_retrieve_delete_and_store(tc):
    r = tc.responses.create(model="x", input="Hello", max_output_tokens=4, temperature=0)
    got = tc.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert tc.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        tc.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        tc.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        tc.responses.create(model="x", input="Hi", previous_response_id=r.id)
    unstored = tc.responses.create(model="x", input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        tc.responses.retrieve(unstored.id)


def test_previous_response_id_carries_the_conversation(tc):
    r1 = tc.responses.create(
        model="x", input="My name is Ada.", instructions="Be brief.", max_output_tokens=4, temperature=0
    )
    r2 = tc.responses.create(
        model="x", input="What is my name?", previous_response_id=r1.id, max_output_tokens=4, temperature=0
    )
    # instructions are not carried over (as in OpenAI's API); the turns are
    msgs = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    chat = tc.chat.completions.create(model="x", messages=msgs, max_tokens=4, temperature=0)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.output_text == chat.choices[0].message.content


# ---------------------------------------------------------------- reasoning and structured output
def test_reasoning_items(tiny, tc):
    kw = dict(model="x", input="Hello", max_output_tokens=6, extra_body={"seed": 4})
    r = tc.responses.create(reasoning={"effort": "high"}, **kw)
    chat = tc.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        seed=4,
        extra_body={"enable_thinking": True},
    )
    reasoning = (chat.choices[0].message.model_extra or {}).get("reasoning_content")
    assert reasoning  # --temp 2: varied text, all inside the opened <think> block
    item = r.output[0]
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
    assert item.content[0].text == reasoning
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 6
    off = tc.responses.create(reasoning={"effort": "none"}, **kw)
    assert all(o.type != "reasoning" for o in off.output) and off.usage.input_tokens < r.usage.input_tokens
    frames = _sse(tiny, {"input": "Hello", "max_output_tokens": 6, "seed": 4, "reasoning": {"effort": "low"}})
    types = _check_stream(frames)
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" not in types
    assert "".join(d["delta"] for _, d in frames if d["type"] == "response.reasoning_text.delta") == reasoning


def test_json_schema_text_format(tc):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = tc.responses.create(
        model="x",
        input="Pick a city",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
    )
    assert json.loads(r.output_text)["city"] in ("Paris", "Oslo")
    assert r.text.format.type == "json_schema"


# ---------------------------------------------------------------- bad input: 4xx in OpenAI's shape
BAD = [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["not an object"]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input[0].role"),
    (
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content[0]",
    ),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{oops"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "previous_response_id": 7}, "previous_response_id"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_are_4xx(tiny, body, param):
    r = httpx.post(tiny.base + "/v1/responses", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param, err


def test_unparseable_bodies_and_unknown_ids(tiny):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(tiny.base + "/v1/responses", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    for method in ("GET", "DELETE"):
        r = httpx.request(method, tiny.base + "/v1/responses/resp_nope")
        assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"]
    r = httpx.post(tiny.base + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_large_max_output_tokens_is_clamped_not_refused(tc):
    r = tc.responses.create(
        model="x",
        input="Hi",
        max_output_tokens=10_000_000,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "x", "schema": {"enum": ["yes", "no"]}}},
    )
    assert r.status == "completed" and json.loads(r.output_text) in ("yes", "no")
