"""Which sequences run in the next engine step.

FCFS: a waiting sequence is admitted when fewer than ``max_running`` are running and, with
a KV budget (in tokens), when the KV its whole context needs fits beside the running ones.
Each step carries every running sequence's decode row plus prefill chunks of at most
``prefill_size`` tokens per sequence, within ``token_budget`` tokens per step (decode rows
first, so running streams are never stalled by a long prompt).  A prompt that one chunk would hold
is not split at the edge of a step's budget when other prompt chunks are in the step: it waits for
the next step, whole, and shorter prompts behind it may take the rest of the budget (first chunks of several
prompts run as one packed forward; a chunk that starts past position 0 runs on its own).  A longer prompt beside
other chunks takes at least half a chunk, or waits the same way.

When the running sequences outgrow the KV budget, the most recently admitted one is
preempted: its KV state is dropped (the engine frees it), it goes back to the front of the
queue with the tokens it has generated, and when readmitted it recomputes its KV from
prompt + output (recompute, not swap) and continues where it stopped.

With a paged KV pool (``blocks``, a ``kv_blocks.KVBlocks``) the budget is the pool's blocks: a
sequence is admitted when the blocks its context needs (``kv_demand``, less the cached prefix blocks
it was given) fit beside what the running ones still need; each step every running sequence's table
is grown to ``kv_demand`` positions (its next decode position included, so an overlapped next step
needs none), and when that cannot be done the newest is preempted and its blocks freed at once.
A second manager (``code_blocks``) may hold the pages of compressed codes (TurboQuant, the server's
default format): sequences marked ``codes`` are admitted, grown and preempted against it the same way.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .backend import SeqWork, StepBatch
from .sampling import SamplerState, SamplingParams
from .turboquant.presets import KVFormat

log = logging.getLogger("swiftlm.engine")  # (the budget's warning sits with the engine's records)


@dataclass
class Sequence:
    seq_id: int
    prompt_tokens: list[int]
    params: SamplingParams
    state: SamplerState
    output_tokens: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose KV the backend holds
    cancelled: bool = False
    preemptions: int = 0
    media: Any = None  # media.MediaInputs: the prompt is prefilled in one chunk with these arrays
    kv_table: list[int] | None = None  # paged pool: the manager's live block list (Scheduler.blocks_needed)
    paged: bool = True  # its KV lives in the paged pool (False: a compressed cache of its own, no blocks)
    codes: bool = False  # its codes live in pages of the code pool (``Scheduler.code_blocks``)
    kv_format: KVFormat = KVFormat()  # decided once at admission (``presets.admitted_format``)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_tokens + self.output_tokens

    def tokens(self, start: int, end: int | None = None) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole context."""
        P = len(self.prompt_tokens)
        end = P + len(self.output_tokens) if end is None else end
        if start >= P:  # pragma: no mutate (start == P: both branches give output_tokens[:end - P])
            return self.output_tokens[start - P : end - P]
        if end <= P:  # pragma: no mutate (end == P: both branches give prompt_tokens[start:])
            return self.prompt_tokens[start:end]
        return self.prompt_tokens[start:] + self.output_tokens[: end - P]

    @property
    def prefill_target(self) -> int:
        """Positions to compute before decoding: the prompt, or after a preemption everything
        but the last generated token (which the next decode row feeds)."""
        return len(self.prompt_tokens) + max(0, len(self.output_tokens) - 1)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def kv_demand(self) -> int:
        """KV positions this sequence holds after its next step."""
        return len(self.prompt_tokens) + len(self.output_tokens) + 1


def kv_budget_tokens(budget_bytes: int, bytes_per_token: int, ctx_size: int) -> int | None:
    """--kv-budget-bytes as tokens (None: no budget), never less than one sequence at full context."""
    if not budget_bytes or not bytes_per_token:
        return None
    tokens = budget_bytes // bytes_per_token
    if tokens < ctx_size + 1:  # one sequence at full context must always fit
        log.warning(
            "--kv-budget-bytes %d holds %d tokens, less than one full context (%d); raising it",
            budget_bytes,
            tokens,
            ctx_size,
        )
        tokens = ctx_size + 1
    return tokens


class Scheduler:
    def __init__(
        self,
        max_running: int = 1,
        prefill_size: int = 512,
        token_budget: int | None = None,
        kv_budget_tokens: int | None = None,
        blocks: Any = None,
        max_positions: int = 0,
    ):
        self.max_running = max(1, max_running)
        self.blocks = blocks  # kv_blocks.KVBlocks of a paged pool, or None
        self.code_blocks: Any = None  # kv_blocks.KVBlocks of the code pages of compressed sequences, or None
        self.starved: list[int] = []  # running sequences the pool could not grow (nothing left to preempt)
        self.max_positions = max_positions  # a sequence's positions never exceed this (the context), 0: no cap
        self.kv_budget = kv_budget_tokens or None
        self.preemptions = 0
        self.prefill_size = max(1, prefill_size)
        # at least one prompt token beside a full set of decode rows, or a prompt could wait forever
        self.token_budget = max(
            token_budget or max(self.prefill_size, self.max_running) + self.max_running, self.max_running + 1
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_in_use(self) -> int:
        return sum(s.num_computed for s in self.running)

    def block_stats(self) -> dict[str, Any] | None:
        """The paged pool's manager's stats; with code pages, theirs under ``code_pages``."""
        out = self.blocks.stats() if self.blocks is not None else None
        c = self.code_blocks
        if c is not None:
            out = dict(out or {})
            out["code_pages"] = {
                "page_size": c.block_size,
                "pages_total": c.num_blocks,
                "pages_used": c.used(),
                "pages_free": c.available(),
            }
        return out

    def _positions(self, seq: Sequence) -> int:
        d = seq.kv_demand
        return min(d, self.max_positions) if self.max_positions else d

    @property
    def managed(self) -> bool:
        """Whether a block manager (16-bit blocks or code pages) holds any sequence's KV."""
        return self.blocks is not None or self.code_blocks is not None

    def manager(self, seq: Sequence) -> Any:
        """The block manager ``seq``'s KV is counted against (None: a cache of its own)."""
        if seq.codes:
            return self.code_blocks
        return self.blocks if seq.paged else None

    def blocks_needed(self, seq: Sequence, positions: int | None = None) -> int:
        """New blocks ``seq`` needs for its table to cover ``positions`` (default: its ``kv_demand``).  The
        table is the manager's live list, kept on the sequence: a decode row between block boundaries costs
        one length check, no manager call."""
        m = self.manager(seq)
        if m is None:
            return 0
        t = seq.kv_table
        if t is None:
            t = seq.kv_table = m.table(seq.seq_id)
        n = self._positions(seq) if positions is None else positions
        bs = m.block_size
        return 0 if n <= len(t) * bs else -(-n // bs) - len(t)

    def ensure_blocks(self, seq: Sequence, positions: int | None = None) -> bool:
        """Grow ``seq``'s table to cover ``positions`` (default: its ``kv_demand``); False if the pool is short."""
        if positions is not None and self.max_positions:
            positions = min(positions, self.max_positions)  # never a block past the context
        if not self.blocks_needed(seq, positions):
            return True
        return self.manager(seq).grow(seq.seq_id, self._positions(seq) if positions is None else positions)

    def _preempt(self, preempted: list[int], victim: Sequence | None = None) -> int:
        """Send ``victim`` (default: the most recently admitted running sequence) back to the front of the queue
        (recomputed when readmitted); with a paged pool its blocks go back now.  Returns the blocks it still
        needed."""
        victim = victim or self.running[-1]
        self.running.remove(victim)
        need = 0
        m = self.manager(victim)
        if m is not None:
            need = self.blocks_needed(victim)
            m.free(victim.seq_id)
            victim.kv_table = None
        victim.num_computed = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        preempted.append(victim.seq_id)
        return need

    def schedule(self) -> StepBatch:
        mgrs = [m for m in (self.blocks, self.code_blocks) if m is not None]
        need = {id(m): 0 for m in mgrs}  # blocks the running sequences still need, per manager
        for s in self.running:
            m = self.manager(s)
            if m is not None:
                need[id(m)] += self.blocks_needed(s)
        while self.waiting and len(self.running) < self.max_running:
            if (
                self.kv_budget
                and self.running
                and sum(s.kv_demand for s in self.running) + self.waiting[0].kv_demand > self.kv_budget
            ):
                break  # FCFS: nobody overtakes the head of the queue
            head = self.waiting[0]
            m = self.manager(head)
            if m is not None:
                head.kv_table = None  # (its table may have been freed or replaced while it waited)
                extra = self.blocks_needed(head)
                if self.running and need[id(m)] + extra > m.available():
                    break
                need[id(m)] += extra
            self.running.append(self.waiting.popleft())
        preempted: list[int] = []
        while self.kv_budget and len(self.running) > 1 and sum(s.kv_demand for s in self.running) > self.kv_budget:
            victim = self.running[-1]
            m = self.manager(victim)
            n = self._preempt(preempted)
            if m is not None:
                need[id(m)] -= n
        for m in mgrs:  # a manager short of blocks: its newest sequence goes back, while it has more than one
            while need[id(m)] > m.available():
                mine = [s for s in self.running if self.manager(s) is m]
                if len(mine) <= 1:
                    break
                need[id(m)] -= self._preempt(preempted, mine[-1])
        starved = set()
        if any(need.values()):
            for seq in self.running:  # every table covers its next step
                if not self.ensure_blocks(seq):  # a lone sequence past what the whole pool holds: the engine ends it
                    starved.add(seq.seq_id)
                    self.starved.append(seq.seq_id)
        budget = self.token_budget
        work: list[SeqWork] = []
        for seq in self.running:  # decode rows first
            if not seq.in_prefill and seq.seq_id not in starved:
                work.append(
                    SeqWork(
                        seq.seq_id,
                        seq.tokens(seq.num_computed),
                        seq.num_computed,
                        True,
                        seq.params,
                        seq.state,
                        kv_format=seq.kv_format,
                    )
                )
                budget -= 1
        chunks = 0
        for seq in self.running:  # then prefill chunks, oldest first
            if seq.in_prefill and budget > 0 and seq.seq_id not in starved:
                target = seq.prefill_target
                rest = target - seq.num_computed
                # beside other chunks, a prompt that one chunk holds is not split at the budget's edge (its later
                # chunk would start past position 0 and run on its own, not packed with the others), and a longer
                # one takes at least half a chunk: a sliver of a long prompt (the few tokens a step's budget has
                # left) costs a forward of its own each step, and as a first chunk it would keep a compressed
                # cache from holding the prompt in 16 bits.  Either waits for the next step, where it comes first;
                # shorter prompts behind it may still fill the budget.
                if chunks and budget < (rest if rest <= self.prefill_size else max(1, self.prefill_size // 2)):
                    continue
                n = min(self.prefill_size, budget, rest)
                media = None
                if seq.media is not None and seq.num_computed == 0:
                    n, media = target, seq.media  # media prompts: alone in one chunk (running rows still step)
                end = seq.num_computed + n
                resumed = bool(seq.output_tokens)  # a preempted sequence samples from its decode row
                work.append(
                    SeqWork(
                        seq.seq_id,
                        seq.tokens(seq.num_computed, end),
                        seq.num_computed,
                        end == target and not resumed,
                        seq.params,
                        seq.state,
                        media,
                        seq.kv_format,
                    )
                )
                budget -= n
                chunks += 1
        return StepBatch(work, preempted)
