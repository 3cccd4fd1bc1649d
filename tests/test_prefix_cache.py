"""Prompt (prefix) reuse: the store's policy, and the engine + backend end to end."""

from __future__ import annotations

import time

import pytest
from conftest import BACKENDS, needs_torch
from torch_layout import relayout

from swiftlm import SamplingParams
from swiftlm.prefix_cache import PrefixCache


def test_longest_prefix_lru_and_byte_bound():
    pc = PrefixCache(max_bytes=100, min_tokens=2)
    pc.insert([1, 2, 3, 4], "a", 40)
    pc.insert([1, 2, 9], "b", 40)
    assert pc.lookup([1, 2, 3, 4, 5]) == (4, "a")
    assert pc.lookup([1, 2, 9, 9]) == (3, "b")
    assert pc.lookup([1, 2, 3, 4]) == (3, "a")  # one prompt token is always left to compute
    assert pc.lookup([7, 7, 7]) == (0, None)
    pc.lookup([1, 2, 9, 1])  # touch "b": "a" is now least recently used
    pc.insert([5, 6, 7], "c", 40)  # 120 bytes > 100: evicts "a"
    assert pc.lookup([1, 2, 3, 4, 5])[1] == "b" and pc.bytes == 80
    pc.insert([5, 6, 7, 8], "d", 40)  # supersedes its own prefix "c"
    assert len(pc) == 2 and pc.lookup([5, 6, 7, 8, 0]) == (4, "d")
    assert pc.hits == 6 and pc.misses == 1


@needs_torch
@pytest.mark.slow
def test_shared_system_prompt_ttft_and_identical_outputs():
    """A ~1,100-token system prompt shared by two chats: the second reuses it (TTFT at most a fifth of the
    first's) and both give the tokens of an engine without the cache.  The prompt spans three prefill
    chunks (512 tokens each), long enough for prefill to dominate the first TTFT; each uncached prefill of
    it is a few CPU-seconds, and the test runs three."""
    from swiftlm import LLM

    system = " ".join(f"Rule {i}: answer politely and cite the relevant section number." for i in range(90))
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for q in ("What is rule 3 about?", "Summarise the rules in one line.")
    ]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cached = LLM(backend="torch")
    plain = LLM(backend="torch", prompt_cache_bytes=0)
    try:
        n_prompt = len(cached.engine.chat_prompt(chats[0]))
        assert n_prompt >= 2 * cached.settings.prefill_size  # more than two prefill chunks

        def ttft(llm, chat):
            t0 = time.perf_counter()
            it = llm.stream(chat, p)
            first = next(it)
            dt = time.perf_counter() - t0
            rest = list(it)
            return dt, first.token_ids + sum((d.token_ids for d in rest), [])

        t_first, out_first = ttft(cached, chats[0])
        t_second, out_second = ttft(cached, chats[1])
        res = cached.generate(chats[1], p)
        assert res.usage["cached_tokens"] >= n_prompt - 20  # the whole system prompt was reused
        print(f"TTFT first {t_first:.3f}s, second (cached) {t_second:.3f}s, ratio {t_second / t_first:.3f}")
        assert t_second <= 0.2 * t_first
        # identical outputs with and without the cache
        assert out_first == plain.generate(chats[0], p).token_ids
        assert out_second == plain.generate(chats[1], p).token_ids
        assert cached.engine.prefix_cache.hits >= 2
    finally:
        cached.close()
        plain.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_turn_reuses_the_previous_turn(tiny_llama, backend):
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend=backend)
    try:
        p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        history = [{"role": "user", "content": "Tell me something about the weather in spring, please."}]
        first = llm.generate(history, p)
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And in autumn?"}]
        second = llm.generate(history, p)
        # everything the first turn computed (its prompt and the fed part of its answer) that the
        # re-rendered history still starts with is reused, exactly
        computed = first.prompt_token_ids + first.token_ids[:-1]
        common = next(
            (i for i, (a, b) in enumerate(zip(computed, second.prompt_token_ids)) if a != b),
            min(len(computed), len(second.prompt_token_ids)),
        )
        assert second.usage["cached_tokens"] == min(common, len(second.prompt_token_ids) - 1) > 16
    finally:
        llm.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_and_uncached_outputs_are_identical(tiny_llama, backend):
    """Same greedy tokens whether the prefix comes from the cache or is computed (fp32)."""
    from swiftlm import LLM

    sys_msg = {"role": "system", "content": "You are a terse assistant. " * 12}
    chats = [[sys_msg, {"role": "user", "content": q}] for q in ("One?", "Two, please.", "Three!")]
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with (
        LLM(str(tiny_llama), backend=backend) as cached,
        LLM(str(tiny_llama), backend=backend, prompt_cache_bytes=0) as plain,
    ):
        got = [cached.generate(c, p) for c in chats]
        assert [o.usage["cached_tokens"] > 0 for o in got] == [False, True, True]
        assert [o.token_ids for o in got] == [plain.generate(c, p).token_ids for c in chats]


@needs_torch
def test_torch_static_slot_pool_on_cpu(tiny_llama):
    """The CUDA layout (fixed-capacity slots from a pool, made under inference mode) run on
    CPU: the prompt cache copies into and out of reused slots, outputs stay identical."""
    from swiftlm import LLM

    sys_msg = {"role": "system", "content": "You are a terse assistant. " * 12}
    chats = [[sys_msg, {"role": "user", "content": q}] for q in ("One?", "Two, please.", "Three!")]
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with (
        LLM(str(tiny_llama), backend="torch", ctx_size=256) as cached,
        LLM(str(tiny_llama), backend="torch", prompt_cache_bytes=0) as plain,
    ):
        m = cached.engine.model
        relayout(m, static=True, context=256)  # slots as on CUDA (no graphs: those need a GPU)
        got = [cached.generate(c, p) for c in chats]
        assert [o.usage["cached_tokens"] > 0 for o in got] == [False, True, True]
        assert [o.token_ids for o in got] == [plain.generate(c, p).token_ids for c in chats]
        assert len(m.seqs.free_slots) == 1  # the one slot went back to the pool and was reused


@needs_torch
def test_a_queued_request_holds_no_kv_until_it_runs(tiny_llama):
    """A prompt-cache hit is restored when its request is admitted, not when it is queued (queued
    hits would hold KV while they wait); the hit still counts and the output equals the uncached one."""
    import threading

    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend="torch", parallel=1, prompt_cache_bytes=1 << 26)
    try:
        prompt = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron"
        greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        first = llm.generate(prompt, greedy)  # fills the prompt cache
        # the long request holds the one slot: a stream we stop reading (cancelled at the end), with
        # more tokens than any machine decodes in the polling window below
        long = llm.stream("other words here", SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True))
        next(long)  # it is running: its first token came back
        out: dict = {}
        queued = threading.Thread(target=lambda: out.setdefault("r", llm.generate(prompt, greedy)))
        queued.start()
        deadline = time.monotonic() + 30
        while not llm.engine.scheduler.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        waiting = list(llm.engine.scheduler.waiting)
        assert waiting, "the second request should be queued behind the first"
        assert all(s.seq_id not in llm.engine.model.caches for s in waiting)  # no KV while queued
        # nor a reference to the cache entry it will hit: one the cache evicts meanwhile is freed (a
        # queued request pinning an evicted entry would hold memory that no figure counts)
        payload = next(iter(llm.engine.prefix_cache._entries.values())).payload
        held = [v for s in waiting for v in vars(llm.engine._live[s.seq_id]).values()]
        assert not any(v is payload or (isinstance(v, tuple) and any(x is payload for x in v)) for v in held)
        long.close()  # cancels the long request: the queued one is admitted
        queued.join(120)
        assert out["r"].token_ids == first.token_ids
        assert llm.engine.prefix_cache.hits >= 1
    finally:
        llm.close()
