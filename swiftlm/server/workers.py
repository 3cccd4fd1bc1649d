"""``--api-workers N``: N HTTP worker processes on one port, in front of engine processes.

Why: one Python process that parses requests, applies chat templates, detokenises and writes SSE
for hundreds of streams is bound by its one interpreter (the GIL), however fast the engine is.

Shape (``serve_workers``, the process ``swiftlm serve`` started, the *supervisor*):

1. every setting is checked before anything listens (cli_serve.check_before_serving, then
   ``check_settings`` here);
2. N listening sockets bound to the same address with ``SO_REUSEPORT`` (the kernel spreads new
   connections over them); the first fixes the port when ``--port 0``;
3. the engine process(es): one, or one per ``--data-parallel`` replica, each started with 1 + N
   connections (engine_process.EngineClient(workers=N)): the supervisor keeps connection 0 (it
   hears ``Fatal`` and stops the engines at the end), worker w gets connection w + 1;
4. N workers (fresh interpreters, in a session of their own so a terminal's Ctrl-C reaches the
   supervisor only), each running the ordinary server (app.serve) on its socket with
   ``EngineClient.attach`` engines (with --data-parallel: a ReplicaSet over them, routing by the
   engines' whole load: this worker's outstanding sequences plus the other workers' at the last
   stats snapshot);
5. the ready line once every worker listens.

/health and /metrics answer for the whole server from any worker: the engine's figures come from
its snapshots (the same for every worker), and the HTTP counters (requests, errors, tokens
delivered, latencies) live in prometheus-client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, a
temporary directory of the supervisor's), summed at each scrape.

Stopping: SIGINT / SIGTERM to the supervisor is passed on (SIGTERM) to every worker, each of which
drains as one server does (--shutdown-timeout); then the engines stop.  A second Ctrl-C forces the
workers.  A worker that dies is not restarted: the supervisor logs it with its exit code, stops the
others and exits 1 (as a dead engine does), so a process manager sees one failure.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

AUTO_PARALLEL = 64  # --parallel above this counts as "many streams" for the automatic worker count


def resolve_count(settings: Any, backend: Any) -> int:
    """How many API workers: --api-workers, else 1, or min(cores // 4, 2 x engines) (at least 1) when
    several engines run (--data-parallel) or --parallel is above 64, and the engine runs in its own process."""
    if settings.api_workers:
        return int(settings.api_workers)
    from ..engine_process import wanted

    engines = max(1, int(settings.data_parallel or 1))
    if engines == 1 and settings.parallel <= AUTO_PARALLEL:
        return 1
    if settings.models_file or settings.extra_models or settings.distributed:
        return 1
    try:
        if not wanted(settings, backend):
            return 1
    except ConfigError:
        return 1
    return max(1, min((os.cpu_count() or 1) // 4, 2 * engines))


def check_settings(settings: Any, backend: Any) -> None:
    """What --api-workers N (N > 1) does not combine with, in one sentence."""
    n = int(settings.api_workers or 0)
    if n <= 1:
        return
    if settings.engine_process == "off":
        raise ConfigError(
            f"--api-workers {n} needs the engine in its own process (the workers share it); drop --engine-process off"
        )
    if settings.models_file or settings.extra_models:
        raise ConfigError(f"--api-workers {n} serves one model (not --models-file or a repeated --model)")
    if settings.distributed:
        raise ConfigError(f"--api-workers {n} does not combine with --distributed (mlx.launch ranks)")


def listen_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` listening sockets on one address (SO_REUSEPORT); the first chooses the port when 0."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    out: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, kind, proto)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr)
            addr = (addr[0], s.getsockname()[1], *addr[2:])
            s.listen(2048)
            s.set_inheritable(True)
    except BaseException:
        for s in out:
            s.close()
        raise
    return out


@dataclass
class WorkerSetup:
    """What a worker process is told (pickled on its control connection)."""

    index: int
    workers: int
    settings: Any
    spec: Any
    backend: str
    sock_fd: int
    engine_fds: list[int]
    devices: list[str]


# ---------------------------------------------------------------------------------------- supervisor
def serve_workers(settings: Any, n: int, loading: Any = None) -> int:
    from ..backend import choose_backend
    from ..distributed.replicas import build_replicas
    from ..engine_process import EngineClient
    from ..registry import resolve

    spec = resolve(settings.model, allow_download=False if settings.offline else None)
    backend, why = choose_backend(settings.backend)
    settings = settings.model_copy(update={"api_workers": n, "engine_process": "on"})
    socks = listen_sockets(settings.host, settings.port, n)
    port = socks[0].getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="swiftlm-metrics-")
    stop = threading.Event()
    outcome: dict[str, Any] = {}

    def fatal(msg: str) -> None:
        outcome.setdefault("fatal", msg)
        stop.set()

    procs: list[subprocess.Popen] = []
    engine: Any = None
    try:

        def make(s: Any, b: Any, sp: Any) -> Any:
            return EngineClient(s, b, sp, workers=n)

        import contextlib

        name = settings.served_model_name or spec.name
        entry = type("E", (), {"name": name, "model": settings.model})()
        with loading(entry) if loading is not None else contextlib.nullcontext():
            if settings.data_parallel > 1:
                engine = build_replicas(settings, backend, spec, make)
                clients, devices = list(engine.replicas), list(engine.devices)
            else:
                engine = make(settings, backend, spec)
                clients, devices = [engine], []
        engine.on_fatal = fatal
        ctls: list[Connection] = []
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
        for i in range(n):
            mine, theirs = Pipe(duplex=True)
            fds = [theirs.fileno(), socks[i].fileno()] + [c.worker_conns[i].fileno() for c in clients]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", f"from swiftlm.server.api_worker import worker_main; worker_main({fds[0]})"],
                    pass_fds=fds,
                    stdin=subprocess.DEVNULL,
                    close_fds=True,
                    env=env,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which passes it on
                )
            )
            theirs.close()
            mine.send(WorkerSetup(i, n, settings, spec, backend.name, fds[1], fds[2:], devices))
            ctls.append(mine)
        for c in clients:  # the workers hold their ends now
            for wc in c.worker_conns:
                wc.close()
            c.worker_conns = []
        for s in socks:
            s.close()
        _install_signals(stop, procs, outcome)
        _wait_listening(ctls, procs, outcome)
        if "error" not in outcome and "fatal" not in outcome:
            print(
                json.dumps(
                    {
                        "event": "ready",
                        "host": settings.host,
                        "port": port,
                        "scheme": "https" if settings.ssl_certfile else "http",
                        "model": name,
                        "models": [name],
                        "backend": backend.name,
                        "backend_choice": why,
                        "api_workers": n,
                    }
                ),
                flush=True,
            )
            _supervise(stop, procs, outcome)
        _stop_workers(procs, settings.shutdown_timeout + 15.0)
    except Exception as exc:
        print(f"swiftlm: error: {exc}", file=sys.stderr)
        outcome["error"] = exc
        _stop_workers(procs, 5.0)
    finally:
        for s in socks:
            s.close()
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if "fatal" in outcome:
        print(f"swiftlm: error: {outcome['fatal']}", file=sys.stderr)
        return 1
    if "error" in outcome:
        return getattr(outcome["error"], "exit_code", 1)
    return 0


def _install_signals(stop: threading.Event, procs: list[subprocess.Popen], outcome: dict) -> None:
    def handle(sig: int, frame: Any) -> None:
        first = "signal" not in outcome
        outcome["signal"] = sig
        for p in procs:  # the first: drain (SIGTERM); a second Ctrl-C: force (SIGINT after SIGTERM)
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM if first else signal.SIGINT)
                except ProcessLookupError:  # pragma: no cover
                    pass
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


def _wait_listening(ctls: list[Connection], procs: list[subprocess.Popen], outcome: dict) -> None:
    """Each worker says "listening" (or fails); a worker that exits first is an error."""
    waiting = dict(enumerate(ctls))
    while waiting and "signal" not in outcome and "fatal" not in outcome:
        for c in wait(list(waiting.values()), timeout=0.5):
            i = next(k for k, v in waiting.items() if v is c)
            try:
                msg = c.recv()
            except (EOFError, OSError):
                msg = ("exited", procs[i].wait(5.0))
            if msg[0] != "listening":
                outcome["error"] = RuntimeError(f"API worker {i} (pid {procs[i].pid}) failed to start: {msg[1]}")
                return
            del waiting[i]


def _supervise(stop: threading.Event, procs: list[subprocess.Popen], outcome: dict) -> None:
    """Until a signal, an engine's death, or a worker's: one worker gone stops the server (exit 1)."""
    while not stop.wait(0.2):
        for i, p in enumerate(procs):
            if p.poll() is not None:
                msg = f"API worker {i} (pid {p.pid}) exited with code {p.returncode}; stopping the server"
                log.critical(msg)
                outcome.setdefault("fatal", msg)
                stop.set()
                break
    if "signal" not in outcome:  # a death: the others drain as on SIGTERM
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)


def _stop_workers(procs: list[subprocess.Popen], timeout: float) -> None:
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5.0)
