"""/health and /metrics tell the truth: measured memory, Counters for counts, histograms for
latencies, throughput over busy wall time, SwiftLM's field and metric names.  Each metric is
provoked and read back.  Servers: the tiny random checkpoint on loopback (one per backend for
the memory figures; torch for the rest), and one in-process app whose engine is made to fail
on purpose (unhandled errors, errors mid-stream)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import BACKENDS, needs_torch, run_cli
from prometheus_client.parser import text_string_to_metric_families
from server_util import ServerProc

MiB = 1 << 20
MSGS = [{"role": "user", "content": "Tell me a long story about the sea and the mountains, please."}]
NO_EOS: dict = {}  # filled by the eos fixture: logit_bias banning the tiny tokenizer's EOS ids


def scrape(base: str) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": {(sample name, labels): value}}}"""
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {
            "type": fam.type,
            "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples},
        }
    return out


def value(m: dict, sample: str, **labels: str) -> float:
    for fam in m.values():
        v = fam["samples"].get((sample, tuple(sorted(labels.items()))))
        if v is not None:
            return v
    return 0.0


def health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=30).json()


def chat(base: str, max_tokens: int = 8, messages=MSGS, **kw) -> dict:
    r = httpx.post(
        base + "/v1/chat/completions",
        timeout=120,
        json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw},
    )
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(base: str, timeout: float = 30) -> dict:
    end = time.time() + timeout
    while True:
        h = health(base)
        if h["stats"]["requests_active"] == 0 or time.time() > end:
            return h
        time.sleep(0.05)


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module", autouse=True)
def eos(tiny_llama):
    from swiftlm.tokenizer import load_hf_tokenizer

    NO_EOS.update({str(t): -100 for t in load_hf_tokenizer(tiny_llama).eos_token_ids})


@pytest.fixture(scope="module", params=BACKENDS)
def any_server(request, tiny_llama):
    """The tiny checkpoint on each backend (memory figures)."""
    s = ServerProc("--model", str(tiny_llama), "--backend", request.param, "--parallel", "2", "--max-tokens", "16")
    s.backend = request.param
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.fixture(scope="module")
def server(tiny_llama):
    """torch, 4 slots, a KV budget of one full context (--kv-budget-bytes is raised to that), so
    that concurrent long requests are preempted."""
    pytest.importorskip("torch")
    s = ServerProc(
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--parallel",
        "4",
        "--max-tokens",
        "16",
        "--ctx-size",
        "256",
        "--kv-budget-bytes",
        "1",
    )
    yield s
    assert s.stop() == 0, s.stderr_tail()


# ------------------------------------------------------------------------------------- /health memory
def test_health_memory_is_measured(any_server):
    base = any_server.base
    chat(base)
    h = wait_idle(base)
    m = h["memory"]
    # ours, in bytes, and SwiftLM's, in MiB rounded down (its meaning: the device allocator)
    for k in (
        "active",
        "peak",
        "cache",
        "total_system",
        "process_rss_bytes",
        "process_peak_rss_bytes",
        "weights_bytes",
        "kv_bytes",
        "kv_allocated_bytes",
        "prompt_cache_bytes",
        "device_total_bytes",
        "packed_weights_bytes",
    ):
        assert isinstance(m[k], int) and m[k] >= 0, k
    assert m["active_mb"] == m["active"] // MiB and m["peak_mb"] == m["peak"] // MiB
    assert m["cache_mb"] == m["cache"] // MiB and m["total_system_mb"] == m["device_total_bytes"] // MiB
    assert m["gpu_architecture"] == "cpu" and m["device"] == "cpu" and m["device_name"]
    # the process's resident memory, as the kernel counts it
    rss = proc_rss(any_server.proc.pid)
    assert abs(m["process_rss_bytes"] - rss) < 0.1 * rss
    assert m["process_peak_rss_bytes"] >= m["process_rss_bytes"] * 0.99
    assert m["peak"] >= m["active"] > 0
    assert m["weights_bytes"] > 0
    if any_server.backend == "torch":  # no allocator counts on the CPU: the process is the device
        assert abs(m["active"] - m["process_rss_bytes"]) < 0.1 * m["process_rss_bytes"]
        # weights (and their oneDNN-packed copy, cpu_packed.py) plus the interpreter, torch and buffers
        assert m["active"] > m["weights_bytes"] + m["packed_weights_bytes"]
    else:  # MLX's allocator: at least the weights live in MLX arrays
        assert m["active"] >= m["weights_bytes"] * 0.9
    # the finished request's KV went to the prompt cache; no sequence holds KV now
    assert m["prompt_cache_bytes"] > 0 and m["kv_bytes"] == 0
    assert m["prompt_cache_bytes"] == h["stats"]["prompt_cache"]["bytes"]


def test_health_kv_bytes_while_a_stream_runs(any_server):
    base = any_server.base
    body = {"messages": MSGS, "max_tokens": 400, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    seen = None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n += 1
            if n == 3:
                seen = health(base)["memory"]
                break
    assert seen is not None and seen["kv_bytes"] > 0
    assert seen["kv_allocated_bytes"] >= seen["kv_bytes"]
    assert wait_idle(base)["memory"]["kv_bytes"] == 0


def test_info_plan_matches_what_the_backend_holds(any_server, tiny_llama):
    """`swiftlm info` sizes weights and KV as the backend holds them (fp32 on the CPU)."""
    r = run_cli("info", "--json", "--model", str(tiny_llama), "--backend", any_server.backend)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["memory_plan"]
    assert plan["backend"] == any_server.backend and plan["device"] == "cpu"
    assert plan["weights_bytes"] == health(any_server.base)["memory"]["weights_bytes"]
    m = scrape(any_server.base)
    assert plan["kv_bytes_per_token"] == value(m, "swiftlm_kv_cache_bytes_per_token")
    assert plan["kv_element_size"] == 4


@needs_torch
def test_info_sizes_the_bundled_gguf_as_torch_holds_it():
    """The Q4_1 GGUF is ~94 MiB on disk; torch on the CPU dequantizes it to fp32 (538 MB)."""
    r = run_cli("info", "--json", "--model", "smollm2-135m-instruct", "--backend", "torch")
    plan = json.loads(r.stdout)["memory_plan"]
    assert plan["weights_file_bytes"] < 100 * MiB
    assert plan["weights_bytes"] == 134_515_008 * 4  # parameters x fp32 (what param_bytes measures)
    assert plan["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert plan["total_bytes"] == plan["weights_bytes"] + plan["kv_cache_bytes"] + plan["prompt_cache_bytes"]


# ------------------------------------------------------------------------------------------ counters
COUNTERS = [
    "swiftlm_requests",
    "swiftlm_request_errors",
    "swiftlm_stream_errors",
    "swiftlm_prompt_tokens",
    "swiftlm_generation_tokens",
    "swiftlm_tokens_generated",
    "swiftlm_engine_requests",
    "swiftlm_requests_finished",
    "swiftlm_prompt_tokens_processed",
    "swiftlm_engine_steps",
    "swiftlm_preemptions",
    "swiftlm_busy_seconds",
    "swiftlm_prompt_cache_hits",
    "swiftlm_prompt_cache_misses",
    "swiftlm_prompt_cache_tokens_reused",
    "swiftlm_steps_overlapped",
]
HISTOGRAMS = [
    "swiftlm_time_to_first_token_seconds",
    "swiftlm_inter_token_latency_seconds",
    "swiftlm_engine_time_to_first_token_seconds",
    "swiftlm_request_queue_seconds",
    "swiftlm_request_duration_seconds",
    "swiftlm_time_per_output_token_seconds",
    "swiftlm_step_seconds",
]
GAUGES = [
    "swiftlm_requests_active",
    "swiftlm_queue_depth",
    "swiftlm_running_sequences",
    "swiftlm_uptime_seconds",
    "swiftlm_avg_tokens_per_second",
    "swiftlm_tokens_per_second",
    "swiftlm_memory_bytes",
    "swiftlm_memory_active_bytes",
    "swiftlm_memory_peak_bytes",
    "swiftlm_memory_cache_bytes",
    "swiftlm_prompt_cache_bytes",
    "swiftlm_kv_cache_bytes_in_use",
]


def test_metric_types(server):
    chat(server.base, max_tokens=4)
    m = scrape(server.base)
    for name in COUNTERS:
        assert m[name]["type"] == "counter", name
    for name in HISTOGRAMS:
        assert m[name]["type"] == "histogram", name
    for name in GAUGES:
        assert m[name]["type"] == "gauge", name
    text = httpx.get(server.base + "/metrics").text
    for name in (
        "swiftlm_tokens_generated_total",
        "swiftlm_tokens_per_second",
        "swiftlm_memory_active_bytes",
        "swiftlm_memory_peak_bytes",
        "swiftlm_memory_cache_bytes",
    ):  # SwiftLM's names, as SwiftLM writes them
        assert f"\n{name} " in text, name


def test_request_and_token_counters(server):
    before = scrape(server.base)
    r = chat(server.base, max_tokens=6)
    wait_idle(server.base)
    after = scrape(server.base)
    n_out, n_in = r["usage"]["completion_tokens"], r["usage"]["prompt_tokens"]

    def delta(sample, **labels):
        return value(after, sample, **labels) - value(before, sample, **labels)

    assert delta("swiftlm_requests_total", route="chat") == 1
    assert delta("swiftlm_engine_requests_total") == 1
    assert delta("swiftlm_tokens_generated_total") == n_out
    assert delta("swiftlm_generation_tokens_total") == n_out
    assert delta("swiftlm_prompt_tokens_total") == n_in
    assert delta("swiftlm_prompt_tokens_processed_total") == n_in
    assert delta("swiftlm_requests_finished_total", reason=r["choices"][0]["finish_reason"]) == 1
    assert delta("swiftlm_engine_steps_total") >= n_out
    h = health(server.base)["stats"]
    assert h["tokens_generated"] == value(after, "swiftlm_tokens_generated_total")
    assert h["requests_finished"][r["choices"][0]["finish_reason"]] == value(
        after, "swiftlm_requests_finished_total", reason=r["choices"][0]["finish_reason"]
    )


def test_cancelled_requests_are_counted(server):
    before = scrape(server.base)
    body = {"messages": MSGS, "max_tokens": 200, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the client goes away mid-stream
    wait_idle(server.base)
    after = scrape(server.base)
    assert (
        value(after, "swiftlm_requests_finished_total", reason="cancelled")
        - value(before, "swiftlm_requests_finished_total", reason="cancelled")
        == 1
    )


def test_error_counter_counts_client_errors(server):
    before = scrape(server.base)
    r = httpx.post(
        server.base + "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSGS, "temperature": 7})
    assert r.status_code == 400
    after = scrape(server.base)
    assert (
        value(after, "swiftlm_request_errors_total", status="400")
        - value(before, "swiftlm_request_errors_total", status="400")
        == 2
    )


def test_prompt_cache_counters(server):
    before = scrape(server.base)
    msgs = [
        {"role": "system", "content": "You answer questions about rivers and their sources. " * 3},
        {"role": "user", "content": "Which river is the longest?"},
    ]
    chat(server.base, max_tokens=2, messages=msgs)
    chat(server.base, max_tokens=2, messages=msgs)
    after = scrape(server.base)
    assert value(after, "swiftlm_prompt_cache_hits_total") - value(before, "swiftlm_prompt_cache_hits_total") >= 1
    assert value(after, "swiftlm_prompt_cache_misses_total") >= 1
    assert (
        value(after, "swiftlm_prompt_cache_tokens_reused_total")
        - value(before, "swiftlm_prompt_cache_tokens_reused_total")
        >= 16
    )
    assert value(after, "swiftlm_prompt_cache_bytes") > 0


def test_preemptions_counter(server):
    """Four long requests against a KV budget of one context: some are preempted and recomputed."""
    before = scrape(server.base)
    body = {"messages": MSGS, "max_tokens": 200, "temperature": 0, "logit_bias": NO_EOS}
    out: list = []

    def one():
        out.append(httpx.post(server.base + "/v1/chat/completions", json=body, timeout=300))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    after = scrape(server.base)
    assert value(after, "swiftlm_preemptions_total") > value(before, "swiftlm_preemptions_total")
    assert health(server.base)["stats"]["preemptions"] == value(after, "swiftlm_preemptions_total")


# ---------------------------------------------------------------------------------------- histograms
def test_latency_histograms(server):
    before = scrape(server.base)
    chunks = 0
    body = {"messages": MSGS, "max_tokens": 8, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
    wait_idle(server.base)
    after = scrape(server.base)

    def dcount(name):
        return value(after, name + "_count") - value(before, name + "_count")

    for name in (
        "swiftlm_time_to_first_token_seconds",
        "swiftlm_engine_time_to_first_token_seconds",
        "swiftlm_request_queue_seconds",
        "swiftlm_request_duration_seconds",
        "swiftlm_time_per_output_token_seconds",
    ):
        assert dcount(name) == 1, name
        assert value(after, name + "_bucket", le="+Inf") == value(after, name + "_count")
    assert 1 <= dcount("swiftlm_inter_token_latency_seconds") <= 7
    lat = health(server.base)["stats"]["latency"]
    assert lat["duration"]["count"] == value(after, "swiftlm_request_duration_seconds_count")
    assert lat["duration"]["max_s"] >= lat["duration"]["p50_s"] > 0


def test_engine_ttft_is_bounded():
    """EngineStats.ttft (and every latency the engine keeps) is a fixed-size histogram."""
    from swiftlm.engine import EngineStats

    st = EngineStats()
    size = len(st.ttft.counts)
    for i in range(100_000):
        st.ttft.observe(i * 1e-5)
    assert len(st.ttft.counts) == size and st.ttft.count == 100_000
    assert abs(st.ttft.sum - sum(i * 1e-5 for i in range(100_000))) < 1e-6
    assert 0.45 < st.ttft.quantile(0.5) < 0.55


def test_throughput_is_over_busy_wall_time(server):
    """avg tokens/s = tokens / wall time with requests live: idle time does not dilute it, and
    the time of every phase of a request (not only decode steps) is in it."""
    wait_idle(server.base)
    m0 = scrape(server.base)
    t0 = time.perf_counter()
    # 48 tokens: long enough that the engine's time dominates the request's fixed HTTP and template cost
    # (with a dozen, that fixed cost brings the busy / wall ratio down to the 0.5 bound)
    chat(server.base, max_tokens=48, logit_bias=NO_EOS)
    wall = time.perf_counter() - t0
    h = wait_idle(server.base)
    m1 = scrape(server.base)
    busy = value(m1, "swiftlm_busy_seconds_total") - value(m0, "swiftlm_busy_seconds_total")
    assert 0.5 * wall < busy <= wall + 0.01
    tps = value(m1, "swiftlm_avg_tokens_per_second")
    assert tps == value(m1, "swiftlm_tokens_per_second")  # SwiftLM's name, same figure
    assert tps == pytest.approx(
        value(m1, "swiftlm_tokens_generated_total") / value(m1, "swiftlm_busy_seconds_total"), rel=0.01
    )
    assert h["stats"]["avg_tokens_per_sec"] == pytest.approx(tps, rel=0.01)
    time.sleep(1.0)  # idle: the figure stays
    assert value(scrape(server.base), "swiftlm_avg_tokens_per_second") == pytest.approx(tps, rel=1e-6)


# ------------------------------------------------------------- errors the route never sees (in-process)
@pytest.fixture(scope="module")
def inproc(tiny_llama):
    """The app in this process (Starlette's TestClient) around a real engine, so that a test can
    make the engine or a route fail on purpose."""
    pytest.importorskip("torch")
    from starlette.testclient import TestClient

    from swiftlm import LLM
    from swiftlm.server.app import create_app

    llm = LLM(str(tiny_llama), backend="torch", parallel=2, max_tokens=16)
    app = create_app(llm.settings, engine=llm.engine, spec=llm.spec, backend="torch")
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, app.state.swiftlm, llm
    llm.close()


def _errors(state, status: str) -> float:
    text = state.metrics.render(state.engine).decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "swiftlm_request_errors_total" and s.labels.get("status") == status:
                return s.value
    return 0.0


def test_count_error_api():
    from swiftlm.server.metrics import Metrics

    m = Metrics()
    m.count_error(404)
    m.count_error(500, "stream")
    text = m.render(None).decode()
    assert 'swiftlm_request_errors_total{status="404"} 1\n' in text  # counts print as integers
    assert 'swiftlm_request_errors_total{status="500"} 1\n' in text and "swiftlm_stream_errors_total 1\n" in text


def test_error_counter_counts_404_405(inproc):
    client, state, _ = inproc
    n404, n405 = _errors(state, "404"), _errors(state, "405")
    assert client.get("/v1/nothing-here").status_code == 404
    assert client.get("/v1/chat/completions").status_code == 405
    assert _errors(state, "404") == n404 + 1 and _errors(state, "405") == n405 + 1


def test_error_counter_counts_unhandled_500(inproc, monkeypatch):
    client, state, llm = inproc
    before = _errors(state, "500")

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(llm.engine, "plan_chat", boom)
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 500
    assert _errors(state, "500") == before + 1


def _fail_forward(monkeypatch, llm):
    model = llm.engine.model
    real = model.forward

    def forward(batch):
        if any(len(w.tokens) == 1 for w in batch.seqs):  # the first decode step fails
            raise RuntimeError("injected step failure")
        return real(batch)

    monkeypatch.setattr(model, "forward", forward)


def test_engine_counts_failed_requests(inproc, monkeypatch):
    """A step that fails ends its requests with reason 'error'; a non-streamed one answers 500,
    which the route's error counter sees."""
    client, state, llm = inproc
    fin = llm.engine.stats.finished.get("error", 0)
    before = _errors(state, "500")
    _fail_forward(monkeypatch, llm)
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "logit_bias": NO_EOS})
    assert r.status_code == 500
    assert llm.engine.stats.finished.get("error", 0) == fin + 1
    assert _errors(state, "500") == before + 1


def test_error_counter_counts_errors_sent_mid_stream(inproc, monkeypatch):
    client, state, llm = inproc
    before = _errors(state, "500")
    _fail_forward(monkeypatch, llm)
    r = client.post(
        "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "logit_bias": NO_EOS, "stream": True}
    )
    assert r.status_code == 200 and '"error"' in r.text
    assert _errors(state, "500") == before + 1
    text = state.metrics.render(state.engine).decode()
    assert "swiftlm_stream_errors_total 1\n" in text
