"""SIGTERM with 50 streams open: new connections are refused, the streams keep going for
--shutdown-timeout, then each gets its last chunk (finish_reason 'length') and [DONE], and the
process exits 0 within the timeout.  (Queue full, a 429 with Retry-After: test_server.py's test_queue_full_is_429.)"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from server_util import ServerProc

N = 50


def test_sigterm_ends_every_open_stream_with_done(tiny_llama):
    s = ServerProc(
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--parallel",
        str(N),
        "--max-queue",
        str(N),
        "--shutdown-timeout",
        "2",
        "--prompt-cache-bytes",
        "0",
    )
    results: dict[int, list[str]] = {}
    started = threading.Barrier(N + 1, timeout=120)

    def stream(i: int) -> None:
        lines: list[str] = []
        first = True
        try:
            with httpx.stream(
                "POST",
                s.base + "/v1/chat/completions",
                timeout=120,
                json={
                    "messages": [{"role": "user", "content": f"story number {i}"}],
                    "max_tokens": 3000,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                },
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if first:
                            first = False
                            started.wait()
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            lines.append(f"EXC {type(exc).__name__}: {exc}")
            if first:
                started.abort()
        results[i] = lines

    ts = [threading.Thread(target=stream, args=(i,)) for i in range(N)]
    [t.start() for t in ts]
    started.wait()  # every stream has produced its first chunk
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:  # draining: no new connections
        httpx.get(s.base + "/health", timeout=2)
        refused = False
    except httpx.HTTPError:
        refused = True
    rc = s.proc.wait(30)
    took = time.monotonic() - t0
    [t.join(30) for t in ts]
    assert rc == 0, s.stderr_tail()
    assert took < 2 + 10, took
    assert refused
    for i in range(N):
        lines = results[i]
        assert lines and lines[-1] == "[DONE]", (i, lines[-3:])
        last = json.loads(lines[-2])
        assert last["choices"][0]["finish_reason"] == "length", (i, last)
        assert (
            sum(
                1
                for x in lines[:-1]
                if json.loads(x)["choices"] and json.loads(x)["choices"][0]["delta"].get("content")
            )
            > 1
        )  # they kept generating meanwhile
    assert "Traceback" not in s.stderr_tail(20000)


def test_request_timeout_ends_a_long_request_with_what_it_has(tiny_llama):
    s = ServerProc("--model", str(tiny_llama), "--backend", "torch", "--request-timeout", "1.5")
    try:
        t0 = time.monotonic()
        r = httpx.post(
            s.base + "/v1/chat/completions",
            timeout=120,
            json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "ignore_eos": True},
        )
        took = time.monotonic() - t0
        ch = r.json()["choices"][0]
        assert r.status_code == 200 and ch["finish_reason"] == "length" and ch["message"]["content"]
        assert 1.5 <= took < 10 and r.json()["usage"]["completion_tokens"] < 3000
        quick = httpx.post(
            s.base + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert quick.json()["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        assert s.stop() == 0, s.stderr_tail()
