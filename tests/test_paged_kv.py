"""The paged KV pool (backends/torch/kv_pool.py) under the engine's block manager (swiftlm/kv_blocks.py),
run on CPU: the CUDA layout (pool, block tables, the graph bodies run eagerly) with 16-position blocks.

Exactness: greedy outputs equal plain solo runs (the eager CPU path), with several sequences at once,
with n-gram speculation, with preemption forced by a pool smaller than the running sequences need, and
with prompt blocks shared through prefix caching; blocks go back when requests end or are cancelled."""

from __future__ import annotations

import queue
import time

import pytest
from conftest import needs_torch
from torch_layout import relayout

from swiftlm import SamplingParams

CTX = 512


def make_paged(llm, parallel: int, block_size: int = 16, num_blocks: int | None = None) -> None:
    """Give an idle CPU engine's torch model the CUDA layout: a paged pool whose blocks the engine hands out."""
    import torch

    from swiftlm.backends.torch.graphs import GraphDecoder
    from swiftlm.backends.torch.kv_pool import SlotPool

    eng, m = llm.engine, llm.engine.model
    cpu = torch.device("cpu")
    pool = SlotPool(m.module.a, parallel, CTX, torch.float32, cpu, block_size=block_size, num_blocks=num_blocks)
    relayout(m, static=True, context=CTX, pool=pool, graphs=GraphDecoder(m.module, cpu, use_graph=False, fused=False))
    eng.kv.attach_pool(True)  # with a pool, the prompt cache is its blocks


PROMPTS = [
    "a b c a b c a b",
    "the cat sat on the mat the cat " * 3,
    "one two three",
    "x y z",
    "Once upon a time in a land far away there lived " * 2,
    "count: 1 2 3 4 5 6 7 8 9 10",
]


@pytest.fixture(scope="module")
def solo(tiny_llama):
    from swiftlm import LLM

    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", prompt_cache_bytes=0) as plain:
        return [plain.generate(q, p).token_ids for q in PROMPTS]


@needs_torch
@pytest.mark.parametrize("kw", [{"parallel": 4}, {"parallel": 1, "speculative": "ngram"}], ids=["batched", "ngram"])
def test_paged_pool_engine_equals_solo(tiny_llama, solo, kw):
    from swiftlm import LLM

    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, **kw) as llm:
        make_paged(llm, kw["parallel"])
        outs = llm.generate(PROMPTS, p)
        assert [o.token_ids for o in outs] == solo
        blocks = llm.engine.kv_blocks
        blocks.check()
        assert blocks.used() == 0  # every request ended: no block is held


@needs_torch
def test_preemption_in_a_small_pool_keeps_outputs(tiny_llama, solo):
    """12 blocks of 16 positions (192 tokens) for four sequences of ~60-110 positions each: the newest
    is preempted when the others' next blocks are short, then resumed; every output equals its solo run."""
    from swiftlm import LLM

    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=4) as llm:
        make_paged(llm, 4, num_blocks=12)
        outs = llm.generate(PROMPTS, p)
        assert [o.token_ids for o in outs] == solo
        assert llm.engine.scheduler.preemptions > 0
        blocks = llm.engine.kv_blocks
        blocks.check()
        assert blocks.used() == 0


@needs_torch
def test_prefix_blocks_are_shared_not_copied(tiny_llama):
    """A long shared system prompt: later requests start from its cached full blocks (cached_tokens a whole
    number of blocks, counted by the manager) and give the tokens of uncached runs."""
    from swiftlm import LLM

    system = {"role": "system", "content": "You are a terse assistant who answers in one line. " * 6}
    chats = [[system, {"role": "user", "content": q}] for q in ("One?", "Two, please.", "Three!")]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", prompt_cache_bytes=0) as plain:
        want = [plain.generate(c, p).token_ids for c in chats]
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=2) as llm:
        make_paged(llm, 2)
        m, late = llm.engine.model, []
        chunk_rows = m.packed.late_chunks  # the rest after the cached blocks: rows of the batched decode step

        def counted(batch, aid, graphs):
            r = chunk_rows(batch, aid, graphs)
            late.extend(r)
            return r

        m.packed.late_chunks = counted
        got = [llm.generate(c, p) for c in chats]
        assert len(late) == 2  # the two cached requests' rests ran as decode rows (and gave the same tokens)
        assert [o.token_ids for o in got] == want
        cached = [o.usage["cached_tokens"] for o in got]
        assert cached[0] == 0 and cached[1] > 0 and cached[1] % 16 == 0 and cached[2] == cached[1], cached
        stats = llm.engine.kv_blocks.stats()
        assert stats["prefix_hits"] == cached[1] + cached[2]
        assert stats["blocks_used"] == 0 and stats["blocks_cached"] > 0  # released, kept for the next request
        llm.engine.kv_blocks.check()
        # with prefix caching off nothing is matched (and nothing is kept)
        llm.engine.kv_blocks.prefix_caching = False
        llm.engine.kv_blocks.reset_prefix_cache()
        again = llm.generate(chats[1], p)
        assert again.token_ids == want[1] and again.usage["cached_tokens"] == 0


@needs_torch
def test_cancel_frees_blocks_within_one_step(tiny_llama):
    from swiftlm import LLM

    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=2) as llm:
        make_paged(llm, 2)
        eng = llm.engine
        q: queue.Queue = queue.Queue()
        sid = eng.submit(
            eng.text_prompt("tell me a long story " * 4),
            SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
            q.put,
        )
        n = 0
        while n < 5:
            ev = q.get(timeout=120)
            n += len(ev.token_ids)
        assert eng.kv_blocks.used() > 0
        steps = eng.stats.steps
        eng.cancel(sid)
        while not q.get(timeout=120).finished:
            pass
        deadline = time.time() + 5
        while eng.kv_blocks.used() and time.time() < deadline:
            time.sleep(0.01)
        assert eng.kv_blocks.used() == 0
        assert eng.stats.steps - steps <= 1  # freed before a second step ran
        eng.kv_blocks.check()


@needs_torch
def test_health_and_metrics_report_blocks_and_preemptions(tiny_llama):
    """/health's stats.kv_blocks and /metrics' swiftlm_kv_blocks{state} follow the pool: blocks held while
    requests run (here a pool too small for all of them, so preemptions count), all back when they end."""
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from swiftlm import LLM
    from swiftlm.server.app import create_app

    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=4) as llm:
        make_paged(llm, 4, num_blocks=12)
        app = create_app(llm.settings, engine=llm.engine, spec=llm.spec, backend="torch")
        with TestClient(app) as client:
            p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            llm.generate(PROMPTS, p)
            h = client.get("/health").json()["stats"]
            blocks = h["kv_blocks"]
            assert blocks["blocks_total"] == 12 and blocks["block_size"] == 16
            assert blocks["blocks_used"] == 0 and blocks["blocks_free"] + blocks["blocks_cached"] == 12
            assert h["preemptions"] == llm.engine.scheduler.preemptions > 0
            fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
            got = {s.labels["state"]: s.value for s in fams["swiftlm_kv_blocks"].samples}
            assert got == {"used": 0, "free": blocks["blocks_free"], "cached": blocks["blocks_cached"]}
            assert [s.value for s in fams["swiftlm_preemptions"].samples][0] == h["preemptions"]
            # while a long request runs, its blocks are counted as used
            import threading

            t = threading.Thread(
                target=llm.generate, args=(PROMPTS[1], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
            )
            t.start()
            deadline = time.time() + 60
            used = 0
            kv_bytes = 0
            while t.is_alive() and time.time() < deadline and not (used and kv_bytes):
                st = client.get("/health").json()["stats"]
                used, kv_bytes = st["kv_blocks"]["blocks_used"], st["kv_bytes_in_use"]
                time.sleep(0.01)
            t.join()
            bb = llm.engine.model.pool.block_bytes  # KV bytes in use are whole blocks (read apart from blocks_used:
            assert used > 0 and kv_bytes > 0 and kv_bytes % bb == 0  # the step may add one in between)


@needs_torch
def test_a_lone_sequence_past_the_pool_ends_at_length(tiny_llama):
    """A pool smaller than the context (12 blocks of 16: 192 positions of a 512 context) and one request that
    would outgrow it: it ends 'length' when its next position has no block, with the solo run's tokens so far;
    the engine goes on serving."""
    from swiftlm import LLM

    p = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", prompt_cache_bytes=0, ctx_size=CTX) as plain:
        want = plain.generate(PROMPTS[1], p).token_ids
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=2) as llm:
        make_paged(llm, 2, num_blocks=12)
        out = llm.generate(PROMPTS[1], p)
        n = len(llm.engine.text_prompt(PROMPTS[1]))
        assert out.finish_reason == "length" and n + len(out.token_ids) == 192  # every position the pool holds
        assert out.token_ids == want[: len(out.token_ids)]
        assert llm.engine.kv_blocks.used() == 0
        again = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(again.token_ids) == 8


@needs_torch
def test_pool_size_from_memory_and_flags():
    """--kv-cache-memory bytes of blocks (never less than one context); --max-num-seqs is --parallel; with
    --turbo-kv the default pool is one context."""
    import argparse
    from types import SimpleNamespace

    import torch

    from swiftlm.backends.torch.devices import kv_pool_size
    from swiftlm.config import add_settings_arguments, settings_from_args

    a = SimpleNamespace(layers=2, kv_heads=2, head_dim=8)
    per_block = 2 * 2 * 2 * 8 * 16 * 4  # K and V, layers, heads, dim, positions, fp32 bytes
    cfg = SimpleNamespace(kv_block_size=16, kv_cache_memory=str(100 * per_block))
    assert kv_pool_size(cfg, a, torch.device("cpu"), torch.float32, 4, 512) == (16, 100)
    cfg.kv_cache_memory = str(3 * per_block)  # less than one 512-token context: raised to 32 blocks
    assert kv_pool_size(cfg, a, torch.device("cpu"), torch.float32, 4, 512) == (16, 32)
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    s = settings_from_args(p.parse_args(["--max-num-seqs", "7", "--kv-cache-memory", "2GB", "--kv-block-size", "32"]))
    assert (s.parallel, s.kv_cache_memory, s.kv_block_size) == (7, "2GB", 32)
    # --turbo-kv as the server's default: compressed sequences keep caches of their own, so the 16-bit pool is
    # one full context (for requests with turbo_kv "off"), not --parallel contexts (read before any device query)
    s = settings_from_args(p.parse_args(["--turbo-kv", "k4v3", "--parallel", "8", "--kv-block-size", "16"]))
    assert kv_pool_size(s, a, torch.device("cpu"), torch.float32, 8, 512) == (16, 32)
    # ... and --kv-cache-memory sizes the TurboQuant code pages (code_pool_pages) instead
    s = settings_from_args(
        p.parse_args(["--turbo-kv", "k4v3", "--kv-cache-memory", str(100 * per_block), "--kv-block-size", "16"])
    )
    assert kv_pool_size(s, a, torch.device("cpu"), torch.float32, 8, 512) == (16, 32)
    from swiftlm.backends.torch.code_pages import PAGE_ROWS, CodePages
    from swiftlm.backends.torch.devices import code_pool_pages
    from swiftlm.turboquant.presets import settings_format

    page = CodePages.page_bytes_for(a, settings_format(s))
    assert code_pool_pages(s, a, torch.device("cpu"), 8, 4096) == 100 * per_block // page
    s2 = settings_from_args(p.parse_args(["--turbo-kv", "k4v3", "--kv-cache-memory", "1KB"]))
    assert code_pool_pages(s2, a, torch.device("cpu"), 8, 4096) == 4096 // PAGE_ROWS  # at least one context
    # no TurboQuant default (or layers kept 16-bit, whose caches are not static): no code pages; the flag then
    # sizes the 16-bit pool
    assert code_pool_pages(settings_from_args(p.parse_args([])), a, torch.device("cpu"), 8, 4096) == 0
    s3 = settings_from_args(p.parse_args(["--turbo-kv", "k4v3", "--turbo-kv-keep-layers", "1"]))
    assert code_pool_pages(s3, a, torch.device("cpu"), 8, 4096) == 0
    s4 = settings_from_args(
        p.parse_args(
            [
                "--turbo-kv",
                "k4v3",
                "--turbo-kv-keep-layers",
                "1",
                "--kv-cache-memory",
                str(100 * per_block),
                "--kv-block-size",
                "16",
            ]
        )
    )
    assert kv_pool_size(s4, a, torch.device("cpu"), torch.float32, 8, 512) == (16, 100)
    with pytest.raises(Exception, match="kv_block_size"):
        settings_from_args(p.parse_args(["--kv-block-size", "0"]))
    with pytest.raises(Exception, match="not a size"):
        settings_from_args(p.parse_args(["--kv-cache-memory", "lots"]))


@needs_torch
def test_compressed_kv_requests_take_no_blocks(tiny_llama):
    """A request with its own compressed cache (kv_bits) beside a plain one: only the plain one holds blocks,
    and both give their solo tokens."""
    import threading

    from swiftlm import LLM

    plain_p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    bits_p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, kv_bits=8)
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, prompt_cache_bytes=0) as ref:
        want = ref.generate(PROMPTS[1], bits_p).token_ids
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=2) as llm:
        make_paged(llm, 2)
        blocks = llm.engine.kv_blocks
        peak = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                peak.append(blocks.used())
                time.sleep(0.002)

        t = threading.Thread(target=watch)
        t.start()
        got = llm.generate(PROMPTS[1], bits_p)
        stop.set()
        t.join()
        assert got.token_ids == want
        assert max(peak) == 0  # the compressed request never held a block
        assert llm.generate(PROMPTS[0], plain_p).token_ids and blocks.used() == 0


@needs_torch
def test_a_failing_request_frees_its_blocks_and_spares_the_others(tiny_llama):
    """A request that fails in its step (the backend reports it in ``Forward.failed``, as for a LoRA adapter it
    cannot run or a bad media item) gives its blocks back at once; a request running beside it finishes with its
    solo tokens."""
    import threading

    from swiftlm import LLM

    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, prompt_cache_bytes=0) as ref:
        want = ref.generate(PROMPTS[4], p).token_ids
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=2) as llm:
        make_paged(llm, 2)
        eng = llm.engine
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("ok", llm.generate(PROMPTS[4], p)))
        t.start()
        m = eng.model
        forward, doomed, seen = m.forward, set(), []

        def failing_forward(batch):
            fwd = forward(batch)
            sampling = [w for w in batch.seqs if w.sample]
            for w in batch.seqs:
                if w.seq_id in doomed and w.start_pos > 20:  # past its prompt: it holds blocks by now
                    seen.append(len(eng.kv_blocks.table(w.seq_id)))
                    fwd.failed[w.seq_id] = "injected failure"
            if fwd.failed and fwd.logits is not None:  # as a backend does: no logits row for a failed sequence
                keep = [i for i, w in enumerate(sampling) if w.seq_id not in fwd.failed]
                fwd.logits = fwd.logits[keep] if keep else None
            return fwd

        m.forward = failing_forward
        q: queue.Queue = queue.Queue()
        doomed.add(eng.submit(eng.text_prompt(PROMPTS[1]), SamplingParams(max_tokens=40, ignore_eos=True), q.put))
        ev = q.get(timeout=60)
        while not ev.finished:
            ev = q.get(timeout=60)
        assert ev.finish_reason == "error" and "injected" in (ev.error or "") and seen and seen[0] > 0
        assert not eng.kv_blocks.has(ev.seq_id)  # freed in the step that failed it, before its event went out
        t.join(120)
        assert got["ok"].token_ids == want
        assert eng.kv_blocks.used() == 0
        eng.kv_blocks.check()
