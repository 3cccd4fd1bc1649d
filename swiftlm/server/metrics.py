"""Prometheus metrics (prometheus-client), all prefixed ``swiftlm_``.

Types follow what each number is: counts since start are Counters (``*_total``), latencies are
histograms, levels (requests live, bytes held, rates) are Gauges.  What the engine counts is read
from it at scrape time (``EngineCollector``), so nothing is copied or goes stale.  SwiftLM's own
names are served alongside with SwiftLM's meaning: ``swiftlm_tokens_generated_total``,
``swiftlm_tokens_per_second``, ``swiftlm_memory_{active,peak,cache}_bytes``."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from . import access_log


def memory_figures(engine: Any) -> dict[str, Any]:
    """Every memory figure /health and /metrics report, measured (docs/reference/health.md, metrics.md).

    ``active``/``peak``/``cache``: the backend's device allocator (CUDA caching allocator, MLX
    allocator) -- or, for torch on the CPU, this process's RSS / peak RSS / malloc's free bytes.
    Plus the process's resident memory, the weights held, the KV bytes live sequences hold and
    the KV storage allocated, and the prompt cache's bytes."""
    from ..memory import allocator_stats, process_memory

    mem = dict(engine.model.memory())
    proc = process_memory()
    alloc = allocator_stats()
    kv = engine.kv_stats()
    out = {k: v for k, v in mem.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out.update(
        device=mem.get("device", "cpu"),
        architecture=mem.get("architecture") or "cpu",
        device_name=mem.get("device_name", ""),
        process_rss=proc["rss"],
        process_peak_rss=proc["peak_rss"],
        allocator_free=alloc.get("free", 0),
        allocator_in_use=alloc.get("in_use", 0),
        python_blocks=sys.getallocatedblocks(),
        kv=kv["bytes"],
        prompt_cache=engine.prefix_cache.bytes,
    )
    for k in ("active", "peak", "cache", "weights"):
        out.setdefault(k, 0)
    out.setdefault("kv_allocated", kv["bytes"])
    if not out.get("device_total"):
        from ..memory import system_memory

        out["device_total"] = system_memory()
    return out


def health_memory(engine: Any) -> dict[str, Any]:
    """/health's ``memory`` object: our byte figures and SwiftLM's ``*_mb`` fields (MiB, rounded
    down, as SwiftLM does), with SwiftLM's meaning: active/peak/cache of the device allocator, the
    memory size of the device that active is counted on, and its architecture."""
    from ..memory import MiB, system_memory

    m = memory_figures(engine)
    out = {
        "active": m["active"],
        "peak": m["peak"],
        "cache": m["cache"],
        "total_system": system_memory(),
        "active_mb": m["active"] // MiB,
        "peak_mb": m["peak"] // MiB,
        "cache_mb": m["cache"] // MiB,
        "total_system_mb": m["device_total"] // MiB,
        "gpu_architecture": m["architecture"],
        "device": m["device"],
        "device_name": m["device_name"],
        "device_total_bytes": m["device_total"],
        "process_rss_bytes": m["process_rss"],
        "process_peak_rss_bytes": m["process_peak_rss"],
        "allocator_free_bytes": m["allocator_free"],
        "allocator_in_use_bytes": m["allocator_in_use"],
        "python_allocated_blocks": m["python_blocks"],
        "weights_bytes": m["weights"],
        "kv_bytes": m["kv"],
        "kv_allocated_bytes": m["kv_allocated"],
        "prompt_cache_bytes": m["prompt_cache"],
        "packed_weights_bytes": m.get("packed_weights", 0),
    }
    if "reserved" in m:
        out["reserved_bytes"] = m["reserved"]
    return out


def _hist(name: str, doc: str, h: Any) -> HistogramMetricFamily:
    buckets, total = h.cumulative()
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class EngineCollector:
    """What the engine counts and holds, read at scrape time."""

    def __init__(self) -> None:
        self.engine: Any = None

    def collect(self) -> Any:
        eng = self.engine
        if eng is None:
            return
        st = eng.stats
        yield CounterMetricFamily(
            "swiftlm_tokens_generated", "Total tokens generated (SwiftLM's name)", value=st.tokens_generated
        )
        yield CounterMetricFamily(
            "swiftlm_engine_requests", "Requests the engine admitted (each choice of n counts)", value=st.requests_total
        )
        fin = CounterMetricFamily(
            "swiftlm_requests_finished",
            "Requests the engine ended, by reason (stop, length, cancelled, error)",
            labels=["reason"],
        )
        for reason, n in sorted(st.finished.items()):
            fin.add_metric([reason], n)
        yield fin
        yield CounterMetricFamily(
            "swiftlm_prompt_tokens_processed",
            "Prompt tokens of requests that produced a first token",
            value=st.prompt_tokens,
        )
        yield CounterMetricFamily("swiftlm_engine_steps", "Engine steps run", value=st.steps)
        yield CounterMetricFamily(
            "swiftlm_preemptions", "Sequences preempted (KV budget) and recomputed", value=eng.scheduler.preemptions
        )
        blocks = eng.scheduler.block_stats()
        if blocks and "blocks_used" in blocks:  # the paged KV pool (torch on CUDA)
            g = GaugeMetricFamily(
                "swiftlm_kv_blocks",
                "Paged KV pool blocks by state (used: held by running "
                "sequences; cached: free but still holding a matchable prefix)",
                labels=["state"],
            )
            for state in ("used", "free", "cached"):
                g.add_metric([state], blocks[f"blocks_{state}"])
            yield g
            yield GaugeMetricFamily("swiftlm_kv_block_size", "Positions per paged KV block", value=blocks["block_size"])
            yield CounterMetricFamily(
                "swiftlm_prefix_cache_queried_tokens",
                "Prompt tokens looked up in the block prefix cache",
                value=blocks["prefix_queries"],
            )
            yield CounterMetricFamily(
                "swiftlm_prefix_cache_hit_tokens",
                "Prompt tokens served from cached KV blocks",
                value=blocks["prefix_hits"],
            )
        codes = (blocks or {}).get("code_pages")
        if codes:  # TurboQuant code pages (torch on CUDA, --turbo-kv)
            g = GaugeMetricFamily(
                "swiftlm_kv_code_pages",
                "TurboQuant code pages by state (used: held by running sequences)",
                labels=["state"],
            )
            for state in ("used", "free"):
                g.add_metric([state], codes[f"pages_{state}"])
            yield g
        yield CounterMetricFamily(
            "swiftlm_busy_seconds", "Wall time with at least one request live", value=st.busy_wall_seconds()
        )
        tps = st.avg_tokens_per_sec
        yield GaugeMetricFamily(
            "swiftlm_avg_tokens_per_second", "Tokens generated / wall time with requests live", value=tps
        )
        yield GaugeMetricFamily(
            "swiftlm_tokens_per_second",
            "Average token generation rate (SwiftLM's name; the same figure as swiftlm_avg_tokens_per_second)",
            value=tps,
        )
        yield GaugeMetricFamily(
            "swiftlm_requests_active", "Requests being generated or waiting", value=st.requests_active
        )
        yield GaugeMetricFamily("swiftlm_queue_depth", "Sequences waiting for a slot", value=len(eng.scheduler.waiting))
        yield GaugeMetricFamily(
            "swiftlm_running_sequences", "Sequences being decoded", value=len(eng.scheduler.running)
        )
        yield _hist(
            "swiftlm_request_queue_seconds", "Submission to the first engine step that ran the request", st.queue_time
        )
        yield _hist(
            "swiftlm_engine_time_to_first_token_seconds", "Submission to first token sampled (engine side)", st.ttft
        )
        yield _hist(
            "swiftlm_request_duration_seconds", "Submission to the end of the request (any reason)", st.duration
        )
        yield _hist("swiftlm_time_per_output_token_seconds", "Per request: (end - first token) / (tokens - 1)", st.tpot)

        pc = eng.prefix_cache
        yield CounterMetricFamily("swiftlm_prompt_cache_hits", "Requests that reused a cached prefix", value=pc.hits)
        yield CounterMetricFamily(
            "swiftlm_prompt_cache_misses", "Requests that found no cached prefix", value=pc.misses
        )
        yield CounterMetricFamily(
            "swiftlm_prompt_cache_tokens_reused", "Prompt tokens served from the cache", value=pc.tokens_reused
        )
        yield GaugeMetricFamily("swiftlm_prompt_cache_hit_rate", "Prompt cache hit rate", value=pc.hit_rate)
        yield GaugeMetricFamily("swiftlm_prompt_cache_bytes", "Bytes held by the prompt cache", value=pc.bytes)
        yield GaugeMetricFamily("swiftlm_prompt_cache_entries", "Entries in the prompt cache", value=len(pc))

        kv = eng.kv_stats()
        yield GaugeMetricFamily(
            "swiftlm_kv_cache_bytes_per_token",
            "KV bytes per token (the backend's KV dtype)",
            value=eng.info.kv_bytes_per_token,
        )
        yield GaugeMetricFamily(
            "swiftlm_kv_cache_bytes_in_use", "KV bytes held by running sequences", value=kv["bytes"]
        )
        yield GaugeMetricFamily(
            "swiftlm_kv_cache_compression_ratio",
            "16-bit bytes / bytes held for the running sequences' KV",
            value=kv["compression_ratio"],
        )

        mem = memory_figures(eng)
        fam = GaugeMetricFamily(
            "swiftlm_memory_bytes",
            "Memory, measured: device allocator (active, peak, cache), process RSS, weights, KV, prompt cache",
            labels=["kind"],
        )
        for k, v in mem.items():
            if isinstance(v, (int, float)):
                fam.add_metric([k], v)
        yield fam
        yield GaugeMetricFamily(
            "swiftlm_memory_active_bytes",
            "Active memory (SwiftLM's name: the backend allocator's live bytes; torch on CPU: process RSS)",
            value=mem["active"],
        )
        yield GaugeMetricFamily(
            "swiftlm_memory_peak_bytes", "Peak of active memory (SwiftLM's name)", value=mem["peak"]
        )
        yield GaugeMetricFamily(
            "swiftlm_memory_cache_bytes",
            "Memory the allocator holds free for reuse (SwiftLM's name)",
            value=mem["cache"],
        )
        yield GaugeMetricFamily(
            "swiftlm_process_resident_memory_bytes", "Resident memory of the server process", value=mem["process_rss"]
        )

        if eng.speculator is not None:
            sp = eng.speculator.stats
            yield CounterMetricFamily("swiftlm_spec_drafted_tokens", "Speculative tokens drafted", value=sp.drafted)
            yield CounterMetricFamily("swiftlm_spec_accepted_tokens", "Speculative drafts accepted", value=sp.accepted)
            yield GaugeMetricFamily("swiftlm_spec_acceptance_rate", "Accepted / drafted", value=sp.acceptance_rate)
            yield GaugeMetricFamily(
                "swiftlm_spec_tokens_per_target_step", "Tokens emitted per verify pass", value=sp.tokens_per_step
            )


class ExpertStreamCollector:
    """swiftlm_ssd_*: expert streaming's counted reads, taken from the reader at scrape time."""

    def __init__(self) -> None:
        self.engine: Any = None

    def collect(self) -> Any:
        model = getattr(self.engine, "model", None)  # (no engine yet: None)
        reader = model.expert_stream if model is not None else None
        if reader is None:
            return
        from swiftlm.experts.reader import LATENCY_BUCKETS

        st = reader.stats
        yield CounterMetricFamily(
            "swiftlm_ssd_bytes_read", "Bytes read from disk by expert streaming", value=st.bytes_read
        )
        yield CounterMetricFamily("swiftlm_ssd_reads", "Expert read requests (vectored reads)", value=st.reads)
        yield CounterMetricFamily(
            "swiftlm_ssd_experts_read", "Expert slabs read (expert x layer)", value=st.experts_read
        )
        yield CounterMetricFamily(
            "swiftlm_ssd_read_wait_seconds", "Time the engine waited for expert reads", value=st.read_seconds
        )
        yield GaugeMetricFamily(
            "swiftlm_ssd_read_throughput_bytes_per_second",
            "Bytes read / time waited for them",
            value=st.snapshot()["read_bandwidth_bytes_per_s"],
        )
        yield CounterMetricFamily(
            "swiftlm_ssd_prefetch_bytes", "Bytes hinted to the kernel by expert prefetch", value=st.prefetch_bytes
        )
        cum, buckets = 0, []
        for le, n in zip(LATENCY_BUCKETS + (float("inf"),), st.latency_counts):
            cum += n
            buckets.append(("+Inf" if le == float("inf") else repr(le), cum))
        yield HistogramMetricFamily(
            "swiftlm_ssd_read_latency_seconds",
            "Latency of one expert read request",
            buckets=buckets,
            sum_value=st.latency_sum,
        )


class StepCollector:
    """swiftlm_step_seconds{phase}: the engine's step timers (timers.py), read at scrape time."""

    def __init__(self) -> None:
        self.engine: Any = None

    def collect(self) -> Any:
        timers = getattr(self.engine, "timers", None)
        if timers is None:
            return
        from swiftlm.timers import PHASES

        fam = HistogramMetricFamily(
            "swiftlm_step_seconds", "Seconds per engine step spent in each phase", labels=["phase"]
        )
        for phase in PHASES:
            buckets, total = timers.histogram(phase)
            fam.add_metric([phase], buckets, total)
        yield fam
        yield CounterMetricFamily(
            "swiftlm_steps_overlapped",
            "Steps launched before the previous step's ids were read back",
            value=self.engine.stats.overlapped_steps,
        )
        gc_stats = getattr(self.engine, "gc_stats", None)
        snap = gc_stats() if gc_stats is not None else {}
        if "gen2" in snap:  # the process running the step loop (swiftlm/gc_pauses.py)
            n = CounterMetricFamily(
                "swiftlm_gc_collections", "Garbage collections in the engine's process", labels=["generation"]
            )
            t = CounterMetricFamily(
                "swiftlm_gc_pause_seconds",
                "Seconds the engine's process spent in garbage collection",
                labels=["generation"],
            )
            m = GaugeMetricFamily(
                "swiftlm_gc_pause_max_seconds", "Longest garbage-collection pause so far", labels=["generation"]
            )
            for g in ("gen0", "gen1", "gen2"):
                n.add_metric([g[3:]], snap[g]["collections"])
                t.add_metric([g[3:]], snap[g]["seconds"])
                m.add_metric([g[3:]], snap[g]["max_ms"] / 1e3)
            yield from (n, t, m)


class _Uptime:
    def __init__(self, started: float) -> None:
        self.started = started

    def collect(self) -> Any:
        yield GaugeMetricFamily(
            "swiftlm_uptime_seconds", "Seconds since the server started", value=time.time() - self.started
        )


class _Noted:
    """A counter or histogram whose increments and observations are also noted on the current request's
    access-log record (server/access_log.py; nothing is noted when the access log is off)."""

    def __init__(self, metric: Any, note: Any) -> None:
        self.metric, self._note = metric, note

    def inc(self, amount: float = 1) -> None:
        self.metric.inc(amount)
        self._note(amount)

    def observe(self, value: float) -> None:
        self.metric.observe(value)
        self._note(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)


def whole_counts(text: bytes) -> bytes:
    """Counts printed as integers: ``swiftlm_tokens_generated_total 487``, not ``487.0`` (prometheus_client
    prints every value as a float, and as ``4.87e+08`` from a million up), as SwiftLM's Swift server does and
    shell scripts reading /metrics expect.  Integral values of counters and of histograms' bucket and count
    samples are rewritten; counters in seconds, sums, gauges and ``_created`` stamps stay floats."""
    whole: set[str] = set()
    out = []
    for ln in text.decode().split("\n"):
        if ln.startswith("# TYPE "):
            _, _, name, kind = ln.split(" ", 3)
            if kind == "counter" and not name.endswith("_seconds_total"):
                whole.add(name)
            elif kind == "histogram":
                whole.update((name + "_bucket", name + "_count"))
        elif ln and not ln.startswith("#") and ln.split("{", 1)[0].split(" ", 1)[0] in whole:
            head, _, value = ln.rpartition(" ")
            v = float(value)
            if v.is_integer() and abs(v) < 2**53:  # exactly representable: the count itself
                ln = f"{head} {int(v)}"
        out.append(ln)
    return "\n".join(out).encode()


class Metrics:
    """The server's registry.  Routes count requests, errors and streamed tokens here; the rest
    is read from the engine when /metrics is scraped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.started = time.time()
        self.engine_collector = EngineCollector()
        self.experts = ExpertStreamCollector()
        self.steps = StepCollector()
        for c in (_Uptime(self.started), self.engine_collector, self.experts, self.steps):
            self.registry.register(c)
        # --api-workers: the HTTP counters below are kept in prometheus-client's multiprocess files (one set
        # per worker process, in PROMETHEUS_MULTIPROC_DIR) and every scrape sums all workers' files
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if shared:
            from prometheus_client.multiprocess import MultiProcessCollector

            MultiProcessCollector(self.registry, path=shared)
            r = CollectorRegistry()  # the counters' own registry: never rendered (the files are)
        else:
            r = self.registry
        self.requests = Counter("swiftlm_requests", "Requests accepted by the API routes", ["route"], registry=r)
        self.errors = Counter(
            "swiftlm_request_errors",
            "Requests answered with an error: every 4xx/5xx response, and errors sent inside a stream (counted as 500)",
            ["status"],
            registry=r,
        )
        self.stream_errors = Counter(
            "swiftlm_stream_errors",
            "Errors sent as an error frame inside a streamed "
            "response (also counted in swiftlm_request_errors_total, as status 500)",
            registry=r,
        )
        self.prompt_tokens = _Noted(
            Counter("swiftlm_prompt_tokens", "Prompt tokens of requests submitted", registry=r), access_log.note_prompt
        )
        self.gen_tokens = _Noted(
            Counter("swiftlm_generation_tokens", "Tokens delivered to API clients", registry=r), access_log.note_output
        )
        self.ttft = _Noted(
            Histogram(
                "swiftlm_time_to_first_token_seconds",
                "Request received to first token delivered (HTTP side)",
                registry=r,
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            ),
            access_log.note_ttft,
        )
        self.itl = Histogram(
            "swiftlm_inter_token_latency_seconds",
            "Time between tokens delivered to a client",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
        )

    def requests_total(self) -> int:
        """Requests accepted by the API routes, every API worker's (the rendered registry's sum)."""
        total = 0.0
        for fam in self.registry.collect():
            if fam.name == "swiftlm_requests":
                total += sum(x.value for x in fam.samples if x.name == "swiftlm_requests_total")
        return int(total)

    def count_error(self, status: int, where: str = "response") -> None:
        """Count one error answered to a client: ``status`` of the response, or, for an error
        frame sent inside a stream whose 200 header went out already (``where="stream"``), 500."""
        if where == "stream":
            self.stream_errors.inc()
            status = 500
        self.errors.labels(str(int(status))).inc()

    def render(self, engine: Any | None) -> bytes:
        self.engine_collector.engine = engine
        self.experts.engine = engine
        self.steps.engine = engine
        return whole_counts(generate_latest(self.registry))
