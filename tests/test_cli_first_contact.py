"""A new user's first contact (issue 21, item 7): --help, one-sentence mistakes with exit code 2 before anything
starts, the chat REPL's Ctrl-C and /reset, and the README's Python snippets run as printed."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import HAS_TORCH, ROOT, run_cli


def one_sentence(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("swiftlm"), r.stderr
    assert "Traceback" not in r.stderr and "https://" not in r.stderr and "usage:" not in r.stderr
    return lines[0]


def test_help_shows_the_commands_and_serves_flags_with_defaults():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for cmd in ("serve", "generate", "chat", "info", "download", "models", "rm"):
        assert re.search(rf"^\s+{cmd}\s", out, re.M), cmd
    flat = " ".join(out.split())
    for flag, default in (
        ("--port", "5413"),
        ("--host", "127.0.0.1"),
        ("--temp", "0.6"),
        ("--parallel", "1"),
        ("--max-tokens", "2048"),
    ):
        assert re.search(rf"{flag} \S+ .*?\(default: {re.escape(default)}\)", flat), flag
    assert "SWIFTLM_PORT" in flat


@pytest.mark.parametrize(
    "args,env,says",
    [
        (["--temp", "-1"], {}, "--temp (SWIFTLM_TEMP) must be a number >= 0"),
        (["--top-p", "2"], {}, "--top-p (SWIFTLM_TOP_P) must be in (0, 1]"),
        (["--port", "99999"], {}, "--port (SWIFTLM_PORT) must be a TCP port"),
        (["--parallel", "0"], {}, "--parallel (SWIFTLM_PARALLEL) must be >= 1"),
        ([], {"SWIFTLM_PORT": "abc"}, "--port (SWIFTLM_PORT) input should be a valid integer"),
        ([], {"SWIFTLM_TEMP": "-0.5"}, "SWIFTLM_TEMP) must be a number >= 0"),
        (["--log-level", "loud"], {}, "--log-level (SWIFTLM_LOG_LEVEL) must be one of"),
        (["--frobnicate"], {}, "unrecognized arguments: --frobnicate"),
        (["--port", "many"], {}, "argument --port: invalid int value: 'many'"),
        (["generate"], {}, "the following arguments are required: -p/--prompt"),
        (["generate", "-p", "hi", "--temp", "-1"], {}, "--temp (SWIFTLM_TEMP) must be a number >= 0"),
        (["download"], {}, "the following arguments are required: repo_id"),
    ],
)
def test_cli_mistakes_are_one_sentence_and_exit_2(args, env, says):
    t0 = time.time()
    r = run_cli(*args, env=env, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert says in one_sentence(r)
    assert "ready" not in r.stdout and time.time() - t0 < 30


def test_busy_port_is_refused_before_the_server_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run_cli("serve", "--port", str(port), timeout=60)
    assert r.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in one_sentence(r)
    assert "startup" not in r.stderr.lower() and "Uvicorn" not in r.stderr


def test_vision_on_a_text_model_is_refused_before_the_server_starts():
    with socket.socket() as s:  # a free port: the refusal must come from the model check, before any bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("serve", "--port", str(port), "--vision", timeout=60)
    assert r.returncode == 2
    assert "--vision: smollm2-135m-instruct" in one_sentence(r)
    assert "startup" not in r.stderr.lower() and "ready" not in r.stdout


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed on this machine")
def test_chat_ctrl_c_stops_the_answer_not_the_chat_and_reset_says_so():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    p = subprocess.Popen(
        [sys.executable, "-m", "swiftlm.cli", "chat", "--backend", "torch", "--max-tokens", "400", "--temp", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        banner = p.stdout.readline()
        while "swiftlm chat" not in banner:
            assert banner, p.stderr.read()
            banner = p.stdout.readline()
        p.stdin.write("Write a very long story about a dragon who learns to cook, in twenty chapters.\n")
        p.stdin.flush()
        time.sleep(2.5)  # the answer is streaming now (400 tokens take far longer)
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.stdin.write("/reset\n\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "(stopped; Ctrl-D or an empty line quits)" in out
    assert "conversation cleared" in out


# --------------------------------------------------------------------------- README snippets
def readme_snippets() -> list[tuple[int, str, str | None]]:
    """(index, code, why it is not run) for every ```python block of the README."""
    text = (ROOT / "README.md").read_text()
    out = []
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        why = None
        if not re.match(r"(from|import) (openai|swiftlm|anthropic)\b", first):
            why = "a fragment or a signature listing, not a program"
        elif "image_url" in code or "input_audio" in code:
            why = "needs a vision/audio model (the bundled model is text-only)"
        out.append((i, code, why))
    return out


def test_readme_has_runnable_snippets():
    runnable = [c for _, c, why in readme_snippets() if why is None]
    assert any("from openai import OpenAI" in c for c in runnable)
    assert any("from swiftlm import LLM" in c for c in runnable)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_readme_python_snippets_run_as_printed(tmp_path):
    """Each runnable snippet runs unchanged, as a file, with this environment's python, against `swiftlm` serving
    the bundled model on the README's address (127.0.0.1:5413).  One server for all of them; the snippets'
    outputs are checked only for a clean exit (their text is the model's)."""
    snippets = [(i, c) for i, c, why in readme_snippets() if why is None]
    if not _port_free(5413):
        pytest.skip("port 5413, which the README's snippets use, is taken on this machine")
    backend = "torch" if HAS_TORCH else "auto"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swiftlm.cli",
            "serve",
            "--backend",
            backend,
            "--max-tokens",
            "48",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        while line and '"ready"' not in line:
            line = proc.stdout.readline()
        assert '"ready"' in line, "the server did not start"
        failures = []
        for i, code in snippets:
            f = tmp_path / f"snippet_{i}.py"
            f.write_text(code)
            r = subprocess.run(
                [sys.executable, str(f)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
            )
            if r.returncode != 0:
                failures.append(f"README python block {i} failed:\n{code}\n{r.stderr[-1500:]}")
        assert not failures, "\n\n".join(failures)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
