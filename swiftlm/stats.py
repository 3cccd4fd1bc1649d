"""The engine's counters and bounded latency histograms (read by /health and /metrics)."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """Fixed buckets, a count and a sum: bounded however many requests it sees (read by
    /metrics as a Prometheus histogram and by /health as count / mean / quantile estimates)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self.counts[i] += 1
            self.count += 1
            self.sum += seconds
            self.max = max(self.max, seconds)

    def __len__(self) -> int:
        return self.count

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        """Prometheus buckets (le, cumulative count) and the sum."""
        with self._lock:
            counts, total = list(self.counts), self.sum
        cum, out = 0, []
        for le, n in zip(self.buckets + (float("inf"),), counts):
            cum += n
            out.append(("+Inf" if le == float("inf") else repr(le), cum))
        return out, total

    def quantile(self, q: float) -> float:
        """An estimate: linear inside the bucket holding the q-th observation, at most the largest
        value seen (0 when empty)."""
        with self._lock:
            counts, n, top = list(self.counts), self.count, self.max
        if not n:
            return 0.0
        rank, cum, lo = q * n, 0, 0.0
        for le, c in zip(self.buckets + (max(top, self.buckets[-1]),), counts):
            if c and cum + c >= rank:
                return min(top, lo + (le - lo) * max(0.0, rank - cum) / c)
            cum += c
            lo = le
        return top

    def snapshot(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean_s": round(self.sum / self.count, 6) if self.count else 0.0,
            "p50_s": round(self.quantile(0.5), 6),
            "p90_s": round(self.quantile(0.9), 6),
            "p99_s": round(self.quantile(0.99), 6),
            "max_s": round(self.max, 6),
        }


@dataclass
class EngineStats:
    """Counts since start (monotonic), the requests live now, and bounded latency histograms.
    Written by the engine thread only."""

    requests_total: int = 0
    requests_active: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    decode_seconds: float = 0.0  # time in steps that decoded: a phase figure, not a throughput base
    steps: int = 0
    json_closed: int = 0  # structured outputs completed by json_close (near max_tokens, or looping)
    overlapped_steps: int = 0  # steps launched before the previous step's ids were read back
    finished: dict[str, int] = field(default_factory=dict)  # requests ended, by reason (stop, length, cancelled, error)
    busy_seconds: float = 0.0  # wall time with at least one request live, closed periods
    busy_since: float | None = None  # start of the open busy period
    ttft: LatencyHistogram = field(default_factory=LatencyHistogram)  # submit -> first token sampled
    queue_time: LatencyHistogram = field(default_factory=LatencyHistogram)  # submit -> first step with it
    duration: LatencyHistogram = field(default_factory=LatencyHistogram)  # submit -> finished (any reason)
    # per output token after the first: (finished - first token) / (tokens - 1)
    tpot: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(TOKEN_BUCKETS))

    def request_started(self, now: float | None = None) -> None:
        self.requests_total += 1
        if self.requests_active == 0:
            self.busy_since = time.perf_counter() if now is None else now
        self.requests_active += 1

    def request_finished(
        self, reason: str, submitted: float, first_token_at: float | None, n_out: int, now: float | None = None
    ) -> None:
        now = time.perf_counter() if now is None else now
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.duration.observe(now - submitted)
        if first_token_at is not None and n_out > 1:
            self.tpot.observe((now - first_token_at) / (n_out - 1))
        self.requests_active -= 1
        if self.requests_active == 0 and self.busy_since is not None:
            self.busy_seconds += now - self.busy_since
            self.busy_since = None

    def reset(self) -> None:
        """Every figure back to its start (after the start-up warm-up's requests, which are not the server's)."""
        fresh = type(self)()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def busy_wall_seconds(self) -> float:
        since = self.busy_since
        return self.busy_seconds + (time.perf_counter() - since if since is not None else 0.0)

    @property
    def avg_tokens_per_sec(self) -> float:
        """Tokens generated / wall time during which requests were live (idle time excluded;
        prefill, queueing and every phase of a step included)."""
        busy = self.busy_wall_seconds()
        return self.tokens_generated / busy if busy > 0 else 0.0


def kv_stats(model: Any, kv_in_use: Callable[[], int], kv_bytes_per_token: int, default_format: str) -> dict[str, Any]:
    """KV bytes the running sequences hold (``model.kv_stats()``; without it ``kv_in_use()`` tokens at
    ``kv_bytes_per_token``), what a 16-bit cache would hold for them, and the compression ratio
    achieved (16-bit bytes / bytes held)."""
    try:
        s = model.kv_stats()
    except Exception:  # pragma: no cover - a racing free() must not fail /health
        s = None
    if s is None:
        n = kv_in_use() * kv_bytes_per_token
        s = {"bytes": n, "fp16_bytes": n}
    ratio = s["fp16_bytes"] / s["bytes"] if s["bytes"] else 1.0
    return {
        "default_format": default_format,
        "bytes": s["bytes"],
        "fp16_bytes": s["fp16_bytes"],
        "compression_ratio": round(ratio, 4),
    }


def expert_stream_stats(reader: Any, experts_per_token: int) -> dict[str, Any] | None:
    """Counted I/O of SSD expert streaming (``reader``: the model's expert reader; None when experts are
    resident)."""
    if reader is None:
        return None
    out = reader.stats.snapshot()
    out.update(
        {
            "mode": reader.mode,
            "buffer_bytes": reader.buffer_bytes(),
            "expert_bytes_on_disk": reader.layout.expert_bytes_total,
            "experts_per_token": experts_per_token,
        }
    )
    return out
