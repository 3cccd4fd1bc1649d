"""The engine: request lifecycle on one background thread that owns the model.

Callers (the Python API, the server) submit token prompts with sampling parameters and a
*sink*.  The engine thread runs scheduler steps: the backend's forward pass, then the core's
batched sampler (one device-to-host transfer per step), then the checks that need no text
(EOS, stop token ids, max tokens, context).  Detokenisation, stop strings and event delivery
run on the output worker's thread (``outputs.py``), beside the next step.  No caller ever
touches model state.

This module holds the engine's state, its lifecycle, the loop, the prompt cache's side of
admission and the stats readers; mixins hold the rest: ``prompt_side.py`` (prompt rendering,
request checks), ``engine_requests.py`` (submitting, cancelling: the caller's thread) and
``engine_step.py`` (one step: forward, sampling, the overlap, speculation, the per-token checks).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .backend import Model, StepBatch
from .engine_requests import EngineRequests, _Live
from .engine_step import EngineStep
from .fork import ForkGroups
from .outputs import LOGPROB_FLOOR, AsyncSink, Event, Out, OutputWorker, Sink, SyncSink, TokenLogprob  # noqa: F401
from .prefix_cache import PrefixCache
from .prompt_side import PromptSide, QueueFull, pooled  # noqa: F401 (QueueFull, pooled: re-exported)
from .scheduler import Scheduler
from .stats import LATENCY_BUCKETS, TOKEN_BUCKETS, EngineStats, LatencyHistogram  # noqa: F401
from .timers import StepLog, StepTimers
from .turboquant.presets import KVFormat

log = logging.getLogger(__name__)


class Engine(PromptSide, EngineRequests, EngineStep):
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
        self.json_close = True  # structured output closes its JSON before max_tokens (settings.json_close)
        self.json_repeat_guard = 0  # structured output caught repeating a block this many times ends
        self._next_expiry_check = 0.0
        self.tokenizer = model.tokenizer
        self.info = model.info
        # the served KV format (--turbo-kv): a request's own fields override it, decided at admission
        self.kv_default: KVFormat = model.kv_default or KVFormat()  # (ModelHooks: None is plain 16-bit)
        self.ctx_size = min(ctx_size or model.info.context_length, model.info.context_length or ctx_size or 0)
        self.default_max_tokens = default_max_tokens
        self.max_queue = max_queue
        kv_tokens = None
        if kv_budget_bytes and model.info.kv_bytes_per_token:
            kv_tokens = kv_budget_bytes // model.info.kv_bytes_per_token
            if kv_tokens < self.ctx_size + 1:  # one sequence at full context must always fit
                log.warning(
                    "--kv-budget-bytes %d holds %d tokens, less than one full context (%d); raising it",
                    kv_budget_bytes,
                    kv_tokens,
                    self.ctx_size,
                )
                kv_tokens = self.ctx_size + 1
        self.scheduler = Scheduler(
            max_running, prefill_size, token_budget=max_batched_tokens or None, kv_budget_tokens=kv_tokens
        )
        self.stats = EngineStats()
        # prompt reuse needs the backend's snapshot/restore hooks (optional: ModelHooks.can_snapshot_prefix)
        can_cache = model.can_snapshot_prefix
        self.speculator = speculator  # speculative.Speculator: lone decode rows draft and verify
        self.tool_parser = "auto"  # chat.tool_calls format, or auto (from the chat template)
        from .media import MediaPolicy

        self.media_policy = MediaPolicy()  # make_engine sets the model's and the flags' policy
        self.media_processor: Any = None  # media.MediaProcessor for multimodal models
        # a paged KV pool (torch on CUDA): the core hands out its blocks, and full blocks are the prompt cache
        self.code_format: Any = None  # the KV format whose codes are paged (code_pages), if any
        self.kv_blocks = self._paged_kv(prompt_cache_bytes > 0)
        self.prefix_cache = PrefixCache(prompt_cache_bytes if can_cache and self.kv_blocks is None else 0)
        self.forks = ForkGroups(self)  # n / best_of: one prefill per request (fork.py)
        self.fork_stats = self.forks.stats
        self._eos = frozenset(self.tokenizer.eos_token_ids)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.timers = StepTimers()
        self.step_log = StepLog.from_env()  # SWIFTLM_STEP_LOG: a line per step (timelines)
        self._publish = publish
        self._ended: list[int] = []  # with ``publish``: sequences dropped since the last publish
        self.outputs = (
            None
            if publish is not None
            else OutputWorker(self.tokenizer, on_stop=lambda sid: self._inbox.put(("stopped", sid)), timers=self.timers)
        )
        self._outs: list[Out] = []  # this step's messages for the output worker
        self._live: dict[int, _Live] = {}
        self._ids = itertools.count(1)
        self._pending = 0  # submitted, not yet finished (guarded by _lock)
        self._lock = threading.Lock()
        self._orphan_lock = threading.Lock()  # _end_orphans: the dying loop and late submits
        self._admit_gate = threading.Lock()  # held by ``together()``: the loop takes nothing from the inbox meanwhile
        self._stopping = False
        self.fatal: str | None = None  # why the loop died, if it did (then /health is 503)
        self.on_fatal: Any = None  # called with that message (the server exits non-zero)
        from .gc_pauses import GcPauses, freeze
        from .gil import tune_switch_interval

        tune_switch_interval()  # SWIFTLM_GIL_SWITCH_MS (gil.py)
        freeze()  # the loaded model's objects out of the collector's reach: no full-heap pauses mid-stream
        self.gc_pauses = GcPauses.install()  # collections of this process from now on, timed (/health, /metrics)
        self._thread = threading.Thread(target=self._run, name="swiftlm-engine", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e.shutdown(2.0))

    # ------------------------------------------------------------------ lifecycle
    @property
    def live_requests(self) -> int:
        return len(self._live)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
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
            self._stopping = True
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
                arg.prefix_pending = self._prefix_eligible(arg)
                self._mark_paged(arg)
                self.scheduler.add(arg.seq)
                self.stats.request_started()
            elif cmd == "group":  # n choices of one prompt: the first prefills, the others fork from it
                lead, members = (arg[0], arg[1:]) if self.forks.possible else (None, arg)
                for live in arg:
                    self._live[live.seq.seq_id] = live
                    self.stats.request_started()
                    self._mark_paged(live)
                    if live is lead or lead is None:
                        live.prefix_pending = self._prefix_eligible(live)
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
            elif cmd == "stop":
                for live in list(self._live.values()):
                    self._finish(live, "cancelled")
                return

    def _loop(self) -> None:
        # a step launched before the last one was read back: (its batch, its Forward, its launch's seconds)
        inflight: tuple[StepBatch, Any, float] | None = None
        while not self._stopping:
            self._flush_outputs()
            if self.request_timeout:
                self._expire()
            if inflight is None:
                self._drain(block=not self.scheduler.has_work())
                if self._stopping or not self.scheduler.has_work():
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
                        live.prefix_pending = self._prefix_eligible(live)
                self.timers.add("schedule", time.perf_counter() - t0)
                if self.speculator is not None and self._speculate(batch):
                    continue
                fwd, launch_s = None, 0.0
            else:
                batch, fwd, launch_s = inflight
                inflight = None
            try:
                inflight = self._step(batch, fwd, launch_s)
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

    def _paged_kv(self, prefix_caching: bool) -> Any:
        """The block manager of the model's paged KV pool (``kv_blocks.KVBlocks``), or None."""
        from .kv_blocks import KVBlocks

        spec = self.model.kv_block_spec()
        blocks = None
        if spec is not None:
            blocks = KVBlocks(spec[0], spec[1], prefix_caching=prefix_caching)
            self.model.attach_kv_blocks(blocks)
            self.scheduler.blocks = blocks
        self.scheduler.max_positions = self.ctx_size
        code_spec = self.model.code_page_spec()
        if code_spec is not None:  # TurboQuant codes in pages: a second manager, no prefix caching (16-bit rows)
            codes = KVBlocks(code_spec[0], code_spec[1], prefix_caching=False)
            self.model.attach_code_pages(codes)
            self.scheduler.code_blocks, self.code_format = codes, code_spec[2]
        return blocks

    def _prefix_eligible(self, live: _Live) -> bool:
        enabled = self.prefix_cache.enabled or (self.kv_blocks is not None and self.kv_blocks.prefix_caching)
        return (
            enabled
            and not live.seq.kv_format.compressed  # the prompt cache holds 16-bit rows
            and live.seq.media is None
            and not live.seq.params.adapter
        )  # LoRA: own KV

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
            live.prefix_pending = False
            if self.kv_blocks is not None:
                self._adopt_blocks(live)
                continue
            if seq.num_computed or seq.output_tokens:  # preempted and resumed: recomputed, not restored
                continue
            n, payload = self.prefix_cache.lookup(seq.prompt_tokens)
            if not n:
                continue
            try:
                self.model.restore_prefix(seq.seq_id, payload, n)  # type: ignore[attr-defined]
                seq.num_computed = live.cached_tokens = n
                self._outs.append(Out(seq.seq_id, cached_tokens=n))
            except Exception:  # a cache failure costs a full prefill, never the request
                log.exception("prompt cache restore failed; prefilling in full")
                self.model.free([seq.seq_id])

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

    def _adopt_blocks(self, live: _Live) -> None:
        """Prefix caching on the paged pool: the sequence starts with the cached full blocks of its
        prompt (a preempted one: of its prompt and output), shared, not copied."""
        seq, blocks = live.seq, self.kv_blocks
        if seq.num_computed or blocks.has(seq.seq_id) and blocks.table(seq.seq_id):
            return
        ids = blocks.match(seq.tokens(0, seq.prefill_target + 1))
        if not ids:
            return
        blocks.adopt(seq.seq_id, ids)
        n = len(ids) * blocks.block_size
        try:
            self.model.adopt_prefix(seq.seq_id, n)
        except Exception:  # a cache failure costs a full prefill, never the request
            log.exception("adopting cached KV blocks failed; prefilling in full")
            self.model.free([seq.seq_id])
            return
        seq.num_computed = n
        if not seq.output_tokens:
            live.cached_tokens = n
            self._outs.append(Out(seq.seq_id, cached_tokens=n))

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
        if self._publish is not None:
            outs, ended, self._outs, self._ended = self._outs, self._ended, [], []
            self._publish(outs, ended)
        elif self._outs:
            self.outputs.put(self._outs)
            self._outs = []

    def expert_stream_stats(self) -> dict[str, Any] | None:
        """Counted I/O of SSD expert streaming (None when experts are resident)."""
        reader = self.model.expert_stream
        if reader is None:
            return None
        out = reader.stats.snapshot()
        out.update(
            {
                "mode": reader.mode,
                "buffer_bytes": reader.buffer_bytes(),
                "expert_bytes_on_disk": reader.layout.expert_bytes_total,
                "experts_per_token": self.info.experts_per_token,
            }
        )
        return out

    def gc_stats(self) -> dict[str, Any]:
        """The garbage collector's pauses in this process (gc_pauses.py)."""
        return self.gc_pauses.snapshot()

    def kv_stats(self) -> dict[str, Any]:
        """KV bytes the running sequences hold, what a 16-bit cache would hold for them, and the
        compression ratio achieved (16-bit bytes / bytes held)."""
        fmt = self.kv_default
        try:
            s = self.model.kv_stats()
        except Exception:  # pragma: no cover - a racing free() must not fail /health
            s = None
        if s is None:
            n = self.scheduler.kv_in_use() * self.info.kv_bytes_per_token
            s = {"bytes": n, "fp16_bytes": n}
        ratio = s["fp16_bytes"] / s["bytes"] if s["bytes"] else 1.0
        return {
            "default_format": fmt.name,
            "bytes": s["bytes"],
            "fp16_bytes": s["fp16_bytes"],
            "compression_ratio": round(ratio, 4),
        }

    def _mark_paged(self, live: _Live) -> None:
        """A request whose KV is compressed (TurboQuant / kv_bits) takes no pool blocks: code pages when its
        format is the one the model pages (the server's --turbo-kv default), else a cache of its own."""
        if not self.scheduler.managed:
            return
        fmt = live.seq.kv_format
        if fmt.compressed:
            live.seq.paged = False
            live.seq.codes = fmt == self.code_format

    def _finish(self, live: _Live, reason: str, error: str | None = None, notify: bool = True) -> None:
        """Drop the sequence (KV, scheduler, draft state); with ``notify`` tell the caller through
        the output worker (a token message that ends the sequence already does)."""
        seq = live.seq
        self._live.pop(seq.seq_id, None)
        self.scheduler.remove(seq)
        if self.forks.pending:
            self.forks.drop(live)
        if self.prefix_cache.enabled and reason != "error" and seq.media is None and not seq.params.adapter:
            try:
                snap = self.model.snapshot_prefix(seq.seq_id)  # type: ignore[attr-defined]
                if snap is not None:
                    payload, nbytes, n = snap
                    self.prefix_cache.insert(seq.all_tokens[:n], payload, nbytes)
            except Exception:  # pragma: no cover - caching must never fail a request
                log.exception("prompt cache snapshot failed")
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
        with self._lock:
            self._pending -= 1
        if self._publish is not None:
            self._ended.append(seq.seq_id)
        if notify:
            self._outs.append(Out(seq.seq_id, reason=reason, error=error))
