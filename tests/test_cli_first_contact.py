"""A new user's first contact: --help, one-sentence mistakes with exit code 2 before anything starts, the chat
REPL's Ctrl-C and /reset, and every command and snippet of the README run as printed."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
    import threading

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    # SIGINT ignored, as a worker process of a test runner or a script's background job starts it: the chat
    # must still take Ctrl-C
    p = subprocess.Popen(
        [sys.executable, "-m", "swiftlm.cli", "chat", "--backend", "torch", "--max-tokens", "400", "--temp", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    chunks: list[bytes] = []
    grew = threading.Condition()

    def read_out():
        while b := os.read(p.stdout.fileno(), 4096):
            with grew:
                chunks.append(b)
                grew.notify_all()
        with grew:
            chunks.append(b"")  # end of output
            grew.notify_all()

    def wait_for(pred, timeout=300):
        with grew:
            assert grew.wait_for(lambda: pred(b"".join(chunks)) or (chunks and chunks[-1] == b""), timeout)
            return pred(b"".join(chunks))

    reader = threading.Thread(target=read_out, daemon=True)
    reader.start()
    try:
        assert wait_for(lambda o: b"swiftlm chat" in o), p.stderr.read()
        n0 = len(b"".join(chunks))
        p.stdin.write(b"Write a very long story about a dragon who learns to cook, in twenty chapters.\n")
        p.stdin.flush()
        assert wait_for(lambda o: len(o) >= n0 + 40)  # the answer is streaming: its first characters are out
        p.send_signal(signal.SIGINT)
        assert wait_for(lambda o: b"(stopped" in o, 120)
        p.stdin.write(b"/reset\n\n")
        p.stdin.close()
        p.wait(120)
        reader.join(30)
        out, err = b"".join(chunks).decode(), p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "(stopped; Ctrl-D or an empty line quits)" in out
    assert "conversation cleared" in out


# --------------------------------------------------------------------------- the README: every block is run
# Each fenced block of README.md is one of: a ```bash block whose every command matches a rule of README_COMMANDS (and
# is run, or checked, by the rule's test below); a ```python block (run as a file against the server the README
# starts); a ```text block right after a python block (what that block must print); the ```toml and ```json agent
# configurations (read and exercised with the SDK their client is built on).  A block or a command no rule knows
# fails test_readme_every_block_is_run_by_a_test.

README_COMMANDS = [
    (r"scripts/install\.sh && \.venv/bin/swiftlm", "first_run"),
    (r"scripts/test\.sh", "test_sh"),
    (r"curl http://127\.0\.0\.1:5413/v1/chat/completions .*", "curl"),
    (r"swiftlm serve (--model )?Qwen/Qwen3-0\.6B", "hub_serve"),
    (r"export ANTHROPIC_(BASE_URL|AUTH_TOKEN|MODEL)=\S+", "claude_env"),
    (r"claude", "claude_code"),
]
README_LANGUAGES = {"bash", "python", "text", "toml", "json"}
README_PORT = 5413  # the README's address
README_SERVER = ".venv/bin/swiftlm"  # what its first command starts (a module constant: tests/tiers.py reads code)


def readme_blocks(text: str | None = None) -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text() if text is None else text
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```\s*$", text, re.S | re.M)]


def _strip_comment(line: str) -> str:
    """The command without a trailing `# comment` (a '#' after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def bash_commands(code: str) -> list[str]:
    out, cur = [], ""
    for raw in code.splitlines():
        line = _strip_comment(raw)
        if line.endswith("\\"):
            cur += line[:-1].strip() + " "
            continue
        cur = (cur + line.strip()).strip()
        if cur:
            out.append(cur)
        cur = ""
    return out


def command_rule(cmd: str) -> str | None:
    for pattern, name in README_COMMANDS:
        if re.fullmatch(pattern, cmd):
            return name
    return None


def readme_plan(text: str | None = None) -> dict:
    """What the README holds, sorted by the test that runs it; unknown blocks and commands under 'unknown'."""
    plan: dict = {"commands": {}, "python": [], "toml": [], "json": [], "unknown": []}
    blocks = readme_blocks(text)
    for i, (lang, code) in enumerate(blocks):
        if lang not in README_LANGUAGES:
            plan["unknown"].append(f"a ```{lang or '(no language)'} block: {code[:60]!r}")
        elif lang == "bash":
            for cmd in bash_commands(code):
                rule = command_rule(cmd)
                if rule is None:
                    plan["unknown"].append(f"the command {cmd!r}")
                else:
                    plan["commands"].setdefault(rule, []).append(cmd)
        elif lang == "python":
            expect = blocks[i + 1][1].strip() if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else None
            plan["python"].append((code, expect))
        elif lang == "text" and (i == 0 or blocks[i - 1][0] != "python"):
            plan["unknown"].append(f"a ```text block that follows no python block: {code[:60]!r}")
        elif lang in ("toml", "json"):
            plan[lang].append(code)
    return plan


def test_readme_every_block_is_run_by_a_test():
    plan = readme_plan()
    assert not plan["unknown"], "README blocks no test runs:\n" + "\n".join(plan["unknown"])
    assert {"first_run", "test_sh", "curl", "hub_serve", "claude_code"} <= set(plan["commands"])
    assert any("from openai import OpenAI" in c for c, _ in plan["python"])
    assert any("from swiftlm import LLM" in c for c, _ in plan["python"])
    assert len(plan["toml"]) == 1 and len(plan["json"]) == 1  # Codex CLI and opencode


def test_readme_checks_can_fail():
    """The plan's checks catch a command, a block or an output no test runs."""
    assert command_rule("swiftlm serve --frobnicate") is None
    assert command_rule("rm -rf /") is None
    assert bash_commands("a \\\n  b   # c\n\n# only a comment\nd '#not a comment'") == ["a b", "d '#not a comment'"]
    fake = "```bash\nscripts/test.sh\nswiftlm serve --frobnicate\n```\n```yaml\na: 1\n```\n```text\nlost\n```\n"
    plan = readme_plan(fake)
    assert plan["commands"] == {"test_sh": ["scripts/test.sh"]} and len(plan["unknown"]) == 3, plan


def test_readme_install_and_test_commands_are_what_ci_runs():
    """`scripts/install.sh && .venv/bin/swiftlm` and `scripts/test.sh`: the scripts exist, parse, and CI runs the
    second (which runs the first); serving with `.venv/bin/swiftlm` and no arguments is what
    test_readme_snippets_run_as_printed starts."""
    plan = readme_plan()
    assert plan["commands"]["first_run"] and plan["commands"]["test_sh"]
    for script in ("install.sh", "test.sh"):
        path = ROOT / "scripts" / script
        assert os.access(path, os.X_OK), f"scripts/{script} is not executable"
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert re.search(r"^\s*bash scripts/install\.sh", (ROOT / "scripts" / "test.sh").read_text(), re.M)
    assert re.search(r"^\s*bash scripts/test\.sh", (ROOT / ".ci" / "run").read_text(), re.M)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _swiftlm_exe() -> list[str]:
    """The `swiftlm` console script of the environment running the tests."""
    exe = Path(sys.executable).parent / "swiftlm"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "swiftlm.cli"]


def _start(argv: list[str], env: dict, timeout: float = 300) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    deadline = time.time() + timeout
    line = proc.stdout.readline()
    while line and '"ready"' not in line and time.time() < deadline:
        line = proc.stdout.readline()
    if '"ready"' not in line:
        _stop(proc)
        raise AssertionError(f"{argv} did not become ready")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def readme_server():
    """The README's first command's server: `.venv/bin/swiftlm`, no arguments (the bundled model, port 5413)."""
    if not _port_free(README_PORT):
        pytest.skip(f"port {README_PORT}, which the README's snippets use, is taken on this machine")
    exe = ROOT / README_SERVER  # the README's path, as printed
    argv = [str(exe)] if exe.exists() else _swiftlm_exe()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc, ready = _start(argv, env)
    assert ready["port"] == README_PORT and ready["model"] == "smollm2-135m-instruct", ready
    yield ready
    _stop(proc)


def test_readme_snippets_run_as_printed(readme_server, tmp_path):
    """Every python block runs unchanged, as a file, against the README's server, and prints the ```text block that
    follows it; the curl command answers the same text; the agents' settings work with their clients' SDKs."""
    plan = readme_plan()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    failures = []
    for i, (code, expect) in enumerate(plan["python"]):
        f = tmp_path / f"snippet_{i}.py"
        f.write_text(code)
        r = subprocess.run([sys.executable, str(f)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        if r.returncode != 0:
            failures.append(f"README python block {i} failed:\n{code}\n{r.stderr[-1500:]}")
        elif expect is not None and expect not in r.stdout:
            failures.append(f"README python block {i} printed {r.stdout!r}, the README shows {expect!r}")
    assert not failures, "\n\n".join(failures)

    answer = next(e for _, e in plan["python"] if e)
    for cmd in plan["commands"]["curl"]:
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        content = json.loads(r.stdout)["choices"][0]["message"]["content"]
        assert answer in content, (cmd, content)

    _check_claude_code(plan)
    _check_codex(plan)
    _check_opencode(plan)


TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}


def _check_claude_code(plan: dict) -> None:
    """The README's `export ANTHROPIC_*` lines, as Claude Code uses them: the Messages API at the base URL, the token
    as a Bearer header, tools and streaming."""
    import anthropic

    env = dict(re.fullmatch(r"export (\w+)=(\S+)", c).groups() for c in plan["commands"]["claude_env"])
    assert plan["commands"]["claude_code"] == ["claude"]
    client = anthropic.Anthropic(base_url=env["ANTHROPIC_BASE_URL"], auth_token=env["ANTHROPIC_AUTH_TOKEN"])
    tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
    msgs = [{"role": "user", "content": "Read README.md"}]
    m = client.messages.create(
        model=env["ANTHROPIC_MODEL"], max_tokens=16, system="Be brief.", messages=msgs, tools=tools
    )
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(model=env["ANTHROPIC_MODEL"], max_tokens=8, messages=msgs) as s:
        assert s.get_final_message().usage.output_tokens > 0


def _check_codex(plan: dict) -> None:
    """The README's Codex CLI config: the Responses API at the provider's base_url, with a function tool, streamed."""
    import tomllib
    from openai import OpenAI

    (text,) = plan["toml"]
    cfg = tomllib.loads(text)
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert provider["wire_api"] == "responses"
    client = OpenAI(base_url=provider["base_url"], api_key=os.environ.get(provider.get("env_key", ""), "unused"))
    tools = [{"type": "function", **TOOL}]
    r = client.responses.create(model=cfg["model"], input="Read README.md", tools=tools, max_output_tokens=16)
    assert r.status in ("completed", "incomplete")
    events = [e.type for e in client.responses.create(model=cfg["model"], input="Hi", max_output_tokens=8, stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")


def _check_opencode(plan: dict) -> None:
    """The README's opencode config: an OpenAI-compatible provider; chat completions with tools, streamed."""
    from openai import OpenAI

    (text,) = plan["json"]
    cfg = json.loads(text)
    pname, model = cfg["model"].split("/", 1)
    provider = cfg["provider"][pname]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and model in provider["models"]
    client = OpenAI(base_url=provider["options"]["baseURL"], api_key=provider["options"]["apiKey"])
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Read README.md"}],
        tools=[{"type": "function", "function": TOOL}],
        max_tokens=16,
        stream=True,
    )
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_readme_hub_command_downloads_and_serves(tmp_path):
    """`swiftlm serve --model Qwen/Qwen3-0.6B`, run as printed against a stand-in for the hub (HF_ENDPOINT) that
    holds a tiny random-weight qwen3 checkpoint under that name: the model is downloaded into an empty cache, served,
    and answers a chat completion."""
    from conftest import make_ckpt
    from test_hub import FakeHub

    (cmd,) = readme_plan()["commands"]["hub_serve"]
    argv = shlex.split(cmd)
    repo = argv[-1]
    ck = make_ckpt(tmp_path / "ck", "--arch", "qwen3", "--hidden", "64", "--layers", "2", "--heads", "2",
                   "--kv-heads", "1", "--intermediate", "128", "--dtype", "float32")  # fmt: skip
    hub = FakeHub()
    hub.repos[repo] = {"files": {p.name: p.read_bytes() for p in ck.iterdir() if p.is_file()}}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drop = ("HF_TOKEN", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "SWIFTLM_OFFLINE", "HF_HUB_ENABLE_HF_TRANSFER")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        SWIFTLM_PORT=str(port),  # the README's command as printed; only the port is moved, by its variable
        TOKENIZERS_PARALLELISM="false",
    )
    try:
        proc, ready = _start(_swiftlm_exe() + argv[1:], env)
        try:
            assert ready["port"] == port
            assert any(path.startswith(f"/api/models/{repo}") for _, path, _ in hub.requests), "nothing downloaded"
            assert (tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}").is_dir()
            body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                out = json.loads(resp.read())
            assert out["choices"][0]["finish_reason"] in ("stop", "length")
        finally:
            _stop(proc)
    finally:
        hub.close()
