"""A catalogue of hostile and odd inputs (the classes the fuzzer misses): each is a 4xx in the
route's error shape naming the problem, and the same keep-alive connection then serves a good
request."""

from __future__ import annotations

import json

import httpx
import pytest
from server_util import ServerProc

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def raw(s: str) -> dict:
    return {"content": s, "headers": {"content-type": "application/json"}}


CASES = [  # (id, path, request kwargs, status, words in the message)
    ("deep-list", CHAT, raw('{"messages": ' + "[" * 100000 + "]" * 100000 + "}"), 400, "nested"),
    ("deep-object", CHAT, raw('{"x": ' + '{"a":' * 5000 + "1" + "}" * 5000 + ', "messages": []}'), 400, "nested"),
    (
        "depth-over-limit",
        CHAT,
        raw('{"x": ' + "[" * 80 + "]" * 80 + ', "messages": [{"role":"user","content":"hi"}]}'),
        400,
        "deeper than 64",
    ),
    ("nan", CHAT, raw('{"messages": [{"role":"user","content":"hi"}], "temperature": NaN}'), 400, "NaN"),
    ("infinity", CHAT, raw('{"messages": [{"role":"user","content":"hi"}], "top_p": -Infinity}'), 400, "Infinity"),
    (
        "huge-float",
        CHAT,
        raw('{"messages": [{"role":"user","content":"hi"}], "logit_bias": {"5": 1e400}}'),
        400,
        "finite",
    ),
    (
        "duplicate-keys",
        CHAT,
        raw('{"messages": [{"role":"user","content":"hi"}], "max_tokens": 2, "max_tokens": 3}'),
        400,
        "twice",
    ),
    ("lone-surrogate", CHAT, raw('{"messages": [{"role":"user","content":"\\ud800"}]}'), 400, "surrogate"),
    (
        "not-utf8",
        CHAT,
        {"content": b'{"messages": "\xff\xfe"}', "headers": {"content-type": "application/json"}},
        400,
        "UTF-8",
    ),
    (
        "wrong-content-type",
        CHAT,
        {"content": json.dumps({"messages": MSG}), "headers": {"content-type": "text/plain"}},
        415,
        "Content-Type",
    ),
    ("too-many-messages", CHAT, {"json": {"messages": MSG * 10000}}, 400, "8192"),
    (
        "template-kwargs-shadow",
        CHAT,
        {"json": {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": 1}}},
        400,
        "add_generation_prompt",
    ),
    (
        "template-kwargs-messages",
        CHAT,
        {"json": {"messages": MSG, "chat_template_kwargs": {"messages": []}}},
        400,
        "messages",
    ),
    (
        "too-many-tools",
        CHAT,
        {"json": {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}] * 200}},
        400,
        "tools",
    ),
    ("n-huge", CHAT, {"json": {"messages": MSG, "n": 10**9}}, 400, "'n'"),
    (
        "top-logprobs-huge",
        CHAT,
        {"json": {"messages": MSG, "logprobs": True, "top_logprobs": 10**6}},
        400,
        "top_logprobs",
    ),
    ("bias-out-of-vocab", CHAT, {"json": {"messages": MSG, "logit_bias": {"999999999": 5}}}, 400, "token id"),
    ("bias-negative-id", CHAT, {"json": {"messages": MSG, "logit_bias": {"-3": 5}}}, 400, "token id"),
    ("max-tokens-huge", CHAT, {"json": {"messages": MSG, "max_tokens": 10**12}}, 400, "context"),
    ("max-tokens-negative", CHAT, {"json": {"messages": MSG, "max_tokens": -1}}, 400, "max_tokens"),
    ("stop-list-long", CHAT, {"json": {"messages": MSG, "stop": ["a"] * 1000}}, 400, "stop"),
    ("prompt-ids-out-of-vocab", "/v1/completions", {"json": {"prompt": [10**12], "max_tokens": 2}}, 400, "vocabulary"),
    ("embedding-too-long", "/v1/embeddings", {"json": {"input": [[5] * 5000]}}, 400, "context"),
    (
        "responses-bad-part",
        "/v1/responses",
        {"json": {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}]}},
        400,
        "string",
    ),
    # the Ollama API (/api/...): the same checks, errors as {"error": "..."}
    ("ollama-deep-list", "/api/chat", raw('{"messages": ' + "[" * 100000 + "]" * 100000 + "}"), 400, "nested"),
    ("ollama-nan", "/api/generate", raw('{"prompt": "hi", "options": {"temperature": NaN}}'), 400, "NaN"),
    ("ollama-duplicate-keys", "/api/embed", raw('{"input": "a", "input": "b"}'), 400, "twice"),
    (
        "ollama-lone-surrogate",
        "/api/chat",
        raw('{"messages": [{"role":"user","content":"\\ud800"}]}'),
        400,
        "surrogate",
    ),
    (
        "ollama-not-utf8",
        "/api/generate",
        {"content": b'{"prompt": "\xff\xfe"}', "headers": {"content-type": "application/json"}},
        400,
        "UTF-8",
    ),
    (
        "ollama-wrong-content-type",
        "/api/chat",
        {"content": json.dumps({"messages": MSG}), "headers": {"content-type": "text/plain"}},
        415,
        "Content-Type",
    ),
    ("ollama-too-many-messages", "/api/chat", {"json": {"messages": MSG * 10000}}, 400, "8192"),
    (
        "ollama-num-predict-zero",
        "/api/chat",
        {"json": {"messages": MSG, "options": {"num_predict": 0}}},
        400,
        "num_predict",
    ),
    (
        "ollama-temperature-range",
        "/api/generate",
        {"json": {"prompt": "hi", "options": {"temperature": 9}}},
        400,
        "options.temperature",
    ),
    ("ollama-option-type", "/api/chat", {"json": {"messages": MSG, "options": {"top_k": "all"}}}, 400, "options.top_k"),
    ("ollama-num-ctx-small", "/api/chat", {"json": {"messages": MSG, "options": {"num_ctx": 1}}}, 400, "num_ctx"),
    ("ollama-format", "/api/chat", {"json": {"messages": MSG, "format": "yaml"}}, 400, "format"),
    ("ollama-format-schema", "/api/chat", {"json": {"messages": MSG, "format": {"type": 5}}}, 400, "format"),
    (
        "ollama-images-text-model",
        "/api/chat",
        {"json": {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}},
        400,
        "image",
    ),
    (
        "ollama-image-not-a-path",
        "/api/generate",
        {"json": {"prompt": "hi", "images": ["/etc/passwd"]}},
        400,
        "image",
    ),
    (
        "ollama-tool-arguments",
        "/api/chat",
        {"json": {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}]}},
        400,
        "arguments",
    ),
    ("ollama-keep-alive", "/api/generate", {"json": {"prompt": "hi", "keep_alive": "soon"}}, 400, "keep_alive"),
    ("ollama-think", "/api/chat", {"json": {"messages": MSG, "think": "max"}}, 400, "think"),
    ("ollama-context-vocab", "/api/generate", {"json": {"prompt": "hi", "context": [10**12]}}, 400, "vocabulary"),
    ("ollama-template", "/api/generate", {"json": {"prompt": "hi", "template": "{{ .Prompt }}"}}, 400, "template"),
    ("ollama-embed-empty", "/api/embed", {"json": {"input": []}}, 400, "empty"),
    ("ollama-embed-too-long", "/api/embed", {"json": {"input": "a " * 5000, "truncate": False}}, 400, "context"),
    ("ollama-show-no-model", "/api/show", {"json": {}}, 400, "model"),
    ("ollama-pull-not-a-repo", "/api/pull", {"json": {"model": "../../etc/passwd"}}, 400, "repo id"),
    (
        "ollama-delete-bundled",
        "/api/delete",
        {"method": "DELETE", "json": {"model": "smollm2-135m-instruct"}},
        400,
        "bundled",
    ),
    ("ollama-unload-pinned", "/api/generate", {"json": {"keep_alive": 0}}, 409, "pinned"),
    (
        "ollama-delete-unknown",
        "/api/delete",
        {"method": "DELETE", "json": {"model": "no/such-model"}},
        404,
        "not found",
    ),
]


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = ServerProc(
        "--model", str(tiny_llama), "--backend", "torch", "--parallel", "2", "--max-tokens", "4", "--ctx-size", "1024"
    )
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_a_clear_4xx_and_the_connection_still_serves(server, case):
    _, path, kw, status, words = case
    with httpx.Client(base_url=server.base, timeout=120) as c:  # one keep-alive connection
        r = c.request(kw.get("method", "POST"), path, **{k: v for k, v in kw.items() if k != "method"})
        assert r.status_code == status, r.text[:300]
        err = r.json()["error"]
        assert words in (err if isinstance(err, str) else err["message"]), err  # Ollama's error is a string
        ok = c.post(CHAT, json={"messages": MSG, "max_tokens": 2})
        assert ok.status_code == 200


def test_anthropic_route_keeps_its_error_shape(server):
    r = httpx.post(
        server.base + "/v1/messages",
        timeout=60,
        headers={"content-type": "application/json"},
        content='{"model": "x", "max_tokens": 5, "messages": [{"role":"user","content":"hi"}], "a": NaN}',
    )
    assert r.status_code == 400
    body = r.json()
    assert (
        body["type"] == "error"
        and body["error"]["type"] == "invalid_request_error"
        and "NaN" in body["error"]["message"]
    )


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, {"messages": MSG, "max_tokens": 2, "top_k": 9999999999999999999}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "top_k": 9999999999999999999}),
        ("/api/chat", {"messages": MSG, "stream": False, "options": {"num_predict": 2, "top_k": 9999999999999999999}}),
    ],
)
def test_top_k_past_the_vocabulary_means_no_top_k(server, path, body):
    """A top_k of every token (or more than int64 holds: schemathesis found a 500) samples from
    the whole vocabulary, as top_k 0 does."""
    r = httpx.post(server.base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
