"""The engine core in its own process (``--engine-process on``; ``auto``: on for torch on CUDA).

Why: through HTTP the asyncio loop holds the GIL a large share of the time, and the engine
thread's torch calls wait for it (docs/engine.md).  Here the model and the step loop run in a
child process (a fresh interpreter, as multiprocessing's ``spawn`` starts: CUDA initialises in the
child only) that has no
other Python work; the server's process keeps what needs text: the tokenizer, chat templates,
media decoding and the output worker (detokenisation, stop strings, Events to sinks).

Wire: one ``multiprocessing.Pipe`` (a socketpair), each message one ``pickle`` (protocol 5) of a
tuple of plain values.  The child sends ONE message per engine step:
``("out", outputs, ended ids, stats snapshot or None)``, each output a plain tuple (an ``Out``'s
fields); the stats snapshot (counters, histograms, step timers, scheduler and cache levels,
memory) rides along at most every ``SNAPSHOT_EVERY`` seconds, and always when a request ended
or the engine went idle, so /health and /metrics read the same fields as with the in-thread
engine.  The parent sends ``add`` / ``cancel`` / ``stopped`` / ``end_all`` / ``embed`` / ``stop``.

Failure: the child's engine loop dying sends ``fatal``; the child dying outright (killed, a
CUDA abort) closes the pipe.  Either way every open stream ends with the error, new requests
are refused (``QueueFull``: 503) and ``on_fatal`` is called, as with the in-thread engine.  The
child exits when the parent's end of the pipe closes, so a parent killed with SIGKILL leaves no
orphan; it ignores SIGINT/SIGTERM (a terminal's Ctrl-C reaches the whole process group; the
parent drains, then stops the child with ``stop``).
"""

from __future__ import annotations

import atexit
import copy
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Pipe
from typing import Any

from .engine import PromptSide, QueueFull, pooled
from .errors import ConfigError, InvalidRequest
from .fork import ForkStats
from .outputs import Out, OutputWorker, Sink
from .sampling import SamplingParams
from .stats import EngineStats, LatencyHistogram
from .timers import PHASES, StepTimers

log = logging.getLogger(__name__)

SNAPSHOT_EVERY = 0.1  # seconds between stats snapshots while requests run
_P = pickle.HIGHEST_PROTOCOL  # 5 on every supported Python


def wanted(settings: Any, backend: Any) -> bool:
    """--engine-process: on, off, or auto (on when the torch backend will run on CUDA)."""
    mode = getattr(settings, "engine_process", "off")
    if mode == "off":
        return False
    if (getattr(settings, "tensor_parallel", 1) or 1) > 1 or (getattr(settings, "pipeline_parallel", 1) or 1) > 1:
        if mode == "on":
            raise ConfigError(
                "--engine-process on does not combine with --tensor-parallel / --pipeline-parallel "
                "(rank 0 already drives the other ranks' processes); use --engine-process off"
            )
        return False
    if mode == "on":
        return True
    if getattr(backend, "name", "") != "torch" or (getattr(settings, "device", None) or "").startswith("cpu"):
        return False
    try:
        return backend.available().device.startswith("cuda")
    except Exception:  # pragma: no cover - the backend was chosen, so it answered once already
        return False


# ---------------------------------------------------------------------------------------- encoding
def _enc_out(o: Out) -> tuple:
    return (o.seq_id, o.token, o.logprob, o.top, o.reason, o.error, o.progress, o.cached_tokens)


def _hist_state(h: LatencyHistogram) -> tuple:
    return (h.buckets, list(h.counts), h.count, h.sum, h.max)


def _hist_from(state: tuple) -> LatencyHistogram:
    h = LatencyHistogram(state[0])
    h.counts, h.count, h.sum, h.max = state[1], state[2], state[3], state[4]
    return h


_HISTS = ("ttft", "queue_time", "duration", "tpot")


def _stats_state(st: EngineStats) -> dict:
    d = {k: v for k, v in vars(st).items() if k not in _HISTS}
    d["finished"] = dict(st.finished)
    for k in _HISTS:
        d[k] = _hist_state(getattr(st, k))
    return d


def _stats_from(d: dict) -> EngineStats:
    st = EngineStats()
    for k, v in d.items():
        setattr(st, k, _hist_from(v) if k in _HISTS else v)
    return st


def _snapshot(eng: Any) -> dict:
    """Everything /health and /metrics read from an engine, taken on the engine thread."""
    from .memory import process_memory

    sch, pc, model, t = eng.scheduler, eng.prefix_cache, eng.model, eng.timers
    with t._lock:
        timers = ({p: list(t.counts[p]) for p in PHASES}, dict(t.sums), dict(t.n))
    try:
        mem = dict(model.memory())
    except Exception:  # pragma: no cover - a racing free must not fail the snapshot
        mem = {}
    mem["engine_process_rss"] = process_memory()["rss"]
    reader = getattr(model, "expert_stream", None)
    spec = eng.speculator
    return {
        "stats": _stats_state(eng.stats),
        "timers": timers,
        "kv": eng.kv_stats(),
        "memory": mem,
        "sched": (
            len(sch.waiting),
            len(sch.running),
            sch.kv_in_use(),
            sch.kv_budget,
            sch.preemptions,
            sch.block_stats(),
        ),
        "prefix": (len(pc), pc.bytes, pc.hits, pc.misses, pc.tokens_reused),
        "experts": eng.expert_stream_stats(),
        "expert_reader": copy.copy(reader.stats) if reader else None,
        "spec": copy.copy(spec.stats) if spec is not None else None,
        "graph_capture": getattr(model, "graph_capture", None),
        "fork": eng.fork_stats.snapshot(),
        "gc": eng.gc_stats(),
    }


# ---------------------------------------------------------------------------------------- child
def _orphan_watch(ppid: int) -> None:
    """While loading (when nobody reads the pipe), a parent that is gone ends the child."""
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(4)


def main(fd: int) -> None:
    """The engine process (``python -c ... main(fd)``): the first message on the socket ``fd`` is
    (settings, backend name, model spec); load, report ``ready`` (or the load error), then run
    commands until ``stop`` or until the parent's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), name="swiftlm-orphan-watch", daemon=True).start()
    settings, backend_name, spec = pickle.loads(conn.recv_bytes())
    logging.basicConfig(
        level=getattr(logging, str(settings.log_level).upper(), logging.INFO),
        format="%(levelname)s [engine process] %(name)s: %(message)s",
    )
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=_P)
        with send_lock:
            conn.send_bytes(data)

    live = threading.Event()  # set once ``ready`` went out: no step message may precede it
    when = {"t": 0.0, "idle": True}
    engine: Any = None

    def publish(outs: list[Out], ended: list[int]) -> None:
        """On the engine thread, after each step (and each idle wake-up): one message."""
        if not live.is_set():
            return
        now = time.perf_counter()
        idle = not engine._live
        snap = None
        if ended or now - when["t"] >= (SNAPSHOT_EVERY if not idle else 2.0) or (idle and not when["idle"]):
            try:
                snap = _snapshot(engine)
            except Exception:  # pragma: no cover - stats must never stop the engine
                log.exception("stats snapshot failed")
            when["t"] = now
        when["idle"] = idle
        if outs or ended or snap is not None:
            send(("out", [_enc_out(o) for o in outs], ended, snap))

    try:
        from .backend import choose_backend
        from .llm import load_engine

        backend, _ = choose_backend(backend_name)
        engine = load_engine(settings, backend, spec, publish=publish)
        engine.on_fatal = lambda msg: send(("fatal", msg))
        m = engine.model
        send(
            (
                "ready",
                {
                    "info": engine.info,
                    "ctx_size": engine.ctx_size,
                    "max_running": engine.scheduler.max_running,
                    "can_embed": hasattr(m, "hidden_states"),
                    "kv_default": getattr(m, "kv_default", None),
                    "speculator": (engine.speculator.drafter.name, engine.speculator.k)
                    if engine.speculator is not None
                    else None,
                    "expert_reader": (m.expert_stream.mode,) if getattr(m, "expert_stream", None) else None,
                    "pid": os.getpid(),
                    "snapshot": _snapshot(engine),
                },
            )
        )
        live.set()
    except BaseException as exc:  # noqa: BLE001 - the parent must hear why
        try:
            pickle.dumps(exc, protocol=_P)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        try:
            send(("error", exc))
        finally:
            os._exit(3)

    def embed_job(job: int, prompts: list[list[int]]) -> None:
        raw: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is None:
                send(("embedded", job, True, f.result()))
            else:
                try:
                    pickle.dumps(exc, protocol=_P)
                except Exception:
                    exc = RuntimeError(f"{type(exc).__name__}: {exc}")
                send(("embedded", job, False, exc))

        raw.add_done_callback(done)
        engine._inbox.put(("embed", (prompts, raw)))

    code, grace = 0, 5.0
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the parent is gone: stop, leave no orphan
                code = 4
                break
            cmd = msg[0]
            if cmd == "add":
                engine.add_checked(*msg[1:])
            elif cmd == "group":
                engine.add_group_checked(msg[1])
            elif cmd == "cancel":
                engine.cancel(msg[1])
            elif cmd == "stopped":
                engine._inbox.put(("stopped", msg[1]))
            elif cmd == "end_all":
                engine.end_all(msg[1])
            elif cmd == "embed":
                embed_job(msg[1], msg[2])
            elif cmd == "stop":
                grace = msg[1]
                break
    finally:
        engine.shutdown(grace)
        try:
            send(("bye",))
        except Exception:
            pass
        logging.shutdown()
        os._exit(code)  # no interpreter finalisation with device threads alive (see server.app.serve)


# ---------------------------------------------------------------------------------------- parent views
class _SchedulerView:
    """The child's scheduler levels, as /health and /metrics read them (``len(waiting)`` ...)."""

    def __init__(self, max_running: int, t: tuple = (0, 0, 0, None, 0, None)):
        self.max_running = max_running
        n_wait, n_run, self._kv, self.kv_budget, self.preemptions, self._blocks = t
        self.waiting, self.running = range(n_wait), range(n_run)

    def kv_in_use(self) -> int:
        return self._kv

    def block_stats(self) -> dict[str, int] | None:
        return self._blocks


class _PrefixView:
    def __init__(self, t: tuple = (0, 0, 0, 0, 0)):
        self._n, self.bytes, self.hits, self.misses, self.tokens_reused = t

    def __len__(self) -> int:
        return self._n

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class _Ops:
    def end_thread(self) -> None:
        """Nothing of the device lives in this process."""


class _ExpertReaderView:
    def __init__(self, mode: str):
        self.mode, self.stats = mode, None


class _ModelView:
    """What the server reads of ``engine.model``: memory figures and start-up facts (the model is
    in the engine process)."""

    def __init__(self, ready: dict):
        self.ops = _Ops()
        self.graph_capture = None
        self._memory: dict = {}
        er = ready.get("expert_reader")
        self.expert_stream = _ExpertReaderView(er[0]) if er else None
        if ready.get("kv_default") is not None:
            self.kv_default = ready["kv_default"]

    def memory(self) -> dict:
        return dict(self._memory)


class _SpeculatorView:
    def __init__(self, drafter: str, k: int):
        self.drafter = types.SimpleNamespace(name=drafter)
        self.k = k
        from .speculative import SpecStats

        self.stats = SpecStats()


# ---------------------------------------------------------------------------------------- parent
class EngineClient(PromptSide):
    """The ``Engine`` interface, with the engine in a child process (see the module's text)."""

    def __init__(self, settings: Any, backend: Any, spec: Any, start_timeout: float | None = None):
        from .media import MediaPolicy, processor_for
        from .media.processor import check_settings
        from .tokenizer import load_gguf_tokenizer, load_hf_tokenizer

        check_settings(spec, settings)
        self.backend_name = backend.name
        self.tool_parser = settings.tool_parser
        self.json_close, self.json_repeat_guard = settings.json_close, settings.json_repeat_guard
        self.default_max_tokens = settings.max_tokens
        self.max_queue = settings.max_queue
        self.fatal: str | None = None
        self.on_fatal: Any = None
        self._stopping = False
        self._lock = threading.Lock()  # guards _pending and the pipe's sending end
        self._pending = 0
        self._ids = itertools.count(1)
        self._jobs: dict[int, Future] = {}
        self._job_ids = itertools.count(1)
        self.timers = StepTimers()  # the child's phases, merged from snapshots; "output" measured here
        self.stats = EngineStats()
        self.fork_stats = ForkStats()
        # A fresh interpreter (what multiprocessing's 'spawn' gives, without its re-import of the caller's
        # __main__: a script without an ``if __name__ == "__main__"`` guard works), joined by a socketpair
        self._conn, child_conn = Pipe(duplex=True)
        fd = child_conn.fileno()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from swiftlm.engine_process import main; main({fd})"],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        child_conn.close()  # the child's end lives in the child only: its death closes the pipe here
        self._conn.send_bytes(pickle.dumps((settings, backend.name, spec), protocol=_P))
        # while the child loads the model, this process loads the tokenizer (the same files, the same rule
        # as the backends: the GGUF's own vocabulary, else the checkpoint's tokenizer files)
        try:
            self.tokenizer = (
                load_gguf_tokenizer(spec.gguf_meta or {})
                if spec.format == "gguf"
                else load_hf_tokenizer(spec.path, spec.config)
            )
            ready = self._wait_ready(start_timeout)
        except BaseException:
            self._kill()
            raise
        self.info = ready["info"]
        self.ctx_size = ready["ctx_size"]
        self._can_embed = ready["can_embed"]
        self.child_pid = ready["pid"]
        self.scheduler = _SchedulerView(ready["max_running"])
        self.prefix_cache = _PrefixView()
        self.model = _ModelView(ready)
        sp = ready.get("speculator")
        self.speculator = _SpeculatorView(*sp) if sp else None
        self._kv: dict = {"default_format": "fp16", "bytes": 0, "fp16_bytes": 0, "compression_ratio": 1.0}
        self._experts: dict | None = None
        self._gc: dict | None = None
        self._apply(ready["snapshot"])
        processor = processor_for(spec, self.tokenizer)
        self.media_processor = processor
        self.media_policy = MediaPolicy.from_settings(settings, processor.modalities if processor else (), spec.arch)
        self.outputs = OutputWorker(
            self.tokenizer, on_stop=lambda sid: self._send(("stopped", sid)), timers=self.timers, thread=False
        )
        self._bye = threading.Event()
        self._reader = threading.Thread(target=self._read, name="swiftlm-engine-client", daemon=True)
        self._reader.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e.shutdown(2.0))

    def _wait_ready(self, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError("the engine process did not become ready in time")
        msg = pickle.loads(self._conn.recv_bytes())
        if msg[0] == "error":
            raise msg[1]
        if msg[0] != "ready":  # pragma: no cover - protocol error
            raise RuntimeError(f"the engine process sent {msg[0]!r} before 'ready'")
        return msg[1]

    # ------------------------------------------------------------------ the Engine interface
    def submit(self, prompt_tokens: list[int], params: SamplingParams, sink: Sink) -> int:
        self._check(prompt_tokens, params)
        if params.grammar is not None:  # checked here so that a bad grammar is a 400 now, not an error later
            import llguidance

            is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(params.grammar)
            if is_err:
                raise InvalidRequest(f"invalid grammar: {msgs[0] if msgs else 'rejected'}", param="response_format")
        seq_id = self._take_slot(params)
        media = getattr(prompt_tokens, "media", None)
        self.outputs.open(seq_id, sink, params.stop, len(prompt_tokens))
        try:
            self._send(("add", seq_id, list(prompt_tokens), params, media, time.perf_counter()))
        except Exception:
            self.outputs.streams.pop(seq_id, None)
            with self._lock:
                self._pending -= 1
            raise QueueFull(self.fatal or "the engine process is gone") from None
        return seq_id

    def submit_group(self, prompt_tokens: list[int], params: list[SamplingParams], sink: Sink) -> list[int]:
        """As ``Engine.submit_group``: the choices of one request, prefilled once in the child."""
        if len(params) == 1:
            return [self.submit(prompt_tokens, params[0], sink)]
        for p in params:
            self._check(prompt_tokens, p)
        if params[0].grammar is not None:  # one request: one grammar for every choice
            import llguidance

            is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(params[0].grammar)
            if is_err:
                raise InvalidRequest(f"invalid grammar: {msgs[0] if msgs else 'rejected'}", param="response_format")
        ids = self._take_slots(params)
        media, now, prompt = getattr(prompt_tokens, "media", None), time.perf_counter(), list(prompt_tokens)
        for sid, p in zip(ids, params):
            self.outputs.open(sid, sink, p.stop, len(prompt))
        try:
            self._send(("group", [(sid, prompt, p, media, now) for sid, p in zip(ids, params)]))
        except Exception:
            for sid in ids:
                self.outputs.streams.pop(sid, None)
            with self._lock:
                self._pending -= len(ids)
            raise QueueFull(self.fatal or "the engine process is gone") from None
        return ids

    def cancel(self, seq_id: int) -> None:
        self._send_quiet(("cancel", seq_id))

    def end_all(self, reason: str = "length") -> None:
        self._send_quiet(("end_all", reason))

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> Future[list[Any]]:
        if not self._can_embed:
            raise InvalidRequest(f"the {self.backend_name} backend does not compute embeddings")
        if self.fatal:
            raise QueueFull(self.fatal)
        self._check_embed(prompts)
        raw: Future = Future()
        job = next(self._job_ids)
        self._jobs[job] = raw
        try:
            self._send(("embed", job, [list(p) for p in prompts]))
        except Exception:
            self._jobs.pop(job, None)
            raise QueueFull(self.fatal or "the engine process is gone") from None
        return pooled(raw, self.info.pooling, dimensions)

    @property
    def live_requests(self) -> int:
        return self._pending

    @property
    def running(self) -> bool:
        return self._proc.poll() is None and self.fatal is None

    def kv_stats(self) -> dict[str, Any]:
        return dict(self._kv)

    def gc_stats(self) -> dict[str, Any]:
        """The engine process's collections (where the step loop runs), and this process's."""
        from .gc_pauses import GcPauses

        return {**(self._gc or {}), "server_process": GcPauses.install().snapshot()}

    def expert_stream_stats(self) -> dict[str, Any] | None:
        return None if self._experts is None else dict(self._experts)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (its live requests end 'cancelled'), wait for it, and never leave it
        running: past ``timeout`` it is terminated, then killed."""
        if self._stopping:
            return
        self._stopping = True
        self._send_quiet(("stop", timeout))
        self._bye.wait(timeout + 2.0)  # the reader saw 'bye', or the pipe close
        self._kill(grace=2.0)
        self._reader.join(2.0)
        self.outputs.end_all("cancelled")  # whatever the child could not end
        self._conn.close()

    # ------------------------------------------------------------------ internals
    def _send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=_P)
        with self._lock:
            self._conn.send_bytes(data)

    def _send_quiet(self, msg: tuple) -> None:
        try:
            self._send(msg)
        except (OSError, ValueError):  # the child is gone; its death is reported by the reader
            pass

    def _kill(self, grace: float = 0.0) -> None:
        """Wait ``grace`` seconds for the child to exit, then kill it (it ignores SIGTERM) and reap it."""
        try:
            self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10.0)

    def _apply(self, snap: dict) -> None:
        self.stats = _stats_from(snap["stats"])
        self.fork_stats = ForkStats(**snap.get("fork", {}))
        counts, sums, n = snap["timers"]
        t = self.timers
        with t._lock:
            for p in PHASES:
                if p != "output":
                    t.counts[p], t.sums[p], t.n[p] = counts[p], sums[p], n[p]
        self.scheduler = _SchedulerView(self.scheduler.max_running, snap["sched"])
        self.prefix_cache = _PrefixView(snap["prefix"])
        self._kv = snap["kv"]
        self._gc = snap.get("gc")
        self._experts = snap["experts"]
        self.model._memory = snap["memory"]
        self.model.graph_capture = snap["graph_capture"]
        if self.model.expert_stream is not None:
            self.model.expert_stream.stats = snap["expert_reader"]
        if self.speculator is not None and snap["spec"] is not None:
            self.speculator.stats = snap["spec"]

    def _read(self) -> None:
        """The reader thread: each step's message -> the output worker (run right here)."""
        why = None
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                kind = msg[0]
                if kind == "out":
                    _, outs, ended, snap = msg
                    if snap is not None:
                        self._apply(snap)
                    if ended:
                        with self._lock:
                            self._pending -= len(ended)
                    if outs:
                        self.outputs.process([Out(*o) for o in outs])
                elif kind == "embedded":
                    _, job, ok, payload = msg
                    fut = self._jobs.pop(job, None)
                    if fut is not None:
                        fut.set_result(payload) if ok else fut.set_exception(payload)
                elif kind == "fatal":
                    why = msg[1]
                    break
                elif kind == "bye":
                    break
        except (EOFError, OSError):
            pass
        except Exception as exc:  # pragma: no cover - a protocol error is the engine's death too
            log.exception("engine process reader failed")
            why = f"engine process reader failed: {type(exc).__name__}: {exc}"
        try:
            if self._stopping and why is None:
                return
            if why is None:
                try:
                    self._proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
                why = f"the engine process died (exit code {self._proc.returncode})"
            self._die(why)
        finally:
            self._bye.set()

    def _die(self, why: str) -> None:
        self.fatal = why
        self._stopping = True
        log.critical(why)
        self.outputs.end_all("error", why)
        for job in list(self._jobs):
            fut = self._jobs.pop(job, None)
            if fut is not None:
                fut.set_exception(RuntimeError(why))
        with self._lock:
            self._pending = 0
        self._kill()
        if self.on_fatal is not None:
            self.on_fatal(why)
