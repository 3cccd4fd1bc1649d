"""POST /v1/messages (Anthropic's Messages API) on a real server, driven by the official anthropic SDK
pointed at the server's root (as with ANTHROPIC_BASE_URL).

Mechanics run on a tiny random checkpoint with a Qwen-style template (tools in the template, a
``<think>`` block opened when thinking is on), started with ``--api-key`` (the SDK sends
``x-api-key``) and ``--temp 2`` (the default temperature, so random weights sample varied,
non-blank text; Anthropic's own range stops at 1).  The real SmolLM2 checks byte-for-byte
equality with chat completions and the Responses API, and stop sequences, on real answers.
Sampling fields the SDK no longer names (temperature, top_k) and SwiftLM's ``seed`` go in
``extra_body``.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from conftest import ROOT, needs_torch
from server_util import ServerProc

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = needs_torch

KEY = "sekret"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather now in a city",
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
    }
]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    ck = tmp_path_factory.mktemp("anth") / "ck"
    shutil.copytree(tiny_llama, ck)
    shutil.copy(ROOT / "tests" / "data" / "qwen_style.jinja", ck / "chat_template.jinja")
    s = ServerProc(
        "--model",
        str(ck),
        "--backend",
        "torch",
        "--parallel",
        "4",
        "--max-tokens",
        "16",
        "--temp",
        "2",
        "--api-key",
        KEY,
    )
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.fixture(scope="module")
def smol():
    s = ServerProc("--model", "smollm2-135m-instruct", "--backend", "torch", "--parallel", "2", "--max-tokens", "16")
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.fixture(scope="module")
def ac(tiny):
    return anthropic.Anthropic(base_url=tiny.base, api_key=KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def oc(tiny):
    return openai.OpenAI(base_url=tiny.base + "/v1", api_key=KEY, max_retries=0, timeout=180)


def _sse(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    frames = []
    with httpx.stream(
        "POST",
        server.base + "/v1/messages",
        json={**body, "stream": True},
        timeout=180,
        headers=headers if headers is not None else {"x-api-key": KEY},
    ) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                frames.append((name, json.loads(line[6:])))
                name = None
    return frames


def _check_stream(frames: list[tuple[str, dict]]) -> dict:
    """Anthropic's event grammar: message_start, ping, (content_block_start, content_block_delta*,
    content_block_stop)*, message_delta, message_stop, and nothing after. -> the assembled message."""
    types = [d["type"] for _, d in frames]
    assert [n for n, _ in frames] == types
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("message_stop") == 1 and "error" not in types
    msg = frames[0][1]["message"]
    assert msg["content"] == [] and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    open_idx = None
    for t, (_, d) in zip(types[1:-2], frames[1:-2]):
        if t == "ping":
            continue
        if t == "content_block_start":
            assert open_idx is None and d["index"] == len(blocks)
            open_idx = d["index"]
            blocks.append(dict(d["content_block"]))
        elif t == "content_block_delta":
            assert d["index"] == open_idx
            b, delta = blocks[open_idx], d["delta"]
            if delta["type"] == "text_delta":
                b["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                b["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta"
                partial[open_idx] = partial.get(open_idx, "") + delta["partial_json"]
        else:
            assert t == "content_block_stop" and d["index"] == open_idx
            open_idx = None
    assert open_idx is None
    for i, js in partial.items():
        blocks[i]["input"] = json.loads(js)
    delta = frames[-2][1]
    return {
        **msg,
        "content": blocks,
        "stop_reason": delta["delta"]["stop_reason"],
        "stop_sequence": delta["delta"]["stop_sequence"],
        "usage": delta["usage"],
    }


# ---------------------------------------------------------------- basics and equality
def test_create_matches_chat_completions(ac, oc):
    m = ac.messages.create(
        model="x",
        max_tokens=6,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"temperature": 0},
    )
    chat = oc.chat.completions.create(
        model="x",
        max_tokens=6,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text == chat.choices[0].message.content
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]


def test_blocks_translate_like_chat_messages(ac, oc):
    """system blocks, text blocks and a prior assistant turn: the same prompt and the same
    seeded sample as the equivalent chat request."""
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]
    m = ac.messages.create(
        model="x",
        max_tokens=8,
        messages=msgs,
        metadata={"user_id": "u1"},
        system=[{"type": "text", "text": "Be kind."}, {"type": "text", "text": "Be brief."}],
        extra_body={"seed": 9, "temperature": 1, "top_k": 50},
    )
    chat = oc.chat.completions.create(
        model="x",
        max_tokens=8,
        seed=9,
        temperature=1,
        extra_body={"top_k": 50},
        messages=[
            {"role": "system", "content": "Be kind.\nBe brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ],
    )
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in m.content if b.type == "text") == (chat.choices[0].message.content or "")


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}], ids=["greedy", "seeded"]
)
def test_byte_for_byte_equal_to_chat_and_responses_on_smollm2(smol, sampling):
    q = "Name a fruit and its color."
    oc = openai.OpenAI(base_url=smol.base + "/v1", api_key="x", max_retries=0, timeout=180)
    ac = anthropic.Anthropic(base_url=smol.base, api_key="x", max_retries=0, timeout=180)
    seed = sampling.get("seed")
    kw = {k: v for k, v in sampling.items() if k != "seed"}
    chat = oc.chat.completions.create(
        model="x", messages=[{"role": "user", "content": q}], max_tokens=8, seed=seed, **kw
    )
    want = chat.choices[0].message.content
    assert want
    m = ac.messages.create(
        model="x", max_tokens=8, messages=[{"role": "user", "content": q}], extra_body={"seed": seed, **kw}
    )
    assert m.content[0].text == want
    streamed = _check_stream(
        _sse(smol, {"max_tokens": 8, "messages": [{"role": "user", "content": q}], "seed": seed, **kw}, headers={})
    )
    assert streamed["content"] == [{"type": "text", "text": want}]
    r = oc.responses.create(model="x", input=q, max_output_tokens=8, extra_body={"seed": seed}, **kw)
    assert r.output_text == want


def test_stop_sequences_on_smollm2(smol):
    ac = anthropic.Anthropic(base_url=smol.base, api_key="x", max_retries=0, timeout=180)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = ac.messages.create(model="x", max_tokens=10, messages=msgs, extra_body={"temperature": 0})
    text = full.content[0].text
    assert "Paris" in text, text
    m = ac.messages.create(
        model="x", max_tokens=10, messages=msgs, stop_sequences=["zzz", "Paris"], extra_body={"temperature": 0}
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert m.content[0].text == text[: text.index("Paris")]


# ---------------------------------------------------------------- streaming
def test_stream_event_order(tiny, ac):
    frames = _sse(tiny, {"max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0})
    types = [d["type"] for _, d in frames]
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    msg = _check_stream(frames)
    m = ac.messages.create(
        model="x", max_tokens=5, messages=[{"role": "user", "content": "Hello"}], extra_body={"temperature": 0}
    )
    assert msg["content"] == [b.model_dump(exclude_none=True) for b in m.content]
    assert (msg["stop_reason"], msg["usage"]["output_tokens"]) == (m.stop_reason, m.usage.output_tokens)
    with ac.messages.stream(
        model="x", max_tokens=5, messages=[{"role": "user", "content": "Hello"}], extra_body={"temperature": 0}
    ) as st:
        final = st.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason


# ---------------------------------------------------------------- tools
def test_tool_loop(ac):
    m = ac.messages.create(
        model="x",
        max_tokens=48,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_") and use.input["city"] in ("Paris", "Oslo")
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18 C, sunny"}]}
            ],
        },
    ]
    m2 = ac.messages.create(model="x", max_tokens=6, messages=history, tools=TOOLS, extra_body={"temperature": 0})
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use") and m2.content  # the answer arrives
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens > m.usage.input_tokens


def test_tool_loop_streamed(tiny, ac):
    body = {
        "max_tokens": 48,
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }
    msg = _check_stream(_sse(tiny, body))
    assert msg["stop_reason"] == "tool_use"
    (use,) = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert use["input"]["city"] in ("Paris", "Oslo")
    with ac.messages.stream(
        model="x",
        max_tokens=48,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    ) as st:
        final = st.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content if b.type == "tool_use"][0]["input"] == use["input"]
    history = ASK + [
        {"role": "assistant", "content": msg["content"]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use["id"], "content": "9 C"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    done = _check_stream(_sse(tiny, {"max_tokens": 6, "messages": history, "tools": TOOLS, "temperature": 0}))
    assert done["content"] and done["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


def test_tool_choice_none_and_auto(ac):
    m = ac.messages.create(model="x", max_tokens=6, messages=ASK, tools=TOOLS, tool_choice={"type": "none"})
    assert m.stop_reason in ("end_turn", "max_tokens") and all(b.type != "tool_use" for b in m.content)
    m = ac.messages.create(model="x", max_tokens=6, messages=ASK, tools=TOOLS, tool_choice={"type": "auto"})
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens(ac):
    plain = ac.messages.count_tokens(model="x", messages=ASK)
    m = ac.messages.create(model="x", max_tokens=2, messages=ASK)
    assert plain.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    with_tools = ac.messages.count_tokens(model="x", messages=ASK, tools=TOOLS, system="Be brief.")
    assert with_tools.input_tokens > plain.input_tokens
    thinking = ac.messages.count_tokens(model="x", messages=ASK, thinking={"type": "adaptive"})
    assert thinking.input_tokens > plain.input_tokens  # the template opens <think>


# ---------------------------------------------------------------- thinking
def test_thinking_blocks_and_budget(tiny, ac, oc):
    def chat_reasoning(n: int, seed: int) -> str:
        r = oc.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=n,
            seed=seed,
            extra_body={"enable_thinking": True},
        )
        return (r.choices[0].message.model_extra or {}).get("reasoning_content")

    # without a budget cap in reach, the thinking is what chat completions calls reasoning_content
    m = ac.messages.create(
        model="x",
        max_tokens=6,
        messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "enabled", "budget_tokens": 5},
        extra_body={"seed": 2},
    )
    # budget 5 < max_tokens 6: the thinking stops after 5 tokens and the answer takes the last one
    assert m.content[0].type == "thinking" and m.content[0].thinking == chat_reasoning(5, 2)
    assert m.usage.output_tokens <= 6
    m = ac.messages.create(
        model="x",
        max_tokens=14,
        messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "enabled", "budget_tokens": 4},
        extra_body={"seed": 3},
    )
    thinking = chat_reasoning(4, 3)
    assert thinking and m.content[0].thinking == thinking  # capped at 4 reasoning tokens
    assert m.content[1].type == "text" and m.content[1].text  # then the answer
    assert m.usage.output_tokens <= 14 and m.stop_reason in ("max_tokens", "end_turn")
    if m.stop_reason == "max_tokens":  # the answer's tokens count against the same max_tokens
        assert m.usage.output_tokens == 14
    msg = _check_stream(
        _sse(
            tiny,
            {
                "max_tokens": 14,
                "messages": [{"role": "user", "content": "Hello"}],
                "thinking": {"type": "enabled", "budget_tokens": 4},
                "seed": 3,
            },
        )
    )
    assert msg["content"] == [b.model_dump(exclude_none=True) for b in m.content]
    # thinking off: no thinking block, a shorter prompt (no <think> opened)
    off = ac.messages.create(
        model="x",
        max_tokens=4,
        messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "disabled"},
        extra_body={"seed": 3},
    )
    assert all(b.type != "thinking" for b in off.content)
    assert (
        off.usage.input_tokens + off.usage.cache_read_input_tokens
        < m.usage.input_tokens + m.usage.cache_read_input_tokens
    )
    # prior thinking blocks are accepted in the history
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": "Go on."},
    ]
    again = ac.messages.create(model="x", max_tokens=2, messages=history)
    assert again.usage.output_tokens <= 2


def test_output_config_json_schema(ac):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    m = ac.messages.create(
        model="x",
        max_tokens=40,
        messages=[{"role": "user", "content": "Pick a city"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0},
    )
    assert json.loads(m.content[0].text)["city"] in ("Paris", "Oslo") and m.stop_reason == "end_turn"


# ---------------------------------------------------------------- errors in Anthropic's shape
def _err(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]["message"]


def test_auth(tiny):
    body = {"max_tokens": 2, "messages": ASK}
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        _err(httpx.post(tiny.base + "/v1/messages", json=body, headers=headers), 401, "authentication_error")
        _err(
            httpx.post(tiny.base + "/v1/messages/count_tokens", json=body, headers=headers), 401, "authentication_error"
        )
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        assert httpx.post(tiny.base + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    bad = anthropic.Anthropic(base_url=tiny.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="x", max_tokens=2, messages=ASK)


BAD = [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": "many", "messages": ASK}, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 4}, "messages"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": "hi"}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        "messages[0].content[0].tool_use_id",
    ),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
        "messages[0].content[0].source",
    ),
    (
        {"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
        "messages[0].content[0]",
    ),
    ({"max_tokens": 4, "messages": ASK, "system": 5}, "system"),
    ({"max_tokens": 4, "messages": ASK, "system": [{"type": "image"}]}, "system[0]"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    (
        {"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice",
    ),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": "auto"}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 4}}, "budget_tokens"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "maybe"}}, "thinking.type"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": "END"}, "stop_sequences"),
    ({"max_tokens": 4, "messages": ASK, "output_config": {"format": {"type": "xml"}}}, "output_config.format"),
]


@pytest.mark.parametrize("body,where", BAD)
def test_bad_requests_are_4xx(tiny, body, where):
    msg = _err(
        httpx.post(tiny.base + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60),
        400,
        "invalid_request_error",
    )
    assert where in msg, msg


def test_unparseable_bodies(tiny):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            _err(
                httpx.post(
                    tiny.base + path, content=raw, headers={"x-api-key": KEY, "content-type": "application/json"}
                ),
                400,
                "invalid_request_error",
            )
    _err(
        httpx.post(
            tiny.base + "/v1/messages/count_tokens", json={"messages": [{"role": "user"}]}, headers={"x-api-key": KEY}
        ),
        400,
        "invalid_request_error",
    )
    # max_tokens far past the context is cut to fit (clients send large required values), not refused
    m = httpx.post(
        tiny.base + "/v1/messages",
        headers={"x-api-key": KEY},
        timeout=60,
        json={
            "max_tokens": 10_000_000,
            "messages": ASK,
            "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}},
        },
    )
    assert m.status_code == 200 and json.loads(m.json()["content"][0]["text"]) in ("yes", "no")
