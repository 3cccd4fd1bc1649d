"""The control plane of a multi-rank model: rank 0 (the leader) runs the normal engine; every
call the engine makes on its model is first sent to the other ranks (the followers), which make
the same call on their own shard and discard the result.  The collectives inside the calls
(all-reduce, gather) are the backend's; this module only keeps the ranks in step.

Why pickled messages over ``multiprocessing.connection`` sockets, not the backend's own
broadcast (``torch.distributed.broadcast_object_list``):

- backend-agnostic: nothing here imports torch, so MLX's distributed ranks can use it unchanged;
- off the device: an object broadcast over NCCL stages the pickle through GPU memory and
  synchronizes the stream every step, which would serialize the overlapped decode; a socket write
  is a few microseconds of host work and the followers receive it while rank 0 computes;
- failure is visible: a dead rank closes its socket (and its process sentinel fires), which a
  watchdog thread sees at once, where a collective would block until its timeout;
- authenticated (HMAC challenge with a per-launch random key) before anything is unpickled.

Each message is pickled once and written to every follower.  A step's ``StepBatch`` travels
without its sampler state (only rank 0 samples) and without sampling parameters (its KV format,
decided at admission, is on the work item).  Overlapped decode's on-device input ids stay on rank 0's device: the
message carries ``LeaderArray(n)`` and the backend broadcasts the ids itself.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from ..backend import SeqWork, StepBatch
from ..bench.metrics import percentile
from ..gc_pauses import GcPauses, freeze

log = logging.getLogger(__name__)

# Model calls that change state or run collectives: every rank makes them, in the same order.
BROADCAST = frozenset({"forward", "free", "hidden_states", "logits", "score"})


class RankFailure(BaseException):
    """A rank died: the model cannot run.  A BaseException (like SystemExit), so that the engine
    loop does not treat it as one failed step and go on, but dies and reports it (engine.on_fatal
    stops the server with the message)."""


@dataclass
class LeaderArray:
    """Stands in a follower's message for an array that only rank 0 holds on its device (the
    overlapped decode's input ids): ``n`` entries, which the backend broadcasts from rank 0."""

    n: int


@dataclass
class PrefixRef:
    """A prompt-cache payload of a multi-rank model: rank 0's payload, and the key under which
    each follower keeps its own shard's.  When the prompt cache drops it, the followers drop theirs."""

    key: int
    payload: Any


def no_delay(conn: Connection) -> bool:
    """Turn Nagle's algorithm off on a control connection over TCP (True when it is TCP).  A message over 16 KB
    (a step of ~100 decode rows and more) is written as its 4-byte length, then the payload; with Nagle on, the
    payload waits for the length's acknowledgement, which the receiver delays by up to 40 ms: every few steps of
    a busy tensor-parallel server stalled that long (scripts/gpu_api_workers.sh's step logs)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:  # a second handle on the same socket
            if s.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return True
    except (OSError, ValueError):  # closed, or not a socket (a pipe)
        return False


def wire_batch(batch: StepBatch) -> StepBatch:
    seqs = [
        SeqWork(w.seq_id, list(w.tokens), w.start_pos, w.sample, None, None, w.media, w.kv_format) for w in batch.seqs
    ]
    ids = None if batch.input_ids is None else LeaderArray(len(batch.seqs))
    return StepBatch(seqs, list(batch.preempted), ids)


class Leader:
    """Rank 0's model: the local shard's ``Model`` with every state-changing call mirrored to the
    followers first.  Read-only attributes (info, tokenizer, ops, memory, ...) are the local model's.

    Not a ``backend.ModelHooks``: ``__getattr__`` forwards each optional hook to the local model (which
    is one), and inherited defaults would shadow it.  What differs is declared here."""

    can_share_prefix = False  # share_prefix is not mirrored: forks copy (snapshot/restore) instead

    def __init__(
        self,
        model: Any,
        conns: dict[int, Connection],
        procs: dict[int, Any] | None = None,
        grace: float = 10.0,
        label: str = "tensor-parallel",
    ):
        self._model = model
        self._label = label  # how messages name the ranks: "tensor-parallel rank 1"
        self._conns = dict(conns)
        for c in self._conns.values():
            no_delay(c)
        self._procs = dict(procs or {})
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._released: list[int] = []
        self._busy = 0
        self._closing = False
        self._grace = grace
        self.failed: str | None = None
        self.on_failure: Callable[[str], None] | None = None  # told once, from the watchdog thread
        self._errors: dict[int, str] = {}
        self._watch = threading.Thread(target=self._watchdog, name="swiftlm-tp-watchdog", daemon=True)
        self._watch.start()

    @property
    def world(self) -> int:
        return len(self._conns) + 1

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("_model")
        if model is None:
            raise AttributeError(name)
        attr = getattr(model, name)  # (the local model is a ModelHooks: every optional hook resolves)
        if name in BROADCAST:
            return lambda *args, **kw: self._call(name, attr, args, kw)
        if name == "snapshot_prefix":
            return self._snapshot
        if name == "restore_prefix":
            return self._restore
        return attr

    # ------------------------------------------------------------------ calls
    def _call(self, name: str, fn: Callable, args: tuple, kw: dict) -> Any:
        if self.failed and name == "free":  # the engine's clean-up after the failure: nothing left to free
            return None
        wire = (wire_batch(args[0]),) + args[1:] if name == "forward" else args
        self._send(("call", name, wire, kw))
        return self._local(fn, *args, **kw)

    def _snapshot(self, seq_id: int) -> Any:
        if self.failed:
            return None
        key = next(self._keys)
        self._send(("snap", key, seq_id))
        snap = self._local(self._model.snapshot_prefix, seq_id)
        if snap is None:
            self._release(key)
            return None
        payload, nbytes, n = snap
        ref = PrefixRef(key, payload)
        weakref.finalize(ref, Leader._release, weakref.proxy(self), key)
        return ref, nbytes, n

    def _restore(self, seq_id: int, ref: PrefixRef, n: int) -> None:
        self._send(("restore", seq_id, ref.key, n))
        self._local(self._model.restore_prefix, seq_id, ref.payload, n)

    def _release(self, key: int) -> None:  # any thread (the garbage collector's): sent with the next message
        try:
            self._released.append(key)
        except ReferenceError:  # pragma: no cover - the leader is gone
            pass

    def _local(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        self._busy += 1
        try:
            return fn(*args, **kw)
        except Exception as exc:
            why = self._why(wait=3.0)  # a collective broken by a dead peer fails here first
            if why:
                raise RankFailure(why) from exc
            raise
        finally:
            self._busy -= 1

    def _send(self, msg: tuple) -> None:
        if self.failed:
            raise RankFailure(self.failed)
        with self._lock:
            frames = []
            if self._released:
                keys, self._released[:] = list(self._released), []
                frames.append(pickle.dumps(("release", keys), pickle.HIGHEST_PROTOCOL))
            frames.append(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
            try:
                for conn in self._conns.values():
                    for f in frames:
                        conn.send_bytes(f)
            except OSError as exc:
                why = self._why(wait=3.0) or f"{self._label}: sending a step to the other ranks failed: {exc}"
                raise RankFailure(why) from exc

    def _why(self, wait: float) -> str | None:
        end = time.monotonic() + wait
        while self.failed is None and time.monotonic() < end:
            time.sleep(0.05)
        return self.failed

    # ------------------------------------------------------------------ failure
    def _watchdog(self) -> None:
        """Watch the followers' sockets and processes; the first death fails the model (and, via
        ``on_failure``, the server).  A leader stuck in a collective that never returns (NCCL waits
        on a dead peer) ends the process after ``grace`` seconds: exiting beats hanging."""
        live = dict(self._conns)
        sentinels = {p.sentinel: r for r, p in self._procs.items() if p is not None}
        while live and not self._closing:
            try:
                ready = wait(list(live.values()) + list(sentinels), timeout=1.0)
            except OSError:  # a socket closed under us: shutting down
                return
            dead: list[int] = []
            for obj in ready:
                if isinstance(obj, Connection):
                    r = next(k for k, c in live.items() if c is obj)
                    try:
                        kind, text = obj.recv()
                        if kind == "error":
                            self._errors[r] = text
                    except (EOFError, OSError):
                        dead.append(r)
                elif obj in sentinels:
                    dead.append(sentinels.pop(obj))
            if self._closing:
                return
            if dead:
                self._fail(sorted(set(dead))[0])
                return

    def _fail(self, r: int) -> None:
        proc = self._procs.get(r)
        if proc is not None:
            proc.join(2.0)
        code = proc.exitcode if proc is not None else None
        how = (
            f"was killed by signal {-code}"
            if code is not None and code < 0
            else f"exited with code {code}"
            if code is not None
            else "closed its connection"
        )
        err = self._errors.get(r)
        msg = (
            f"{self._label} rank {r}{f' (pid {proc.pid})' if proc is not None else ''} {how}"
            f"{f' ({err})' if err else ''}; the model needs all {self.world} ranks, so it stops"
        )
        self.failed = msg
        log.critical(msg)
        # the process group of a dead peer cannot be torn down reliably (gloo's threads abort the interpreter's
        # exit now and then): a process that lost a rank ends with exit code 1 once its own exit handlers ran
        atexit.register(_exit_after_failure)
        if self.on_failure is not None:
            try:
                self.on_failure(msg)
            except Exception:  # pragma: no cover
                log.exception("on_failure")
        end = time.monotonic() + self._grace
        while self._busy and time.monotonic() < end and not self._closing:
            time.sleep(0.1)
        if self._busy and not self._closing:
            log.critical("rank 0 is still blocked in a collective %.0f s after rank %d died; exiting", self._grace, r)
            logging.shutdown()
            os._exit(1)

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 10.0) -> None:
        """Tell the followers to exit, wait for them (then terminate stragglers)."""
        if self._closing:
            return
        self._closing = True
        with self._lock:
            for conn in self._conns.values():
                try:
                    conn.send_bytes(pickle.dumps(("stop",)))
                except OSError:
                    pass
        end = time.monotonic() + timeout
        for p in self._procs.values():
            if p is not None:
                p.join(max(0.0, end - time.monotonic()))
                if p.is_alive():
                    p.terminate()
                    p.join(2.0)
        for conn in self._conns.values():
            try:
                conn.close()
            except OSError:  # pragma: no cover
                pass
        self._model.close()  # (ModelHooks: a no-op by default)


def _exit_after_failure() -> None:
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # pragma: no cover
            pass
    os._exit(1)


class FollowerTiming:
    """A follower's forward calls, timed: how long it waited for rank 0's message and how long the call took on
    the host (launches; the device work is asynchronous), over the last ``keep`` calls, with its garbage
    collector's pauses.  Logged when the follower stops: a follower that falls behind stalls rank 0 inside the
    next collective."""

    def __init__(self, keep: int = 8192) -> None:
        self.count = 0
        self.wait: deque[float] = deque(maxlen=keep)
        self.call: deque[float] = deque(maxlen=keep)
        self.gc = GcPauses.install()

    def observe(self, wait_s: float, call_s: float) -> None:
        self.count += 1
        self.wait.append(wait_s)
        self.call.append(call_s)

    def summary(self) -> str:
        def ms(xs: deque[float]) -> str:
            qs = "/".join(f"{1e3 * (percentile(xs, p) or 0.0):.2f}" for p in (50, 90, 99))
            return f"p50/p90/p99 {qs} ms, max {1e3 * max(xs, default=0.0):.1f} ms"

        g = self.gc.snapshot()
        gcs = ", ".join(
            f"gen{i} {g[f'gen{i}']['collections']} (max {g[f'gen{i}']['max_ms']:.1f} ms)" for i in (0, 1, 2)
        )
        return f"{self.count} forward calls; waiting {ms(self.wait)}; calling {ms(self.call)}; collections {gcs}"


def follow(model: Any, conn: Connection, rank: int) -> None:
    """A follower's loop: make each call rank 0 sends, on this rank's shard, until told to stop or
    rank 0 goes away.  A failing call is reported to rank 0 and ends this process (the model
    cannot go on with one rank out of step)."""
    snaps: dict[int, Any] = {}
    no_delay(conn)
    freeze()  # what is loaded now is never garbage: full collections skip it (gc_pauses.py)
    timing = FollowerTiming()
    while True:
        t0 = time.perf_counter()
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            log.info("tensor-parallel rank %d: rank 0 has gone; exiting (%s)", rank, timing.summary())
            return
        kind = msg[0]
        t1 = time.perf_counter()
        try:
            if kind == "call":
                getattr(model, msg[1])(*msg[2], **msg[3])
                if msg[1] == "forward":
                    timing.observe(t1 - t0, time.perf_counter() - t1)
            elif kind == "snap":
                snaps[msg[1]] = model.snapshot_prefix(msg[2])
            elif kind == "restore":
                seq_id, key, n = msg[1:]
                model.restore_prefix(seq_id, snaps[key][0], n)
            elif kind == "release":
                for k in msg[1]:
                    snaps.pop(k, None)
            elif kind == "stop":
                log.info("tensor-parallel rank %d: stopping (%s)", rank, timing.summary())
                return
        except Exception as exc:
            what = msg[1] if kind == "call" else kind
            text = f"{what} failed on rank {rank}: {type(exc).__name__}: {exc}"
            log.exception("tensor-parallel %s", text)
            try:
                conn.send(("error", text))
            except OSError:  # pragma: no cover
                pass
            raise SystemExit(1) from None
