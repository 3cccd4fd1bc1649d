"""The arithmetic of ``swiftlm bench serve``, free of I/O: percentiles and summaries, how
inter-token latency is counted when a chunk carries several tokens, request records and their
merge across workers, prompt / length / arrival generation, and SSE parsing.  The definitions of
each metric are in ``serve.py``'s docstring."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) by linear interpolation between closest ranks; None when empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0..100")
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def describe(values: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """mean, p50/p90/p99, min, max (each times ``scale``) and n; None for an empty list."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "min": None, "max": None, "n": 0}
    out: dict[str, Any] = {"mean": sum(values) / len(values) * scale}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p) * scale  # type: ignore[operator]
    out["min"] = min(values) * scale
    out["max"] = max(values) * scale
    out["n"] = len(values)
    return out


def chunk_token_counts(n_chunks: int, n_tokens: int) -> list[int]:
    """Tokens attributed to each of ``n_chunks`` content chunks that carried ``n_tokens`` tokens in all.

    One each when the counts agree; otherwise spread evenly: chunk i ends at cumulative token
    ``max(1, floor((i+1) * n_tokens / n_chunks))``, so the first chunk carries at least one token and the counts
    sum to ``max(n_tokens, 1)``."""
    if n_chunks <= 0:
        return []
    n = max(int(n_tokens), 1)
    if n == n_chunks:
        return [1] * n_chunks
    counts, prev = [], 0
    for i in range(n_chunks):
        cum = max(1, (i + 1) * n // n_chunks)
        counts.append(cum - prev)
        prev = cum
    return counts


def itl_samples(chunk_times: Sequence[float], n_tokens: int) -> list[float]:
    """Inter-token latencies of one request from its content-chunk arrival times (see the module docstring)."""
    counts = chunk_token_counts(len(chunk_times), n_tokens)
    out: list[float] = []
    pending = 0.0
    for i in range(1, len(chunk_times)):
        gap = chunk_times[i] - chunk_times[i - 1] + pending
        k = counts[i]
        if k == 0:
            pending = gap
            continue
        pending = 0.0
        out.extend([gap / k] * k)
    return out


def tpot(chunk_times: Sequence[float], n_tokens: int) -> float | None:
    """Mean time per output token after the first chunk; None with fewer than two tokens over two chunks."""
    counts = chunk_token_counts(len(chunk_times), n_tokens)
    later = sum(counts[1:])
    span = chunk_times[-1] - chunk_times[0] if chunk_times else 0.0
    if later <= 0 or span <= 0:
        return None
    return span / later


def sample_lengths(rng: random.Random, mean: int, std: float, n: int, minimum: int = 1) -> list[int]:
    """n lengths from a normal distribution (rounded, at least ``minimum``); exactly ``mean`` when std is 0."""
    if std <= 0:
        return [max(minimum, int(mean))] * n
    return [max(minimum, int(round(rng.gauss(mean, std)))) for _ in range(n)]


def poisson_arrivals(rng: Any, rate: float, n: int) -> list[float]:
    """Send times (s from the start) of n requests in a Poisson process of ``rate`` per second; the first at 0."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def random_prompt(
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    allowed_ids: Sequence[int],
    length: int,
    rng: random.Random,
    rounds: int = 4,
) -> str:
    """Text of about ``length`` tokens: random ids from ``allowed_ids`` decoded; re-encoded, trimmed or padded
    and decoded again (a few rounds) because decode -> encode does not always give the same ids back."""
    ids = [rng.choice(allowed_ids) for _ in range(length)]
    text = decode(ids)
    for _ in range(rounds):
        got = encode(text)
        if len(got) == length:
            break
        ids = got[:length] if len(got) > length else got + [rng.choice(allowed_ids) for _ in range(length - len(got))]
        text = decode(ids)
    return text


def split_share(total: int, k: int) -> list[int]:
    """``total`` split over k parts as evenly as possible, larger parts first (7, 3 -> [3, 2, 2])."""
    return [total // k + (1 if i < total % k else 0) for i in range(k)]


@dataclass
class RequestRecord:
    index: int
    ok: bool = False
    error: str | None = None
    send: float = 0.0  # s, from the benchmark's start
    ttft: float | None = None  # s
    e2e: float = 0.0  # s
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    max_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # s from send, content chunks only

    def to_json(self) -> dict[str, Any]:
        t = tpot(self.chunk_times, self.output_tokens) if self.ok else None
        return {
            "index": self.index,
            "ok": self.ok,
            "error": self.error,
            "send_s": self.send,
            "ttft_ms": None if self.ttft is None else self.ttft * 1e3,
            "e2e_ms": self.e2e * 1e3,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "usage_reported": self.usage_reported,
            "content_chunks": len(self.chunk_times),
            "max_tokens": self.max_tokens,
            "chunk_ms": [c * 1e3 for c in self.chunk_times],
            "tpot_ms": None if t is None else t * 1e3,
            "stream_tok_s": None if not t else 1.0 / t,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(
            index=d["index"],
            ok=d["ok"],
            error=d["error"],
            send=d["send_s"],
            ttft=None if d["ttft_ms"] is None else d["ttft_ms"] / 1e3,
            e2e=d["e2e_ms"] / 1e3,
            output_tokens=d["output_tokens"],
            prompt_tokens=d["prompt_tokens"],
            usage_reported=d["usage_reported"],
            max_tokens=d["max_tokens"],
            chunk_times=[c / 1e3 for c in d["chunk_ms"]],
        )


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The benchmark's results from its request records (times in the records are seconds)."""
    ok = [r for r in records if r.ok]
    if records:
        duration = max(r.send + r.e2e for r in records) - min(r.send for r in records)
    else:
        duration = 0.0
    total_out = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    itl: list[float] = []
    tpots: list[float] = []
    for r in ok:
        itl.extend(itl_samples(r.chunk_times, r.output_tokens))
        t = tpot(r.chunk_times, r.output_tokens)
        if t is not None:
            tpots.append(t)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unknown")[:200]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": total_out / duration if duration > 0 else None,
        "total_output_tokens": total_out,
        "total_prompt_tokens": sum(prompts) if prompts else None,
        "mean_stream_tok_s": sum(1.0 / t for t in tpots) / len(tpots) if tpots else None,
        "ttft_ms": describe([r.ttft for r in ok if r.ttft is not None], 1e3),
        "itl_ms": describe(itl, 1e3),
        "tpot_ms": describe(tpots, 1e3),
        "e2e_ms": describe([r.e2e for r in ok], 1e3),
        "errors": errors,
    }


def merge_parts(parts: Sequence[tuple[float, Sequence[RequestRecord]]]) -> list[RequestRecord]:
    """Records of several worker processes, each ``(its start on the wall clock, its records)`` with send times
    relative to that start, as one list on a common clock (the earliest start), sorted by request index."""
    if not parts:
        return []
    t0 = min(start for start, _ in parts)
    out: list[RequestRecord] = []
    for start, recs in parts:
        for r in recs:
            out.append(RequestRecord(**{**asdict(r), "send": r.send + (start - t0)}))
    out.sort(key=lambda r: r.index)
    return out


def parse_sse_line(line: bytes) -> tuple[str, Any]:
    """One SSE line -> ("done", None) | ("data", parsed JSON) | ("skip", None)."""
    if not line.startswith(b"data:"):
        return "skip", None
    payload = line[5:].strip()
    if not payload:
        return "skip", None
    if payload == b"[DONE]":
        return "done", None
    return "data", json.loads(payload)


def chunk_content(obj: dict[str, Any]) -> bool:
    """Whether one streamed chunk (chat or completions) carries generated content."""
    for c in obj.get("choices") or ():
        d = c.get("delta")
        if d is not None:
            if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"):
                return True
        elif c.get("text"):
            return True
    return False


# =========================================================================== workload
