"""The real server on loopback, driven by the official openai SDK, raw HTTP and schemathesis.

Mechanics run on a tiny random checkpoint (fast, deterministic in fp32); a few checks use
the bundled SmolLM2 for real answers."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest
from conftest import BACKENDS, needs_torch
from server_util import ServerProc

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


# The shared server: the tiny checkpoint on every backend, and the bundled SmolLM2 on torch
# (on MLX's CPU backend a real 135M model is too slow per prompt token for a suite of this size;
# MLX's real-model behaviour is covered in test_engine_api / test_cli_convert).
TARGETS = [
    pytest.param(("mlx", "tiny"), marks=BACKENDS[0].marks, id="mlx-tiny"),
    pytest.param(("torch", "tiny"), marks=BACKENDS[1].marks, id="torch-tiny"),
    pytest.param(("torch", "bundled"), marks=BACKENDS[1].marks, id="torch-smollm2"),
]


@pytest.fixture(scope="module", params=TARGETS)
def tiny_server(request, tiny_llama):
    backend, model = request.param
    s = ServerProc(
        "--model",
        str(tiny_llama) if model == "tiny" else "smollm2-135m-instruct",
        "--backend",
        backend,
        "--parallel",
        "4",
        "--max-tokens",
        "32",
    )
    s.backend = backend
    yield s
    assert s.stop() == 0, s.stderr_tail()  # SIGTERM stops cleanly


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama):
    from swiftlm.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(tiny_llama)


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


def test_ready_line_and_models(tiny_server, client):
    assert tiny_server.ready["event"] == "ready" and tiny_server.ready["port"] == tiny_server.port
    assert tiny_server.ready["backend"] == tiny_server.backend
    assert [m.id for m in client.models.list().data] == [tiny_server.ready["model"]]


def test_chat_usage_counts_rendered_prompt_tokens(client, tiny_tok):
    r = client.chat.completions.create(model="x", messages=MSGS, max_tokens=5, temperature=0)
    rendered = tiny_tok.apply_chat_template(MSGS, add_generation_prompt=True, enable_thinking=False)
    assert r.usage.prompt_tokens == len(tiny_tok.encode(rendered))
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.choices[0].message.role == "assistant"


def test_stream_matches_non_stream_and_reports_usage(client):
    kw = dict(model="x", messages=MSGS, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1
    roles = [c.choices[0].delta.role for c in chunks if c.choices]
    assert roles[0] == "assistant" and not any(roles[1:])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_max_completion_tokens_and_length(client):
    r = client.chat.completions.create(model="x", messages=MSGS, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3
    if r.usage.completion_tokens == 3:
        assert r.choices[0].finish_reason == "length"


def test_n_and_seed(client):
    kw = dict(model="x", messages=MSGS, max_tokens=8, temperature=2.0, seed=7, n=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # seed + index per choice
    s = list(client.chat.completions.create(stream=True, **kw))
    streamed = [
        "".join(c.choices[0].delta.content or "" for c in s if c.choices and c.choices[0].index == i) for i in range(3)
    ]
    assert streamed == [c.message.content for c in a.choices]


def test_stop_string(client):
    base = client.completions.create(model="x", prompt="Once upon a time", max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(
        model="x", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.token == item.top_logprobs[0].token  # greedy
    s = list(
        client.chat.completions.create(
            model="x", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    streamed = [i.logprob for c in s if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([i.logprob for i in content])
    c = client.completions.create(model="x", prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert "".join(lp.tokens) == c.choices[0].text


def test_completions_stream_echo_and_prompt_list(client):
    full = client.completions.create(model="x", prompt="Hello there", max_tokens=6, temperature=0)
    s = list(client.completions.create(model="x", prompt="Hello there", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == full.choices[0].text
    e = client.completions.create(model="x", prompt="Hello there", max_tokens=6, temperature=0, echo=True)
    assert e.choices[0].text == "Hello there" + full.choices[0].text
    two = client.completions.create(model="x", prompt=["Hello there", "abc"], max_tokens=6, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == full.choices[0].text


def test_raw_sse_framing(tiny_server):
    body = {
        "messages": MSGS,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", tiny_server.base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert "\r" not in raw and "event:" not in raw
    lines = [ln for ln in raw.split("\n") if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    ids = set()
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        obj = json.loads(ln[len("data: ") :])
        ids.add(obj["id"])
    assert len(ids) == 1
    assert raw.endswith("data: [DONE]\n\n") and "\n\n\n" not in raw


def test_prefill_progress_frames_on_request(tiny_server):
    body = {"prompt": "word " * 800, "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST",
        tiny_server.base + "/v1/completions",
        json=body,
        timeout=120,
        headers={"X-SwiftLM-Prefill-Progress": "1"},
    ) as r:
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f.startswith("event: prefill_progress")]
    assert frames, "expected at least one progress frame"
    data = json.loads(frames[0].split("data: ", 1)[1])
    assert set(data) == {"n_past", "n_prompt_tokens", "fraction", "elapsed_seconds"}
    assert 0 < data["fraction"] < 1 and data["n_prompt_tokens"] >= 800
    with httpx.stream("POST", tiny_server.base + "/v1/completions", json=body, timeout=120) as r:
        assert "prefill_progress" not in r.read().decode()


def _health(server):
    return httpx.get(server.base + "/health", timeout=10).json()


@pytest.mark.parametrize("extra", [{"turbo_kv": "k4v3"}, {"turbo_kv": "k3qjl-v3"}, {"kv_bits": 4}, {"kv_bits": 8}])
def test_compressed_kv_formats_per_request(tiny_server, client, extra):
    """Each KV format answers through the SDK (plumbing: the tiny random model's text is not
    meaningful); /health reports the KV bytes held and the compression ratio."""
    r = client.chat.completions.create(model="x", messages=MSGS, max_tokens=8, temperature=0, extra_body=extra)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    kv = _health(tiny_server)["stats"]["kv_cache"]
    assert set(kv) == {"default_format", "bytes", "fp16_bytes", "compression_ratio"}
    assert kv["default_format"] == "fp16"


def test_disconnect_cancels_generation(tiny_server):
    body = {"messages": MSGS, "max_tokens": 3000, "temperature": 0, "stream": True}
    before = _health(tiny_server)["stats"]["tokens_generated"]
    with httpx.stream("POST", tiny_server.base + "/v1/chat/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        got = 0
        for line in it:
            if line.startswith("data: "):
                got += 1
            if got == 2:
                break
    # the connection is closed here
    for _ in range(100):
        h = _health(tiny_server)
        if h["stats"]["requests_active"] == 0:
            break
        time.sleep(0.1)
    assert h["stats"]["requests_active"] == 0
    stopped_at = h["stats"]["tokens_generated"]
    time.sleep(1.0)
    assert _health(tiny_server)["stats"]["tokens_generated"] == stopped_at  # no longer decoding it
    assert stopped_at - before < 3000


def test_health_and_metrics(tiny_server):
    # a server started without --cors sends no CORS headers (test_auth_cors_and_loading has the one with --cors)
    r = httpx.get(tiny_server.base + "/health", headers={"Origin": "http://example.test"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    h = _health(tiny_server)
    assert h["status"] == "ok" and h["backend"] == tiny_server.backend
    assert {"active", "peak", "cache", "total_system"} <= set(h["memory"]) and h["memory"]["total_system"] > 0
    assert {"requests_total", "requests_active", "tokens_generated", "avg_tokens_per_sec"} <= set(h["stats"])
    m = httpx.get(tiny_server.base + "/metrics", timeout=10).text
    for name in (
        "swiftlm_requests_total",
        "swiftlm_generation_tokens_total",
        "swiftlm_requests_active",
        "swiftlm_memory_bytes",
        "swiftlm_uptime_seconds",
        "swiftlm_time_to_first_token_seconds_bucket",
        "swiftlm_inter_token_latency_seconds_bucket",
        "swiftlm_avg_tokens_per_second",
    ):
        assert name in m


BAD = [
    ("malformed json", b'{"messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("non-utf8 body", b'{"messages": "\xff\xfe"}', 400, None),
    ("wrong type", {"messages": MSGS, "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong type temperature", {"messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("missing messages", {"model": "x"}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("bad content", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("negative max_tokens", {"messages": MSGS, "max_tokens": -1}, 400, "max_tokens"),
    ("huge max_tokens", {"messages": MSGS, "max_tokens": 10_000_000}, 400, "max_tokens"),
    ("temperature out of range", {"messages": MSGS, "temperature": 5}, 400, "temperature"),
    ("top_logprobs without logprobs", {"messages": MSGS, "top_logprobs": 3}, 400, "top_logprobs"),
    ("bad logit_bias", {"messages": MSGS, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("n too large", {"messages": MSGS, "n": 100}, 400, "n"),
    ("kv_bits not 4 or 8", {"messages": MSGS, "kv_bits": 3}, 400, "kv_bits"),
    ("kv_bits wrong type", {"messages": MSGS, "kv_bits": "four"}, 400, "kv_bits"),
    ("kv_group_size", {"messages": MSGS, "kv_bits": 4, "kv_group_size": 48}, 400, "kv_group_size"),
    ("unknown turbo_kv preset", {"messages": MSGS, "turbo_kv": "k9v9"}, 400, "turbo_kv"),
    ("turbo_kv and kv_bits", {"messages": MSGS, "turbo_kv": "k4v3", "kv_bits": 8}, 400, "kv_bits"),
    (
        "image to a text model",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ]
        },
        400,
        "messages[0].content[0]",
    ),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_catalogue(tiny_server, name, body, status, param):
    url = tiny_server.base + "/v1/chat/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param, err


def test_oversized_body_and_unknown_route(tiny_server):
    r = httpx.post(tiny_server.base + "/v1/chat/completions", content=b"x" * (9 * 1024 * 1024), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(tiny_server.base + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(tiny_server.base + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_unknown_fields_are_ignored(client):
    r = client.chat.completions.create(model="x", messages=MSGS, max_tokens=2, extra_body={"frobnicate": True})
    assert r.choices


@needs_torch
def test_auth_cors_and_loading(tiny_llama):
    """API key and CORS are the HTTP layer's, the same over every backend: one backend runs it."""
    backend = "torch"
    s = ServerProc(
        "--model", str(tiny_llama), "--backend", backend, "--api-key", "sekret", "--cors", "http://example.test"
    )
    try:
        url = s.base + "/v1/chat/completions"
        body = {"messages": MSGS, "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        ok = openai.OpenAI(base_url=s.base + "/v1", api_key="sekret", max_retries=0)
        assert ok.models.list().data
        assert httpx.get(s.base + "/health").status_code == 200  # always open
        assert httpx.get(s.base + "/metrics").status_code == 200  # open by default (documented)
        pre = httpx.options(
            url,
            headers={
                "Origin": "http://example.test",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://example.test"
    finally:
        s.stop()
    # without --cors, no CORS headers: test_health_and_metrics, on the shared servers


def test_health_is_503_while_loading(tiny_llama, backend):
    import os
    import subprocess as sp
    import sys

    from conftest import ROOT
    from server_util import free_port

    port = free_port()
    p = sp.Popen(
        [
            sys.executable,
            "-m",
            "swiftlm.cli",
            "serve",
            "--model",
            str(tiny_llama),
            "--backend",
            backend,
            "--port",
            str(port),
        ],
        stdout=sp.PIPE,
        stderr=sp.PIPE,
        cwd=ROOT,
        env=dict(os.environ),
    )
    seen = []
    try:
        for _ in range(600):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                seen.append((r.status_code, r.json()["status"]))
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        p.terminate()
        p.wait(20)
    assert seen and seen[-1] == (200, "ok")
    assert (503, "loading") in seen  # the port opens before the weights are loaded


# Examples per API operation: the suite's short run; scripts/fuzz.sh runs the long one (SWIFTLM_FUZZ_EXAMPLES=200).
FUZZ_EXAMPLES = int(os.environ.get("SWIFTLM_FUZZ_EXAMPLES", "10"))


def test_schemathesis_no_5xx(tiny_llama, tmp_path, backend):
    import sys

    s = ServerProc(
        "--model", str(tiny_llama), "--backend", backend, "--ctx-size", "96", "--max-tokens", "8", "--parallel", "4"
    )
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                s.base + "/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                str(FUZZ_EXAMPLES),
                "--phases",
                "examples,coverage,fuzzing",
                "--workers",
                "2",
                "--request-timeout",
                "60",
                "--suppress-health-check",
                "all",
                "--report",
                "junit",
                "--report-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        junit = next(tmp_path.glob("*.xml")).read_text()
        import re

        total = sum(int(x) for x in re.findall(r'tests="(\d+)"', junit)[:1])
        calls = httpx.get(s.base + "/metrics").text
        n_req = sum(float(v) for v in re.findall(r"^swiftlm_requests_total\{[^}]*\} (\S+)", calls, re.M))
        n_err = sum(float(v) for v in re.findall(r"^swiftlm_request_errors_total\{[^}]*\} (\S+)", calls, re.M))
        want = 4 * FUZZ_EXAMPLES  # the API's operations times the examples each, with margin for deduplication
        assert n_req + n_err >= want, f"only {n_req + n_err} requests reached the API ({total} test cases)"
        # samples only (line start): HELP text may name the label too
        assert "500" not in re.findall(r'^swiftlm_request_errors_total\{status="(\d+)"\}', calls, re.M)
        assert s.proc.poll() is None  # still alive
    finally:
        s.stop()


def test_response_format_json_object_and_bad_schema(client, tiny_server):
    r = client.chat.completions.create(
        model="x", messages=MSGS, max_tokens=64, temperature=0.5, seed=3, response_format={"type": "json_object"}
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    bad = httpx.post(
        tiny_server.base + "/v1/chat/completions",
        timeout=30,
        json={
            "messages": MSGS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_queue_full_is_429(tiny_llama, backend):
    """Queue full is a 429 (``queue_full``, with Retry-After), the others are served, and the server exits 0 after.
    (test_shutdown.py had the same test on torch with its own server: merged here.)"""
    import concurrent.futures as cf

    s = ServerProc("--model", str(tiny_llama), "--backend", backend, "--parallel", "1", "--max-queue", "1")
    try:
        # long enough that the first request still runs and the second still waits when the other four arrive (sent
        # at once, they arrive within milliseconds; 200 tokens of the tiny model are ~0.6 s of decoding on torch and
        # ~1.5 s on MLX on the 2-core machine), short enough that waiting out two of them costs little
        body = {"messages": MSGS, "max_tokens": 200, "temperature": 0}
        with cf.ThreadPoolExecutor(6) as ex:
            codes = list(
                ex.map(lambda _: httpx.post(s.base + "/v1/chat/completions", json=body, timeout=300), range(6))
            )
        statuses = sorted(r.status_code for r in codes)
        assert 429 in statuses and 200 in statuses, statuses
        r429 = next(r for r in codes if r.status_code == 429)
        assert r429.json()["error"]["type"] == "rate_limit_error"
        assert r429.json()["error"]["code"] == "queue_full"
        assert all(r.headers.get("retry-after") == "1" for r in codes if r.status_code == 429)
        assert set(statuses) <= {200, 429}
    finally:
        assert s.stop() == 0, s.stderr_tail()
