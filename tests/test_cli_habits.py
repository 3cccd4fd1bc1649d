"""The command-line habits users bring from Ollama, llama-server and mlx_lm.server, one test per habit: --version,
the model as the first argument, llama-server's short flags, pull / ls / ps, "did you mean", a one-screen grouped
--help, the loading line, checks before the port is bound, one-sentence hub errors, the access log, one exit-code
convention, and integer counters on /metrics.

Most run the parser or ``main`` in this process; a process is started only where the process is what is tested
(exit codes, a check before binding, the served name of a running server), with the fake backend plugin."""

from __future__ import annotations

import http.server
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT

from swiftlm import __version__, cli
from swiftlm.cli_common import settings_of
from swiftlm.config import Settings
from swiftlm.errors import SwiftLMError

PLUGINS = str(ROOT / "tests" / "plugins")  # the fake backend, for the processes started here


def swiftlm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=PLUGINS)
    return subprocess.run(
        [sys.executable, "-m", "swiftlm.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def usage_error(capsys, argv: list[str]) -> str:
    """The one line a command-line mistake prints (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "usage:" not in err and "Traceback" not in err, err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# 1 ---------------------------------------------------------------------------------------------------------
def test_version(capsys):
    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr().out.strip() == f"swiftlm {__version__}"


# 2 ---------------------------------------------------------------------------------------------------------
def test_model_as_the_first_argument(capsys, bundled_gguf):
    for argv, command, model in (
        ("serve smollm2", "serve", "smollm2"),
        ("chat smollm2", "chat", "smollm2"),
        ("run smollm2", "chat", "smollm2"),  # Ollama's name for chat
        ("generate smollm2 -p hi", "generate", "smollm2"),
        ("smollm2", "serve", "smollm2"),  # no command: serve
        (f"{bundled_gguf} --port 9", "serve", str(bundled_gguf)),
    ):
        args = cli.parse(argv.split())
        assert (args.command, settings_of(args).model) == (command, model), argv
    assert settings_of(cli.parse("serve --model smollm2".split())).model == "smollm2"  # --model keeps working
    assert settings_of(cli.parse("chat -m smollm2".split())).model == "smollm2"
    err = usage_error(capsys, "serve smollm2 --model other/model".split())
    assert "the model is given twice" in err and "give it once" in err


# 3 ---------------------------------------------------------------------------------------------------------
def test_llama_server_short_flags():
    argv = "serve -m smollm2 -c 4096 -ngl 99 -np 4 --host 0.0.0.0 --port 8081 -a tiny -q".split()
    s = settings_of(cli.parse(argv))
    assert (s.model, s.ctx_size, s.gpu_layers, s.parallel, s.host, s.port) == ("smollm2", 4096, 99, 4, "0.0.0.0", 8081)
    assert s.served_model_name == "tiny" and s.quiet
    assert settings_of(cli.parse("serve --alias tiny --n-gpu-layers 3".split())).served_model_name == "tiny"
    # declared once, on the settings, so every command that takes the setting takes the short form
    for name, short in (("model", "-m"), ("ctx_size", "-c"), ("gpu_layers", "-ngl"), ("parallel", "-np")):
        assert short in Settings.model_fields[name].json_schema_extra["aliases"]
    assert "-a" in Settings.model_fields["served_model_name"].json_schema_extra["aliases"]


def test_alias_names_the_served_model(monkeypatch):
    """-a: the name /v1/models lists, responses carry and the ready line reports (a real server process)."""
    import httpx
    from server_util import ServerProc

    monkeypatch.setenv("PYTHONPATH", PLUGINS)
    srv = ServerProc("--backend", "fake", "-a", "tiny", "--max-tokens", "4", timeout=60)
    try:
        assert srv.ready["model"] == "tiny" and srv.ready["models"] == ["tiny"]
        assert [m["id"] for m in httpx.get(srv.base + "/v1/models").json()["data"]] == ["tiny"]
        r = httpx.post(srv.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
    finally:
        srv.stop()


# 4 ---------------------------------------------------------------------------------------------------------
class _FakeServer(http.server.BaseHTTPRequestHandler):
    bodies = {
        "/health": {"status": "ok", "model": "tiny", "backend": "fake", "memory": {"active": 1 << 20, "peak": 2 << 20}},
        "/v1/models": {
            "object": "list",
            "data": [{"id": "tiny", "created": 1, "status": {"value": "loaded", "in_flight": 0, "pinned": True}}],
        },
    }

    def do_GET(self):  # noqa: N802
        body = json.dumps(self.bodies[self.path]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_pull_ls_and_ps(capsys, monkeypatch):
    assert cli.parse("pull owner/name".split()).command == "download"
    assert cli.parse(["ls"]).command == "models"
    assert cli.main(["pull", "smollm2"]) == 0  # the bundled model: nothing to fetch, no network
    assert "bundled model" in capsys.readouterr().out

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = str(httpd.server_address[1])
        assert cli.main(["ps", "--port", port, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["url"] == f"http://127.0.0.1:{port}" and [m["id"] for m in out["models"]] == ["tiny"]
        monkeypatch.setenv("COLUMNS", "120")
        assert cli.main(["ps", "--port", port]) == 0
        table = capsys.readouterr().out
        assert "tiny" in table and "loaded" in table
    finally:
        httpd.shutdown()
    dead = str(free_port())
    assert cli.main(["ps", "--port", dead]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"swiftlm: error: no swiftlm server answers at http://127.0.0.1:{dead}") and "\n" not in err


# 5 ---------------------------------------------------------------------------------------------------------
def test_did_you_mean(capsys):
    assert "unknown command 'servr' (did you mean serve?)" in usage_error(capsys, ["servr"])
    assert "(did you mean --temp" in usage_error(capsys, "serve --tmp 0.5".split())
    assert "(did you mean --max-tokens" in usage_error(capsys, "chat --max-tokns 3".split())
    assert "(did you mean float16" in usage_error(capsys, "convert a.gguf out --dtype flot16".split())
    assert "(did you mean --concurrency?)" in usage_error(capsys, "bench serve --base-url x --concurency 2".split())
    assert "unknown command 'frobnicate'" in usage_error(capsys, ["frobnicate"])  # neither a command nor a model


# 6 ---------------------------------------------------------------------------------------------------------
def test_serve_help_is_one_screen_by_topic_and_help_all_has_everything(capsys, monkeypatch):
    from swiftlm.cli_help import FIELD_TOPIC, TOPICS, topic_of

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        cli.main("serve --help".split())
    assert e.value.code == 0
    short = capsys.readouterr().out
    lines = short.rstrip("\n").splitlines()
    assert len(lines) <= 60, len(lines)
    assert max(len(ln) for ln in lines) <= 100
    titles = [re.sub(r"( \(and \d+ more\))?:$", "", ln) for ln in lines if ln[:1].isalpha() and ln.endswith(":")]
    assert titles[1:] == [t for _, t, _ in TOPICS], titles  # after the command's own MODEL argument
    for flag in ("-m, --model", "-c, --ctx-size", "-ngl, --gpu-layers", "-np, --parallel", "-a, --served-model-name"):
        assert flag in short, flag
    assert re.search(r"--port PORT .*\(default: 5413\)", short) and "--help-all" in short

    with pytest.raises(SystemExit):
        cli.main("serve --help-all".split())
    full = capsys.readouterr().out
    for name in Settings.model_fields:
        if name != "extra_models":
            assert f"SWIFTLM_{name.upper()}" in full, name
    # every setting has a topic; every name the topics list is a setting
    assert {topic_of(n) for n in Settings.model_fields} <= {k for k, _, _ in TOPICS}
    assert set(FIELD_TOPIC) | {n for _, _, common in TOPICS for n in common} <= set(Settings.model_fields)


# 7 ---------------------------------------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_loading_line_on_a_terminal_only(monkeypatch):
    from swiftlm import cli_progress
    from swiftlm.cli_serve import _loading_hook

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    log = logging.getLogger("swiftlm.test_loading_line")
    handler = logging.StreamHandler(term)  # e.g. uvicorn's start-up lines, bound to the terminal
    log.addHandler(handler)
    try:
        with cli_progress.loading_line("loading tiny (1 MiB)", "loaded tiny"):
            time.sleep(0.3)
            log.warning("Uvicorn running")
    finally:
        log.removeHandler(handler)
    out = term.getvalue()
    assert "loading tiny (1 MiB)" in out
    # what stays on the screen: each line after its last carriage return, without colours
    seen = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", ln.split("\r")[-1]) for ln in out.split("\n")]
    assert any(re.fullmatch(r"✓ loaded tiny in \d+\.\d s", ln.strip()) for ln in seen), seen
    assert any(ln.strip() == "Uvicorn running" for ln in seen), seen  # printed above the bar, not through it
    assert sys.stderr is term and handler.stream is term  # put back

    for quiet, stream in ((True, _Terminal()), (False, io.StringIO())):  # --quiet, or not a terminal: nothing
        monkeypatch.setattr(sys, "stderr", stream)
        with cli_progress.loading_line("loading tiny", quiet=quiet):
            pass
        assert stream.getvalue() == ""
    assert _loading_hook(Settings()) is None  # the server's hook too: no line, the ready line alone on stdout
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert _loading_hook(Settings()) is not None and _loading_hook(Settings(quiet=True)) is None


# 8 ---------------------------------------------------------------------------------------------------------
def test_checks_before_the_port_is_bound(tmp_path):
    from swiftlm.cli_serve import check_settings_before_serving

    port = str(free_port())
    r = swiftlm("serve", "--backend", "fake", "--port", port, "--stream-experts")
    assert r.returncode == 2, r.stderr
    assert "--stream-experts needs an MoE model in safetensors" in r.stderr and "is a GGUF file" in r.stderr
    assert "Uvicorn" not in r.stderr and "startup" not in r.stderr.lower() and "ready" not in r.stdout
    assert len(r.stderr.strip().splitlines()) == 1

    models = tmp_path / "models.toml"
    models.write_text('[[models]]\nmodel = "smollm2"\n')
    for kw, says in (
        (dict(speculative="draft"), "--speculative draft needs --draft-model"),
        (dict(draft_model=str(tmp_path / "nope")), "not found"),
        (dict(adapter=[f"a={tmp_path}"]), "has no adapter_config.json"),
        (dict(gpu_layers=1), "--gpu-layers is built for the torch backend only"),
        (dict(served_model_name="x", models_file=str(models)), "--served-model-name names the one --model"),
    ):
        with pytest.raises(SwiftLMError, match=re.escape(says)) as e:
            check_settings_before_serving(Settings(backend="fake", **kw))
        assert e.value.exit_code == 2
    check_settings_before_serving(Settings(backend="fake"))  # and a good command line passes


# 9 ---------------------------------------------------------------------------------------------------------
def test_hub_errors_are_one_sentence(capsys, monkeypatch, tmp_path):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(repo_id, **kw):
        try:
            raise httpx.ConnectError("[Errno -2] Name or service not known")
        except httpx.ConnectError as exc:
            raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known") from exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("SWIFTLM_OFFLINE", raising=False)
    assert cli.main(["serve", "someone/some-model", "--port", "0"]) == 1  # found before the port is bound
    err = capsys.readouterr().err.strip()
    assert err.startswith("swiftlm: error: someone/some-model is not in the local cache") and "\n" not in err
    assert "cannot be reached" in err and "`swiftlm download someone/some-model`" in err
    assert "LocalEntryNotFoundError" not in err and "ConnectError" not in err

    # --offline: no hub asked, the model is not here (a usage error)
    assert cli.main(["serve", "someone/some-model", "--offline", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "download disabled by --offline" in err and "`swiftlm download someone/some-model` fetches it" in err


# 10 --------------------------------------------------------------------------------------------------------
def test_access_log_line_per_request(fake_llm):
    from starlette.testclient import TestClient

    from swiftlm.server.app import create_app

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    access = logging.getLogger("swiftlm.access")
    keep = Keep()
    access.addHandler(keep)
    settings = fake_llm.settings.model_copy(update={"access_log": True})
    app = create_app(settings, engine=fake_llm.engine, spec=fake_llm.spec, backend="fake")
    msgs = [{"role": "user", "content": "hi"}]
    try:
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0})
            usage = r.json()["usage"]
            client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "stream": True}).read()
            client.get("/health")
            client.get("/v1/nope")
    finally:
        access.removeHandler(keep)
    pat = r"(\S+) (\S+) (\d+) model=(\S+) tokens_in=(\d+) tokens_out=(\d+) ttft=(\S+) duration=(\d+\.\d+)"
    got = [re.fullmatch(pat, ln).groups() for ln in lines]
    chat, stream, health, nope = got
    name = fake_llm.spec.name
    assert chat[:6] == ("POST", "/v1/chat/completions", "200", name, str(usage["prompt_tokens"]), "5")
    assert float(chat[6]) <= float(chat[7])
    assert stream[:6] == ("POST", "/v1/chat/completions", "200", name, str(usage["prompt_tokens"]), "3")
    assert health[:7] == ("GET", "/health", "200", "-", "0", "0", "-")
    assert nope[:3] == ("GET", "/v1/nope", "404")
    assert Settings.model_fields["access_log"].json_schema_extra["group"] == "server"


# 11 --------------------------------------------------------------------------------------------------------
def test_exit_codes_2_for_usage_1_for_runtime():
    usage = [swiftlm("servr"), swiftlm("serve", "--temp", "-1")]  # a mistyped command, a value out of range
    for r in usage:
        assert r.returncode == 2, r.stderr
    runtime = swiftlm("ps", "--port", str(free_port()))
    assert runtime.returncode == 1, runtime.stderr
    for r in [*usage, runtime]:
        assert r.stderr.startswith("swiftlm") and "Traceback" not in r.stderr
    assert swiftlm("-V").returncode == 0


# 12 --------------------------------------------------------------------------------------------------------
def test_counters_print_as_integers():
    from prometheus_client.parser import text_string_to_metric_families

    from swiftlm.server.metrics import Metrics, whole_counts

    m = Metrics()
    m.gen_tokens.inc(487)
    m.prompt_tokens.inc(487_000_000)  # prometheus_client alone prints 4.87e+08
    m.requests.labels("chat").inc()
    m.count_error(404)
    m.ttft.observe(0.25)
    text = m.render(None).decode()
    assert "\nswiftlm_generation_tokens_total 487\n" in text
    assert "\nswiftlm_prompt_tokens_total 487000000\n" in text
    assert '\nswiftlm_requests_total{route="chat"} 1\n' in text
    assert '\nswiftlm_request_errors_total{status="404"} 1\n' in text
    assert "\nswiftlm_time_to_first_token_seconds_count 1\n" in text
    assert '\nswiftlm_time_to_first_token_seconds_bucket{le="0.5"} 1\n' in text
    assert "\nswiftlm_time_to_first_token_seconds_sum 0.25\n" in text  # fractions stay floats
    assert re.search(r"\nswiftlm_generation_tokens_created \d+\.\d+", text)  # a timestamp: a float
    assert "swiftlm_uptime_seconds " in text and not re.search(r"\nswiftlm_uptime_seconds \d+\n", text)
    seconds = b"# TYPE swiftlm_busy_seconds_total counter\nswiftlm_busy_seconds_total 3.0\n"
    assert whole_counts(seconds) == seconds  # a counter of seconds is a duration: a float, even when whole
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["swiftlm_generation_tokens_total"] == 487  # and Prometheus still parses it
