"""Prometheus metrics (prometheus-client), all prefixed ``swiftlm_``."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class ExpertStreamCollector:
    """swiftlm_ssd_*: expert streaming's counted reads, taken from the reader at scrape time."""

    def __init__(self) -> None:
        self.engine: Any = None

    def collect(self) -> Any:
        reader = getattr(getattr(self.engine, "model", None), "expert_stream", None)
        if reader is None:
            return
        from swiftlm.experts.reader import LATENCY_BUCKETS

        st = reader.stats
        yield CounterMetricFamily("swiftlm_ssd_bytes_read", "Bytes read from disk by expert streaming",
                                  value=st.bytes_read)
        yield CounterMetricFamily("swiftlm_ssd_reads", "Expert read requests (vectored reads)", value=st.reads)
        yield CounterMetricFamily("swiftlm_ssd_experts_read", "Expert slabs read (expert x layer)",
                                  value=st.experts_read)
        yield CounterMetricFamily("swiftlm_ssd_read_wait_seconds", "Time the engine waited for expert reads",
                                  value=st.read_seconds)
        yield GaugeMetricFamily("swiftlm_ssd_read_throughput_bytes_per_second",
                                "Bytes read / time waited for them", value=st.snapshot()["read_bandwidth_bytes_per_s"])
        yield CounterMetricFamily("swiftlm_ssd_prefetch_bytes", "Bytes hinted to the kernel by expert prefetch",
                                  value=st.prefetch_bytes)
        cum, buckets = 0, []
        for le, n in zip(LATENCY_BUCKETS + (float("inf"),), st.latency_counts):
            cum += n
            buckets.append(("+Inf" if le == float("inf") else repr(le), cum))
        yield HistogramMetricFamily("swiftlm_ssd_read_latency_seconds", "Latency of one expert read request",
                                    buckets=buckets, sum_value=st.latency_sum)


class StepCollector:
    """swiftlm_step_seconds{phase}: the engine's step timers (timers.py), read at scrape time."""

    def __init__(self) -> None:
        self.engine: Any = None

    def collect(self) -> Any:
        timers = getattr(self.engine, "timers", None)
        if timers is None:
            return
        from swiftlm.timers import PHASES

        fam = HistogramMetricFamily("swiftlm_step_seconds", "Seconds per engine step spent in each phase",
                                    labels=["phase"])
        for phase in PHASES:
            buckets, total = timers.histogram(phase)
            fam.add_metric([phase], buckets, total)
        yield fam
        yield CounterMetricFamily("swiftlm_steps_overlapped", "Steps launched before the previous step's ids "
                                  "were read back", value=self.engine.stats.overlapped_steps)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.experts = ExpertStreamCollector()
        r.register(self.experts)
        self.steps = StepCollector()
        r.register(self.steps)
        self.started = time.time()
        self.requests = Counter("swiftlm_requests", "Requests accepted by the OpenAI routes", ["route"], registry=r)
        self.errors = Counter("swiftlm_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("swiftlm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.gen_tokens = Counter("swiftlm_generation_tokens", "Tokens generated", registry=r)
        self.active = Gauge("swiftlm_requests_active", "Requests being generated or waiting", registry=r)
        self.queue = Gauge("swiftlm_queue_depth", "Sequences waiting for a slot", registry=r)
        self.running = Gauge("swiftlm_running_sequences", "Sequences being decoded", registry=r)
        self.tps = Gauge("swiftlm_avg_tokens_per_second", "Average decode throughput", registry=r)
        self.uptime = Gauge("swiftlm_uptime_seconds", "Seconds since the server started", registry=r)
        self.mem = Gauge("swiftlm_memory_bytes", "Backend memory", ["kind"], registry=r)
        self.pc_hits = Gauge("swiftlm_prompt_cache_hits", "Requests that reused a cached prefix", registry=r)
        self.pc_misses = Gauge("swiftlm_prompt_cache_misses", "Requests that found no cached prefix", registry=r)
        self.pc_hit_rate = Gauge("swiftlm_prompt_cache_hit_rate", "Prompt cache hit rate", registry=r)
        self.pc_bytes = Gauge("swiftlm_prompt_cache_bytes", "Bytes held by the prompt cache", registry=r)
        self.pc_tokens = Gauge("swiftlm_prompt_cache_tokens_reused", "Prompt tokens served from the cache",
                               registry=r)
        self.kv_bytes = Gauge("swiftlm_kv_cache_bytes_per_token", "KV bytes per token (16-bit or model dtype)",
                              registry=r)
        self.kv_in_use = Gauge("swiftlm_kv_cache_bytes_in_use", "KV bytes held by running sequences", registry=r)
        self.kv_ratio = Gauge("swiftlm_kv_cache_compression_ratio",
                              "16-bit bytes / bytes held for the running sequences' KV", registry=r)
        self.preemptions = Gauge("swiftlm_preemptions", "Sequences preempted (KV budget) and recomputed", registry=r)
        self.spec_drafted = Gauge("swiftlm_spec_drafted_tokens", "Speculative tokens drafted", registry=r)
        self.spec_accepted = Gauge("swiftlm_spec_accepted_tokens", "Speculative drafts accepted", registry=r)
        self.spec_rate = Gauge("swiftlm_spec_acceptance_rate", "Accepted / drafted", registry=r)
        self.spec_tps = Gauge("swiftlm_spec_tokens_per_target_step", "Tokens emitted per verify pass", registry=r)
        self.ttft = Histogram("swiftlm_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.itl = Histogram("swiftlm_inter_token_latency_seconds", "Time between streamed tokens", registry=r,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))

    def render(self, engine: Any | None) -> bytes:
        self.uptime.set(time.time() - self.started)
        self.experts.engine = engine
        self.steps.engine = engine
        if engine is not None:
            st = engine.stats
            self.active.set(st.requests_active)
            self.queue.set(len(engine.scheduler.waiting))
            self.running.set(len(engine.scheduler.running))
            self.tps.set(st.avg_tokens_per_sec)
            for k, v in engine.model.memory().items():
                self.mem.labels(k).set(v)
            pc = engine.prefix_cache
            self.pc_hits.set(pc.hits)
            self.pc_misses.set(pc.misses)
            self.pc_hit_rate.set(pc.hit_rate)
            self.pc_bytes.set(pc.bytes)
            self.pc_tokens.set(pc.tokens_reused)
            self.kv_bytes.set(engine.info.kv_bytes_per_token)
            kv = engine.kv_stats()
            self.kv_in_use.set(kv["bytes"])
            self.kv_ratio.set(kv["compression_ratio"])
            self.preemptions.set(engine.scheduler.preemptions)
            if engine.speculator is not None:
                sp = engine.speculator.stats
                self.spec_drafted.set(sp.drafted)
                self.spec_accepted.set(sp.accepted)
                self.spec_rate.set(sp.acceptance_rate)
                self.spec_tps.set(sp.tokens_per_step)
        return generate_latest(self.registry)
