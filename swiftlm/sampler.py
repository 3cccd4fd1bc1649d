"""The batched sampler: one call samples every row of a step, on the device.

Written once over a small array-ops interface (``BatchOps``); each backend hands its own
(torch, mlx) and ``NumpyOps`` in ``sampling.py`` is the reference.  Per-row parameters
(temperature, top-k, top-p, min-p, penalties, logit bias, grammar masks) become arrays, so
the device work per step does not grow with the number of distinct settings, and the host
work per row is only building those arrays.  The order of operations is the one documented
in ``sampling.py``.

Randomness is counter-based: row ``r`` draws ``u = splitmix64(seed_r, draw_r)`` (one uniform
in (0, 1] per sampled token, computed on the host for all rows at once) and takes the token
whose cumulative probability first reaches ``u``.  A token therefore depends only on the
request's seed, how many tokens it has drawn and its own logits: never on which other
requests share the batch, on preemption and recompute, or on the backend's RNG.

``launch`` queues the device work and returns a ``Pending``; ``Pending.finish`` makes the
step's one device-to-host transfer (token ids, plus logprobs for rows that asked, packed into
one array) and advances grammar constraints.  Between the two the caller may queue more work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .sampling import SamplerState, SamplingParams

NEG_INF = float("-inf")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """splitmix64(seed ^ golden * (counter + 1)) as float64 in (0, 1], vectorised."""
    with np.errstate(over="ignore"):
        z = (
            np.asarray([int(x) & 0xFFFFFFFFFFFFFFFF for x in seeds], dtype=np.uint64)
            ^ (np.asarray(counters, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        )
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 1.0) * (1.0 / (1 << 53))


class BatchOps(Protocol):
    """Operations on 2-D float32 arrays [rows, vocab] on the backend's device."""

    def f32(self, x: Any) -> Any: ...  # float32 copy
    def as_f32(self, x: Any) -> Any: ...  # float32, the same array when it already is
    def vec(self, a: np.ndarray) -> Any: ...  # host -> device (any dtype)
    def gather2(self, x: Any, r: Any, c: Any) -> Any: ...  # x[r, c]
    def scatter2(self, x: Any, r: Any, c: Any, v: Any) -> Any: ...  # x[r, c] = v (may be in place)
    def where(self, cond: Any, a: Any, b: Any) -> Any: ...  # broadcasting, float32
    def log_softmax_rows(self, x: Any) -> Any: ...
    def softmax_rows(self, x: Any) -> Any: ...
    def argmax_rows(self, x: Any) -> Any: ...  # int [rows]
    def sort_desc_rows(self, x: Any) -> tuple[Any, Any]: ...  # stable: (values, indices)
    def take_along(self, x: Any, idx: Any) -> Any: ...
    def put_along(self, x: Any, idx: Any, v: Any) -> Any: ...
    def cumsum_rows(self, x: Any) -> Any: ...
    def topk_rows(self, x: Any, k: int) -> tuple[Any, Any]: ...  # (values, indices), values descending
    def max_rows(self, x: Any) -> Any: ...  # [rows, 1]
    def count_below(self, c: Any, t: Any) -> Any: ...  # int [rows]: #(c[r] < t[r])
    # optional: ``draw_rows(y, u) -> int [rows]``, the inverse-CDF draw below in one kernel (None or absent:
    # softmax, cumsum and count_below); ``sample_simple(logits, host)``, the fused path of ``simple_inputs``
    def to_host(self, x: Any) -> np.ndarray: ...  # a blocking transfer
    def start_copy(self, x: Any) -> Any: ...  # queue THE transfer now (async where possible)
    def wait(self, handle: Any) -> np.ndarray: ...  # ... and take its result
    def pack(self, cols: list[Any]) -> Any: ...  # [rows, k] float32 from [rows] / [rows, j] parts
    def where_int(self, cond: Any, a: Any, b: Any) -> Any: ...  # like where, integer result
    def one_row(self, x: Any) -> Any: ...  # [V] -> [1, V]
    def end_thread(self) -> None: ...  # a thread that ran device work is ending


@dataclass
class Row:
    params: SamplingParams
    state: SamplerState


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def plain_greedy(p: SamplingParams, s: SamplerState) -> bool:
    """Rows whose token is the argmax of the raw logits (nothing else to compute)."""
    return (
        p.greedy
        and not p.logprobs
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and s.constraint is None
    )


class Pending:
    """Device work queued by ``launch``; ``finish`` reads it back once."""

    def __init__(self, ops: BatchOps, rows: list[Row], tokens: Any, packed: Any, top_k: int):
        self.ops, self.rows, self.tokens, self.packed, self.top_k = ops, rows, tokens, packed, top_k
        self.failed: dict[int, str] = {}  # row index -> error (its grammar refused the token): set by finish
        # the copy is queued right behind the sampler's kernels, ahead of whatever the caller queues next
        self.handle = ops.start_copy(tokens if packed is None else packed)

    def finish(self) -> list[Sampled]:
        out: list[Sampled] = []
        if self.packed is None:
            toks = self.ops.wait(self.handle).astype(np.int64).tolist()
            out = [Sampled(int(t)) for t in toks]
        else:
            host = self.ops.wait(self.handle)  # [n, 2 + 2K]: token, logprob, K ids, K logprobs
            K = self.top_k
            for r, row in enumerate(self.rows):
                tok = int(host[r, 0])
                if not row.params.logprobs:
                    out.append(Sampled(tok))
                    continue
                k = row.params.top_logprobs
                top = None
                if k:
                    top = [(int(i), float(v)) for i, v in zip(host[r, 2 : 2 + k], host[r, 2 + K : 2 + K + k])]
                out.append(Sampled(tok, float(host[r, 1]), top))
        for r, (row, s) in enumerate(zip(self.rows, out)):
            if row.state.constraint is not None:
                try:  # one row's grammar failing is that row's error, not the batch's
                    row.state.constraint.consume(s.token)
                except Exception as exc:
                    self.failed[r] = f"constrained decoding failed: {type(exc).__name__}: {exc}"
        return out


class PendingEach:
    """Rows launched one by one (``launch_each``): the same ``finish`` over their results."""

    def __init__(self, parts: list[Pending]):
        self.parts = parts
        self.tokens = None  # no single device tensor of ids: the next step is not overlapped
        self.failed: dict[int, str] = {}

    def finish(self) -> list[Sampled]:
        out = []
        for r, p in enumerate(self.parts):
            out += p.finish()
            if p.failed:
                self.failed[r] = p.failed[0]
        return out


def launch(ops: BatchOps, logits: Any, rows: list[Row]) -> Pending:
    """Queue sampling of every row of ``logits`` [n, V] (row r with ``rows[r]``).  Each row's
    draw counter advances only when the launch succeeds (a retry draws the same numbers)."""
    pending = _launch(ops, logits, rows, [r.state.draws for r in rows])
    for r in rows:
        r.state.draws += 1
    return pending


def launch_each(ops: BatchOps, logits: Any, rows: list[Row]) -> tuple[PendingEach, list[int], dict[int, str]]:
    """After a batched ``launch`` raised: launch row by row, so the row that fails (its logit
    bias, its grammar mask ...) fails alone.  Returns (pending over the rows that launched, their
    indices in ``rows``, {index: error} for the others)."""
    parts, ok, failed = [], [], {}
    for i, row in enumerate(rows):
        try:
            parts.append(launch(ops, ops.one_row(logits[i]), [row]))
            ok.append(i)
        except Exception as exc:
            failed[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    return PendingEach(parts), ok, failed


def _launch(ops: BatchOps, logits: Any, rows: list[Row], counters: list[int]) -> Pending:
    P = [r.params for r in rows]
    S = [r.state for r in rows]
    if all(plain_greedy(p, s) for p, s in zip(P, S)):  # the fast path: one argmax, ids back
        return Pending(ops, rows, ops.argmax_rows(logits), None, 0)
    fused = getattr(ops, "sample_simple", None)
    if fused is not None:
        host = simple_inputs(P, S, counters, _width(logits))
        if host is not None:  # temperature / logit bias / greedy only: one fused call (a graph on CUDA)
            return Pending(ops, rows, fused(logits, host), None, 0)
    x = adjust(ops, logits, P, S)
    want_lp = any(p.logprobs for p in P)
    lp = ops.log_softmax_rows(x) if want_lp else None
    greedy = np.array([p.greedy for p in P])
    if greedy.all():
        tok = ops.argmax_rows(x)
    else:
        tok = _draw(ops, x, P, greedy, uniforms([s.seed for s in S], counters))
    if not want_lp:
        return Pending(ops, rows, tok, None, 0)
    K = max(p.top_logprobs for p in P)
    tok_lp = ops.take_along(lp, tok.reshape(-1, 1))
    cols = [tok, tok_lp]
    if K:
        vals, idx = ops.topk_rows(lp, K)
        cols += [idx, vals]
    return Pending(ops, rows, tok, ops.pack(cols), K)


SIMPLE_BIAS = 8  # logit-bias entries per row the fused path carries


def simple_inputs(P: list[SamplingParams], S: list[SamplerState], counters: Sequence[int], V: int) -> np.ndarray | None:
    """The per-row inputs of the fused sampler (``BatchOps.sample_simple``) as one float32 array
    [n, 3 + 2 * SIMPLE_BIAS]: temperature (1 for greedy rows), the row's uniform, greedy (0/1), the
    logit-bias token ids (exact in float32 below 2**24) and values, zero-padded.  None when a row
    needs more (top-k/p, min-p, penalties, logprobs, a grammar, many biases, a bias outside the
    vocabulary): then the general path runs, with its errors."""
    K = SIMPLE_BIAS
    if V >= 1 << 24:
        return None
    for p, s in zip(P, S):
        if (
            p.logprobs
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or s.constraint is not None
            or len(p.logit_bias) > K
        ):
            return None
        if not p.greedy and ((p.top_k or 0) > 0 or p.top_p < 1.0 or p.min_p > 0):
            return None
        if any(not (0 <= int(t) < V) for t in p.logit_bias):
            return None
    n = len(P)
    host = np.zeros((n, 3 + 2 * K), np.float32)
    host[:, 0] = [1.0 if p.greedy else p.temperature for p in P]
    host[:, 1] = uniforms([s.seed for s in S], counters).astype(np.float32)
    host[:, 2] = [p.greedy for p in P]
    for i, p in enumerate(P):
        for j, (tok, b) in enumerate(p.logit_bias.items()):
            host[i, 3 + j], host[i, 3 + K + j] = int(tok), b
    return host


def adjust(ops: BatchOps, logits: Any, P: list[SamplingParams], S: list[SamplerState]) -> Any:
    """float32 logits after logit_bias, repetition penalty, presence/frequency penalty and the
    grammar mask (in that order); ``logits`` itself is never modified (a copy is made when needed)."""
    x = ops.f32(logits) if any(p.logit_bias or p.repetition_penalty != 1.0 for p in P) else logits
    r, c, v = [], [], []
    for i, p in enumerate(P):
        for tok, b in p.logit_bias.items():
            r.append(i), c.append(tok), v.append(b)
    if r:
        R, C = ops.vec(np.array(r, np.int64)), ops.vec(np.array(c, np.int64))
        x = ops.scatter2(x, R, C, ops.gather2(x, R, C) + ops.vec(np.array(v, np.float32)))
    r, c, v = [], [], []
    for i, (p, s) in enumerate(zip(P, S)):
        if p.repetition_penalty != 1.0:
            ctx = (s.prompt_tokens + s.output_tokens)[-p.repetition_context_size :]
            ids = sorted(set(ctx))
            r += [i] * len(ids)
            c += ids
            v += [p.repetition_penalty] * len(ids)
    if r:
        R, C = ops.vec(np.array(r, np.int64)), ops.vec(np.array(c, np.int64))
        pen = ops.vec(np.array(v, np.float32))
        vals = ops.gather2(x, R, C)
        x = ops.scatter2(x, R, C, ops.where(vals > 0, vals / pen, vals * pen))
    r, c, v = [], [], []
    for i, (p, s) in enumerate(zip(P, S)):
        if (p.presence_penalty or p.frequency_penalty) and s.output_tokens:
            counts = Counter(s.output_tokens)
            r += [i] * len(counts)
            c += list(counts)
            v += [n * p.frequency_penalty + p.presence_penalty for n in counts.values()]
    if r:
        if x is logits:
            x = ops.f32(logits)
        R, C = ops.vec(np.array(r, np.int64)), ops.vec(np.array(c, np.int64))
        x = ops.scatter2(x, R, C, ops.gather2(x, R, C) - ops.vec(np.array(v, np.float32)))
    if x is logits:
        x = ops.as_f32(logits)  # read-only from here on: no copy when the logits are float32 already
    if any(s.constraint is not None for s in S):
        masks = [s.constraint.allowed() if s.constraint is not None else None for s in S]
        V = next(m for m in masks if m is not None).shape[-1]
        allowed = np.stack([m if m is not None else np.ones(V, dtype=bool) for m in masks])
        x = ops.where(ops.vec(allowed), x, NEG_INF)
    return x


def _draw(ops: BatchOps, x: Any, P: list[SamplingParams], greedy: np.ndarray, u: np.ndarray) -> Any:
    """Temperature, top-k, top-p, min-p, then inverse-CDF with ``u``; greedy rows take the argmax."""
    n = len(P)
    temps = np.array([1.0 if g else p.temperature for p, g in zip(P, greedy)], np.float32).reshape(n, 1)
    kernel = getattr(ops, "draw_rows", None)  # optional: the draw below in the backend's own kernel (CUDA)
    # one setting: no copy; with a kernel always per row, as the fused path divides (CUDA divides by a scalar
    # as a multiplication by its reciprocal, which may round differently)
    one = (temps == temps[0, 0]).all() and kernel is None
    y = x / float(temps[0, 0]) if one else x / ops.vec(temps)
    ks = np.array([p.top_k if (p.top_k and p.top_k > 0) else 0 for p in P], np.int64)
    if ks.any():
        V = _width(y)
        kmax = int(min(ks.max(), V))
        vals, _ = ops.topk_rows(y, kmax)
        kth = ops.take_along(vals, ops.vec((np.clip(np.minimum(ks, V), 1, None) - 1).reshape(n, 1)))
        kth = ops.where(ops.vec((ks > 0).reshape(n, 1)), kth, NEG_INF)
        y = ops.where(y < kth, NEG_INF, y)
    tps = np.array([p.top_p for p in P], np.float32)
    if (tps < 1.0).any():
        vals, idx = ops.sort_desc_rows(y)
        probs = ops.softmax_rows(vals)
        before = ops.cumsum_rows(probs) - probs  # mass strictly above each token
        first = np.zeros((1, _width(y)), dtype=bool)
        first[0, 0] = True
        before = ops.where(ops.vec(first), 0.0, before)  # the most probable token always stays
        # rows without top_p compare against 2: never masked, whatever the rounding of the cumsum
        thr = np.where(tps < 1.0, np.maximum(tps, 1e-30), 2.0).astype(np.float32).reshape(n, 1)
        y = ops.put_along(y, idx, ops.where(before >= ops.vec(thr), NEG_INF, vals))
    mps = np.array([p.min_p for p in P], np.float32)
    if (mps > 0).any():
        ls = ops.log_softmax_rows(y)
        with np.errstate(divide="ignore"):
            off = np.log(mps).astype(np.float32).reshape(n, 1)  # min_p 0 -> -inf: nothing masked
        y = ops.where(ls < ops.max_rows(ls) + ops.vec(off), NEG_INF, y)
    if kernel is not None:
        tok = kernel(y, u.astype(np.float32))
    else:
        cdf = ops.cumsum_rows(ops.softmax_rows(y))
        total = cdf[:, -1:]  # the last column: a view, no host-to-device copy
        target = ops.vec(u.astype(np.float32).reshape(n, 1)) * total
        tok = ops.count_below(cdf, target)
    tok = ops.where_int(tok < _width(y), tok, _width(y) - 1)
    if greedy.any():
        tok = ops.where_int(ops.vec(greedy), ops.argmax_rows(x), tok)
    return tok


def _width(x: Any) -> int:
    return int(x.shape[-1])


def sample_row(
    ops: Any, logits: Any, params: SamplingParams, state: SamplerState
) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    """Sample one token from a 1-D row of logits; returns (token, logprob, top_logprobs).  The batched
    sampler on a batch of one: the same arithmetic, the same draw as in any batch."""
    s = launch(ops, ops.one_row(logits), [Row(params, state)]).finish()[0]
    return s.token, s.logprob, s.top_logprobs
