"""Token events that queue up behind a slow reader are merged into one chunk (same text, ids and
logprobs, in order); nothing merges across sequences, past a final event, around an error or a
progress event, or under a reasoning budget."""

import asyncio
from collections import deque

from swiftlm.outputs import Event, TokenLogprob
from swiftlm.server.chat_core import ChatRun


def _run(events, budget=None):
    async def go():
        r = ChatRun.__new__(ChatRun)
        r._q, r._buf, r.budget = asyncio.Queue(), deque(), budget
        for ev in events:
            r._q.put_nowait(ev)
        out = []
        while not r._q.empty() or r._buf:
            out.append(r._next_event())
        return out

    return asyncio.run(go())


def _lp(i):
    return TokenLogprob(i, f"t{i}", -0.1 * i, [])


def test_queued_token_events_merge_in_order():
    evs = [Event(1, text=f"t{i}", token_ids=[i], logprobs=[_lp(i)]) for i in range(4)]
    evs.append(Event(1, text="!", token_ids=[9], finished=True, finish_reason="stop", completion_tokens=5))
    (ev,) = _run(evs)
    assert ev.text == "t0t1t2t3!" and ev.token_ids == [0, 1, 2, 3, 9]
    assert [x.token for x in ev.logprobs] == [0, 1, 2, 3]
    assert ev.finished and ev.finish_reason == "stop" and ev.completion_tokens == 5


def test_nothing_merges_across_boundaries():
    evs = [
        Event(1, text="a", token_ids=[1]),
        Event(2, text="b", token_ids=[2]),  # another sequence
        Event(2, text="c", token_ids=[3], finished=True, finish_reason="stop"),
        Event(2, text="late", token_ids=[4]),  # after a final event
        Event(3, progress=(5, 10)),
        Event(3, text="d", token_ids=[5]),  # a progress event
        Event(3, text="", error="boom", finished=True, finish_reason="error"),
    ]  # an error
    out = _run(evs)
    assert [(e.seq_id, e.text, e.token_ids) for e in out] == [
        (1, "a", [1]),
        (2, "bc", [2, 3]),
        (2, "late", [4]),
        (3, "", []),
        (3, "d", [5]),
        (3, "", []),
    ]
    assert out[-1].error == "boom"


def test_reasoning_budget_sees_every_event():
    evs = [Event(1, text=f"t{i}", token_ids=[i]) for i in range(3)]
    assert [e.token_ids for e in _run(evs, budget=8)] == [[0], [1], [2]]
