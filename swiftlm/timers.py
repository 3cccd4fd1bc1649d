"""The engine's own step timers: where each step's time goes, per phase.

Phases (seconds per engine step):
  schedule  - choosing the step's rows (scheduler.schedule) and freeing preempted KV
  prepare   - the backend building its inputs (token/position/slot tensors, caches) before the forward
  forward   - the forward pass; on CUDA this is the launch (the device runs asynchronously)
  sample    - queueing the batched sampler's device work
  sync      - the one device-to-host transfer of sampled ids (waits for the device)
  process   - the engine's bookkeeping of the sampled ids (EOS / length checks, freeing finished rows)
  output    - the output worker: detokenise, stop strings, logprob text, event delivery (its own thread)
Exposed as the Prometheus histogram ``swiftlm_step_seconds{phase=...}`` and in ``/health``.
"""

from __future__ import annotations

import bisect
import threading

PHASES = ("schedule", "prepare", "forward", "sample", "sync", "process", "output")
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


class StepTimers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {p: [0] * (len(BUCKETS) + 1) for p in PHASES}
        self.sums = {p: 0.0 for p in PHASES}
        self.n = {p: 0 for p in PHASES}

    def reset(self) -> None:
        """Forget every phase (a benchmark measures its run only); the holders keep this object."""
        with self._lock:
            for p in PHASES:
                self.counts[p] = [0] * (len(BUCKETS) + 1)
                self.sums[p], self.n[p] = 0.0, 0

    def add(self, phase: str, seconds: float) -> None:
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            self.counts[phase][i] += 1
            self.sums[phase] += seconds
            self.n[phase] += 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per phase: count, total seconds, mean milliseconds."""
        with self._lock:
            return {
                p: {
                    "count": self.n[p],
                    "seconds": round(self.sums[p], 6),
                    "mean_ms": round(1e3 * self.sums[p] / self.n[p], 4) if self.n[p] else 0.0,
                }
                for p in PHASES
            }

    def histogram(self, phase: str) -> tuple[list[tuple[str, int]], float]:
        """Cumulative Prometheus buckets and the sum, for one phase."""
        with self._lock:
            cum, out = 0, []
            for le, c in zip(BUCKETS + (float("inf"),), self.counts[phase]):
                cum += c
                out.append(("+Inf" if le == float("inf") else repr(le), cum))
            return out, self.sums[phase]


class StepLog:
    """One JSON line per engine step, for timelines of a serving run (``SWIFTLM_STEP_LOG=path``;
    off by default: it writes a line on every step): when the step began (``time.perf_counter`` of the
    engine's process), its decode rows, prefill chunks and tokens, whether its forward was launched
    by the step before (overlapped), and its phases in milliseconds.  ``scripts/step_timeline.py``
    summarises a log: where a serving run's wall time went (decode-only steps, steps with prompt
    chunks, gaps between steps)."""

    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1 << 16)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> StepLog | None:
        import os

        path = os.environ.get("SWIFTLM_STEP_LOG")  # "{pid}" in it: one file per engine process
        return cls(path.replace("{pid}", str(os.getpid()))) if path else None

    def write(
        self, t0: float, decode: int, prefill_seqs: int, prefill_tokens: int, overlapped: bool, phases: dict[str, float]
    ) -> None:
        ms = ",".join(f'"{k}":{1e3 * v:.4f}' for k, v in phases.items())
        line = (
            f'{{"t":{t0:.6f},"decode":{decode},"prefill_seqs":{prefill_seqs},'
            f'"prefill_tokens":{prefill_tokens},"overlapped":{str(overlapped).lower()},{ms}}}\n'
        )
        with self._lock:
            self._f.write(line)

    def close(self) -> None:
        with self._lock:
            self._f.close()
