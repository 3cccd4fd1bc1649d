"""The Ollama API (/api/...) on a real `swiftlm serve` of the bundled SmolLM2, driven by the official
`ollama` client: chat and generate (streamed and not; greedy text equal to /v1's), format, tool-call
history, embeddings, the model routes, pull / delete against the loopback stand-in for the Hugging
Face hub (test_hub.FakeHub), keep_alive, and 4xx for bad bodies.  One server for the module; few
tokens per request (CI machines have few cores).  The wire translation (tool calls out, messages in,
keep_alive) is also checked in-process, without a server."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import server_util
from server_util import ServerProc
from test_hub import COMMIT, FakeHub, _repo_files

ollama = pytest.importorskip("ollama")

MODEL = "smollm2-135m-instruct"
CTX = 320  # holds the tool-call history (233 tokens) and keeps the truncated embedding short
N = 3  # tokens per greedy generation
GREEDY = {"temperature": 0, "num_predict": N}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = FakeHub()
    h.repos["test-org/tiny-llama"] = {"files": _repo_files("llama")}
    h.repos["test-org/tiny-gguf"] = {
        "files": {"tiny-Q4_K_M.gguf": b"GGUF-q4" * 100, "tiny-Q8_0.gguf": b"GGUF-q8" * 100, "README.md": b"# x\n"}
    }
    home = tmp_path_factory.mktemp("hf")  # the server's own cache: deletes never touch the user's
    h.env = {"HF_ENDPOINT": h.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
    yield h
    h.close()


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    # ServerProc starts the server offline; this one may download (from the stand-in only)
    # one compute thread: with the cores shared by other processes, OpenMP's waiting threads make each
    # step several times slower
    extra = {**hub.env, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    # a models file: its one entry is loaded at start-up but not pinned, so keep_alive may unload it
    models = tmp_path_factory.mktemp("cfg") / "models.toml"
    models.write_text(f'[[models]]\nname = "{MODEL}"\nmodel = "{MODEL}"\n')
    real = subprocess.Popen

    def popen(*args, **kw):
        kw["env"] = {**kw["env"], **extra}
        return real(*args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_util.subprocess, "Popen", popen)
        s = ServerProc(
            "--models-file",
            str(models),
            "--max-tokens",
            "8",
            "--ctx-size",
            str(CTX),
            "--parallel",
            "2",
            "--strict-model-names",
        )
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base, timeout=300)


def v1_chat(server, messages, max_tokens=N, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def capital(server) -> dict:
    """/v1/chat/completions' greedy answer to QUESTION: the reference for the Ollama routes."""
    return v1_chat(server, QUESTION)


def check_timings(final) -> None:
    for k in DURATIONS:
        assert isinstance(final[k], int) and final[k] > 0, (k, final[k])
    assert final["total_duration"] >= final["load_duration"] + final["prompt_eval_duration"] + final["eval_duration"]


# ---------------------------------------------------------------- chat / generate
def test_chat_greedy_equals_openai_route_streamed_and_not(client, capital):
    want = capital["choices"][0]["message"]["content"]
    usage = capital["usage"]
    r = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=False)
    assert r.message.role == "assistant" and r.message.content == want
    assert r.done and r.done_reason == capital["choices"][0]["finish_reason"]
    assert r.eval_count == usage["completion_tokens"] and r.prompt_eval_count == usage["prompt_tokens"]
    check_timings(r)

    parts = list(client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == want
    final = parts[-1]
    assert final.message.content == "" and final.eval_count == usage["completion_tokens"]
    check_timings(final)


def test_generate_streamed_and_not(client, capital, server):
    want = capital["choices"][0]["message"]["content"]
    r = client.generate(model=MODEL, prompt=QUESTION[0]["content"], options=GREEDY)
    assert r.response == want  # the prompt as the user's message: the chat's answer
    assert len(r.context) == r.prompt_eval_count + r.eval_count
    check_timings(r)
    parts = list(client.generate(model=MODEL, prompt=QUESTION[0]["content"], options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == want and parts[-1].done
    check_timings(parts[-1])

    raw = "The capital of France is"
    r = client.generate(model=MODEL, prompt=raw, raw=True, options=GREEDY)
    comp = httpx.post(
        server.base + "/v1/completions",
        json={"model": MODEL, "prompt": raw, "temperature": 0, "max_tokens": N},
        timeout=300,
    ).json()
    assert r.response == comp["choices"][0]["text"] and r.context is None  # raw: no template, no context
    assert r.prompt_eval_count == comp["usage"]["prompt_tokens"]


def test_format_json_schema_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat(model=MODEL, messages=QUESTION, format=schema, options={"temperature": 0, "num_predict": 12})
    jsonschema.validate(json.loads(r.message.content), schema)
    assert r.eval_count <= 12 and r.done_reason in ("stop", "length")


def test_tool_call_history_round_trip(client, server):
    """assistant tool_calls (arguments as an object) -> tool message (tool_name) -> the answer, the
    same as /v1 gives for the same history in OpenAI's shape."""
    # keys in the order the ollama client sends them: the tools are written into the prompt as JSON
    params = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Get the weather in a city", "parameters": params},
        }
    ]
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    history = [
        ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 24 C"},
    ]
    r = client.chat(model=MODEL, messages=history, tools=tools, options=GREEDY)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    openai_history = [
        ask,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    v1 = v1_chat(server, openai_history, tools=tools)
    ref = v1["choices"][0]["message"]
    assert r.prompt_eval_count == v1["usage"]["prompt_tokens"] and r.message.content == (ref["content"] or "")
    want_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ref.get("tool_calls") or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls or []] == want_calls


# ---------------------------------------------------------------- embeddings
def test_embed_both_routes_match_v1(client, server):
    np = pytest.importorskip("numpy")
    texts = ["hello world", "the capital of France"]
    r = client.embed(model=MODEL, input=texts)
    ref = httpx.post(server.base + "/v1/embeddings", json={"model": MODEL, "input": texts}, timeout=120).json()
    assert len(r.embeddings) == 2
    for got, want in zip(r.embeddings, ref["data"]):
        np.testing.assert_allclose(got, want["embedding"], rtol=1e-6, atol=1e-7)
    assert r.prompt_eval_count == ref["usage"]["prompt_tokens"] and r.total_duration > 0
    old = client.embeddings(model=MODEL, prompt=texts[0])
    np.testing.assert_allclose(old.embedding, r.embeddings[0], rtol=1e-6, atol=1e-7)
    assert client.embeddings(model=MODEL, prompt="").embedding == []

    long = " ".join(["word"] * (CTX + 100))
    assert len(client.embed(model=MODEL, input=long).embeddings[0]) == len(r.embeddings[0])  # truncated
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input=long, truncate=False)
    assert e.value.status_code == 400 and "context" in e.value.error


# ---------------------------------------------------------------- models
def test_list_show_ps_version(client, server):
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {MODEL}
    m = listed[MODEL]
    assert m.size > 0 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "llama" and m.details.parameter_size.endswith("M")

    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and "vision" not in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == CTX
    assert shown.details.format == "gguf" and "{%" in shown.template  # the model's chat template
    assert f"num_ctx {CTX}".split() == shown.parameters.splitlines()[-1].split()

    running = client.ps().models
    assert [p.model for p in running] == [MODEL] and running[0].context_length == CTX and running[0].size > 0

    v = httpx.get(server.base + "/api/version", timeout=30).json()
    assert v["version"].count(".") == 2 and "swiftlm" in v

    for call in (lambda: client.show("nope"), lambda: client.chat(model="nope", messages=QUESTION, stream=False)):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and "nope" in e.value.error


def test_pull_and_delete(client, hub):
    snap = Path(hub.env["HF_HOME"]) / "hub" / "models--test-org--tiny-llama" / "snapshots" / COMMIT
    statuses = [p.status for p in client.pull("test-org/tiny-llama", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    for f, data in hub.repos["test-org/tiny-llama"]["files"].items():
        assert (snap / f).read_bytes() == data

    # a tag picks the GGUF files of one quantization, as Ollama's hf.co/ pulls
    assert client.pull("hf.co/test-org/tiny-gguf:Q4_K_M", stream=False).status == "success"
    gguf = Path(hub.env["HF_HOME"]) / "hub" / "models--test-org--tiny-gguf" / "snapshots" / COMMIT
    assert sorted(p.name for p in gguf.iterdir()) == ["tiny-Q4_K_M.gguf"]

    with pytest.raises(ollama.ResponseError) as e:
        client.pull("test-org/nope", stream=False)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError):  # streamed: the error is the last line
        list(client.pull("test-org/nope", stream=True))
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3", stream=False)
    assert e.value.status_code == 400 and "owner/name" in e.value.error

    assert client.delete("test-org/tiny-llama").status == "success"
    assert not snap.exists()
    for name, status in (("test-org/tiny-llama", 404), (MODEL, 400), ("test-org/tiny-gguf:Q4_K_M", 400)):
        with pytest.raises(ollama.ResponseError) as e:
            client.delete(name)
        assert e.value.status_code == status, name


# ---------------------------------------------------------------- bad bodies
BAD = [  # (route, body): each a 4xx with an Ollama error
    ("/api/chat", "[1, 2]"),
    ("/api/chat", '{"messages": "hi"}'),
    ("/api/chat", '{"messages": [5]}'),
    ("/api/chat", '{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x", "images": [5]}]}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "options": {"temperature": "hot"}}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "options": {"top_p": 9}}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "options": {"num_predict": 0}}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "options": {"num_ctx": 2}}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "options": {"repeat_last_n": -5}}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "options": {"stop": [""]}}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "format": "xml"}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "format": {"type": 5}}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "think": "max"}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "keep_alive": "soon"}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "keep_alive": true}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}'),
    ("/api/chat", '{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]}'),
    ("/api/chat", '{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}'),
    ("/api/chat", '{"model": 5, "messages": [{"role": "user", "content": "x"}]}'),
    ("/api/generate", '{"prompt": 5}'),
    ("/api/generate", '{"prompt": "x", "suffix": "y"}'),
    ("/api/generate", '{"prompt": "x", "template": "{{ .Prompt }}"}'),
    ("/api/generate", '{"prompt": "x", "context": [-1]}'),
    ("/api/generate", '{"prompt": "x", "context": ["a"]}'),
    ("/api/generate", '{"prompt": "x", "raw": true, "images": ["aGk="]}'),
    ("/api/generate", '{"prompt": "x", "options": {"temperature": NaN}}'),
    ("/api/generate", '{"prompt": "x", "top_logprobs": 99}'),
    ("/api/embed", "{}"),
    ("/api/embed", '{"input": 5}'),
    ("/api/embed", '{"input": []}'),
    ("/api/embed", '{"input": "x", "dimensions": 0}'),
    ("/api/embed", '{"input": "x", "dimensions": 100000}'),
    ("/api/embeddings", '{"prompt": ["x"]}'),
    ("/api/show", "{}"),
    ("/api/show", '{"model": 5}'),
    ("/api/pull", '{"model": "../../etc"}'),
    ("/api/pull", '{"model": "a/b:not a tag"}'),
    ("/api/pull", '{"model": "a/b", "stream": 1}'),
    ("/api/delete", '{"model": "../../x"}'),
    ("/api/delete", "{}"),
]


def test_bad_bodies_are_4xx_on_every_route(server):
    with httpx.Client(base_url=server.base, timeout=120) as c:
        for path, body in BAD:
            method = "DELETE" if path == "/api/delete" else "POST"
            r = c.request(method, path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text[:300])
            assert isinstance(r.json()["error"], str) and r.json()["error"], (path, body)
        for path in ("/api/chat", "/api/generate", "/api/embed", "/api/show"):
            r = c.post(path, json={"model": "nope", "messages": QUESTION, "prompt": "x", "input": "x"})
            assert r.status_code == 404 and "nope" in r.json()["error"], (path, r.text)
        assert c.get("/api/tags").status_code == 200  # the connection still serves


# ---------------------------------------------------------------- keep_alive (last: it unloads the model)
def test_keep_alive_zero_unloads(client):
    assert [p.model for p in client.ps().models] == [MODEL]
    r = client.generate(model=MODEL, prompt="", keep_alive=0)
    assert r.done and r.done_reason == "unload"
    assert client.ps().models == []
    assert [m.model for m in client.list().models] == [MODEL]  # still served: loads on the next request


# ---------------------------------------------------------------- in-process: the wire translation
def test_keep_alive_values():
    from swiftlm.server.errors import APIError
    from swiftlm.server.ollama_schemas import keep_alive_seconds

    cases = {None: None, 0: 0.0, "0": 0.0, 30: 30.0, "30": 30.0, "5m": 300.0, "1h30m": 5400.0, "1.5s": 1.5}
    cases.update({"250ms": 0.25, -1: -1.0, "-1": -1.0, "-5m": -1.0, 1e300: -1.0})
    for value, want in cases.items():
        assert keep_alive_seconds(value) == want, value
    for value in ("soon", "5 m", "m", "5x", "", True):
        with pytest.raises(APIError):
            keep_alive_seconds(value)


def test_request_translation():
    from swiftlm.server.errors import APIError
    from swiftlm.server.ollama_schemas import chat_messages, response_format, thinking

    assert response_format("json") == {"type": "json_object"} and response_format("") is None
    assert response_format({"type": "object"}) == {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    assert thinking(True) == (True, {}) and thinking("high") == (True, {"reasoning_effort": "high"})
    for bad in (lambda: response_format("xml"), lambda: thinking("max")):
        with pytest.raises(APIError):
            bad()

    out = chat_messages(
        [
            {"role": "user", "content": "look", "images": ["aGk="]},
            {
                "role": "assistant",
                "content": "",
                "thinking": "hmm",
                "tool_calls": [
                    {"function": {"name": "a", "arguments": {"x": 1}}},
                    {"function": {"name": "b", "arguments": {}}},
                ],
            },
            {"role": "tool", "tool_name": "b", "content": "B"},
            {"role": "tool", "content": "A"},
        ]
    )
    assert out[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/*;base64,aGk="}},
        {"type": "text", "text": "look"},
    ]
    ids = [c["id"] for c in out[1]["tool_calls"]]
    assert out[1]["reasoning_content"] == "hmm" and out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert [out[2]["tool_call_id"], out[3]["tool_call_id"]] == [ids[1], ids[0]]  # by tool_name, then in order
    assert "tool_name" not in out[2] and "images" not in out[0]


def test_streamed_tool_calls_and_thinking_in_ollama_shape():
    """The chat path's parsed pieces -> Ollama lines (streamed) and the merged message (not)."""
    from swiftlm.chat.tool_calls import ToolCall
    from swiftlm.outputs import Event
    from swiftlm.server.chat_core import Step
    from swiftlm.server.ollama import OllamaRoutes, collect

    calls = [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("now", "{}")]

    class Run:
        parsers = [SimpleNamespace(calls=calls)]
        completion_tokens, output_ids = 7, [[1, 2, 3, 4, 5, 6, 7]]

        async def steps(self):
            yield Step(0, Event(0, "x", [1]), [("reasoning", "let me see")])
            yield Step(0, Event(0, "x", [2, 3]), [("content", "Checking.")])
            yield Step(0, Event(0, "x", [4, 5, 6]), [("tool_call", calls[0]), ("tool_call", calls[1])])
            yield Step(0, Event(0, "", [7], finished=True, finish_reason="stop"), [], "tool_calls")

    routes = OllamaRoutes(SimpleNamespace(settings=None, models=None, metrics=None), chat=None)
    job = SimpleNamespace(prompt=[9, 9])

    async def lines():
        return [x async for x in routes._lines(Run(), job, "chat", "m", (1, 1, 1), False, False)]

    got = asyncio.run(lines())
    assert got[0]["message"] == {"role": "assistant", "content": "", "thinking": "let me see"}
    assert got[2]["message"]["tool_calls"] == [
        {"id": calls[0].id, "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert got[3]["message"]["tool_calls"][0]["function"] == {"index": 1, "name": "now", "arguments": {}}
    final = got[-1]
    assert final["done"] and final["done_reason"] == "stop" and final["eval_count"] == 7
    assert final["prompt_eval_count"] == 2 and all(not x["done"] for x in got[:-1])

    async def merged():
        return await collect(routes._lines(Run(), job, "chat", "m", (1, 1, 1), False, False), "chat")

    msg = asyncio.run(merged())["message"]
    assert msg["content"] == "Checking." and msg["thinking"] == "let me see"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "now"]


def test_keep_alive_timer_unloads_an_idle_model_and_respects_pins():
    from swiftlm.server.errors import APIError
    from swiftlm.server.models import CURRENT
    from swiftlm.server.ollama_models import NEVER, KeepAlive

    unloaded = []

    class Manager:
        ttl = 0

        async def unload(self, e, reason=""):
            e.state = "unloaded"
            unloaded.append(e.name)

    def entry(name, pin=False):
        return SimpleNamespace(name=name, pin=pin, state="loaded", in_flight=0, last_used=0.0)

    async def scenario():
        import time

        keep = KeepAlive(SimpleNamespace(models=Manager()))
        a, b, c = entry("a"), entry("b", pin=True), entry("c")
        for e, seconds in ((a, 0.1), (b, 0.1), (c, -1.0)):
            e.last_used = time.monotonic()
            CURRENT.set(e)
            keep.apply(seconds)
        assert c.pin and keep.expires_at(c) == NEVER and keep.expires_at(b) == NEVER
        await asyncio.sleep(0.4)
        assert unloaded == ["a"]  # b: pinned by the configuration; c: kept by keep_alive -1
        CURRENT.set(c)
        keep.apply(None)  # a later request without keep_alive: the server's policy again
        assert not c.pin
        with pytest.raises(APIError) as e:
            await keep.unload(b)  # an explicit unload: a configured pin wins
        assert e.value.status == 409 and b.state == "loaded"
        c.in_flight = 1
        await keep.unload(c)  # once its request is done
        await asyncio.sleep(0.1)
        assert unloaded == ["a"]
        c.in_flight = 0
        await asyncio.sleep(0.2)
        assert unloaded == ["a", "c"]

    asyncio.run(scenario())
