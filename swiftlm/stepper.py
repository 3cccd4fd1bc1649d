"""One engine step, on the engine thread: the backend's forward, the core's batched sampler (one
device-to-host transfer), the next decode step launched before this one's ids are read back when
it surely is the same rows (the overlap), a lone decode row's speculative draft-and-verify, and
the checks on each sampled id that need no text (EOS, stop token ids, max tokens, context, closing
structured output's JSON).  ``Stepper`` is owned by ``engine.Engine``; its loop calls it (engine thread only)."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from . import sampler
from .backend import SampledToken, SeqWork, StepBatch
from .fork import ForkGroups
from .intake import Live
from .kv_admission import KVAdmission
from .outputs import Out
from .scheduler import Scheduler
from .speculative import eligible
from .stats import EngineStats
from .timers import StepLog, StepTimers

log = logging.getLogger("swiftlm.engine")  # the engine's logger: a step's records sit with the engine's own


JSON_CLOSE_WINDOW = 48  # tokens left at which structured output starts checking what closing it takes
JSON_CLOSE_MARGIN = 2  # closing tokens can grow by a token or two per step: close with this much to spare


def _repeats(tokens: list[int], times: int) -> bool:
    """The tail is one block of 3..64 tokens repeated ``times`` times in a row.  Blocks that are
    themselves a 1- or 2-token period (a run of zeros, "0, 0, ...") do not count: that is data."""
    n = len(tokens)
    for p in range(3, min(64, n // times) + 1):
        block = tokens[n - p :]
        if any(all(block[k] == block[k - d] for k in range(d, p)) for d in (1, 2)):
            continue
        if all(tokens[n - (k + 1) * p : n - k * p] == block for k in range(1, times)):
            return True
    return False


class Stepper:
    """The step and the per-token checks.  It shares the engine's ``live`` requests and this step's
    ``outs`` (the engine flushes them: ``flush``), ends sequences through the engine's ``finish``
    (which frees what they hold), and looks at ``inbox`` only to see whether a command waits (then it
    does not overlap).  ``json_close`` / ``json_repeat_guard``: settings (make_engine sets them)."""

    def __init__(
        self,
        model: Any,
        scheduler: Scheduler,
        *,
        live: dict[int, Live],
        outs: list[Out],
        finish: Callable[..., None],
        flush: Callable[[], None],
        inbox: queue.SimpleQueue,
        forks: ForkGroups,
        kv: KVAdmission,
        speculator: Any,
        stats: EngineStats,
        timers: StepTimers,
        step_log: StepLog | None,
        tokenizer: Any,
        ctx_size: int,
    ):
        self.model, self.scheduler = model, scheduler
        self.live, self.outs, self.finish, self.flush, self.inbox = live, outs, finish, flush, inbox
        self.forks, self.kv, self.speculator = forks, kv, speculator
        self.stats, self.timers, self.step_log = stats, timers, step_log
        self.tokenizer, self.ctx_size = tokenizer, ctx_size
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.json_close = True  # structured output closes its JSON before max_tokens (settings.json_close)
        self.json_repeat_guard = 0  # structured output caught repeating a block this many times ends

    def step(self, batch: StepBatch, fwd: Any, launch_s: float) -> tuple[StepBatch, Any, float] | None:
        """forward -> batched sampling -> (next step's forward, when it can start on the device
        before these ids are read) -> one transfer -> bookkeeping.  Text is the worker's.
        ``fwd``/``launch_s``: this step's forward when it was launched (overlapped) by the previous
        step, and how long that launch took.  Returns the launched next step, if any."""
        t1 = time.perf_counter()
        fwd_given = fwd is not None
        if fwd is None:
            fwd = self.model.forward(batch)
        t2 = time.perf_counter()
        forward_s = launch_s or (t2 - t1)
        rows = [w for w in batch.seqs if w.sample and w.seq_id not in fwd.failed]
        failed = dict(fwd.failed)  # seq id -> error: these sequences end with it, the rest go on
        pending = None
        logits, forked = fwd.logits, False
        if self.forks.pending and rows:  # leaders whose prompt just ran: their members sample from its logits
            extra, idx = self.forks.take(rows)
            if extra:
                logits, rows, forked = self.forks.gather(fwd.logits, len(rows), idx), rows + extra, True
        if rows:
            srows = [sampler.Row(w.params, w.state) for w in rows]
            try:
                pending = sampler.launch(self.model.ops, logits, srows)
            except Exception:  # find the row(s) at fault and fail only them
                log.exception("batched sampling failed; sampling the %d rows one by one", len(rows))
                pending, ok, bad = sampler.launch_each(self.model.ops, logits, srows)
                failed.update({rows[i].seq_id: err for i, err in bad.items()})
                rows = [rows[i] for i in ok]
        t3 = time.perf_counter()
        nxt = None
        if (
            pending is not None
            and pending.tokens is not None
            and not failed
            and not forked
            and self.can_overlap(batch, fwd)
        ):
            nb = StepBatch(
                [
                    SeqWork(w.seq_id, [0], w.start_pos + len(w.tokens), True, w.params, w.state, kv_format=w.kv_format)
                    for w in batch.seqs
                ],
                input_ids=pending.tokens,
            )
            tn = time.perf_counter()
            nfwd = self.model.forward(nb)
            nxt = (nb, nfwd, time.perf_counter() - tn)  # its forward was launched (and timed) now
            self.stats.overlapped_steps += 1
        t4 = time.perf_counter()
        sampled = pending.finish() if pending is not None else []
        if pending is not None and pending.failed:  # a grammar refused its sampled token
            failed.update({rows[i].seq_id: err for i, err in pending.failed.items()})
        t5 = time.perf_counter()
        self.timers.add("prepare", fwd.prepare_seconds)
        self.timers.add("forward", max(0.0, forward_s - fwd.prepare_seconds))
        self.timers.add("sample", t3 - t2)
        self.timers.add("sync", t5 - t4)
        self.stats.steps += 1
        if self.step_log is not None:
            pre = [len(w.tokens) for w in batch.seqs if len(w.tokens) > 1]
            self.step_log.write(
                t1,
                len(batch.seqs) - len(pre),
                len(pre),
                sum(pre),
                fwd_given,
                {"forward": forward_s, "sample": t3 - t2, "overlap_launch": t4 - t3, "sync": t5 - t4},
            )
        if any(len(w.tokens) == 1 for w in batch.seqs):
            self.stats.decode_seconds += t5 - t2 + forward_s
        for sid, err in failed.items():  # one sequence's failure (its media, its sampling) is its own
            live = self.live.get(sid)
            if live is not None:
                self.finish(live, "error", error=err)
        for w in batch.seqs:
            live = self.live.get(w.seq_id)
            if live is not None:
                seq = live.seq
                if not seq.output_tokens and not seq.preemptions and seq.num_computed == live.cached_tokens:
                    self.stats.queue_time.observe(t1 - live.submitted)  # its first step
                if seq.num_computed < seq.prefill_target:
                    self.forks.stats.prefill_tokens += len(w.tokens)
                live.seq.num_computed += len(w.tokens)
                if self.kv.kv_blocks is not None:  # newly full blocks become matchable (prefix caching)
                    self.kv.commit(live)
                if not w.sample and not live.seq.output_tokens:
                    self.outs.append(Out(w.seq_id, progress=(live.seq.num_computed, len(live.seq.prompt_tokens))))
        for w, s in zip(rows, sampled):
            live = self.live.get(w.seq_id)
            if live is not None and w.seq_id not in failed:
                self.on_token(live, SampledToken(w.seq_id, s.token, s.logprob, s.top_logprobs))
        self.flush()
        self.timers.add("process", time.perf_counter() - t5)
        return nxt

    def can_overlap(self, batch: StepBatch, fwd: Any) -> bool:
        """Launch the next decode step before reading this one's ids back, when the next step is
        certainly these same rows decoding: every row samples, none can end by length now, no
        request waits to be admitted, no command is pending, and the KV budget has room.  A row
        that ends by EOS or a stop string meanwhile has its extra token discarded."""
        if not self.model.overlap or fwd.failed or self.speculator is not None or not self.inbox.empty():
            return False
        sch = self.scheduler
        if sch.waiting or len(batch.seqs) != len(sch.running):
            return False
        for w in batch.seqs:
            live = self.live.get(w.seq_id)
            if live is None or not w.sample:
                return False
            seq = live.seq
            if seq.num_computed != w.start_pos or seq.media is not None:
                return False
            n_out = len(seq.output_tokens) + 1  # after this step
            if n_out + 1 > (seq.params.max_tokens or 0) or len(seq.prompt_tokens) + n_out + 1 > self.ctx_size:
                return False
        if sch.kv_budget and sum(s.kv_demand for s in sch.running) + len(sch.running) > sch.kv_budget:
            return False
        if sch.managed:  # the next step writes one position past this one: its block first
            for w in batch.seqs:
                if not sch.ensure_blocks(self.live[w.seq_id].seq, w.start_pos + len(w.tokens) + 1):
                    return False
        return True

    def speculate(self, batch: StepBatch) -> bool:
        """Draft and verify when a single sequence is decoding (with several, the batched
        plain step is used: per-sequence acceptance would split the batch).  True if done."""
        if len(batch.seqs) != 1:
            return False
        w = batch.seqs[0]
        live = self.live.get(w.seq_id)
        if live is None or not w.sample or len(w.tokens) != 1 or not live.seq.output_tokens or not eligible(w.params):
            return False
        seq = live.seq
        room = min((w.params.max_tokens or 0) - len(seq.output_tokens), self.ctx_size - len(seq.all_tokens))
        if self.scheduler.managed and not self.scheduler.ensure_blocks(seq, w.start_pos + self.speculator.k + 1):
            return False  # the verified block's positions need blocks: a plain step instead
        t0 = time.perf_counter()
        try:
            sampled = self.speculator.step(w, seq, room)
        except Exception as exc:  # fail this sequence, keep the engine
            log.exception("speculative step failed")
            self.finish(live, "error", error=f"{type(exc).__name__}: {exc}")
            return True
        if sampled is None:
            return False
        self.stats.steps += 1
        self.stats.decode_seconds += time.perf_counter() - t0
        seq.num_computed = w.start_pos + len(sampled)
        for s in sampled:
            if w.seq_id not in self.live:  # finished (stop, length) part-way: the rest is dropped
                break
            self.on_token(live, s)
        return True

    def on_token(self, live: Live, s: SampledToken) -> None:
        """Record a sampled id; end the sequence on EOS / stop token / max tokens / context.
        Stop strings need text: the output worker checks them."""
        seq, params = live.seq, live.seq.params
        if live.first_token_at is None:
            live.first_token_at = time.perf_counter()
            self.stats.ttft.observe(live.first_token_at - live.submitted)
            self.stats.prompt_tokens += len(seq.prompt_tokens)
        seq.output_tokens.append(s.token)
        self.stats.tokens_generated += 1
        out = Out(seq.seq_id, s.token, s.logprob, s.top_logprobs)
        self.outs.append(out)
        if (not params.ignore_eos and s.token in self.eos) or s.token in params.stop_token_ids:
            out.reason = "stop"
        elif (
            len(seq.output_tokens) >= (params.max_tokens or 0)
            or len(seq.prompt_tokens) + len(seq.output_tokens) >= self.ctx_size
        ):
            out.reason = "length"
        if out.reason is None and seq.state.constraint is not None and (self.json_close or self.json_repeat_guard):
            self.close_json(live, out)
        if out.reason is not None:
            self.finish(live, out.reason, notify=False)

    def close_json(self, live: Live, out: Out) -> None:
        """Structured output near its token limit, or caught in a loop: feed the shortest text that
        completes the JSON (chat.json_close) as the last tokens, so the content always parses.
        Near the limit it ends 'length'; a loop (the same block of >= 3 tokens repeated
        ``json_repeat_guard`` times) ends 'stop'."""
        from .chat.json_close import closing_suffix

        seq, params = live.seq, live.seq.params
        room = min(
            (params.max_tokens or 0) - len(seq.output_tokens),
            self.ctx_size - len(seq.prompt_tokens) - len(seq.output_tokens),
        )
        looping = bool(self.json_repeat_guard) and _repeats(seq.output_tokens, self.json_repeat_guard)
        if not looping and (not self.json_close or room > JSON_CLOSE_WINDOW):
            return
        suffix = closing_suffix(self.tokenizer.decode(seq.output_tokens))
        if suffix is None:
            return
        ids = self.tokenizer.encode(suffix, add_special_tokens=False)
        if not ids or (not looping and len(ids) + JSON_CLOSE_MARGIN < room):
            return
        for t in ids:  # forced: the grammar is not asked (the sequence ends with them)
            seq.output_tokens.append(t)
            self.stats.tokens_generated += 1
            self.outs.append(Out(seq.seq_id, t))
        reason = "stop" if looping else "length"
        self.outs.append(Out(seq.seq_id, reason=reason))  # token-less: every forced token's text is kept
        self.stats.json_closed += 1
        self.finish(live, reason, notify=False)  # ``out`` keeps reason None: no second finish
