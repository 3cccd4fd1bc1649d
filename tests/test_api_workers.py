"""--api-workers N: N HTTP processes on one port in front of the engine process.

A real `swiftlm serve` on a tiny checkpoint (CPU, torch): 32 concurrent greedy streams through two
workers give the texts of the in-process model; /health and /metrics answer for both workers from
either; SIGTERM drains and leaves no process; a worker's death stops the server with exit code 1;
what does not combine is refused in one sentence (exit code 2)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import needs_torch, run_cli

pytestmark = needs_torch

N_STREAMS = 32
MAX_TOKENS = 12


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(k) for k in (task / "children").read_text().split()]
                out.update(kids)
                todo += kids
        except FileNotFoundError:
            pass
    return out


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and b"zombie" not in _status(p)}


def _status(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except FileNotFoundError:
        return b"zombie"


def _stream_text(base: str, prompt: str) -> str:
    import httpx

    body = {"model": "x", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, done = "", False
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert done
    return text


def test_two_workers_32_streams_equal_one_process_health_metrics_aggregate_then_sigterm(tiny_llama):
    import httpx
    from server_util import ServerProc

    from swiftlm import LLM, SamplingParams

    prompts = [f"Story {i}: once upon a time" for i in range(N_STREAMS)]
    with LLM(str(tiny_llama), backend="torch", parallel=8) as single:
        outs = single.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        want = [o.text for o in outs]
    s = ServerProc(
        "--model", str(tiny_llama), "--backend", "torch", "--parallel", "8", "--api-workers", "2", "--max-queue", "64"
    )
    try:
        assert s.ready["api_workers"] == 2
        procs = _descendants(s.proc.pid)
        assert len(procs) >= 3  # two workers, the engine process
        with ThreadPoolExecutor(N_STREAMS) as pool:
            got = list(pool.map(lambda p: _stream_text(s.base, p), prompts))
        assert got == want
        pids = set()
        for _ in range(20):  # each on a new connection: the kernel spreads them over both workers
            h = httpx.get(s.base + "/health", timeout=30).json()
            pids.add(h["api_workers"]["pid"])
            assert h["api_workers"]["requests"] == N_STREAMS
            assert h["stats"]["requests_total"] == N_STREAMS
            m = httpx.get(s.base + "/metrics", timeout=30).text
            assert f'swiftlm_requests_total{{route="completions"}} {N_STREAMS}' in m, m[:3000]
            assert f"swiftlm_generation_tokens_total {N_STREAMS * MAX_TOKENS}" in m
        assert len(pids) == 2, pids
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.stderr_tail()
        t0 = time.time()
        while _alive(procs) and time.time() - t0 < 10:
            time.sleep(0.2)
        assert not _alive(procs), "a worker or the engine process outlived the server"
    finally:
        s.stop()


def test_a_dead_worker_stops_the_server_with_exit_1(tiny_llama):
    from server_util import ServerProc

    s = ServerProc("--model", str(tiny_llama), "--backend", "torch", "--api-workers", "2")
    try:
        procs = _descendants(s.proc.pid)
        workers = [p for p in procs if b"worker_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        assert s.proc.wait(60) == 1
        assert "API worker" in s.stderr_tail() and "exited with code -9" in s.stderr_tail(), s.stderr_tail()
        t0 = time.time()
        while _alive(procs) and time.time() - t0 < 10:
            time.sleep(0.2)
        assert not _alive(procs)
    finally:
        s.stop()


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--api-workers", "2", "--engine-process", "off"], "--api-workers 2 needs the engine in its own process"),
        (["--api-workers", "-1"], "api"),
    ],
)
def test_bad_flags_refused_in_one_sentence(tiny_llama, flags, msg):
    r = run_cli("serve", "--model", str(tiny_llama), "--backend", "torch", "--port", "0", *flags, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_automatic_count():
    from types import SimpleNamespace

    from swiftlm.config import Settings
    from swiftlm.server.workers import resolve_count

    cuda = SimpleNamespace(name="torch", available=lambda: SimpleNamespace(device="cuda:0"))
    cpu = SimpleNamespace(name="torch", available=lambda: SimpleNamespace(device="cpu"))
    cores = os.cpu_count() or 1
    assert resolve_count(Settings(api_workers=3), cpu) == 3
    assert resolve_count(Settings(), cuda) == 1  # one engine, --parallel 1
    assert resolve_count(Settings(parallel=256), cuda) == max(1, min(cores // 4, 2))
    assert resolve_count(Settings(parallel=256), cpu) == 1  # auto keeps the engine on a thread on CPU
    assert resolve_count(Settings(parallel=256, engine_process="off"), cuda) == 1
