"""API keys from a file (Bearer and x-api-key, OpenAI and Anthropic routes), a per-key token
bucket answering 429 with Retry-After, and HTTPS with a self-signed certificate."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from server_util import ServerProc

MSG = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(tiny_llama, tmp_path_factory):
    f = tmp_path_factory.mktemp("keys") / "keys.txt"
    f.write_text("# team keys\nalice: sk-alice\nsk-bob   # a key without a name\n")
    s = ServerProc(
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--api-keys-file",
        str(f),
        "--rate-limit",
        "60",
        "--rate-burst",
        "3",
    )
    yield s
    assert s.stop() == 0, s.stderr_tail()


def test_keys_from_file(keyed):
    url = keyed.base + "/v1/chat/completions"
    assert httpx.post(url, json=MSG, timeout=60).status_code == 401
    assert httpx.post(url, json=MSG, headers={"Authorization": "Bearer sk-nope"}, timeout=60).status_code == 401
    assert httpx.post(url, json=MSG, headers={"Authorization": "Bearer sk-alice"}, timeout=60).status_code == 200
    assert httpx.post(url, json=MSG, headers={"x-api-key": "sk-bob"}, timeout=60).status_code == 200
    r = httpx.post(
        keyed.base + "/v1/messages", json={**MSG, "model": "x"}, headers={"x-api-key": "sk-nope"}, timeout=60
    )
    assert r.status_code == 401 and r.json()["type"] == "error"  # Anthropic's shape on its route
    assert httpx.get(keyed.base + "/health", timeout=30).status_code == 200  # open


def test_rate_limit_per_key(keyed):
    time.sleep(3.5)  # the earlier test's tokens refill (one a second)
    url = keyed.base + "/v1/completions"
    body = {"prompt": "a", "max_tokens": 1}
    # the burst on the cheapest /v1 route, so that a loaded machine cannot refill the bucket between requests
    codes = [httpx.get(keyed.base + "/v1/models", headers={"Authorization": "Bearer sk-alice"}) for _ in range(5)]
    assert [r.status_code for r in codes[:3]] == [200, 200, 200]  # the burst
    limited = [r for r in codes[3:] if r.status_code == 429]
    assert limited and int(limited[0].headers["retry-after"]) >= 1
    assert limited[0].json()["error"]["code"] == "rate_limited" and "alice" in limited[0].json()["error"]["message"]
    # another key has its own bucket
    assert httpx.post(url, json=body, headers={"x-api-key": "sk-bob"}, timeout=60).status_code == 200
    time.sleep(1.2)
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer sk-alice"}, timeout=60).status_code == 200


def test_https_with_a_self_signed_certificate(tiny_llama, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    s = ServerProc(
        "--model", str(tiny_llama), "--backend", "torch", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)
    )
    try:
        assert s.ready["scheme"] == "https"
        https = s.base.replace("http://", "https://")
        import ssl

        ctx = ssl.create_default_context(cafile=str(cert))
        r = httpx.post(https + "/v1/chat/completions", json=MSG, verify=ctx, timeout=60)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
            httpx.get(s.base + "/health", timeout=5).raise_for_status()
    finally:
        assert s.stop() == 0, s.stderr_tail()
