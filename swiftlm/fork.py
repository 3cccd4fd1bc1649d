"""Fork groups: the n choices of one request (``n`` / ``best_of``) prefill their prompt once.

``Engine.submit_group`` takes one prompt and one ``SamplingParams`` per choice.  The first choice
(the *leader*) is queued as any request; the others (*members*) wait beside it, holding nothing.
In the step where the leader's last prompt chunk has run, before sampling:

1. the backend makes the leader's prompt KV a fork source: ``share_prefix`` (torch on the CPU: a
   read-only prefix that every fork points to, copy-on-write, ``backends/torch/shared_kv.py``),
   else a ``snapshot_prefix`` payload (CUDA slot pool, MLX, tensor / pipeline ranks: the rows are
   copied into each member when it is admitted);
2. every member samples its first token from the leader's last-position logits (a row gather:
   the same logits, each member's own seed and sampler state);
3. the members go to the front of the queue with their KV *pending*: when the scheduler is about to
   admit one, ``fork_from`` (or ``restore_prefix``) gives it the prompt's KV and it decodes from
   there.  The prompt never runs through the model a second time.

Members are sequences like any other from then on: cancelled, timed out, preempted (recomputed)
and finished one by one.  A leader that ends before its prompt is done (cancelled, failed) hands
the group to the next member, which prefills instead.  A backend with neither hook, or a cache it
cannot fork (compressed KV), leaves the members to prefill on their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .backend import SeqWork

log = logging.getLogger(__name__)


@dataclass
class ForkStats:
    """Counters (monotonic) of prompt work and of forks, written by the engine thread."""

    prefill_tokens: int = 0  # positions run through the model in prefill chunks (prompt-cache hits excluded)
    groups: int = 0  # fork groups whose prompt was prefilled once for all their choices
    forked: int = 0  # sequences started from another's prefilled prompt
    forked_tokens: int = 0  # prompt positions those sequences did not prefill
    shared: int = 0  # forks that point at shared KV rows (no copy)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


class ForkGroups:
    """The engine's fork groups (see the module text).  Engine-thread only.  ``live``: the engine's live
    requests by id; ``prefix_eligible``: whether a request uses the prompt cache (a member that
    prefills on its own looks it up, ``kv_admission.KVAdmission.eligible``)."""

    def __init__(self, model: Any, scheduler: Any, live: dict[int, Any], prefix_eligible: Callable[[Any], bool]):
        self.model, self.scheduler, self.live, self.prefix_eligible = model, scheduler, live, prefix_eligible
        self.can_share = model.can_share_prefix  # (ModelHooks; the tensor-parallel Leader declares False)
        self.can_copy = model.can_snapshot_prefix
        self.pending: dict[int, list[Any]] = {}  # leader's seq id -> members (_Live) waiting for its prompt
        self.stats = ForkStats()

    @property
    def possible(self) -> bool:
        return self.can_share or self.can_copy

    def add(self, leader: Any, members: list[Any]) -> None:
        if members:
            self.pending[leader.seq.seq_id] = list(members)

    def drop(self, live: Any) -> None:
        """``live`` ends: a leader still prefilling hands its members to the first of them (which
        prefills instead); a member still waiting leaves its group."""
        sid = live.seq.seq_id
        members = self.pending.pop(sid, None)
        if members:
            new, rest = members[0], members[1:]
            if rest:
                self.pending[new.seq.seq_id] = rest
            new.prefix_pending = self.prefix_eligible(new)
            self.scheduler.waiting.appendleft(new.seq)
            return
        for lst in self.pending.values():
            if live in lst:
                lst.remove(live)
                return

    def take(self, rows: list[SeqWork]) -> tuple[list[SeqWork], list[int]]:
        """In a step, after the forward and before sampling: the members of each leader whose prompt
        just completed, as extra sample rows, and for each the index of its leader's logits row."""
        extra: list[SeqWork] = []
        idx: list[int] = []
        for j, w in enumerate(rows):
            members = self.pending.get(w.seq_id)
            live = self.live.get(w.seq_id)
            if not members or live is None:
                continue
            seq = live.seq
            if seq.output_tokens or seq.num_computed + len(w.tokens) != len(seq.prompt_tokens):
                continue
            del self.pending[w.seq_id]
            source = self._source(w.seq_id)
            waiting = self.scheduler.waiting
            if source is None:  # no fork here: the members prefill on their own
                for m in reversed(members):
                    m.prefix_pending = self.prefix_eligible(m)
                    waiting.appendleft(m.seq)
                continue
            kind, handle, n = source
            self.stats.groups += 1
            for m in reversed(members):
                m.fork = (kind, handle, n)
                waiting.appendleft(m.seq)
            for m in members:
                extra.append(SeqWork(m.seq.seq_id, [], n, True, m.seq.params, m.seq.state, kv_format=m.seq.kv_format))
                idx.append(j)
        return extra, idx

    def gather(self, logits: Any, n_rows: int, idx: list[int]) -> Any:
        """The step's logits with the leaders' rows repeated for their members (a row gather)."""
        ops = self.model.ops
        return ops.take(logits, ops.vec(np.asarray(list(range(n_rows)) + idx, dtype=np.int64)))

    def _source(self, seq_id: int) -> tuple[str, Any, int] | None:
        m = self.model
        try:
            if self.can_share:
                got = m.share_prefix(seq_id)
                if got is not None:
                    return "shared", got[0], got[1]
            if self.can_copy:
                snap = m.snapshot_prefix(seq_id)
                if snap is not None:
                    return "copy", snap[0], snap[2]
        except Exception:  # a fork failure costs the members their own prefill, never the request
            log.exception("forking a prompt's KV failed; the choices prefill on their own")
        return None

    def admit(self, live: Any) -> None:
        """A member about to be admitted: its prompt KV from the fork source (no prefill)."""
        kind, handle, n = live.fork
        live.fork = None
        seq, m = live.seq, self.model
        if seq.num_computed:  # pragma: no cover - a member holds nothing before this
            return
        try:
            (m.fork_from if kind == "shared" else m.restore_prefix)(seq.seq_id, handle, n)
        except Exception:  # recomputed instead (prompt + its first token), as after a preemption
            log.exception("starting a fork from its prompt's KV failed; recomputing it")
            m.free([seq.seq_id])
            return
        seq.num_computed = n
        self.stats.forked += 1
        self.stats.forked_tokens += n
        self.stats.shared += kind == "shared"
