"""The engine with TurboQuant code pages (``--turbo-kv`` on CUDA: ``code_pages.py``), on this CPU: an idle
engine's torch model is given static TurboQuant caches (the CUDA layout, run eagerly) whose codes are pages
of a small pool that the engine's second block manager hands out.  Requests are admitted, grown and
preempted against the pages, and each one's tokens equal those of the same static caches holding
whole-context codes of their own (the same arithmetic on the same rows; greedy)."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import needs_torch
from torch_layout import relayout

from swiftlm.sampling import SamplingParams

CTX = 512
PAGE = 64
PROMPTS = [
    "a b c a b c a b",
    "the cat sat on the mat the cat " * 3,
    "one two three",
    "x y z",
    "Once upon a time in a land far away there lived " * 2,
    "count: 1 2 3 4 5 6 7 8 9 10",
]
TURBO = dict(turbo_kv="k4v3", turbo_kv_window=8)


def make_static(llm, pages: int | None) -> None:
    """An idle CPU engine's model: static TurboQuant caches (eager), with ``pages`` code pages (None: none)."""
    import torch

    from swiftlm.backends.torch.code_pages import CodePages

    eng, m = llm.engine, llm.engine.model
    relayout(m, context=CTX)
    m.seqs.static_ok = lambda fmt: fmt.kind == "turbo"
    if pages is not None:
        m.seqs.code_pages = CodePages(m.module.a, m.kv_default, pages, torch.device("cpu"), page_rows=PAGE)
        eng.kv.attach_pool(False)
        assert eng.code_format == m.kv_default and eng.scheduler.code_blocks is not None


@pytest.fixture(scope="module")
def whole(tiny_llama):
    from swiftlm import LLM

    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=4, **TURBO) as llm:
        make_static(llm, None)
        outs = [o.token_ids for o in llm.generate(PROMPTS, p)]
        assert all(getattr(c, "static", False) for c in llm.engine.model.seqs.turbo_free[llm.engine.model.kv_default])
        return outs


def _watch(blocks):
    peak, stop = [], threading.Event()

    def run():
        while not stop.is_set():
            peak.append(blocks.used())
            time.sleep(0.002)

    t = threading.Thread(target=run)
    t.start()
    return peak, stop, t


@needs_torch
@pytest.mark.parametrize("pages", [40, 4], ids=["roomy", "tight"])
def test_code_pages_engine_equals_whole_context_codes(tiny_llama, whole, pages):
    """40 pages: every request fits at once; 4 pages (256 positions) for six requests of ~70-110 positions
    (two pages each): they wait, or are preempted and recomputed, and still give the same tokens."""
    from swiftlm import LLM

    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=4, **TURBO) as llm:
        make_static(llm, pages)
        codes = llm.engine.scheduler.code_blocks
        peak, stop, t = _watch(codes)
        outs = llm.generate(PROMPTS, p)
        stop.set()
        t.join()
        assert [o.token_ids for o in outs] == whole
        assert 0 < max(peak) <= pages
        assert codes.used() == 0  # every page back once the requests end
        codes.check()
        pool = llm.engine.model.seqs.code_pages
        caches = llm.engine.model.seqs.turbo_free[llm.engine.model.kv_default]
        assert caches and all(c.paged and c.code_pages is pool and not c.pages.list for c in caches)
        stats = llm.engine.scheduler.block_stats()["code_pages"]
        assert stats == {"page_size": PAGE, "pages_total": pages, "pages_used": 0, "pages_free": pages}
        if pages == 4:
            assert llm.engine.scheduler.preemptions > 0 or max(peak) == pages


@needs_torch
def test_other_formats_keep_their_own_caches(tiny_llama):
    """With code pages for k4v3: a k3v2 request keeps a cache of its own (no pages), a turbo_kv "off" one
    runs 16-bit, and a k4v3 one takes pages: each gives the tokens it gives alone without pages."""
    from swiftlm import LLM

    reqs = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, turbo_kv=f) for f in ("k3v2", "off", None)]
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=3, **TURBO) as ref:
        make_static(ref, None)
        want = [ref.generate(PROMPTS[4], r).token_ids for r in reqs]
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=3, **TURBO) as llm:
        make_static(llm, 16)
        codes = llm.engine.scheduler.code_blocks
        got = [llm.generate(PROMPTS[4], r).token_ids for r in reqs[:2]]
        assert codes.used() == 0 and max(_peak_of(llm, reqs[1])) == 0
        got.append(llm.generate(PROMPTS[4], reqs[2]).token_ids)
        assert got == want
        m = llm.engine.model
        assert not any(
            c.paged for c in m.seqs.turbo_free[[f for f in m.seqs.turbo_free if f.name.startswith("k3v2")][0]]
        )


def _peak_of(llm, params):
    """Pages held while ``params`` generates (a request that must hold none)."""
    peak, stop, t = _watch(llm.engine.scheduler.code_blocks)
    llm.generate(PROMPTS[0], params)
    stop.set()
    t.join()
    return peak


@needs_torch
def test_forks_and_speculation_on_code_pages(tiny_llama):
    """``n`` = 2 (a fork group: each choice prefills its own compressed cache) and n-gram speculation (the verify
    block writes past the decode row, rolled back by position) over code pages: the tokens of whole-context codes."""
    from swiftlm import LLM

    rep = "one two three four five six seven eight nine ten " * 6
    pn = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, n=2)
    ps = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    got = {}
    for pages in (None, 12):
        with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=2, speculative="ngram", **TURBO) as llm:
            make_static(llm, pages)
            fork = [c.token_ids for c in llm.generate(PROMPTS[1], pn).outputs]
            spec = llm.generate(rep, ps).token_ids
            got[pages] = (fork, spec, llm.engine.speculator.stats.accepted)
            if pages:
                assert llm.engine.scheduler.code_blocks.used() == 0
    assert got[12][0] == got[None][0] and len(got[12][0]) == 2 and len(got[12][0][0]) == 50
    assert got[12][1] == got[None][1]
    assert got[12][2] > 0  # drafts were accepted: verify blocks ran over the pages


@needs_torch
def test_a_cache_that_does_not_fit_fails_only_its_request(tiny_llama, whole):
    """A request whose whole-context cache cannot be allocated (device memory: simulated here) fails with an
    error that says so; the requests running beside it, on code pages, finish with their tokens."""
    import torch

    from swiftlm import LLM

    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=4, **TURBO) as llm:
        make_static(llm, 40)
        m = llm.engine.model
        made = m.seqs.compressed

        def compressed(fmt):
            if fmt.name.startswith("k3v2"):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return made(fmt)

        m.seqs.compressed = compressed
        errors, outs = [], {}

        def one(i, params):
            try:
                outs[i] = llm.generate(PROMPTS[i], params).token_ids
            except Exception as exc:
                errors.append(str(exc))

        bad = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, turbo_kv="k3v2")
        ts = [threading.Thread(target=one, args=(i, p)) for i in range(3)] + [
            threading.Thread(target=one, args=(3, bad))
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(errors) == 1 and "not enough device memory" in errors[0] and "k3v2" in errors[0], errors
        assert [outs[i] for i in range(3)] == whole[:3]
        assert llm.engine.scheduler.code_blocks.used() == 0


@needs_torch
def test_health_and_metrics_report_code_pages(tiny_llama):
    """``/health`` ``stats.kv_blocks.code_pages`` and ``/metrics`` ``swiftlm_kv_code_pages{state}``, as the
    manager counts them, while a request holds pages and after it ends."""
    from starlette.testclient import TestClient

    from swiftlm import LLM
    from swiftlm.server.app import create_app

    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=2, **TURBO) as llm:
        make_static(llm, 16)
        codes = llm.engine.scheduler.code_blocks
        app = create_app(llm.settings, engine=llm.engine, spec=llm.spec, backend="torch")
        with TestClient(app) as client:
            seen = []
            stop = threading.Event()

            def scrape():
                while not stop.is_set():
                    seen.append(client.get("/health").json()["stats"]["kv_blocks"]["code_pages"]["pages_used"])
                    time.sleep(0.01)

            t = threading.Thread(target=scrape)
            t.start()
            r = client.post(
                "/v1/completions",
                json={"model": "m", "prompt": PROMPTS[4], "max_tokens": 120, "temperature": 0, "ignore_eos": True},
            )
            stop.set()
            t.join()
            assert r.status_code == 200, r.text
            assert max(seen) > 0  # pages held while the request ran
            h = client.get("/health").json()["stats"]["kv_blocks"]["code_pages"]
            assert h == {"page_size": PAGE, "pages_total": 16, "pages_used": 0, "pages_free": 16}
            text = client.get("/metrics").text
            assert 'swiftlm_kv_code_pages{state="used"} 0.0' in text
            assert 'swiftlm_kv_code_pages{state="free"} 16.0' in text
            assert codes.used() == 0
