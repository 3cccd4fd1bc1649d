"""Sampling parameters, their validation, per-sequence sampler state, and the array-ops shims.

The sampler itself is ``sampler.py`` (batched, on the device; ``sampler.sample_row`` is that
sampler on one row).  The 1-D helpers (``apply_penalties``, ``truncate``, ``masked_logits``)
give the same distribution for speculative decoding's acceptance test.  Each backend hands
its own ops (mlx.core, torch) so logits never leave the device; ``NumpyOps`` is the reference.

Order of operations for one row of logits (all in float32):
  1. logit_bias (added);
  2. repetition_penalty over the last ``repetition_context_size`` tokens of prompt +
     output (positive logits divided, negative multiplied, as in CTRL / llama.cpp);
  3. presence / frequency penalty over the tokens generated so far (OpenAI semantics);
  4. logprobs are reported from this distribution (before temperature / truncation);
  5. temperature 0 -> argmax; otherwise divide by temperature, then top_k, top_p, min_p
     masks, then an inverse-CDF draw with the request's own counter-based uniform
     (seeded per request; no global random state is shared between requests).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from .errors import InvalidRequest
from .turboquant.presets import KVFieldError, KVFormat, request_override

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    grammar: str | None = None  # llguidance grammar (from response_format): constrained decoding
    turbo_kv: str | None = None  # KV-cache format for this request: a TurboQuant preset or "off"
    kv_bits: int | None = None  # or affine-quantized KV (4 or 8 bits, kv_group_size coordinates per group)
    kv_group_size: int = 64
    adapter: str | None = None  # a LoRA adapter served on the model (--adapter NAME=PATH); None: the base
    # not a request field: set by validate(), turbo_kv / kv_bits / kv_group_size parsed (None: the served
    # model's default format); the engine completes it once at admission (Sequence.kv_format)
    kv_request: KVFormat | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_logprobs:
            self.logprobs = True

    def _validate_kv(self, bad: Any) -> None:
        """Parse the KV-cache fields once, into ``kv_request`` (the engine reads it at admission)."""
        try:
            self.kv_request = request_override(self.turbo_kv, self.kv_bits, self.kv_group_size)
        except KVFieldError as e:
            raise bad(e.param, e.msg) from None

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        def bad(name: str, msg: str) -> InvalidRequest:
            return InvalidRequest(f"'{name}' {msg}", param=name)

        def num(name: str, v: Any) -> None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            num(name, getattr(self, name))
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 disable it)")
        if vocab_size and self.top_k >= vocab_size:  # every token: the same as no top-k (and no int64 overflow)
            self.top_k = 0
        if not 0.01 <= self.repetition_penalty <= 10:
            raise bad("repetition_penalty", "must be in [0.01, 10]")
        if not isinstance(self.repetition_context_size, int) or self.repetition_context_size < 1:
            raise bad("repetition_context_size", "must be a positive integer")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 16:
            raise bad("n", "must be an integer in [1, 16]")
        self._validate_kv(bad)
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be up to 16 non-empty strings")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or (vocab_size and tok >= vocab_size):
                raise bad("logit_bias", f"has an invalid token id {tok!r}")
            num("logit_bias", bias)
            if not -100 <= bias <= 100:
                raise bad("logit_bias", "values must be in [-100, 100]")
        return self

    def for_choice(self, i: int) -> SamplingParams:
        """An independent copy for choice ``i`` of an n>1 request: seed + i (when seeded), n = 1."""
        q = replace(
            self, logit_bias=dict(self.logit_bias), stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), n=1
        )
        if self.seed is not None:
            q.seed = self.seed + i
        return q

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class SamplerState:
    """Per-sequence sampler state: token history and the request's own RNG."""

    seed: int | None = None
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    draws: int = 0  # tokens sampled so far: the counter of the request's counter-based RNG (sampler.py)
    constraint: Any = None  # chat.structured.Constraint when the request constrains its output

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)


class ArrayOps(Protocol):
    """The few array operations the sampler needs, on 1-D float32 vectors."""

    def asarray(self, values: list, dtype: str) -> Any: ...
    def float32(self, x: Any) -> Any: ...
    def log_softmax(self, x: Any) -> Any: ...
    def exp(self, x: Any) -> Any: ...
    def argmax(self, x: Any) -> int: ...
    def argsort_desc(self, x: Any) -> Any: ...
    def take(self, x: Any, idx: Any) -> Any: ...
    def put(self, x: Any, idx: Any, values: Any) -> Any: ...
    def cumsum(self, x: Any) -> Any: ...
    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def kth_largest(self, x: Any, k: int) -> Any: ...
    def from_numpy(self, a: np.ndarray) -> Any: ...
    def max(self, x: Any) -> Any: ...
    def item(self, x: Any) -> float: ...
    def tolist(self, x: Any) -> list: ...


NEG_INF = float("-inf")


def apply_penalties(ops: ArrayOps, x: Any, params: SamplingParams, state: SamplerState) -> Any:
    if params.logit_bias:
        ids = ops.asarray(list(params.logit_bias.keys()), "int32")
        bias = ops.asarray(list(params.logit_bias.values()), "float32")
        x = ops.put(x, ids, ops.take(x, ids) + bias)
    if params.repetition_penalty != 1.0:
        ctx = (state.prompt_tokens + state.output_tokens)[-params.repetition_context_size :]
        if ctx:
            ids = ops.asarray(sorted(set(ctx)), "int32")
            vals = ops.take(x, ids)
            p = params.repetition_penalty
            x = ops.put(x, ids, ops.where(vals > 0, vals / p, vals * p))
    if (params.presence_penalty or params.frequency_penalty) and state.output_tokens:
        counts = Counter(state.output_tokens)
        ids = ops.asarray(list(counts.keys()), "int32")
        c = ops.asarray([float(v) for v in counts.values()], "float32")
        vals = ops.take(x, ids) - c * params.frequency_penalty - params.presence_penalty
        x = ops.put(x, ids, vals)
    return x


def truncate(ops: ArrayOps, x: Any, params: SamplingParams) -> Any:
    """Mask logits (already divided by temperature) by top_k, top_p and min_p."""
    if params.top_k and params.top_k > 0:
        thresh = ops.kth_largest(x, params.top_k)
        x = ops.where(x < thresh, NEG_INF, x)
    if params.top_p < 1.0:
        order = ops.argsort_desc(x)
        probs = ops.exp(ops.log_softmax(ops.take(x, order)))
        before = ops.cumsum(probs) - probs  # mass strictly above each token
        # the most probable token always stays (a top_p below float32's range is 0 there, and
        # 0 >= 0 would mask every token: NaN probabilities)
        before = ops.put(before, ops.asarray([0], "int32"), ops.asarray([0.0], "float32"))
        sorted_x = ops.where(before >= max(params.top_p, 1e-30), NEG_INF, ops.take(x, order))
        x = ops.put(x, order, sorted_x)
    if params.min_p > 0.0:
        lp = ops.log_softmax(x)
        x = ops.where(lp < ops.max(lp) + math.log(params.min_p), NEG_INF, x)
    return x


def masked_logits(ops: ArrayOps, logits: Any, params: SamplingParams, state: SamplerState) -> Any:
    """Logits after bias and penalties, with tokens the grammar forbids at -inf."""
    x = apply_penalties(ops, ops.float32(logits), params, state)
    if state.constraint is not None:  # only tokens that keep the output valid under the grammar
        x = ops.where(ops.from_numpy(state.constraint.allowed()), x, NEG_INF)
    return x


class NumpyOps:
    """Reference ops (and the fallback for any backend that hands numpy logits)."""

    def asarray(self, values, dtype):
        return np.asarray(values, dtype=dtype)

    def float32(self, x):
        return np.asarray(x, dtype=np.float32).copy()

    def log_softmax(self, x):
        m = np.max(x)
        z = x - m
        with np.errstate(divide="ignore"):
            return z - np.log(np.sum(np.exp(z)))

    def exp(self, x):
        return np.exp(x)

    def argmax(self, x):
        return int(np.argmax(x))

    def argsort_desc(self, x):
        return np.argsort(-x, kind="stable")

    def take(self, x, idx):
        return x[idx]

    def put(self, x, idx, values):
        x = x.copy()
        x[idx] = values
        return x

    def cumsum(self, x):
        return np.cumsum(x)

    def where(self, cond, a, b):
        return np.where(cond, a, b).astype(np.float32)

    def kth_largest(self, x, k):
        k = min(k, x.shape[-1])
        return np.partition(x, -k)[-k]

    def from_numpy(self, a):
        return a

    def max(self, x):
        return np.max(x)

    def item(self, x):
        return float(x)

    def tolist(self, x):
        return np.asarray(x).tolist()

    # ---- batched ops (sampler.BatchOps) on [rows, V] float32 arrays
    def f32(self, x):
        return np.array(x, dtype=np.float32)

    def as_f32(self, x):
        return np.asarray(x, dtype=np.float32)

    def vec(self, a):
        return np.asarray(a)

    def gather2(self, x, r, c):
        return x[r, c]

    def scatter2(self, x, r, c, v):
        x = x.copy()
        x[r, c] = v
        return x

    def log_softmax_rows(self, x):
        m = np.max(x, axis=-1, keepdims=True)
        z = x - m
        with np.errstate(divide="ignore"):
            return (z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))).astype(np.float32)

    def softmax_rows(self, x):
        z = np.exp(x - np.max(x, axis=-1, keepdims=True))
        return (z / np.sum(z, axis=-1, keepdims=True)).astype(np.float32)

    def argmax_rows(self, x):
        return np.argmax(x, axis=-1)

    def sort_desc_rows(self, x):
        idx = np.argsort(-x, axis=-1, kind="stable")
        return np.take_along_axis(x, idx, -1), idx

    def take_along(self, x, idx):
        return np.take_along_axis(x, np.asarray(idx), -1)

    def put_along(self, x, idx, v):
        x = x.copy()
        np.put_along_axis(x, idx, v, -1)
        return x

    def cumsum_rows(self, x):
        return np.cumsum(x, axis=-1, dtype=np.float32)

    def topk_rows(self, x, k):
        idx = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        return np.take_along_axis(x, idx, -1), idx

    def max_rows(self, x):
        return np.max(x, axis=-1, keepdims=True)

    def count_below(self, c, t):
        return np.sum(c < t, axis=-1)

    def to_host(self, x):
        return np.asarray(x)

    def start_copy(self, x):
        return x

    def wait(self, handle):
        return self.to_host(handle)

    def pack(self, cols):
        return np.concatenate([np.asarray(c, np.float32).reshape(len(c), -1) for c in cols], axis=1)

    def where_int(self, cond, a, b):
        return np.where(cond, a, b).astype(np.int64)

    def one_row(self, x):
        return np.asarray(x).reshape(1, -1)

    def end_thread(self) -> None:
        pass
