"""The start-up warm-up (swiftlm/warm_up.py): a model that asks for it (``ModelHooks.warm_up_waves``) gets its
scratch requests run through the step loop before the engine is handed out, wave by wave, each wave's batch shrinking
one row at a time;
the engine's figures and prompt cache start empty afterwards; ``warm_up=False`` (``--no-warm-up``) skips it; a
context shorter than a scratch prompt caps it; a failing warm-up leaves a working engine.  On the fake backend."""

from __future__ import annotations

import logging

import pytest
import swiftlm_fake_backend as fake

from swiftlm import LLM, SamplingParams


@pytest.fixture
def asking(monkeypatch):
    """The fake model asks for a warm-up of these waves of prompt lengths."""
    waves: list[list[int]] = []
    monkeypatch.setattr(fake.FakeModel, "warm_up_waves", lambda self: [list(w) for w in waves])
    fake.STEPS.clear()
    return waves


def test_warm_up_runs_before_serving_and_leaves_no_trace(asking):
    asking[:] = [[40, 130], [30, 20, 25]]  # the torch backend's shape: short and long (several chunks), then a batch
    with LLM(backend="fake", parallel=4, ctx_size=1024, prefill_size=64, prompt_cache_bytes=1 << 20) as llm:
        steps = list(fake.STEPS)
        eng = llm.engine
        # every scratch prompt token was fed before the engine was handed out
        assert sum(p for p, _ in steps) == 40 + 130 + 30 + 20 + 25
        assert (64, 1) in steps, steps  # the first one decodes alone beside a chunk of the long one
        # the second wave, after its last prompt step: request i stops after 8 (i + 1) tokens, so decode rows 3,
        # then 2, then 1
        last_prompt = max(i for i, (p, _) in enumerate(steps) if p)
        rows = [d for _, d in steps[last_prompt + 1 :]]
        assert rows[0] == 3 and 2 in rows and rows[-1] == 1, rows
        assert rows == sorted(rows, reverse=True), rows  # the batch only shrinks
        assert eng.stats.requests_total == 0 and eng.stats.tokens_generated == 0 and eng.stats.steps == 0
        assert eng.stats.finished == {} and len(eng.stats.ttft) == 0
        assert all(v["count"] == 0 for v in eng.timers.snapshot().values())  # the step phases too
        assert len(eng.prefix_cache) == 0 and eng.prefix_cache.misses == 0
        out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))
        assert len(out.outputs[0].token_ids) == 4
        assert eng.stats.requests_total == 1


def test_scratch_requests_sample(asking, monkeypatch):
    """The scratch requests are sampled, not greedy: a greedy row takes the argmax and leaves the sampler's kernels
    (Triton on CUDA) to compile at the first sampled request a client sends."""
    import swiftlm.sampler as sampler

    asking[:] = [[40, 130]]
    kinds: list[bool] = []
    real = sampler.plain_greedy

    def spy(p, s):
        kinds.append(p.greedy)
        return real(p, s)

    monkeypatch.setattr(sampler, "plain_greedy", spy)
    with LLM(backend="fake", parallel=4, ctx_size=1024, prefill_size=64):
        pass
    assert kinds and not any(kinds), kinds


def test_no_warm_up_setting_skips_it(asking):
    asking[:] = [[40, 30]]
    with LLM(backend="fake", parallel=4, ctx_size=1024, warm_up=False):
        assert fake.STEPS == []


def test_a_model_that_asks_for_none_gets_none():
    fake.STEPS.clear()
    with LLM(backend="fake", parallel=2, ctx_size=1024):
        assert fake.STEPS == []


def test_scratch_prompts_fit_the_context(asking):
    asking[:] = [[1300, 500]]
    with LLM(backend="fake", parallel=2, ctx_size=128) as llm:
        fed = sum(p for p, _ in fake.STEPS)
        # each prompt capped so that it and its 8 (i + 1) new tokens fit 128 positions
        assert fed == (128 - 8 - 1) + (128 - 16 - 1)
        assert llm.engine.stats.requests_total == 0


def test_a_failing_warm_up_leaves_a_working_engine(asking, monkeypatch, caplog):
    asking[:] = [[20]]

    def boom(*a, **k):
        raise RuntimeError("compile failed")

    monkeypatch.setattr("swiftlm.warm_up.warm_up", boom)
    with caplog.at_level(logging.WARNING, logger="swiftlm.llm"):
        with LLM(backend="fake", parallel=2, ctx_size=256) as llm:
            out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0))
            assert len(out.outputs[0].token_ids) == 3
    assert any("warm-up failed" in r.getMessage() and "compile failed" in r.getMessage() for r in caplog.records)


def test_torch_warm_up_lengths(monkeypatch):
    """The torch backend's lengths: a graphed TurboQuant server (static caches, codes in pages) gets one prompt of
    several chunks and then one per batch size up to 16, each past the 16-bit window plus a compression block (so
    that it compresses); other formats on CUDA the prompt of several chunks only; none on the CPU."""
    torch = pytest.importorskip("torch")
    from swiftlm.backends.torch import seq_caches
    from swiftlm.turboquant.presets import COMPRESS_BLOCK, KVFormat, affine, parse_turbo

    monkeypatch.setattr(seq_caches, "triton_ok", lambda device: True)  # as on a GPU
    dev = torch.device("cpu")
    fmt = parse_turbo("k4v3")
    (short, long), batch = seq_caches.warm_up_waves(fmt, dev, 8)
    assert long > 2 * 512 and short < 512  # one decoding (alone) beside the chunks of a long prompt
    assert len(batch) == 8  # one per batch size
    assert all(n > fmt.window + COMPRESS_BLOCK for n in [short, long, *batch])  # each compresses
    assert len(seq_caches.warm_up_waves(fmt, dev, 64)[1]) == 16
    cuda = torch.device("cuda")
    for other in (parse_turbo("k4v3", keep_layers=2), affine(8, 32), KVFormat()):
        assert seq_caches.warm_up_waves(other, dev, 8) == []
        ((short16, long16),) = seq_caches.warm_up_waves(other, cuda, 8)
        assert long16 > 2 * 512 and short16 < 512
    monkeypatch.setattr(seq_caches, "triton_ok", lambda device: False)  # the CPU: its kernels warm up at load
    assert seq_caches.warm_up_waves(fmt, dev, 8) == []


def test_warm_up_of_an_engine_process_engine_publishes_nothing():
    """In the engine process the engine's outputs go to ``publish`` (the parent's connections), and requests come
    in checked by the parent: the scratch requests' outputs must not reach it, and the parent's next request is
    published as usual."""
    import threading
    import time

    from swiftlm.config import Settings
    from swiftlm.engine import Engine
    from swiftlm.registry import resolve
    from swiftlm.warm_up import FIRST_ID, warm_up

    model = fake.FakeBackend().load(resolve(Settings().model, allow_download=False), None)
    published: list[tuple[list, list[int]]] = []
    ended = threading.Event()

    def publish(outs, dropped):
        published.append((list(outs), list(dropped)))
        if 1 in dropped:
            ended.set()

    eng = Engine(model, max_running=4, ctx_size=1024, publish=publish)
    try:
        warm_up(eng, [40, 30, 20], model.info.vocab_size)
        assert eng.stats.requests_total == 0
        seen = {o.seq_id for outs, _ in published for o in outs} | {s for _, d in published for s in d}
        assert not any(s >= FIRST_ID for s in seen), seen
        eng.intake.add_checked(1, [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0), None, time.perf_counter())
        assert ended.wait(30)
        tokens = [o.token for outs, _ in published for o in outs if o.seq_id == 1 and o.token is not None]
        assert len(tokens) == 3 and eng.stats.requests_total == 1
    finally:
        eng.shutdown()
