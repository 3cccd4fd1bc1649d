"""Data-parallel replicas (``--data-parallel N``): N engines behind one engine interface.

Each replica is a whole ``Engine`` with its own model on its own device (cuda:0..N-1 on a GPU
machine; on a CPU-only machine N engines on the CPU, which is how the tests run it).  The server
and the Python API hold a ``ReplicaSet`` where they would hold an ``Engine``: the same calls
(submit, cancel, end_all, embed, shutdown, the prompt helpers) and the same read-outs (stats,
scheduler, prefix_cache, timers, kv_stats, model.memory), aggregated over the replicas.

Routing (``ReplicaSet.route``), per submitted sequence:

- *load* of a replica = its outstanding requests: submitted to it and not finished yet (its own
  count, plus submits under way to it from other threads; with --api-workers, plus the other
  workers' live sequences on it at its last stats snapshot, at most 0.1 s old while busy);
- *prefix affinity*: a prompt of more than ``affinity_tokens`` tokens (default 64) has a key, the
  hash of its first ``affinity_tokens`` tokens.  The first time a key is seen it is given to the
  least-loaded replica and remembered (LRU, 4096 keys); later prompts with that key go to the same
  replica, so its prompt cache hits -- unless that replica is *much busier*: at least ``slack``
  requests (default: one batch, the replicas' --parallel) more outstanding than the least-loaded
  one.  Then the request goes to the least-loaded replica (the key keeps its replica);
- shorter prompts go to the least-loaded replica (ties: the lowest index; with --api-workers, least loaded by this
  worker's own requests, then by the other workers' last counts, ties rotated by the worker's number: ``_rank``);
- a replica whose queue is full (QueueFull) is skipped for the next least-loaded; all full: 429.

Sequence ids are disjoint across replicas (replica i numbers its sequences i+1, i+1+N, ...), so
an id names its replica without a table and events need no translation.  A replica whose loop
dies makes the set fatal: new requests are refused and ``on_fatal`` is told (the server exits
non-zero, as with one engine); requests live on the healthy replicas finish.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..stats import EngineStats, LatencyHistogram
from ..timers import StepTimers

log = logging.getLogger(__name__)

AFFINITY_TOKENS = 64
AFFINITY_KEYS = 4096
# attributes that make_engine / the server set on an engine: set on every replica
_BROADCAST = frozenset(
    {
        "on_fatal",
        "json_close",
        "json_repeat_guard",
        "tool_parser",
        "media_processor",
        "media_policy",
        "backend_name",
        "request_timeout",
        "default_max_tokens",
    }
)


def prefix_key(prefix: Sequence[Any]) -> bytes:
    """The affinity key of a prompt's first items (tokens here; characters in swiftlm.deploy.affinity)."""
    return hashlib.blake2b(repr(list(prefix)).encode(), digest_size=8).digest()


class ReplicaSet:
    def __init__(
        self,
        engines: Sequence[Any],
        affinity_tokens: int = AFFINITY_TOKENS,
        slack: int | None = None,
        devices: Sequence[str] | None = None,
    ):
        if not engines:
            raise ValueError("a ReplicaSet needs at least one engine")
        n = len(engines)
        d = self.__dict__  # plain attributes, past __setattr__'s broadcast
        d["replicas"] = list(engines)
        d["devices"] = (
            list(devices) if devices else [str(getattr(getattr(e, "model", None), "device", "")) for e in engines]
        )
        d["affinity_tokens"] = max(1, int(affinity_tokens))
        d["slack"] = max(1, int(slack if slack is not None else engines[0].scheduler.max_running))
        d["_lock"] = threading.Lock()
        d["_submitted"] = [0] * n  # sequences handed to each replica (successful submits)
        d["_inflight"] = [0] * n  # routed, inside the replica's submit() now (not yet in its count)
        d["_home"] = OrderedDict()  # affinity key -> replica index (LRU)
        d["routed"] = [0] * n  # sequences routed to each replica
        d["affinity_hits"] = 0  # sequences sent to their key's replica
        d["affinity_spills"] = 0  # ... sent elsewhere because it was much busier
        d["_fatal"] = None
        d["_on_fatal"] = None
        d["_worker"] = int(getattr(engines[0], "conn_index", 0) or 0)  # this API worker's number (ties rotate by it)
        for i, e in enumerate(engines):
            e.slots.ids = itertools.count(i + 1, n)  # disjoint ids: (id - 1) % n is the replica
            e.on_fatal = self._replica_died

    # ------------------------------------------------------------------ attributes
    def __getattr__(self, name: str) -> Any:  # what is the same on every replica: the first one's
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["replicas"][0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "on_fatal":
            self.__dict__["_on_fatal"] = value
        elif name in _BROADCAST:
            for e in self.replicas:
                setattr(e, name, value)
        else:
            self.__dict__[name] = value

    def __len__(self) -> int:
        return len(self.replicas)

    def replica_of(self, seq_id: int) -> int:
        return (seq_id - 1) % len(self.replicas)

    # ------------------------------------------------------------------ routing
    def load(self, i: int) -> int:
        """Outstanding requests of replica ``i``: in its inbox (submitted, not yet taken in) plus held."""
        e = self.replicas[i]
        pending = getattr(getattr(e, "slots", None), "pending", None)  # Engine and EngineClient: not finished
        if isinstance(pending, int):  # --api-workers: plus the other workers' sequences on it (their last count)
            return pending + getattr(e, "_others", 0) + self._inflight[i]
        inbox = max(0, self._submitted[i] - e.stats.requests_total)  # other engines: from their counters
        return inbox + e.live_requests

    def _rank(self, i: int) -> tuple[int, int, int]:
        """Replica ``i``'s place in the least-loaded choice (smallest first).  With --api-workers: this worker's own
        outstanding requests on it (exact), then the other workers' at its last snapshot, then the index rotated by
        this worker's number.  Each worker splitting its own requests evenly splits them all evenly; the others'
        counts are up to 0.1 s old, and a burst routed on them herded (2 workers, 256 requests: 147 / 109).
        Otherwise: the replica's load, then its index."""
        e = self.replicas[i]
        pending = getattr(getattr(e, "slots", None), "pending", None)
        if isinstance(pending, int):
            n = len(self.replicas)
            return pending + self._inflight[i], getattr(e, "_others", 0), (i - self._worker) % n
        return self.load(i), 0, i

    def _key(self, prompt: Sequence[int]) -> bytes | None:
        k = self.affinity_tokens
        if len(prompt) <= k:
            return None
        return prefix_key(prompt[:k])

    def route(self, prompt: Sequence[int], skip: frozenset[int] = frozenset()) -> int:
        """The replica for ``prompt`` (see the module docstring).  Call under ``_lock``."""
        cand = [i for i in range(len(self.replicas)) if i not in skip]
        least = min(cand, key=self._rank)
        key = self._key(prompt)
        if key is None:
            return least
        loads = {i: self.load(i) for i in cand}
        home = self._home.get(key)
        if home is None or home in skip:
            if home is None:
                self._home[key] = least
                if len(self._home) > AFFINITY_KEYS:
                    self._home.popitem(last=False)
            return least
        self._home.move_to_end(key)
        if loads[home] - loads[least] >= self.slack:
            self.__dict__["affinity_spills"] += 1
            return least
        self.__dict__["affinity_hits"] += 1
        return home

    # ------------------------------------------------------------------ requests
    def submit(self, prompt_tokens: list[int], params: Any, sink: Any) -> int:
        from ..engine import QueueFull

        if self._fatal:
            raise QueueFull(self._fatal)
        tried: set[int] = set()
        while True:
            with self._lock:
                i = self.route(prompt_tokens, frozenset(tried))
                self._submitted[i] += 1
                self._inflight[i] += 1
            try:
                sid = self.replicas[i].submit(prompt_tokens, params, sink)
            except QueueFull:
                with self._lock:
                    self._submitted[i] -= 1
                    self._inflight[i] -= 1
                tried.add(i)
                if len(tried) == len(self.replicas) or self._fatal:
                    raise
                continue
            except BaseException:
                with self._lock:
                    self._submitted[i] -= 1
                    self._inflight[i] -= 1
                raise
            with self._lock:
                self._inflight[i] -= 1
                self.routed[i] += 1
            return sid

    def cancel(self, seq_id: int) -> None:
        self.replicas[self.replica_of(seq_id)].cancel(seq_id)

    def end_all(self, reason: str = "length") -> None:
        for e in self.replicas:
            e.end_all(reason)

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> Any:
        with self._lock:
            i = min(range(len(self.replicas)), key=self._rank)
        return self.replicas[i].embed(prompts, dimensions)

    def shutdown(self, timeout: float = 10.0) -> None:
        threads = [threading.Thread(target=e.shutdown, args=(timeout,), daemon=True) for e in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)

    def _replica_died(self, msg: str) -> None:
        if self._fatal is None:
            self.__dict__["_fatal"] = msg
            log.critical("a data-parallel replica died; refusing new requests: %s", msg)
        cb = self._on_fatal
        if cb is not None:
            cb(msg)

    # ------------------------------------------------------------------ state, aggregated
    @property
    def fatal(self) -> str | None:
        return self._fatal or next((e.fatal for e in self.replicas if e.fatal), None)

    @property
    def on_fatal(self) -> Any:
        return self._on_fatal

    @property
    def running(self) -> bool:
        return all(e.running for e in self.replicas)

    @property
    def live_requests(self) -> int:
        return sum(e.live_requests for e in self.replicas)

    @property
    def stats(self) -> EngineStats:
        """Counters summed; latency histograms merged; busy time: the busiest replica's (a lower
        bound of the set's busy wall time, equal to it while the load keeps every replica busy)."""
        out = EngineStats()
        for e in self.replicas:
            s = e.stats
            for f in (
                "requests_total",
                "requests_active",
                "tokens_generated",
                "prompt_tokens",
                "decode_seconds",
                "steps",
                "json_closed",
                "overlapped_steps",
            ):
                setattr(out, f, getattr(out, f) + getattr(s, f))
            for reason, n in list(s.finished.items()):
                out.finished[reason] = out.finished.get(reason, 0) + n
        out.busy_seconds = max(e.stats.busy_wall_seconds() for e in self.replicas)
        for f in ("ttft", "queue_time", "duration", "tpot"):
            setattr(out, f, _merge_hist([getattr(e.stats, f) for e in self.replicas]))
        return out

    @property
    def scheduler(self) -> _SchedulerView:
        return _SchedulerView([e.scheduler for e in self.replicas])

    @property
    def prefix_cache(self) -> _CacheView:
        return _CacheView([e.prefix_cache for e in self.replicas])

    @property
    def timers(self) -> StepTimers:
        out = StepTimers()
        for e in self.replicas:
            t = e.timers
            with t._lock:
                for p in out.counts:
                    out.counts[p] = [a + b for a, b in zip(out.counts[p], t.counts[p])]
                    out.sums[p] += t.sums[p]
                    out.n[p] += t.n[p]
        return out

    @property
    def model(self) -> _ModelView:
        return _ModelView([e.model for e in self.replicas])

    @property
    def speculator(self) -> Any:
        specs = [e.speculator for e in self.replicas]
        return None if specs[0] is None else _SpecView(specs)

    def kv_stats(self) -> dict[str, Any]:
        per = [e.kv_stats() for e in self.replicas]
        b, f16 = sum(p["bytes"] for p in per), sum(p["fp16_bytes"] for p in per)
        return {
            "default_format": per[0]["default_format"],
            "bytes": b,
            "fp16_bytes": f16,
            "compression_ratio": round(f16 / b, 4) if b else 1.0,
        }

    def gc_stats(self) -> dict[str, Any]:
        """Each replica's garbage-collector pauses (replicas on threads share one process's)."""
        return {"per_replica": [e.gc_stats() for e in self.replicas]}

    def expert_stream_stats(self) -> dict[str, Any] | None:
        per = [e.expert_stream_stats() for e in self.replicas]
        if per[0] is None:
            return None
        out = dict(per[0])
        for p in per[1:]:
            for k, v in p.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k in out and "per_token" not in k:
                    out[k] += v
        return out

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica: device, routed requests, outstanding load, tokens, prompt-cache hits."""
        out = []
        for i, e in enumerate(self.replicas):
            out.append(
                {
                    "replica": i,
                    "device": self.devices[i],
                    "routed": self.routed[i],
                    "outstanding": self.load(i),
                    "running": len(e.scheduler.running),
                    "queued": len(e.scheduler.waiting),
                    "tokens_generated": e.stats.tokens_generated,
                    "prompt_cache_hits": e.prefix_cache.hits,
                    "prompt_cache_misses": e.prefix_cache.misses,
                    "fatal": e.fatal,
                }
            )
        return out

    def routing_stats(self) -> dict[str, Any]:
        return {
            "replicas": len(self.replicas),
            "affinity_tokens": self.affinity_tokens,
            "slack": self.slack,
            "affinity_hits": self.affinity_hits,
            "affinity_spills": self.affinity_spills,
            "affinity_keys": len(self._home),
            "per_replica": self.replica_stats(),
        }


def _merge_hist(hs: list[LatencyHistogram]) -> LatencyHistogram:
    out = LatencyHistogram(hs[0].buckets)
    for h in hs:
        with h._lock:
            out.counts = [a + b for a, b in zip(out.counts, h.counts)]
            out.count += h.count
            out.sum += h.sum
            out.max = max(out.max, h.max)
    return out


class _SchedulerView:
    """What /health and /metrics read from a scheduler, over every replica."""

    def __init__(self, scheds: list[Any]):
        self._s = scheds
        # list(): one C-level copy (a deque the engine thread mutates cannot change under it); a child
        # engine's view (engine_process) holds ranges of its counts, which copy the same way
        self.waiting = [q for s in scheds for q in list(s.waiting)]
        self.running = [r for s in scheds for r in list(s.running)]
        self.preemptions = sum(s.preemptions for s in scheds)
        self.max_running = sum(s.max_running for s in scheds)
        budgets = [s.kv_budget for s in scheds]
        self.kv_budget = sum(budgets) if all(budgets) else None

    def kv_in_use(self) -> int:
        return sum(s.kv_in_use() for s in self._s)

    def block_stats(self) -> dict[str, int] | None:
        """The replicas' paged-pool counters, summed (block_size: the first's)."""
        stats = [b for b in (s.block_stats() for s in self._s) if b]
        if not stats:
            return None
        out = {k: sum(b[k] for b in stats) for k in stats[0]}
        out["block_size"] = stats[0]["block_size"]
        return out


class _CacheView:
    """The prompt caches' counters, summed (each replica keeps its own cache)."""

    def __init__(self, caches: list[Any]):
        self._c = caches
        for f in ("bytes", "hits", "misses", "tokens_reused", "max_bytes"):  # (a child engine's view: no cap)
            setattr(self, f, sum(getattr(c, f, 0) for c in caches))

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return sum(len(c) for c in self._c)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class _OpsView:
    def __init__(self, ops: list[Any]):
        self._ops = ops

    def end_thread(self) -> None:  # the calling thread is done with every replica's device
        for o in self._ops:
            o.end_thread()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops[0], name)


class _ModelView:
    """The first replica's model, but ``memory()`` covers every replica: weights and KV storage
    (counted from tensors) are summed; allocator figures are summed when the replicas are on
    distinct devices (CUDA), and taken once when they share one (the CPU: one process)."""

    def __init__(self, models: list[Any]):
        self._m = models

    @property
    def ops(self) -> _OpsView:
        return _OpsView([m.ops for m in self._m])

    def memory(self) -> dict[str, Any]:
        per = [dict(m.memory()) for m in self._m]
        distinct = len({str(getattr(m, "device", i)) for i, m in enumerate(self._m)}) == len(self._m)
        out = dict(per[0])
        summed = ("weights", "kv_allocated") + (
            ("active", "peak", "cache", "reserved", "device_total") if distinct else ()
        )
        for k in summed:
            if all(isinstance(p.get(k), (int, float)) for p in per):
                out[k] = sum(p[k] for p in per)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m[0], name)


class _SpecView:
    def __init__(self, specs: list[Any]):
        from ..speculative import SpecStats

        self._s = specs
        self.drafter, self.k = specs[0].drafter, specs[0].k
        st = self.stats = SpecStats()
        for s in specs:
            st.steps += s.stats.steps
            st.drafted += s.stats.drafted
            st.accepted += s.stats.accepted
            st.emitted += s.stats.emitted


# ---------------------------------------------------------------------- building
def check_settings(settings: Any, backend: Any) -> list[str | None]:
    """The device of each replica, or one sentence why this combination is refused."""
    n = settings.data_parallel
    if backend.name != "torch":
        raise ConfigError(
            f"--data-parallel needs the torch backend (the {backend.name} backend runs one model per device here)"
        )
    if getattr(settings, "tensor_parallel", 1) not in (None, 1):
        raise ConfigError("--data-parallel and --tensor-parallel do not combine in this version")
    if settings.gpu_layers is not None:
        raise ConfigError(
            "--data-parallel and --gpu-layers do not combine (every replica's offloaded layers would share one CPU)"
        )
    if settings.models_file or settings.extra_models:
        raise ConfigError("--data-parallel serves one model (not --models-file or a repeated --model)")
    from ..memory import device_kind

    kind = device_kind(backend.available().device or "")
    if settings.device not in (None, "cpu"):
        raise ConfigError(
            f"--device {settings.device} with --data-parallel: each replica takes its own device "
            "(cuda:0..N-1); leave --device out, or use --device cpu"
        )
    if settings.device == "cpu" or kind != "cuda":
        return ["cpu"] * n
    return [f"cuda:{i}" for i in range(n)]


def build_replicas(settings: Any, backend: Any, spec: Any, make_engine: Any) -> ReplicaSet:
    """Load ``settings.data_parallel`` engines (``make_engine`` each, on its own device) and
    wrap them.  A failure unloads what was loaded."""
    devices = check_settings(settings, backend)
    engines: list[Any] = []
    try:
        for i, dev in enumerate(devices):
            log.info("data-parallel replica %d/%d on %s", i + 1, len(devices), dev)
            engines.append(make_engine(settings.model_copy(update={"data_parallel": 1, "device": dev}), backend, spec))
    except BaseException:
        for e in engines:
            e.shutdown(2.0)
        raise
    return ReplicaSet(engines, devices=devices)


__all__ = ["ReplicaSet", "build_replicas", "check_settings"]
