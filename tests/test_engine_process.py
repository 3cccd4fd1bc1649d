"""--engine-process on: the model and the step loop in a child process behind ``EngineClient``.

Exact equalities against the in-thread engine (greedy tokens of concurrent requests, seeded
sampled tokens: the child runs the same Engine on the same backend, so the math is identical);
cancellation frees the slot; the child killed ends open streams with an error, marks the
engine fatal and makes ``swiftlm serve`` exit 1; SIGTERM leaves no process behind; /health and
/metrics keep every field the in-thread engine gives them."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from conftest import needs_torch
from server_util import ServerProc

pytestmark = needs_torch

PROMPTS = ["The capital of France is", "Once upon a time there was", "def fibonacci(n):", "List three primary colors:"]


def _llm(model=None, **kw):
    """On the CPU in fp32 on any machine: these tests compare the child-process engine with the thread engine
    token for token, which bf16 on a GPU does not promise (which rows share a forward depends on timing)."""
    from swiftlm import LLM

    kw.setdefault("device", "cpu")
    return LLM(model, backend="torch", **kw)


@pytest.fixture(scope="module")
def pair():
    """The bundled SmolLM2 (real weights), in a child process and on a thread: 4 slots each."""
    on = _llm(engine_process="on", parallel=4, max_queue=8)
    off = _llm(engine_process="off", parallel=4)
    yield on, off
    on.close()
    off.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_kinds_and_settings(pair):
    from swiftlm.engine import Engine
    from swiftlm.engine_process import EngineClient

    on, off = pair
    assert isinstance(on.engine, EngineClient) and isinstance(off.engine, Engine)
    assert on.engine.child_pid != os.getpid() and _alive(on.engine.child_pid)
    assert on.engine.info.vocab_size == off.engine.info.vocab_size and on.engine.ctx_size == off.engine.ctx_size


def test_greedy_concurrent_equal_to_thread_engine(pair):
    from swiftlm import SamplingParams

    on, off = pair
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    a, b = on.generate(PROMPTS, p), off.generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in a)


def test_seeded_sampling_and_logprobs_equal(pair):
    from swiftlm import SamplingParams

    on, off = pair
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, logprobs=True, top_logprobs=2)
    a, b = on.generate(PROMPTS[:2], p), off.generate(PROMPTS[:2], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):  # logprobs: which rows share a forward depends on arrival timing, and fp32
        # matmuls of another batch shape round differently (~1e-6); the sampled tokens do not depend on it
        lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert [(t.token, t.text, [i for i, _, _ in t.top]) for t in lx] == [
            (t.token, t.text, [i for i, _, _ in t.top]) for t in ly
        ]
        assert all(abs(s.logprob - t.logprob) < 1e-4 for s, t in zip(lx, ly))


def test_stop_strings_and_chat(pair):
    from swiftlm import SamplingParams

    on, off = pair
    msgs = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    p = SamplingParams(max_tokens=40, temperature=0, stop=[", 5"])
    a, b = on.chat(msgs, p), off.chat(msgs, p)
    assert a.text == b.text and a.finish_reason == b.finish_reason
    time.sleep(0.3)  # the child drops the sequence when the parent's stop message arrives
    assert on.engine.live_requests == 0


def test_grammar_in_the_child(pair):
    import json

    from swiftlm import SamplingParams
    from swiftlm.chat.structured import grammar_for
    from swiftlm.errors import InvalidRequest

    on, off = pair
    g = grammar_for(
        {
            "type": "json_schema",
            "json_schema": {
                "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
            },
        }
    )
    p = SamplingParams(max_tokens=40, temperature=0, grammar=g)
    msgs = [{"role": "user", "content": "Name a city in France as JSON."}]
    a, b = on.chat(msgs, p), off.chat(msgs, p)
    assert a.token_ids == b.token_ids and "city" in json.loads(a.text)
    with pytest.raises(InvalidRequest):
        on.engine.submit([1, 2, 3], SamplingParams(max_tokens=4, grammar="start: nonsense("), lambda ev: None)


def test_embeddings_equal(pair):
    import numpy as np

    on, off = pair
    ids = [on.engine.text_prompt("hello world"), on.engine.text_prompt("the sea")]
    a = on.engine.embed(ids).result(60)
    b = off.engine.embed(ids).result(60)
    assert len(a) == 2 and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_cancel_frees_the_slot(pair):
    from swiftlm import SamplingParams

    on, _ = pair
    eng = on.engine
    p = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    gens = [on.stream(q, p) for q in PROMPTS]  # 4 slots, all taken
    for g in gens:
        next(g)
    assert eng.live_requests == 4
    before = eng.stats.finished.get("cancelled", 0)
    for g in gens:
        g.close()  # the caller stopped iterating: cancel
    deadline = time.time() + 20
    while eng.live_requests and time.time() < deadline:
        time.sleep(0.05)
    assert eng.live_requests == 0
    out = on.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4  # a slot was free
    deadline = time.time() + 5
    while eng.stats.finished.get("cancelled", 0) < before + 4 and time.time() < deadline:
        time.sleep(0.05)
    assert eng.stats.finished.get("cancelled", 0) == before + 4
    assert eng.stats.requests_active == 0 and len(eng.scheduler.running) == 0


def test_health_and_metrics_fields_match_thread_engine(pair):
    """The same app around each engine: every /health key and every /metrics family of the
    in-thread engine is there with the engine process (plus the child's RSS)."""
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from swiftlm import SamplingParams
    from swiftlm.server.app import create_app

    def keys(d, pre=""):
        out = set()
        for k, v in d.items():
            out.add(pre + k)
            if isinstance(v, dict) and k not in ("requests_finished",):
                out |= keys(v, pre + k + ".")
        return out

    got = {}
    for name, llm in zip(("on", "off"), pair):
        llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0))
        app = create_app(llm.settings, engine=llm.engine, spec=llm.spec, backend="torch")
        with TestClient(app) as client:
            h = client.get("/health")
            m = client.get("/metrics").text
        assert h.status_code == 200
        fams = {
            (
                f.name,
                tuple(
                    sorted(
                        {
                            lab
                            for s in f.samples
                            for lab in s.labels.values()
                            if f.name in ("swiftlm_step_seconds", "swiftlm_memory_bytes")
                        }
                    )
                ),
            )
            for f in text_string_to_metric_families(m)
        }
        got[name] = (keys(h.json()), fams, h.json())
    on_keys, on_fams, on_h = got["on"]
    off_keys, off_fams, _ = got["off"]
    assert off_keys <= on_keys, off_keys - on_keys
    assert {n for n, _ in off_fams} <= {n for n, _ in on_fams}
    mem_on = dict(on_fams)["swiftlm_memory_bytes"]
    assert set(dict(off_fams)["swiftlm_memory_bytes"]) <= set(mem_on) and "engine_process_rss" in mem_on
    st = on_h["stats"]
    assert st["requests_total"] >= 1 and st["tokens_generated"] > 0 and st["steps"] > 0
    assert st["step_phases"]["forward"]["count"] > 0 and st["step_phases"]["output"]["count"] > 0
    assert on_h["memory"]["weights_bytes"] > 0


# ---------------------------------------------------------------------------------------- failure
@pytest.fixture(scope="module")
def tiny_pair(tiny_llama):
    on = _llm(str(tiny_llama), engine_process="on", parallel=3)
    off = _llm(str(tiny_llama), engine_process="off", parallel=3)
    yield on, off
    on.close()
    off.close()


def test_tiny_llama_greedy_equal(tiny_pair):
    from swiftlm import SamplingParams

    on, off = tiny_pair
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    qs = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    assert [o.token_ids for o in on.generate(qs, p)] == [o.token_ids for o in off.generate(qs, p)]


def test_killed_child_ends_streams_with_error_and_is_fatal(tiny_pair):
    from swiftlm import SamplingParams
    from swiftlm.engine import QueueFull

    on, _ = tiny_pair
    eng = on.engine
    told = []
    eng.on_fatal = told.append
    g = on.stream([5, 6, 7], SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True))
    next(g)
    os.kill(eng.child_pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="engine process died"):
        for _ in g:
            pass
    assert eng.fatal and told == [eng.fatal] and not eng.running
    with pytest.raises(QueueFull):
        eng.submit([5, 6], SamplingParams(max_tokens=2), lambda ev: None)
    t0 = time.time()
    on.close()  # no hang on a dead child
    assert time.time() - t0 < 3 and not _alive(eng.child_pid)


# ---------------------------------------------------------------------------------------- server
def _child_of(pid: int) -> int:
    deadline = time.time() + 10
    while time.time() < deadline:
        kids = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/children") as f:
                    kids += [int(x) for x in f.read().split()]
            except FileNotFoundError:  # that thread ended between the listing and the read
                continue
        if kids:
            return kids[0]
        time.sleep(0.1)
    raise AssertionError("no engine process found")


def test_server_chat_streamed_and_not_then_sigterm_leaves_no_process():
    s = ServerProc("--backend", "torch", "--engine-process", "on", "--parallel", "2", "--prompt-cache-bytes", "0")
    try:
        child = _child_of(s.proc.pid)
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0}
        r = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        parts = []
        with httpx.stream("POST", s.base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as rs:
            for line in rs.iter_lines():
                if line.startswith("data: {"):
                    import json

                    ch = json.loads(line[6:])["choices"]
                    if ch:
                        parts.append(ch[0]["delta"].get("content") or "")
        assert text and "".join(parts) == text
        h = httpx.get(s.base + "/health", timeout=10).json()
        assert h["status"] == "ok" and h["stats"]["requests_total"] >= 2
    finally:
        code = s.stop()
    assert code == 0, s.stderr_tail()
    assert not _alive(child)


def test_server_exits_nonzero_when_the_engine_process_dies():
    s = ServerProc("--backend", "torch", "--engine-process", "on", "--parallel", "2")
    try:
        os.kill(_child_of(s.proc.pid), signal.SIGKILL)
        s.proc.wait(30)
    finally:
        code = s.stop()
    assert code == 1, s.stderr_tail()
    assert "engine process died" in s.stderr_tail()
