"""Which sequences run in the next engine step.

FCFS: a waiting sequence is admitted when fewer than ``max_running`` are running.  Each
step carries every running sequence's decode row plus prefill chunks of at most
``prefill_size`` tokens per sequence, within ``token_budget`` tokens per step (decode rows
first, so running streams are never stalled by a long prompt).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .backend import SeqWork, StepBatch
from .sampling import SamplerState, SamplingParams


@dataclass
class Sequence:
    seq_id: int
    prompt_tokens: list[int]
    params: SamplingParams
    state: SamplerState
    output_tokens: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose KV the backend holds
    cancelled: bool = False

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_tokens + self.output_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_tokens)


class Scheduler:
    def __init__(self, max_running: int = 1, prefill_size: int = 512, token_budget: int | None = None):
        self.max_running = max(1, max_running)
        self.prefill_size = max(1, prefill_size)
        self.token_budget = token_budget or max(self.prefill_size, self.max_running) + self.max_running
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

    def schedule(self) -> StepBatch:
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        budget = self.token_budget
        work: list[SeqWork] = []
        for seq in self.running:  # decode rows first
            if not seq.in_prefill:
                work.append(SeqWork(seq.seq_id, seq.all_tokens[seq.num_computed:], seq.num_computed,
                                    True, seq.params, seq.state))
                budget -= 1
        for seq in self.running:  # then prefill chunks, oldest first
            if seq.in_prefill and budget > 0:
                n = min(self.prefill_size, budget, len(seq.prompt_tokens) - seq.num_computed)
                end = seq.num_computed + n
                work.append(SeqWork(seq.seq_id, seq.prompt_tokens[seq.num_computed:end], seq.num_computed,
                                    end == len(seq.prompt_tokens), seq.params, seq.state))
                budget -= n
        return StepBatch(work)
