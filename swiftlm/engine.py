"""The engine: request lifecycle on one background thread that owns the model.

Callers (the Python API, the server) submit token prompts with sampling parameters and a
*sink*.  The engine thread runs scheduler steps: the backend's forward pass, then the core's
batched sampler (one device-to-host transfer per step), then the checks that need no text
(EOS, stop token ids, max tokens, context).  Detokenisation, stop strings and event delivery
run on the output worker's thread (``outputs.py``), beside the next step.  No caller ever
touches model state.

Who owns what (``Engine`` builds each part and hands it what it needs; no part reaches back):

- callers' threads: ``prompts`` (``prompts.Prompts``: rendering, checks), ``slots`` (``slots.Slots``:
  the queue's count and ids) and ``intake`` (``intake.Intake``: submit, cancel, embed), which only
  put commands into the inbox; ``life`` (``slots.Lifecycle``) says whether the engine takes requests.
- the engine thread: this module's loop (it drains the inbox, schedules, ends requests: ``_finish``)
  and what it owns: ``scheduler``, ``stepper`` (``stepper.Stepper``: one step), ``kv``
  (``kv_admission.KVAdmission``: paged pool, prompt cache), ``forks`` (``fork.ForkGroups``); the live
  requests (``_live``) and a step's outputs (``_outs``) are shared with them, never touched elsewhere.
- the output worker's thread: ``outputs`` (``outputs.OutputWorker``): text, stop strings, events.

The public methods (``submit``, ``chat_prompt``, ...) and settings (``tool_parser``, ``json_close``,
...) forward to the part that owns them, so every caller sees one ``Engine`` (as ``EngineClient``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from .backend import Model, StepBatch
from .fork import ForkGroups
from .intake import Intake, Live
from .kv_admission import KVAdmission
from .outputs import LOGPROB_FLOOR, AsyncSink, Event, Out, OutputWorker, Sink, SyncSink, TokenLogprob  # noqa: F401
from .prompts import PromptFront, Prompts, pooled  # noqa: F401 (pooled: re-exported)
from .sampling import SamplingParams
from .scheduler import Scheduler, kv_budget_tokens
from .slots import Lifecycle, QueueFull, Slots, delegated  # noqa: F401 (QueueFull: re-exported)
from .stats import LATENCY_BUCKETS, TOKEN_BUCKETS, EngineStats, LatencyHistogram, expert_stream_stats, kv_stats  # noqa: F401
from .stepper import Stepper
from .timers import StepLog, StepTimers
from .turboquant.presets import KVFormat

log = logging.getLogger(__name__)


class Engine(PromptFront):
    # settings and state that live on the parts (set by make_engine, a replica set's broadcast, the server)
    fatal = delegated("life", "fatal", "why the loop died, if it did (then /health is 503)")
    tool_parser = delegated("prompts", "tool_parser")
    media_policy = delegated("prompts", "media_policy")
    media_processor = delegated("prompts", "media_processor")
    json_close = delegated("stepper", "json_close")
    json_repeat_guard = delegated("stepper", "json_repeat_guard")
    default_max_tokens = delegated("slots", "default_max_tokens")
    max_queue = delegated("slots", "max_queue")
    backend_name = delegated("intake", "backend_name")
    kv_blocks = delegated("kv", "kv_blocks", "the paged KV pool's block manager (kv_blocks.KVBlocks), or None")
    prefix_cache = delegated("kv", "prefix_cache")
    code_format = delegated("kv", "code_format")

    def __init__(
        self,
        model: Model,
        *,
        max_running: int = 1,
        prefill_size: int = 512,
        max_queue: int = 64,
        ctx_size: int | None = None,
        default_max_tokens: int = 2048,
        prompt_cache_bytes: int = 0,
        speculator: Any = None,
        kv_budget_bytes: int = 0,
        request_timeout: float = 0.0,
        publish: Callable[[list[Out], list[int]], None] | None = None,
        max_batched_tokens: int = 0,
    ):
        """``publish``: where each step's outputs go instead of an output worker of this process,
        called on the engine thread with (outputs, ids of the sequences ended since the last
        call), also when both are empty (the engine process, ``engine_process.py``)."""
        self.model = model
        self.request_timeout = request_timeout  # seconds from submit; 0: none
        self._next_expiry_check = 0.0
        self.tokenizer = model.tokenizer
        self.info = model.info
        # the served KV format (--turbo-kv): a request's own fields override it, decided at admission
        self.kv_default: KVFormat = model.kv_default or KVFormat()  # (ModelHooks: None is plain 16-bit)
        self.ctx_size = min(ctx_size or model.info.context_length, model.info.context_length or ctx_size or 0)
        kv_tokens = kv_budget_tokens(kv_budget_bytes, model.info.kv_bytes_per_token, self.ctx_size)
        self.scheduler = Scheduler(
            max_running, prefill_size, token_budget=max_batched_tokens or None, kv_budget_tokens=kv_tokens
        )
        self.stats = EngineStats()
        self.speculator = speculator  # speculative.Speculator: lone decode rows draft and verify
        self.life = Lifecycle()
        self.on_fatal: Any = None  # called with ``fatal`` (the server exits non-zero)
        # the engine thread's state, shared with its parts: live requests by id, this step's outputs
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[int, Live] = {}
        self._outs: list[Out] = []  # this step's messages for the output worker
        self._ended: list[int] = []  # with ``publish``: sequences dropped since the last publish
        self._publish = publish
        # a paged KV pool (torch on CUDA): the core hands out its blocks, and full blocks are the prompt cache
        self.kv = KVAdmission(model, self.scheduler, self.ctx_size, prompt_cache_bytes, self._live, self._outs)
        self.forks = ForkGroups(model, self.scheduler, self._live, self.kv.eligible)  # n / best_of (fork.py)
        self.fork_stats = self.forks.stats
        self.timers = StepTimers()
        self.step_log = StepLog.from_env()  # SWIFTLM_STEP_LOG: a line per step (timelines)
        self.outputs = (
            None
            if publish is not None
            else OutputWorker(self.tokenizer, on_stop=lambda sid: self.intake.stopped(sid), timers=self.timers)
        )
        self.slots = Slots(max_queue, self.scheduler.max_running, default_max_tokens)
        self.prompts = Prompts(self.tokenizer, self.info, self.ctx_size, model, self.life)
        self.intake = Intake(
            model, self.prompts, self.slots, self.life, self._inbox, self.outputs, self.kv_default, self._end_orphans
        )
        self.stepper = Stepper(
            model,
            self.scheduler,
            live=self._live,
            outs=self._outs,
            finish=self._finish,
            flush=self._flush_outputs,
            inbox=self._inbox,
            forks=self.forks,
            kv=self.kv,
            speculator=speculator,
            stats=self.stats,
            timers=self.timers,
            step_log=self.step_log,
            tokenizer=self.tokenizer,
            ctx_size=self.ctx_size,
        )
        self._orphan_lock = threading.Lock()  # _end_orphans: the dying loop and late submits
        self._admit_gate = threading.Lock()  # held by ``together()``: the loop takes nothing from the inbox meanwhile
        from .gc_pauses import GcPauses, freeze
        from .gil import tune_switch_interval

        tune_switch_interval()  # SWIFTLM_GIL_SWITCH_MS (gil.py)
        freeze()  # the loaded model's objects out of the collector's reach: no full-heap pauses mid-stream
        self.gc_pauses = GcPauses.install()  # collections of this process from now on, timed (/health, /metrics)
        self._thread = threading.Thread(target=self._run, name="swiftlm-engine", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e.shutdown(2.0))

    # ------------------------------------------------------------------ the callers' API (intake, prompts)
    def submit(self, prompt_tokens: list[int], params: SamplingParams, sink: Sink) -> int:
        return self.intake.submit(prompt_tokens, params, sink)

    def submit_group(self, prompt_tokens: list[int], params: list[SamplingParams], sink: Sink) -> list[int]:
        return self.intake.submit_group(prompt_tokens, params, sink)

    def cancel(self, seq_id: int) -> None:
        self.intake.cancel(seq_id)

    def end_all(self, reason: str = "length") -> None:
        self.intake.end_all(reason)

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> Future[list[Any]]:
        return self.intake.embed(prompts, dimensions)

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between steps, after every figure of the steps before is recorded."""
        self._inbox.put(("call", fn))

    @contextlib.contextmanager
    def outputs_to(self, publish: Callable[[list[Out], list[int]], None]) -> Iterator[None]:
        """Inside the block every step's outputs go to ``publish`` (outputs, ids of the sequences ended), not to the
        output worker or the engine process's connections (warm_up.py's scratch requests)."""
        saved = self._publish
        self._publish = publish
        try:
            yield
        finally:
            self._publish = saved

    # ------------------------------------------------------------------ lifecycle
    @property
    def live_requests(self) -> int:
        return len(self._live)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.life.stopping:
            return
        self.life.stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout)
        if self.outputs is not None:
            self.outputs.close(timeout)
        from .gc_pauses import unfreeze

        unfreeze()  # this engine's model may sit in reference cycles: let a collection free it

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def _run(self) -> None:
        """The loop, and what happens if it dies: every live request ends with the error, new
        ones are refused, and ``on_fatal`` is told (never a silent hang)."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread must report any death
            self.fatal = f"engine loop died: {type(exc).__name__}: {exc}"
            self.life.stopping = True
            log.critical(self.fatal, exc_info=True)
            self._end_orphans()
            try:
                self.model.ops.end_thread()
            except Exception:  # pragma: no cover
                pass
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Requests submitted inside the block reach the scheduler in one drain, before the next step
        (``LLM.generate`` of a list): a batch is admitted as a batch, not as the submit loop and the
        engine thread happen to interleave."""
        with self._admit_gate:
            yield

    def end_streams_now(self, msg: str) -> None:
        """A failure seen outside the loop that the loop may not see for a long time (a tensor-parallel
        rank died while rank 0 waits in an NCCL collective that never returns): every open request's
        caller gets ``msg`` as its error now, through the output worker (an already-ended stream ignores
        it).  The engine's own state stays the loop's to clean up, or the exiting process's."""
        if self.outputs is not None:  # in an engine process the parent's worker ends the streams
            self.outputs.put([Out(sid, reason="error", error=msg) for sid in list(self.outputs.streams)])

    def _end_orphans(self) -> None:
        """Once the loop has died (``fatal`` is set first): every live request, and every one still in
        the inbox (submitted while the last step ran, or racing the death), ends with the error --
        nothing else would ever run them.  Called by the dying loop and by a submit that finds it dead."""
        with self._orphan_lock:
            while True:
                try:
                    cmd, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if cmd == "add":
                    self._live[arg.seq.seq_id] = arg
                elif cmd == "group":
                    self._live.update((x.seq.seq_id, x) for x in arg)
                elif cmd == "embed":
                    arg[1].set_exception(RuntimeError(self.fatal))
            for live in list(self._live.values()):
                try:
                    self._finish(live, "error", error=self.fatal)
                except Exception:  # pragma: no cover
                    pass
            try:
                self._flush_outputs()
            except Exception:  # pragma: no cover
                pass

    # ------------------------------------------------------------------ loop
    def _drain(self, block: bool) -> None:
        first = True
        while True:
            try:
                cmd, arg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            if first:  # wait until a ``together()`` submitter has put its whole batch in
                with self._admit_gate:
                    pass
            block = first = False
            if cmd == "add":
                self._live[arg.seq.seq_id] = arg
                # looked up and restored at admission, not now: a queued request holds no KV, not even a
                # reference to a cache entry (queued requests holding entries would keep what the cache
                # evicts alive: memory that no figure counts)
                arg.prefix_pending = self.kv.eligible(arg)
                self.kv.mark_paged(arg)
                self.scheduler.add(arg.seq)
                self.stats.request_started()
            elif cmd == "group":  # n choices of one prompt: the first prefills, the others fork from it
                lead, members = (arg[0], arg[1:]) if self.forks.possible else (None, arg)
                for live in arg:
                    self._live[live.seq.seq_id] = live
                    self.stats.request_started()
                    self.kv.mark_paged(live)
                    if live is lead or lead is None:
                        live.prefix_pending = self.kv.eligible(live)
                        self.scheduler.add(live.seq)
                if lead is not None:
                    self.forks.add(lead, members)
            elif cmd == "refused":  # add_checked could not build the request (its grammar): it ends here
                sid, err = arg
                self._ended.append(sid)
                self._outs.append(Out(sid, reason="error", error=err))
            elif cmd == "cancel":
                live = self._live.get(arg)
                if live is not None:
                    self._finish(live, "cancelled")
            elif cmd == "stopped":  # a stop string, found by the output worker, which already told the caller
                live = self._live.get(arg)
                if live is not None:
                    self._finish(live, "stop", notify=False)
            elif cmd == "end_all":
                for live in list(self._live.values()):
                    self._finish(live, arg)
            elif cmd == "embed":  # between steps: the device is free (no step in flight here)
                prompts, fut = arg
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(self.model.hidden_states(prompts))
                    except Exception as exc:  # the request's error, not the engine's
                        fut.set_exception(exc)
            elif cmd == "call":  # a function of the engine's state, run between steps (warm_up.py)
                arg()
            elif cmd == "stop":
                for live in list(self._live.values()):
                    self._finish(live, "cancelled")
                return

    def _loop(self) -> None:
        # a step launched before the last one was read back: (its batch, its Forward, its launch's seconds)
        inflight: tuple[StepBatch, Any, float] | None = None
        while not self.life.stopping:
            self._flush_outputs()
            if self.request_timeout:
                self._expire()
            if inflight is None:
                self._drain(block=not self.scheduler.has_work())
                if self.life.stopping or not self.scheduler.has_work():
                    continue
                t0 = time.perf_counter()
                self._restore_prefixes()
                batch = self.scheduler.schedule()
                self._end_starved()
                if not batch.seqs:
                    continue
                for sid in batch.preempted:  # recompute later: drop the KV state now
                    self.model.free([sid])
                    live = self._live.get(sid)
                    if live is not None and self.kv_blocks is not None:  # its cached blocks, if still there
                        live.prefix_pending = self.kv.eligible(live)
                self.timers.add("schedule", time.perf_counter() - t0)
                if self.speculator is not None and self.stepper.speculate(batch):
                    continue
                fwd, launch_s = None, 0.0
            else:
                batch, fwd, launch_s = inflight
                inflight = None
            try:
                inflight = self.stepper.step(batch, fwd, launch_s)
            except Exception as exc:  # a failing step fails its sequences, not the engine
                log.exception("engine step failed")
                inflight = None
                for w in batch.seqs:
                    live = self._live.get(w.seq_id)
                    if live is not None:
                        self._finish(live, "error", error=f"{type(exc).__name__}: {exc}")
        if inflight is not None:  # an overlapped step still running on the device: let it end here, not at exit
            try:
                self.model.ops.wait(self.model.ops.start_copy(inflight[1].logits))
            except Exception:  # pragma: no cover - shutting down anyway
                log.exception("waiting for the last step failed")
        self._flush_outputs()
        for live in list(self._live.values()):  # shutting down: release every waiter
            self._finish(live, "cancelled")
        self._flush_outputs()
        if self.step_log is not None:
            self.step_log.close()
        try:
            self.model.ops.end_thread()  # MLX: this thread's streams go with it (a clean exit)
        except Exception:  # pragma: no cover
            log.exception("releasing the engine thread's device streams failed")

    def _restore_prefixes(self) -> None:
        """Prompt-cache hits of the sequences the scheduler can admit now (the first free-slot
        count of the queue, FCFS): their KV is restored just before they run.  Fork group members
        get their prompt's KV from its fork source here (fork.py)."""
        sch = self.scheduler
        for seq in list(sch.waiting)[: max(0, sch.max_running - len(sch.running))]:
            live = self._live.get(seq.seq_id)
            if live is not None and live.fork is not None:
                self.forks.admit(live)
                continue
            if live is None or not live.prefix_pending:
                continue
            self.kv.restore(live)

    def _end_starved(self) -> None:
        """Sequences the paged pool cannot hold any longer (a lone one past the pool's tokens: --kv-cache-memory
        below the context) end as at their length limit, with what they generated."""
        sch = self.scheduler
        while sch.starved:
            live = self._live.get(sch.starved.pop())
            if live is not None:
                m = sch.manager(live.seq)
                log.warning(
                    "request %d: the %s (%d tokens) cannot hold its next position; ending it at length",
                    live.seq.seq_id,
                    "TurboQuant code pages" if live.seq.codes else "KV pool",
                    m.num_blocks * m.block_size if m is not None else 0,
                )
                self._finish(live, "length")

    def _expire(self) -> None:
        """--request-timeout: a request past its deadline ends as at its length limit (its text so
        far, finish_reason 'length'); checked at most four times a second."""
        now = time.perf_counter()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 0.25
        for live in list(self._live.values()):
            if now - live.submitted >= self.request_timeout:
                self._finish(live, "length")

    def _flush_outputs(self) -> None:
        """This step's outputs to the output worker (or ``publish``); ``_outs`` is emptied in place (the
        parts hold it)."""
        outs = self._outs[:]
        self._outs.clear()
        if self._publish is not None:
            ended = self._ended[:]
            self._ended.clear()
            self._publish(outs, ended)
        elif outs:
            self.outputs.put(outs)

    def expert_stream_stats(self) -> dict[str, Any] | None:
        """Counted I/O of SSD expert streaming (None when experts are resident)."""
        return expert_stream_stats(self.model.expert_stream, self.info.experts_per_token)

    def gc_stats(self) -> dict[str, Any]:
        """The garbage collector's pauses in this process (gc_pauses.py)."""
        return self.gc_pauses.snapshot()

    def kv_stats(self) -> dict[str, Any]:
        """KV bytes held, their 16-bit equivalent and the compression ratio (stats.kv_stats)."""
        return kv_stats(self.model, self.scheduler.kv_in_use, self.info.kv_bytes_per_token, self.kv_default.name)

    def _finish(self, live: Live, reason: str, error: str | None = None, notify: bool = True) -> None:
        """Drop the sequence (KV, scheduler, draft state); with ``notify`` tell the caller through
        the output worker (a token message that ends the sequence already does)."""
        seq = live.seq
        self._live.pop(seq.seq_id, None)
        self.scheduler.remove(seq)
        if self.forks.pending:
            self.forks.drop(live)
        self.kv.save(live, reason)
        if self.speculator is not None:
            try:
                self.speculator.free(seq.seq_id)
            except Exception:  # pragma: no cover
                log.exception("freeing draft state failed")
        try:
            self.model.free([seq.seq_id])
        except Exception:  # pragma: no cover - freeing must not kill the loop
            log.exception("free failed")
        self.stats.request_finished(reason, live.submitted, live.first_token_at, len(seq.output_tokens))
        self.slots.give_back()
        if self._publish is not None:
            self._ended.append(seq.seq_id)
        if notify:
            self._outs.append(Out(seq.seq_id, reason=reason, error=error))
