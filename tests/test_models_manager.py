"""The model manager's policy (load on demand, one load for concurrent waiters, LRU eviction by
count and memory, TTL, pins, names and aliases, a failing load) on stand-in engines: fast and
exact.  The same manager serving real checkpoints is tested in test_multi_model.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from swiftlm.server.models import ModelEntry, ModelLoadFailed, ModelManager, ModelNotFound, entries_from_toml


class FakeEngine:
    def __init__(self, name: str):
        self.name, self.closed = name, False

    def shutdown(self) -> None:
        self.closed = True


def manager(names=("a", "b", "c"), fail=(), delay=0.0, **kw):
    loads: list[str] = []

    def load(e: ModelEntry):
        loads.append(e.name)
        time.sleep(delay)
        if e.name in fail:
            raise RuntimeError("weights are corrupt")
        return FakeEngine(e.name), None

    m = ModelManager([ModelEntry(n, f"/models/{n}") for n in names], load, **kw)
    return m, loads


def run(coro):
    return asyncio.run(coro)


def test_names_single_and_strict():
    one, _ = manager(names=("only",))
    assert one.entry("gpt-4o").name == "only" and one.entry(None).name == "only"  # clients' hard-coded names
    strict, _ = manager(names=("only",), strict=True)
    with pytest.raises(ModelNotFound, match="available: only"):
        strict.entry("gpt-4o")
    many, _ = manager()
    with pytest.raises(ModelNotFound, match="'nope' is not served here; available: a, b, c"):
        many.entry("nope")
    assert many.entry(None).name == "a"
    with pytest.raises(ValueError, match="used twice"):
        ModelManager([ModelEntry("x", "p", aliases=["y"]), ModelEntry("y", "q")], lambda e: (None, None))


def test_concurrent_requests_share_one_load():
    m, loads = manager(delay=0.2)

    async def go():
        es = await asyncio.gather(*(m.acquire("b") for _ in range(5)))
        assert all(e is es[0] for e in es) and es[0].in_flight == 5
        for e in es:
            m.release(e)

    run(go())
    assert loads == ["b"] and m.entry("b").state == "loaded"


def test_lru_eviction_by_count_skips_busy_and_pinned():
    m, loads = manager(names=("a", "b", "c", "d"), max_loaded=2)
    m.entries[0].pin = True  # a stays

    async def go():
        a = await m.acquire("a")
        m.release(a)
        b = await m.acquire("b")  # b in flight: cannot be evicted
        c = await m.acquire("c")  # over the count, but a is pinned and b is busy
        assert {e.name for e in m.loaded()} == {"a", "b", "c"}
        m.release(c)
        m.release(b)
        eng_b = b.engine
        await asyncio.sleep(0.01)
        await m.acquire("b")  # b now most recently used
        m.release(b)
        d = await m.acquire("d")  # three loaded, room for two: evicts c (least recently used), then b
        m.release(d)
        return eng_b

    eng_b = run(go())
    assert [e.name for e in m.loaded()] == ["a", "d"]  # the pinned one stays, counted in the two
    assert m.entry("c").state == m.entry("b").state == "unloaded" and m.entry("c").engine is None
    assert eng_b.closed and loads == ["a", "b", "c", "d"]


def test_memory_budget_evicts_until_it_fits():
    sizes = {"a": 60, "b": 30, "c": 50}
    m, _ = manager(memory_budget=100, size_of=lambda e: sizes[e.name])

    async def go():
        for n in ("a", "b"):
            m.release(await m.acquire(n))
            await asyncio.sleep(0.01)
        m.release(await m.acquire("c"))  # 60 + 30 + 50 > 100: evict a (LRU); 30 + 50 fits

    run(go())
    assert [e.name for e in m.loaded()] == ["b", "c"]


def test_ttl_unloads_idle_models_and_shutdown_engines():
    m, loads = manager(ttl=0.2)

    async def go():
        m.start()
        e = await m.acquire("a")
        eng = e.engine
        await asyncio.sleep(0.4)
        assert e.state == "loaded"  # in flight: never unloaded by the TTL
        m.release(e)
        await asyncio.sleep(0.5)
        assert e.state == "unloaded" and eng.closed
        e2 = await m.acquire("a")  # loads again on demand
        m.release(e2)
        await m.close()

    run(go())
    assert loads == ["a", "a"]


def test_failed_load_is_each_waiters_error_and_others_keep_serving():
    m, loads = manager(fail=("b",), delay=0.05)

    async def go():
        a = await m.acquire("a")
        results = await asyncio.gather(*(m.acquire("b") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, ModelLoadFailed) and "weights are corrupt" in str(r) for r in results)
        assert m.entry("b").state == "failed" and "weights are corrupt" in m.entry("b").error
        assert a.state == "loaded" and a.engine is not None
        m.release(a)
        with pytest.raises(ModelLoadFailed):  # the next request tries again
            await m.acquire("b")

    run(go())
    assert loads.count("b") == 2


def test_listing_and_aliases():
    m = ModelManager(
        [ModelEntry("qwen", "/m/q", aliases=["gpt-4o"], pin=True), ModelEntry("llama", "/m/l")],
        lambda e: (FakeEngine(e.name), None),
    )
    assert m.entry("gpt-4o").name == "qwen"
    ls = m.listing()
    assert [x["id"] for x in ls] == ["qwen", "llama"] and ls[0]["aliases"] == ["gpt-4o"]
    assert ls[0]["status"] == {"value": "unloaded", "in_flight": 0, "pinned": True}


def test_models_file(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text(
        '[[models]]\nname = "small"\nmodel = "/m/s"\naliases = ["gpt-4o-mini"]\nturbo_kv = true\n'
        'pin = true\n\n[[models]]\nmodel = "/m/big.gguf"\nctx_size = 8192\n'
    )
    es = entries_from_toml(f)
    assert (es[0].name, es[0].model, es[0].aliases, es[0].pin, es[0].overrides) == (
        "small",
        "/m/s",
        ["gpt-4o-mini"],
        True,
        {"turbo_kv": True},
    )
    assert (es[1].name, es[1].overrides) == ("/m/big.gguf", {"ctx_size": 8192})
    f.write_text('[[models]]\nmodel = "/m/s"\nport = 9\n')
    with pytest.raises(ValueError, match="server-wide setting"):
        entries_from_toml(f)
    f.write_text('title = "x"\n')
    with pytest.raises(ValueError, match="models"):
        entries_from_toml(f)
