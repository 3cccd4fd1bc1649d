"""Speculative decoding: draft a few tokens cheaply, verify them with one target pass.

Drafts come from prompt lookup (``NgramDrafter``: the continuation of the latest earlier
occurrence of the text's last n-gram, no second model) or from a smaller model sharing the
tokenizer (``ModelDrafter``).  The target scores ``[last token] + drafts`` in one forward pass
(``Model.score``: logits at every fed position) and the core decides what is kept:

- greedy: draft ``i`` is kept while it equals the target's own choice at that position, then
  the target's token follows; the output is the plain greedy output, token for token;
- sampling: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): keep draft
  ``d`` with probability ``min(1, p(d) / q(d))``, otherwise draw from ``max(p - q, 0)``
  renormalised; a prompt-lookup draft is a point mass (``q(d) = 1``).  The output has the
  target's distribution exactly.

Rollback is by position: the target's (and draft's) KV state past the kept tokens is
overwritten by the next step, which starts at the first position not kept (both backends
trim a cache that is longer than a step's start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .backend import SampledToken, SeqWork
from .sampler import sample_row
from .sampling import SamplerState, SamplingParams, masked_logits, truncate


def probs(ops: Any, logits: Any, params: SamplingParams, state: SamplerState) -> np.ndarray:
    """The distribution ``sample_row`` draws from (penalties, grammar, temperature, top-k/p,
    min-p), as float64 numpy."""
    x = truncate(ops, masked_logits(ops, logits, params, state) / params.temperature, params)
    lp = np.asarray(ops.tolist(ops.log_softmax(x)), dtype=np.float64)
    p = np.exp(lp)
    return p / p.sum()


def eligible(params: SamplingParams) -> bool:
    """Requests that speculate.  Logprobs are reported per sampled position by the plain path."""
    return not params.logprobs


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the last ``n`` tokens
    (``n`` from ``max_ngram`` down to ``min_ngram``) and propose what followed it."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(
        self, seq_id: int, tokens: list[int], k: int, params: SamplingParams, state: SamplerState
    ) -> tuple[list[int], list[np.ndarray] | None]:
        n_tok = len(tokens)
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = arr[n_tok - n :]
            # windows that end before the tail itself, most recent first
            win = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            for start in hits[::-1]:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow, None
        return [], None

    def free(self, seq_id: int) -> None:
        pass


class ModelDrafter:
    """A smaller model with the same tokenizer drafts ``k`` tokens: greedily for greedy
    requests, else sampled from its own distribution ``q`` (returned for the acceptance rule)."""

    name = "draft-model"

    def __init__(self, model: Any):
        self.model = model
        self.fed: dict[int, list[int]] = {}  # tokens whose KV the draft holds, per sequence

    def propose(
        self, seq_id: int, tokens: list[int], k: int, params: SamplingParams, state: SamplerState
    ) -> tuple[list[int], list[np.ndarray] | None]:
        fed = self.fed.get(seq_id, [])
        n = 0
        limit = min(len(fed), len(tokens) - 1)  # feed at least the last token to get logits
        while n < limit and fed[n] == tokens[n]:
            n += 1
        ops = self.model.ops
        if len(tokens) - n <= 2:  # the usual catch-up (last draft + the bonus token): single-token
            for i in range(n, len(tokens)):  # steps, which replay CUDA graphs instead of an eager pass
                logits = self.model.logits(seq_id, [tokens[i]], i)
        else:
            logits = self.model.logits(seq_id, tokens[n:], n)
        fed = list(tokens)
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        rng = _rng(state, "draft")
        for i in range(k):
            if params.greedy:
                d = int(ops.argmax(ops.float32(logits)))
            else:
                q = probs(ops, logits, params, _scratch(state))
                d = int(rng.choice(q.shape[0], p=q))
                qs.append(q)
            drafts.append(d)
            if i + 1 < k:
                logits = self.model.logits(seq_id, [d], len(fed))
                fed.append(d)
        self.fed[seq_id] = fed
        return drafts, (None if params.greedy else qs)

    def free(self, seq_id: int) -> None:
        self.fed.pop(seq_id, None)
        self.model.free([seq_id])


def _scratch(state: SamplerState) -> SamplerState:
    """The draft's view of a sequence: same history, no grammar (q may be any distribution)."""
    return SamplerState(seed=state.seed, prompt_tokens=state.prompt_tokens, output_tokens=state.output_tokens)


def _rng(state: SamplerState, which: str) -> np.random.Generator:
    attr = f"_spec_rng_{which}"
    rng = getattr(state, attr, None)
    if rng is None:
        rng = np.random.default_rng([state.seed or 0, 0x5BEC, 1 if which == "draft" else 2])
        setattr(state, attr, rng)
    return rng


@dataclass
class SpecStats:
    steps: int = 0  # target verify passes
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by verify passes (accepted + one per pass)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


class Speculator:
    """Drafts and verifies for one sequence at a time (the engine calls it for a lone decode row)."""

    def __init__(self, model: Any, drafter: Any, num_draft_tokens: int = 4):
        self.model, self.drafter, self.k = model, drafter, max(1, num_draft_tokens)
        self.stats = SpecStats()
        # per-sequence draft length: halved when a whole draft is rejected, doubled (up to k)
        # when all of it is kept, so text that prompt lookup cannot predict costs little
        self.budget: dict[int, int] = {}

    def free(self, seq_id: int) -> None:
        self.budget.pop(seq_id, None)
        self.drafter.free(seq_id)

    def step(self, w: SeqWork, seq: Any, room: int) -> list[SampledToken] | None:
        """One speculative decode step for a lone decode row; None when there is nothing to
        draft (the caller runs the plain step).  ``room``: tokens the sequence may still emit."""
        k = min(self.budget.get(w.seq_id, self.k), room - 1)
        if k < 1:
            return None
        params, state = w.params, w.state
        drafts, qs = self.drafter.propose(w.seq_id, seq.all_tokens, k, params, state)
        if not drafts:
            return None
        rows = self.model.score(w.seq_id, w.tokens + drafts, w.start_pos, pad_to=self.k + 1)
        ops = self.model.ops
        out: list[int] = []
        history = state.output_tokens  # the engine appends the kept tokens itself: restore after
        base = len(history)
        try:
            for i in range(len(drafts) + 1):
                if params.greedy:
                    token, _, _ = sample_row(ops, rows[i], params, state)
                    out.append(token)
                    if i == len(drafts) or token != drafts[i]:
                        break
                else:
                    token, kept = self._sample(ops, rows[i], params, state, drafts, qs, i)
                    out.append(token)
                    if state.constraint is not None:
                        state.constraint.consume(token)
                    if not kept:
                        break
                history.append(token)
        finally:
            del history[base:]
        kept = len(out) - 1
        cur = self.budget.get(w.seq_id, self.k)
        self.budget[w.seq_id] = min(self.k, cur * 2) if kept == len(drafts) else max(1, cur // 2) if kept == 0 else cur
        self.stats.steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += len(out) - 1
        self.stats.emitted += len(out)
        return [SampledToken(w.seq_id, t) for t in out]

    @staticmethod
    def _sample(
        ops: Any,
        row: Any,
        params: SamplingParams,
        state: SamplerState,
        drafts: list[int],
        qs: list[np.ndarray] | None,
        i: int,
    ) -> tuple[int, bool]:
        """-> (token, whether it is the kept draft); a resampled or bonus token ends the step."""
        p = probs(ops, row, params, state)
        rng = _rng(state, "verify")
        if i == len(drafts):  # every draft kept: the bonus token comes from the target
            return int(rng.choice(p.shape[0], p=p)), False
        d = drafts[i]
        q = qs[i] if qs is not None else None
        qd = q[d] if q is not None else 1.0
        if qd > 0 and rng.random() < min(1.0, p[d] / qd):
            return d, True
        if q is None:
            resid = p.copy()
            resid[d] = 0.0
        else:
            resid = np.maximum(p - q, 0.0)
        total = resid.sum()
        resid = resid / total if total > 0 else p
        return int(rng.choice(resid.shape[0], p=resid)), False
