"""Many models behind one server (--models-file): load on demand, names and aliases, 404 for
unknown names, two models serving at once, LRU eviction and TTL that give the memory back
(process RSS measured), and a model that fails to load failing only its own requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import make_ckpt
from server_util import ServerProc

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """~200 MB of fp32 weights: large enough that its memory coming back shows in the RSS."""
    return make_ckpt(
        tmp_path_factory.mktemp("mm") / "big",
        "--arch",
        "qwen3",
        "--dtype",
        "float32",
        "--hidden",
        "512",
        "--layers",
        "8",
        "--heads",
        "8",
        "--kv-heads",
        "4",
        "--intermediate",
        "1536",
    )


@pytest.fixture(scope="module")
def broken(tmp_path_factory, tiny_llama):
    import shutil

    d = tmp_path_factory.mktemp("mm") / "broken"
    shutil.copytree(tiny_llama, d)
    for f in d.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return d


def models_file(tmp_path, *entries: str) -> str:
    f = tmp_path / "models.toml"
    f.write_text("\n".join(entries))
    return str(f)


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def states(base: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]}


def chat(base: str, model: str, n: int = 4, **kw) -> httpx.Response:
    return httpx.post(
        base + CHAT,
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": n,
            "temperature": 0,
            **kw,
        },
        timeout=120,
    )


def test_on_demand_aliases_404_and_concurrency(tmp_path, tiny_llama, big):
    mf = models_file(
        tmp_path,
        f'[[models]]\nname = "a"\nmodel = "{tiny_llama}"\npin = true\n',
        f'[[models]]\nname = "b"\nmodel = "{big}"\naliases = ["gpt-4o"]\nparallel = 2\n',
    )
    s = ServerProc("--models-file", mf, "--backend", "torch")
    try:
        assert states(s.base) == {"a": "loaded", "b": "unloaded"}  # the pinned one at start, b on demand
        r = chat(s.base, "nope")
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "available: a, b" in err["message"]
        r = chat(s.base, "gpt-4o")  # an alias loads b
        assert r.status_code == 200 and r.json()["model"] == "b"
        assert states(s.base) == {"a": "loaded", "b": "loaded"}
        solo_a = chat(s.base, "a", 6).json()["choices"][0]["message"]["content"]
        # two models progress at once: a answers while b is busy with a long stream.  b's stream is
        # closed (cancelling it) once a has answered, instead of decoding all 400 tokens: were the models
        # served one after the other, a's answer would come only after b had finished on its own.
        b_streaming, b_stop = threading.Event(), threading.Event()
        b_ended_on_its_own = threading.Event()

        def long_b():
            with httpx.stream(
                "POST",
                s.base + CHAT,
                timeout=300,
                json={
                    "model": "b",
                    "messages": [{"role": "user", "content": "go"}],
                    "max_tokens": 400,
                    "temperature": 0,
                    "stream": True,
                    "logit_bias": {},
                    "ignore_eos": True,
                },
            ) as resp:
                chunks = 0
                for line in resp.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= 3:
                        b_streaming.set()  # b is decoding: tokens are coming back
                    if line == "data: [DONE]":
                        b_ended_on_its_own.set()
                    if b_stop.is_set():
                        break
            b_streaming.set()  # (or failed: the assertions below say so)

        t = threading.Thread(target=long_b)
        t.start()
        assert b_streaming.wait(120)
        assert not b_ended_on_its_own.is_set()  # b is still running as a's request goes in
        r = chat(s.base, "a", 6)
        a_finished_while_b_ran = not b_ended_on_its_own.is_set()
        b_stop.set()
        t.join(300)
        assert r.status_code == 200 and r.json()["model"] == "a"
        assert r.json()["choices"][0]["message"]["content"] == solo_a  # unaffected by the other model
        assert a_finished_while_b_ran
        e = httpx.post(s.base + "/v1/embeddings", json={"model": "a", "input": "hi"}, timeout=60)
        assert e.status_code == 200 and e.json()["model"] == "a"
    finally:
        assert s.stop() == 0, s.stderr_tail()


def test_eviction_and_ttl_return_memory(tmp_path, tiny_llama, big):
    mf = models_file(
        tmp_path, f'[[models]]\nname = "a"\nmodel = "{tiny_llama}"\n', f'[[models]]\nname = "b"\nmodel = "{big}"\n'
    )
    s = ServerProc("--models-file", mf, "--backend", "torch", "--max-loaded-models", "1", "--model-ttl", "3")
    try:
        pid = s.proc.pid
        assert chat(s.base, "a").status_code == 200
        base = rss(pid)
        assert chat(s.base, "b").status_code == 200  # one model at a time: a is evicted
        assert states(s.base) == {"a": "unloaded", "b": "loaded"}
        with_b = rss(pid)
        assert with_b - base > 150e6  # b's ~200 MB of weights are resident
        assert chat(s.base, "a").status_code == 200  # b evicted, its memory returned
        assert states(s.base) == {"a": "loaded", "b": "unloaded"}
        after_evict = rss(pid)
        assert with_b - after_evict > 0.75 * (with_b - base), (base, with_b, after_evict)
        assert chat(s.base, "b").status_code == 200
        loaded_again = rss(pid)
        deadline = time.time() + 20  # idle for --model-ttl: unloaded
        while time.time() < deadline and states(s.base)["b"] != "unloaded":
            time.sleep(0.5)
        assert states(s.base)["b"] == "unloaded"
        # the state flips when the unload starts; the memory goes back as it completes (engine threads end,
        # malloc trims): read RSS until it has dropped or 15 s passed (a loaded machine can read it early)
        deadline = time.time() + 15
        after_ttl = rss(pid)
        while loaded_again - after_ttl <= 0.75 * (with_b - base) and time.time() < deadline:
            time.sleep(0.5)
            after_ttl = rss(pid)
        assert loaded_again - after_ttl > 0.75 * (with_b - base), (loaded_again, after_ttl)
    finally:
        assert s.stop() == 0, s.stderr_tail()


def test_a_failing_load_is_that_requests_error(tmp_path, tiny_llama, broken):
    mf = models_file(
        tmp_path,
        f'[[models]]\nname = "a"\nmodel = "{tiny_llama}"\npin = true\n',
        f'[[models]]\nname = "broken"\nmodel = "{broken}"\n',
    )
    s = ServerProc("--models-file", mf, "--backend", "torch")
    try:
        r = chat(s.base, "broken")
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and "'broken' failed to load" in err["message"]
        assert states(s.base) == {"a": "loaded", "broken": "failed"}
        assert chat(s.base, "a").status_code == 200  # the others keep serving
        assert httpx.get(s.base + "/health", timeout=30).status_code == 200
    finally:
        assert s.stop() == 0, s.stderr_tail()


def test_one_model_serves_any_name_unless_strict(tiny_llama):
    s = ServerProc("--model", str(tiny_llama), "--backend", "torch", "--strict-model-names")
    try:
        name = s.ready["model"]
        assert chat(s.base, name).status_code == 200
        r = chat(s.base, "gpt-4o")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        assert s.stop() == 0, s.stderr_tail()


def test_repeated_model_flag_and_pin(tiny_llama, big):
    s = ServerProc("--model", str(tiny_llama), "--model", str(big), "--backend", "torch", "--pin", str(big))
    try:
        assert s.ready["models"] == [str(tiny_llama), str(big)]
        assert states(s.base) == {str(tiny_llama): "loaded", str(big): "loaded"}  # --pin: loaded at start
        r = chat(s.base, str(big))
        assert r.status_code == 200 and r.json()["model"] == str(big)
        r = chat(s.base, "gpt-4o")  # several models: an unknown name is a 404, not a guess
        assert r.status_code == 404 and str(tiny_llama) in r.json()["error"]["message"]
    finally:
        assert s.stop() == 0, s.stderr_tail()
