"""The HTTP API in-process (Starlette's TestClient) over the fake backend plugin: the wire shapes of the OpenAI,
Anthropic and Responses routes, embeddings, tools, errors and the hostile-input catalogue, with no server process
and no torch or MLX.  The fake model spells a scripted reply (tests/plugins/swiftlm_fake_backend.py), so each test
knows the exact text a greedy request must return.  The same routes over real models and a real server process
are tested in test_server.py, test_anthropic_api.py, test_responses_api.py and test_hostile_inputs.py."""

from __future__ import annotations

import json

import pytest
from test_hostile_inputs import CASES

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MSG = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture
def oc(fake_app):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=fake_app, max_retries=0)


@pytest.fixture
def ac(fake_app):
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=fake_app, max_retries=0)


def sse_data(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ------------------------------------------------------------------ OpenAI chat completions
def test_chat_returns_the_scripted_reply_with_usage(oc, fake_replies, fake_llm):
    fake_replies["capital of France"] = "Paris is the capital."
    r = oc.chat.completions.create(model="m", messages=MSG, temperature=0, max_tokens=32)
    choice = r.choices[0]
    assert choice.message.content == "Paris is the capital." and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and r.object == "chat.completion"
    prompt = fake_llm.tokenizer.apply_chat_template(MSG, add_generation_prompt=True)
    n_prompt = len(fake_llm.tokenizer.encode(prompt))
    n_reply = len(fake_llm.tokenizer.encode("Paris is the capital."))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == n_reply + 1  # the end-of-sequence token is counted, not shown
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_concatenates_to_the_non_streamed_answer(oc, fake_replies):
    fake_replies["capital of France"] = "Paris, of course. It has been so for centuries."
    full = oc.chat.completions.create(model="m", messages=MSG, temperature=0, max_tokens=40)
    chunks = list(
        oc.chat.completions.create(
            model="m", messages=MSG, temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_max_tokens_ends_with_length(oc, fake_replies):
    r = oc.chat.completions.create(model="m", messages=MSG, temperature=0, max_completion_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_stop_string_is_cut_and_not_shown(oc, fake_replies):
    fake_replies["capital of France"] = "Paris. Next question please."
    r = oc.chat.completions.create(model="m", messages=MSG, temperature=0, max_tokens=30, stop=["Next"])
    assert r.choices[0].message.content == "Paris. " and r.choices[0].finish_reason == "stop"


def test_n_choices_and_seeded_sampling_repeat(oc, fake_replies):
    kw = dict(model="m", messages=MSG, max_tokens=12, temperature=1.0, seed=7)
    a = oc.chat.completions.create(n=3, **kw)
    b = oc.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_logprobs_shape(oc, fake_replies):
    fake_replies["capital of France"] = "Paris."
    r = oc.chat.completions.create(model="m", messages=MSG, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens  # every generated token, the end-of-sequence one too
    assert "".join(t.token for t in content).startswith("Paris.")
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_completions_echo_and_prompt_list(oc, fake_replies):
    fake_replies["Once upon"] = " a time."
    r = oc.completions.create(model="m", prompt=["Once upon", "Twice"], max_tokens=6, temperature=0, echo=True)
    assert len(r.choices) == 2
    assert r.choices[0].text == "Once upon a time." and r.choices[0].finish_reason == "stop"
    assert r.choices[1].text.startswith("Twice") and r.choices[1].finish_reason == "length"


def test_tool_call_is_parsed_streamed_and_not(oc, fake_replies):
    fake_replies["Weather in Oslo"] = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    r = oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=40)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    chunks = list(
        oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=40, stream=True)
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == {"city": "Oslo"}
    # the tool's answer goes back in and the conversation continues
    fake_replies["sunny"] = "It is sunny in Oslo."
    msgs += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    r2 = oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=40)
    assert r2.choices[0].message.content == "It is sunny in Oslo."


def test_response_format_json_schema_constrains_the_reply(oc, fake_replies):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fake_replies["capital of France"] = "Sure! Paris."  # not JSON: the grammar must override the script
    r = oc.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj, dict) and isinstance(obj["city"], str)


def test_models_list(oc):
    ids = [m.id for m in oc.models.list().data]
    assert ids and all(isinstance(i, str) for i in ids)


# ------------------------------------------------------------------ errors
def test_unknown_route_and_method_are_openai_errors(fake_app):
    r = fake_app.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = fake_app.get("/v1/chat/completions")
    assert r.status_code == 405


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "top_p": 2}, "top_p"),
        ({"messages": MSG, "max_tokens": "many"}, "max_tokens"),
        ({"messages": MSG, "n": 0}, "n"),
    ],
)
def test_bad_chat_bodies_name_the_field(fake_app, body, param):
    r = fake_app.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err.get("param") or "") + err["message"]


# An app built around one engine has no models manager: unloading answers 400 "does not load or unload models"
# there, where a server's manager answers 409 for its pinned model (that case runs in test_hostile_inputs.py).
INPROC_CASES = [c for c in CASES if c[0] != "ollama-unload-pinned"]


@pytest.mark.parametrize("case", INPROC_CASES, ids=[c[0] for c in INPROC_CASES])
def test_hostile_catalogue_in_process(fake_app, case):
    _, path, kw, status, words = case
    r = fake_app.request(kw.get("method", "POST"), path, **{k: v for k, v in kw.items() if k != "method"})
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert words in (err if isinstance(err, str) else err["message"])  # Ollama's error is a string
    ok = fake_app.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert ok.status_code == 200


# ------------------------------------------------------------------ Anthropic messages
def test_anthropic_create_equals_chat_completions(ac, oc, fake_replies):
    fake_replies["capital of France"] = "Paris."
    a = ac.messages.create(model="m", max_tokens=20, messages=MSG, extra_body={"temperature": 0})
    o = oc.chat.completions.create(model="m", messages=MSG, max_tokens=20, temperature=0)
    assert a.content[0].type == "text" and a.content[0].text == o.choices[0].message.content == "Paris."
    assert a.stop_reason == "end_turn" and a.role == "assistant" and a.type == "message"
    assert a.usage.input_tokens == o.usage.prompt_tokens


def test_anthropic_stream_event_order(ac, fake_replies):
    fake_replies["capital of France"] = "Paris is lovely."
    with ac.messages.stream(model="m", max_tokens=20, messages=MSG, extra_body={"temperature": 0}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_delta") < kinds.index("content_block_stop")
    assert "message_delta" in kinds and final.content[0].text == "Paris is lovely."


def test_anthropic_tool_use(ac, fake_replies):
    fake_replies["Weather in Oslo"] = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    m = ac.messages.create(
        model="m",
        max_tokens=40,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=tools,
        extra_body={"temperature": 0},
    )
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use and use[0].name == "get_weather" and use[0].input == {"city": "Oslo"}


def test_anthropic_count_tokens_and_error_shape(ac, fake_app, fake_llm):
    n = ac.messages.count_tokens(model="m", messages=MSG)
    prompt = fake_llm.tokenizer.apply_chat_template(MSG, add_generation_prompt=True)
    assert n.input_tokens == len(fake_llm.tokenizer.encode(prompt))
    r = fake_app.post("/v1/messages", json={"model": "m", "messages": MSG})  # max_tokens missing
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ Responses
def test_responses_create_store_and_continue(oc, fake_replies):
    fake_replies["capital of France"] = "Paris."
    r = oc.responses.create(model="m", input=MSG[0]["content"], temperature=0, max_output_tokens=20)
    assert r.output_text == "Paris." and r.status == "completed"
    got = oc.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Paris."
    fake_replies["Paris."] = "And Berlin is Germany's."  # the stored turn is part of the next prompt
    r2 = oc.responses.create(
        model="m", input="And Germany?", previous_response_id=r.id, temperature=0, max_output_tokens=20
    )
    assert r2.output_text == "And Berlin is Germany's."
    oc.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(r.id)


def test_responses_stream_events(oc, fake_replies):
    fake_replies["capital of France"] = "Paris, France."
    events = list(oc.responses.create(model="m", input=MSG[0]["content"], temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Paris, France." and events[-1].response.output_text == text


# ------------------------------------------------------------------ embeddings
def test_embeddings_shape_and_token_ids_equal_text(oc, fake_llm):
    r = oc.embeddings.create(model="m", input=["hello world", "bye"])
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) > 0
    ids = fake_llm.tokenizer.encode("hello world")
    r2 = oc.embeddings.create(model="m", input=[ids])
    assert r2.data[0].embedding == pytest.approx(r.data[0].embedding, abs=1e-6)
    assert r.usage.prompt_tokens == len(ids) + len(fake_llm.tokenizer.encode("bye"))


def test_embeddings_bad_input_is_400(fake_app):
    r = fake_app.post("/v1/embeddings", json={"input": []})
    assert r.status_code == 400 and "input" in r.json()["error"]["message"]


# ------------------------------------------------------------------ health and metrics
def test_health_and_metrics_count_requests(fake_app, oc, fake_replies):
    before = fake_app.get("/health").json()["stats"]["requests_total"]
    oc.chat.completions.create(model="m", messages=MSG, temperature=0, max_tokens=3)
    h = fake_app.get("/health").json()
    assert h["status"] == "ok" and h["backend"] == "fake" and h["stats"]["requests_total"] == before + 1
    m = fake_app.get("/metrics").text
    assert "swiftlm_requests_total" in m or "swiftlm_" in m
