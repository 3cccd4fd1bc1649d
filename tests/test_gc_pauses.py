"""swiftlm/gc_pauses.py: collections are timed per generation, the freeze is counted once and can be
turned off, and /metrics exposes the engine's figures."""

from __future__ import annotations

import gc

from swiftlm import gc_pauses
from swiftlm.gc_pauses import GcPauses, freeze


def test_collections_are_timed_per_generation():
    g = GcPauses.install()
    assert GcPauses.install() is g  # one callback per process
    before = g.snapshot()
    gc.collect(0)
    gc.collect(2)
    after = g.snapshot()
    assert after["gen0"]["collections"] == before["gen0"]["collections"] + 1
    assert after["gen2"]["collections"] == before["gen2"]["collections"] + 1
    assert after["gen2"]["seconds"] > before["gen2"]["seconds"]
    assert after["gen2"]["max_ms"] > 0


def test_freeze_counts_once_and_can_be_turned_off(monkeypatch):
    try:
        monkeypatch.setenv("SWIFTLM_GC_FREEZE", "0")
        assert freeze() == 0
        monkeypatch.setenv("SWIFTLM_GC_FREEZE", "1")
        n = freeze()
        # Frozen objects freed by refcount leave the permanent generation, and a thread left running by an
        # earlier test can free some between the two reads: the count can only fall.
        assert 0 < gc.get_freeze_count() <= n and gc.get_freeze_count() > 0.99 * n
        assert GcPauses.install().snapshot()["frozen_objects"] == n
        gc_pauses.unfreeze()
        assert gc.get_freeze_count() == 0 and GcPauses.install().snapshot()["frozen_objects"] == 0
    finally:
        gc.unfreeze()
        gc_pauses._frozen = 0


def test_a_shut_down_engines_cyclic_garbage_is_collectable():
    """freeze() then unfreeze() (what Engine.__init__ / shutdown do): an object in a reference cycle that
    was alive at the freeze is freed by a collection after the unfreeze (frozen, it never would be)."""
    import weakref

    class Node:
        pass

    try:
        a = Node()
        a.self = a  # a cycle: only the cyclic collector frees it
        ref = weakref.ref(a)
        freeze()
        del a
        gc.collect()
        assert ref() is not None  # frozen: the collector does not look at it
        gc_pauses.unfreeze()
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
        gc_pauses._frozen = 0


def test_metrics_expose_the_engines_gc_figures():
    from swiftlm.server.metrics import StepCollector
    from swiftlm.timers import StepTimers

    class Stats:
        overlapped_steps = 0

    class Eng:
        timers, stats = StepTimers(), Stats()

        def gc_stats(self):
            return {
                "frozen_objects": 5,
                "gen0": {"collections": 3, "seconds": 0.002, "max_ms": 1.0},
                "gen1": {"collections": 1, "seconds": 0.001, "max_ms": 1.0},
                "gen2": {"collections": 2, "seconds": 0.5, "max_ms": 300.0},
            }

    c = StepCollector()
    c.engine = Eng()
    fams = {f.name: f for f in c.collect()}
    samples = {(s.name, s.labels.get("generation")): s.value for f in fams.values() for s in f.samples}
    assert samples[("swiftlm_gc_collections_total", "2")] == 2
    assert samples[("swiftlm_gc_pause_seconds_total", "2")] == 0.5
    assert samples[("swiftlm_gc_pause_max_seconds", "2")] == 0.3
