"""The engine core in its own process (``--engine-process on``; ``auto``: on for torch on CUDA).

Why: through HTTP the asyncio loop holds the GIL a large share of the time, and the engine
thread's torch calls wait for it (docs/engine.md).  Here the model and the step loop run in a
child process (a fresh interpreter, as multiprocessing's ``spawn`` starts: CUDA initialises in the
child only) that has no other Python work; the server's process keeps what needs text: the
tokenizer, chat templates, media decoding and the output worker (detokenisation, stop strings,
Events to sinks).  Under ``--tensor-parallel`` / ``--pipeline-parallel`` the child is rank 0 and
starts the other ranks itself (engine_child.py).

Wire: typed messages (engine_wire.py) over ``multiprocessing`` connections (socketpairs).  The
child sends one ``Step`` per engine step (outputs, ended ids, and now and then a stats snapshot,
so /health and /metrics read the same fields as with the in-thread engine).

Connections: ``EngineClient(..., workers=N)`` starts the child with 1 + N connections: its own,
and one per API worker process (``--api-workers``), which a worker takes over with
``EngineClient.attach``.  Each connection numbers its sequences from its own base
(``id_base``), so ids are disjoint and the child routes each output to its owner.

Failure: the child's engine loop dying (or a rank of its model dying) sends ``Fatal``; the child
dying outright (killed, a CUDA abort) closes the pipe.  Either way every open stream ends with the
error, new requests are refused (``QueueFull``: 503) and ``on_fatal`` is called, as with the
in-thread engine.  The child exits when the starting process's end closes, so a parent killed with
SIGKILL leaves no orphan; it ignores SIGINT/SIGTERM (a terminal's Ctrl-C reaches the whole process
group; the parent drains, then stops the child with ``Stop``).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection, Pipe
from typing import Any

from . import engine_wire as w
from .engine_views import ModelView, PrefixView, SchedulerView, SpeculatorView
from .errors import InvalidRequest
from .fork import ForkStats
from .outputs import Out, OutputWorker, Sink
from .prompts import PromptFront, Prompts, pooled
from .sampling import SamplingParams
from .slots import Lifecycle, QueueFull, Slots, delegated
from .stats import EngineStats
from .timers import PHASES, StepTimers

log = logging.getLogger(__name__)

ID_STRIDE = 1 << 40  # connection c numbers its sequences from c * ID_STRIDE (times the replica count)


def wanted(settings: Any, backend: Any) -> bool:
    """--engine-process: on, off, or auto (on when the torch backend will run on CUDA, one GPU or
    several ranks of --tensor-parallel / --pipeline-parallel alike)."""
    mode = getattr(settings, "engine_process", "off")
    if mode == "off":
        return False
    if mode == "on":
        return True
    if getattr(backend, "name", "") != "torch" or (getattr(settings, "device", None) or "").startswith("cpu"):
        return False
    try:
        return backend.available().device.startswith("cuda")
    except Exception:  # pragma: no cover - the backend was chosen, so it answered once already
        return False


# ---------------------------------------------------------------------------------------- parent
def _shut(conn: Connection) -> None:
    import socket

    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:  # pragma: no cover - already closed
        pass


class EngineClient(PromptFront):
    """The ``Engine`` interface, with the engine in a child process (see the module's text).  It owns, as
    ``Engine`` does, the prompt side (``prompts``), the queue's slots (``slots``) and its ``life``; the
    child's engine owns the rest."""

    fatal = delegated("life", "fatal", "why the engine process died, if it did (then /health is 503)")
    tool_parser = delegated("prompts", "tool_parser")
    media_policy = delegated("prompts", "media_policy")
    media_processor = delegated("prompts", "media_processor")
    default_max_tokens = delegated("slots", "default_max_tokens")
    max_queue = delegated("slots", "max_queue")

    def __init__(
        self,
        settings: Any,
        backend: Any,
        spec: Any,
        start_timeout: float | None = None,
        *,
        workers: int = 0,
        conn: Connection | None = None,
    ):
        """Start the engine process (``conn`` None), with ``workers`` extra connections for API worker
        processes (``worker_conns``: hand each to its worker, then close it here); or, with ``conn``,
        attach to a running one through that connection (an API worker; ``backend`` is its name)."""
        from .tokenizer import load_gguf_tokenizer, load_hf_tokenizer

        self.backend_name = backend if isinstance(backend, str) else backend.name
        self._init_fields(settings)
        self._proc: subprocess.Popen | None = None
        self.worker_conns: list[Connection] = []
        if conn is None:
            from .media.processor import check_settings

            check_settings(spec, settings)
            # A fresh interpreter (what multiprocessing's 'spawn' gives, without its re-import of the caller's
            # __main__: a script without an ``if __name__ == "__main__"`` guard works), joined by socketpairs
            pairs = [Pipe(duplex=True) for _ in range(1 + workers)]
            self._conn = pairs[0][0]
            self.worker_conns = [p[0] for p in pairs[1:]]
            fds = [p[1].fileno() for p in pairs]
            self._proc = subprocess.Popen(
                [sys.executable, "-c", f"from swiftlm.engine_child import main; main({fds})"],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
            for p in pairs:  # the child's ends live in the child only: its death closes the pipes here
                p[1].close()
            self._conn.send_bytes(w.dumps(w.Setup(settings, self.backend_name, spec, 1 + workers)))
        else:
            self._conn = conn
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
        self._init_ready(settings, spec, ready)

    @classmethod
    def attach(cls, settings: Any, backend_name: str, spec: Any, conn: Connection) -> EngineClient:
        """An API worker's view of an engine process that its supervisor started."""
        return cls(settings, backend_name, spec, conn=conn)

    def _init_fields(self, settings: Any) -> None:
        self.json_close, self.json_repeat_guard = settings.json_close, settings.json_repeat_guard
        self.life = Lifecycle()
        self.on_fatal: Any = None
        self._lock = threading.Lock()  # guards the pipe's sending end
        self._others = 0  # other connections' live sequences at the last snapshot (API workers)
        self._jobs: dict[int, Future] = {}
        self._job_ids = itertools.count(1)
        self.timers = StepTimers()  # the child's phases, merged from snapshots; "output" measured here
        self.stats = EngineStats()
        self.fork_stats = ForkStats()

    def _init_ready(self, settings: Any, spec: Any, ready: w.Ready) -> None:
        from .media import MediaPolicy, processor_for

        facts = ready.facts
        self.conn_index = ready.conn
        self.id_base = ready.conn * ID_STRIDE
        self.slots = Slots(
            settings.max_queue, facts["max_running"], settings.max_tokens, itertools.count(self.id_base + 1)
        )
        self.info = facts["info"]
        self.ctx_size = facts["ctx_size"]
        self._can_embed = facts["can_embed"]
        self.child_pid = facts["pid"]
        self.rank_pids: dict[int, int] = facts.get("rank_pids") or {}
        self.scheduler = SchedulerView(facts["max_running"])
        self.prefix_cache = PrefixView()
        self.model = ModelView(facts)
        sp = facts.get("speculator")
        self.speculator = SpeculatorView(*sp) if sp else None
        self._kv: dict = {"default_format": "fp16", "bytes": 0, "fp16_bytes": 0, "compression_ratio": 1.0}
        self._experts: dict | None = None
        self._gc: dict | None = None
        self._apply(facts["snapshot"])
        self.prompts = Prompts(self.tokenizer, self.info, self.ctx_size, self.model, self.life)
        processor = processor_for(spec, self.tokenizer)
        self.prompts.tool_parser = settings.tool_parser
        self.prompts.media_processor = processor
        self.prompts.media_policy = MediaPolicy.from_settings(
            settings, processor.modalities if processor else (), spec.arch
        )
        self.outputs = OutputWorker(
            self.tokenizer, on_stop=lambda sid: self._send(w.Stopped(sid)), timers=self.timers, thread=False
        )
        self._bye = threading.Event()
        self._reader = threading.Thread(target=self._read, name="swiftlm-engine-client", daemon=True)
        self._reader.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e.shutdown(2.0))

    def _wait_ready(self, timeout: float | None) -> w.Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError("the engine process did not become ready in time")
        msg = w.loads(self._conn.recv_bytes())
        if isinstance(msg, w.LoadError):
            raise msg.error
        if not isinstance(msg, w.Ready):  # pragma: no cover - protocol error
            raise RuntimeError(f"the engine process sent {type(msg).__name__} before Ready")
        return msg

    # ------------------------------------------------------------------ the Engine interface
    def submit(self, prompt_tokens: list[int], params: SamplingParams, sink: Sink) -> int:
        self.prompts.check(prompt_tokens, params)
        if params.grammar is not None:  # checked here so that a bad grammar is a 400 now, not an error later
            import llguidance

            is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(params.grammar)
            if is_err:
                raise InvalidRequest(f"invalid grammar: {msgs[0] if msgs else 'rejected'}", param="response_format")
        seq_id = self.slots.take(params)
        media = getattr(prompt_tokens, "media", None)
        self.outputs.open(seq_id, sink, params.stop, len(prompt_tokens))
        try:
            self._send(w.Add(seq_id, list(prompt_tokens), params, media, time.perf_counter()))
        except Exception:
            self.outputs.streams.pop(seq_id, None)
            self.slots.give_back()
            raise QueueFull(self.fatal or "the engine process is gone") from None
        return seq_id

    def submit_group(self, prompt_tokens: list[int], params: list[SamplingParams], sink: Sink) -> list[int]:
        """As ``Engine.submit_group``: the choices of one request, prefilled once in the child."""
        if len(params) == 1:
            return [self.submit(prompt_tokens, params[0], sink)]
        for p in params:
            self.prompts.check(prompt_tokens, p)
        if params[0].grammar is not None:  # one request: one grammar for every choice
            import llguidance

            is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(params[0].grammar)
            if is_err:
                raise InvalidRequest(f"invalid grammar: {msgs[0] if msgs else 'rejected'}", param="response_format")
        ids = self.slots.take_all(params)
        media, now, prompt = getattr(prompt_tokens, "media", None), time.perf_counter(), list(prompt_tokens)
        for sid, p in zip(ids, params):
            self.outputs.open(sid, sink, p.stop, len(prompt))
        try:
            self._send(w.Group([w.Add(sid, prompt, p, media, now) for sid, p in zip(ids, params)]))
        except Exception:
            for sid in ids:
                self.outputs.streams.pop(sid, None)
            self.slots.give_back(len(ids))
            raise QueueFull(self.fatal or "the engine process is gone") from None
        return ids

    def cancel(self, seq_id: int) -> None:
        self._send_quiet(w.Cancel(seq_id))

    def end_all(self, reason: str = "length") -> None:
        self._send_quiet(w.EndAll(reason))

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> Future[list[Any]]:
        if not self._can_embed:
            raise InvalidRequest(f"the {self.backend_name} backend does not compute embeddings")
        if self.fatal:
            raise QueueFull(self.fatal)
        self.prompts.check_embed(prompts)
        raw: Future = Future()
        job = next(self._job_ids)
        self._jobs[job] = raw
        try:
            self._send(w.Embed(job, [list(p) for p in prompts]))
        except Exception:
            self._jobs.pop(job, None)
            raise QueueFull(self.fatal or "the engine process is gone") from None
        return pooled(raw, self.info.pooling, dimensions)

    @property
    def live_requests(self) -> int:
        """This connection's outstanding sequences, plus (API workers) the other connections' at the
        engine's last snapshot: the engine's whole load, as a router over replicas wants it."""
        return self.slots.pending + self._others

    @property
    def running(self) -> bool:
        alive = self._proc.poll() is None if self._proc is not None else not self._bye.is_set()
        return alive and self.fatal is None

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
        running: past ``timeout`` it is terminated, then killed.  Attached (an API worker): close
        this connection only (the child cancels this worker's live sequences)."""
        if self.life.stopping:
            return
        self.life.stopping = True
        if self._proc is not None:
            self._send_quiet(w.Stop(timeout))
            self._bye.wait(timeout + 2.0)  # the reader saw Bye, or the pipe close
            self._kill(grace=2.0)
        else:  # the reader thread sees EOF (closing the connection under its recv would fail it), so does the child
            _shut(self._conn)
        self._reader.join(2.0)
        self.outputs.end_all("cancelled")  # whatever the child could not end
        self._conn.close()
        for c in self.worker_conns:
            c.close()

    # ------------------------------------------------------------------ internals
    def _send(self, msg: Any) -> None:
        data = w.dumps(msg)
        with self._lock:
            self._conn.send_bytes(data)

    def _send_quiet(self, msg: Any) -> None:
        try:
            self._send(msg)
        except (OSError, ValueError):  # the child is gone; its death is reported by the reader
            pass

    def _kill(self, grace: float = 0.0) -> None:
        """Wait ``grace`` seconds for the child to exit, then kill it (it ignores SIGTERM) and reap it."""
        if self._proc is None:
            return
        try:
            self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10.0)

    def _apply(self, snap: dict) -> None:
        self.stats = w.stats_from(snap["stats"])
        self.fork_stats = ForkStats(**snap.get("fork", {}))
        counts, sums, n = snap["timers"]
        t = self.timers
        with t._lock:
            for p in PHASES:
                if p != "output":
                    t.counts[p], t.sums[p], t.n[p] = counts[p], sums[p], n[p]
        self.scheduler = SchedulerView(self.scheduler.max_running, snap["sched"])
        self.prefix_cache = PrefixView(snap["prefix"])
        self._kv = snap["kv"]
        self._gc = snap.get("gc")
        self._experts = snap["experts"]
        self.model._memory = snap["memory"]
        self.model.graph_capture = snap["graph_capture"]
        if self.model.expert_stream is not None:
            self.model.expert_stream.stats = snap["expert_reader"]
        if self.speculator is not None and snap["spec"] is not None:
            self.speculator.stats = snap["spec"]
        by_conn = snap.get("live_by_conn")
        if by_conn is not None:
            self._others = sum(v for k, v in by_conn.items() if k != getattr(self, "conn_index", 0))

    def _read(self) -> None:
        """The reader thread: each step's message -> the output worker (run right here)."""
        why = None
        try:
            while True:
                msg = w.loads(self._conn.recv_bytes())
                if type(msg) is w.Step:
                    if msg.snap is not None:
                        self._apply(msg.snap)
                    if msg.ended:
                        self.slots.give_back(len(msg.ended))
                    if msg.outs:
                        self.outputs.process([Out(*o) for o in msg.outs])
                elif type(msg) is w.Embedded:
                    fut = self._jobs.pop(msg.job, None)
                    if fut is not None:
                        fut.set_result(msg.payload) if msg.ok else fut.set_exception(msg.payload)
                elif type(msg) is w.Fatal:
                    why = msg.why
                    break
                elif type(msg) is w.Bye:
                    break
        except (EOFError, OSError):
            pass
        except Exception as exc:  # pragma: no cover - a protocol error is the engine's death too
            log.exception("engine process reader failed")
            why = f"engine process reader failed: {type(exc).__name__}: {exc}"
        try:
            if self.life.stopping and why is None:
                return
            if why is None:
                if self._proc is not None:
                    try:
                        self._proc.wait(1.0)
                    except subprocess.TimeoutExpired:
                        pass
                    why = f"the engine process died (exit code {self._proc.returncode})"
                else:
                    why = f"the engine process (pid {self.child_pid}) died"
            self._die(why)
        finally:
            self._bye.set()

    def _die(self, why: str) -> None:
        self.fatal = why
        self.life.stopping = True
        log.critical(why)
        self.outputs.end_all("error", why)
        for job in list(self._jobs):
            fut = self._jobs.pop(job, None)
            if fut is not None:
                fut.set_exception(RuntimeError(why))
        with self.slots.lock:
            self.slots.pending = 0
        self._kill()
        if self.on_fatal is not None:
            self.on_fatal(why)
