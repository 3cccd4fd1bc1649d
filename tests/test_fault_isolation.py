"""One sequence's failure inside a step is that sequence's error: the other sequences of the same
steps produce exactly what a clean run produces (seeded sampling, fp32 on CPU).  And if the
engine loop itself dies, every waiter gets the error and new requests are refused (no hang)."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import BACKENDS

from swiftlm import LLM, SamplingParams
from swiftlm import sampler as sampler_mod

PROMPTS = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota", "kappa lambda mu", "nu xi omicron pi"]
BAD_SEED = 666  # the injected failure hits the request with this seed


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=2.0, seed=BAD_SEED if i == 2 else 100 + i, ignore_eos=True)


def _run_all(llm: LLM) -> dict[int, object]:
    out: dict[int, object] = {}

    def go(i: int) -> None:
        try:
            out[i] = llm.generate(PROMPTS[i], _params(i)).token_ids
        except Exception as exc:  # the failed request's error reaches its caller
            out[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(PROMPTS))]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    return out


@pytest.fixture(params=BACKENDS)
def llm(request, tiny_llama):
    m = LLM(str(tiny_llama), backend=request.param, parallel=len(PROMPTS))
    yield m
    m.close()


def test_sampling_failure_of_one_row(llm, monkeypatch):
    clean = _run_all(llm)
    real = sampler_mod._launch

    def flaky(ops, logits, rows, counters):
        if any(r.state.seed == BAD_SEED for r in rows) and rows[0].state.draws >= 3:
            raise ValueError("injected: this row's sampling parameters broke the kernel")
        return real(ops, logits, rows, counters)

    monkeypatch.setattr(sampler_mod, "_launch", flaky)
    got = _run_all(llm)
    assert isinstance(got[2], Exception) or len(got[2]) < 8  # the bad request ended early, with an error
    for i in (0, 1, 3, 4):
        assert got[i] == clean[i], i  # everyone else: token for token the clean run
    assert llm.engine.running


def test_grammar_failure_of_one_row(llm, monkeypatch):
    clean = _run_all(llm)

    class Broken:
        def __init__(self):
            self.n = 0

        def consume(self, token):
            self.n += 1
            if self.n == 3:
                raise RuntimeError("injected: the grammar rejected the token")

        def mask(self, *a, **k):  # no restriction: only consume fails
            return None

    real_finish = sampler_mod.Pending.finish

    def finish(self):
        for row in self.rows:
            if row.state.seed == BAD_SEED and row.state.constraint is None:
                row.state.constraint = Broken()
        return real_finish(self)

    monkeypatch.setattr(sampler_mod.Pending, "finish", finish)
    monkeypatch.setattr(sampler_mod, "plain_greedy", lambda p, s: False)
    got = _run_all(llm)
    assert isinstance(got[2], Exception) or len(got[2]) < 8
    for i in (0, 1, 3, 4):
        assert got[i] == clean[i], i
    assert llm.engine.running


def test_engine_loop_death_is_reported_not_a_hang(tiny_llama, monkeypatch):
    m = LLM(str(tiny_llama), backend="torch", parallel=2)
    told: list[str] = []
    m.engine.on_fatal = told.append
    try:

        def boom():
            raise RuntimeError("injected: the scheduler broke")

        monkeypatch.setattr(m.engine.scheduler, "schedule", boom)
        with pytest.raises(Exception, match="engine loop died"):
            m.generate("hello there", SamplingParams(max_tokens=4))
        # the dying loop ends the live requests first (their callers get the error), then tells on_fatal
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not m.engine.running and told and "scheduler broke" in told[0]
        with pytest.raises(Exception, match="engine loop died"):  # refused at once, not queued forever
            m.generate("again", SamplingParams(max_tokens=4))
    finally:
        m.close()


class _Killed(BaseException):
    """Not an Exception: a per-step fault handler does not catch it, so the loop itself dies."""


def test_requests_queued_when_the_loop_dies_end_with_its_error(tiny_llama, monkeypatch):
    """A request waiting in the inbox while the loop dies (submitted during the last step) ends with
    the loop's error at once, not never (nothing drains the inbox once the loop is gone)."""
    m = LLM(str(tiny_llama), backend="torch", parallel=2)
    m.engine.on_fatal = lambda msg: None
    inside, release = threading.Event(), threading.Event()
    real = m.engine.scheduler.schedule

    def schedule(*a, **kw):
        if m.engine.scheduler.running or m.engine.scheduler.waiting:
            inside.set()
            release.wait(30)
            raise _Killed("injected: the loop is killed")
        return real(*a, **kw)

    monkeypatch.setattr(m.engine.scheduler, "schedule", schedule)
    errors: dict[str, BaseException] = {}

    def go(name: str) -> None:
        try:
            m.generate(name, SamplingParams(max_tokens=4))
        except Exception as exc:
            errors[name] = exc

    try:
        first = threading.Thread(target=go, args=("first",))
        first.start()
        assert inside.wait(30)  # the loop is inside a step with the first request
        second = threading.Thread(target=go, args=("second",))
        second.start()
        deadline = threading.Event()
        deadline.wait(0.3)  # the second request is submitted: it sits in the inbox
        release.set()
        first.join(30)
        second.join(30)
        assert not first.is_alive() and not second.is_alive(), "a request waited forever on a dead loop"
        assert "loop is killed" in str(errors["first"]) and "loop is killed" in str(errors["second"])
    finally:
        release.set()
        m.close()


def test_rank_failure_ends_streams_while_the_step_is_stuck(tiny_llama, monkeypatch):
    """A tensor-parallel rank's death seen by the watchdog (swiftlm.llm._rank_failed) ends every open
    request with the rank's error at once, even while the loop stays blocked inside a forward -- as
    rank 0 does on CUDA, where NCCL waits on the dead peer (the streams would get no error until the
    server's shutdown cut them).  The blocked forward stands in for that collective."""
    from swiftlm.llm import _rank_failed

    m = LLM(str(tiny_llama), backend="torch", parallel=2)
    m.engine.on_fatal = lambda msg: None
    inside, release = threading.Event(), threading.Event()
    real = m.engine.model.forward
    calls = [0]

    def forward(batch):
        calls[0] += 1
        if calls[0] > 3:  # generation is under way: the next "collective" never returns
            inside.set()
            release.wait(60)
            raise _Killed("released at the end of the test")
        return real(batch)

    monkeypatch.setattr(m.engine.model, "forward", forward)
    errors: dict[int, BaseException] = {}

    def go(i: int) -> None:
        try:
            m.generate(PROMPTS[i], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        except Exception as exc:
            errors[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    try:
        [t.start() for t in ts]
        assert inside.wait(30)
        _rank_failed(
            m.engine, "tensor-parallel rank 1 (pid 1) was killed by signal 9; the model needs all 2 ranks, so it stops"
        )
        [t.join(10) for t in ts]
        assert not any(t.is_alive() for t in ts), "a request kept waiting on a stuck step"
        assert inside.is_set() and not release.is_set()  # the step was still blocked when they ended
        for i in range(2):
            assert "rank 1 (pid 1) was killed by signal 9" in str(errors[i])
        with pytest.raises(Exception, match="rank 1"):  # new requests are refused
            m.generate("again", SamplingParams(max_tokens=2))
    finally:
        release.set()
        m.close()
