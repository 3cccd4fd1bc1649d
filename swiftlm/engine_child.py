"""The engine process's side (``python -c "from swiftlm.engine_child import main; main([fds])"``).

It serves one or more connections (socketpairs its parent passed it).  Connection 0 belongs to
the process that started it (the server, or with ``--api-workers`` the supervisor): ``Setup``
comes on it first, ``Stop`` is obeyed on it only, and its closing stops the engine (a parent
killed with SIGKILL leaves no orphan).  Connections 1.. belong to API worker processes: each
submits its own requests; the outputs of a sequence go back on the connection that added it, and
a connection that closes has its live sequences cancelled.  Every connection gets ``Ready``, each
stats snapshot and ``Fatal``.  The sequence ids of different connections must be disjoint (each
worker numbers its own from its own base; see engine_process.EngineClient).

Under ``--tensor-parallel`` / ``--pipeline-parallel`` this process is rank 0: ``load_engine``
spawns the other ranks from here (distributed/launch.py), and a rank's death reaches every
connection as ``Fatal`` naming the rank (llm._rank_failed -> engine.on_fatal).
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any

from . import engine_wire as w
from .outputs import Out
from .timers import PHASES

log = logging.getLogger(__name__)

SNAPSHOT_EVERY = 0.1  # seconds between stats snapshots while requests run


def snapshot(eng: Any) -> dict:
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
    reader = model.expert_stream
    spec = eng.speculator
    return {
        "stats": w.stats_state(eng.stats),
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
        "graph_capture": model.graph_capture,
        "fork": eng.fork_stats.snapshot(),
        "gc": eng.gc_stats(),
    }


def _orphan_watch(ppid: int) -> None:
    """While loading (when nobody reads the pipe), a parent that is gone ends the child."""
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(4)


class _Conns:
    """The connections and who owns which live sequence."""

    def __init__(self, conns: list[Any]):
        self.conns = conns
        self.locks = [threading.Lock() for _ in conns]
        self.owner: dict[int, int] = {}  # live sequence id -> connection index
        self.closed: set[int] = set()

    def send(self, i: int, data: bytes) -> None:
        if i in self.closed:
            return
        try:
            with self.locks[i]:
                self.conns[i].send_bytes(data)
        except (OSError, ValueError):  # that worker is gone: its reader thread cancels its sequences
            self.closed.add(i)

    def send_all(self, msg: Any) -> None:
        data = w.dumps(msg)
        for i in range(len(self.conns)):
            self.send(i, data)


def main(fds: list[int] | int) -> None:
    """Load (``Setup`` from connection 0), report ``Ready`` on every connection (or ``LoadError``),
    then run commands until ``Stop`` or until connection 0 closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from multiprocessing.connection import Connection

    fds = [fds] if isinstance(fds, int) else list(fds)
    cs = _Conns([Connection(fd) for fd in fds])
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), name="swiftlm-orphan-watch", daemon=True).start()
    setup: w.Setup = w.loads(cs.conns[0].recv_bytes())
    logging.basicConfig(
        level=getattr(logging, str(setup.settings.log_level).upper(), logging.INFO),
        format="%(levelname)s [engine process] %(name)s: %(message)s",
    )
    live = threading.Event()  # set once ``Ready`` went out: no step message may precede it
    when = {"t": 0.0, "idle": True}
    engine: Any = None
    many = len(cs.conns) > 1

    def publish(outs: list[Out], ended: list[int]) -> None:
        """On the engine thread, after each step (and each idle wake-up): one message per connection."""
        if not live.is_set():
            return
        now = time.perf_counter()
        idle = not engine.live_requests
        snap = None
        if ended or now - when["t"] >= (SNAPSHOT_EVERY if not idle else 2.0) or (idle and not when["idle"]):
            try:
                snap = snapshot(engine)
                if many:  # each worker's share of the live sequences (their routing load)
                    snap["live_by_conn"] = dict(collections.Counter(cs.owner.values()))
            except Exception:  # pragma: no cover - stats must never stop the engine
                log.exception("stats snapshot failed")
            when["t"] = now
        when["idle"] = idle
        if not (outs or ended or snap is not None):
            return
        if not many:
            cs.send(0, w.dumps(w.Step([w.enc_out(o) for o in outs], ended, snap)))
            return
        per: dict[int, w.Step] = {}
        for o in outs:
            per.setdefault(cs.owner.get(o.seq_id, 0), w.Step()).outs.append(w.enc_out(o))
        for sid in ended:
            per.setdefault(cs.owner.pop(sid, 0), w.Step()).ended.append(sid)
        for i in range(len(cs.conns)):
            msg = per.get(i)
            if msg is None and snap is None:
                continue
            msg = msg or w.Step()
            msg.snap = snap
            cs.send(i, w.dumps(msg))

    try:
        from .backend import choose_backend
        from .llm import load_engine

        backend, _ = choose_backend(setup.backend)
        engine = load_engine(setup.settings, backend, setup.spec, publish=publish)
        engine.on_fatal = lambda msg: cs.send_all(w.Fatal(msg))
        m = engine.model
        procs = getattr(m, "_procs", None) or {}  # --tensor/--pipeline-parallel: this host's other ranks
        facts = {
            "info": engine.info,
            "ctx_size": engine.ctx_size,
            "max_running": engine.scheduler.max_running,
            "can_embed": m.can_embed,
            "kv_default": m.kv_default,
            "lora_names": tuple(m.lora.names) if m.lora is not None else None,
            "speculator": (engine.speculator.drafter.name, engine.speculator.k)
            if engine.speculator is not None
            else None,
            "expert_reader": (m.expert_stream.mode,) if m.expert_stream is not None else None,
            "pid": os.getpid(),
            "rank_pids": {r: p.pid for r, p in procs.items() if p is not None},
            "snapshot": snapshot(engine),
        }
        for i in range(len(cs.conns)):
            cs.send(i, w.dumps(w.Ready(facts, i)))
        live.set()
    except BaseException as exc:  # noqa: BLE001 - the parent must hear why
        try:
            cs.send_all(w.LoadError(w.picklable(exc)))
        finally:
            os._exit(3)

    def embed_job(i: int, job: int, prompts: list[list[int]]) -> None:
        def done(f: Future) -> None:
            exc = f.exception()
            cs.send(
                i,
                w.dumps(w.Embedded(job, True, f.result()) if exc is None else w.Embedded(job, False, w.picklable(exc))),
            )

        engine.intake.hidden_states(prompts).add_done_callback(done)

    def handle(i: int, msg: Any) -> bool:
        """One command from connection ``i``; False: stop the engine."""
        if isinstance(msg, w.Add):
            if many:
                cs.owner[msg.seq_id] = i
            engine.intake.add_checked(msg.seq_id, msg.prompt, msg.params, msg.media, msg.t)
        elif isinstance(msg, w.Group):
            if many:
                cs.owner.update((a.seq_id, i) for a in msg.adds)
            engine.intake.add_group_checked([(a.seq_id, a.prompt, a.params, a.media, a.t) for a in msg.adds])
        elif isinstance(msg, w.Cancel):
            engine.cancel(msg.seq_id)
        elif isinstance(msg, w.Stopped):
            engine.intake.stopped(msg.seq_id)
        elif isinstance(msg, w.EndAll):
            engine.end_all(msg.reason)
        elif isinstance(msg, w.Embed):
            embed_job(i, msg.job, msg.prompts)
        elif isinstance(msg, w.Stop) and i == 0:
            return False
        return True

    def serve_worker(i: int) -> None:
        """An API worker's connection, on its own thread; when it closes, its sequences are cancelled."""
        conn = cs.conns[i]
        while True:
            try:
                msg = w.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            handle(i, msg)
        cs.closed.add(i)
        for sid in [s for s, o in list(cs.owner.items()) if o == i]:
            engine.cancel(sid)

    for i in range(1, len(cs.conns)):
        threading.Thread(target=serve_worker, args=(i,), name=f"swiftlm-engine-conn{i}", daemon=True).start()

    code, grace = 0, 5.0
    try:
        while True:
            try:
                msg = w.loads(cs.conns[0].recv_bytes())
            except (EOFError, OSError):  # the parent is gone: stop, leave no orphan
                code = 4
                break
            if not handle(0, msg):
                grace = msg.grace
                break
    finally:
        engine.shutdown(grace)
        try:  # --tensor-parallel: the other ranks exit (ModelHooks.close: a no-op by default)
            engine.model.close()
        except Exception:  # pragma: no cover
            log.exception("closing the model")
        try:
            cs.send_all(w.Bye())
        except Exception:
            pass
        logging.shutdown()
        os._exit(code)  # no interpreter finalisation with device threads alive (see server.app.serve)
