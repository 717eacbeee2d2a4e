"""`GcPacer`: what lives at a settle is frozen (out of every automatic and explicit collection's sight), garbage
cycles among frozen objects are freed by the next thorough pass, and the process gets its collector back."""
import gc
import weakref

import pytest

from radix_sync.gc_pacing import GcPacer


class _Node:
    pass


@pytest.fixture
def clock():
    t = [0.0]
    yield t
    gc.unfreeze()  # whatever a test left frozen is this test process's again


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def _live_cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def test_settle_freezes_and_a_thorough_pass_frees_frozen_cycles(clock):
    pacer = GcPacer(10.0, clock=lambda: clock[0])
    held, ref = _live_cycle()
    assert pacer.settle() == 0.0  # no thorough pass yet: the cycle, alive, is frozen
    assert gc.get_freeze_count() > 0 and pacer.num_settles == 1
    del held  # garbage now, but only a collection can free a cycle
    gc.collect()
    assert ref() is not None  # frozen: even an explicit full collection does not walk it
    clock[0] = 9.9
    pacer.settle()
    assert ref() is not None and pacer.num_thorough == 0
    clock[0] = 10.0
    assert pacer.settle() > 0  # the period is over: unfreeze, collect everything, freeze again
    assert ref() is None and pacer.num_thorough == 1 and pacer.last_freed >= 2
    assert gc.get_freeze_count() > 0
    s = pacer.summary()
    assert s["thorough_passes"] == 1 and s["freed"]["total"] == pacer.total_freed >= 2
    assert s["thorough_ms"]["max"] >= s["thorough_ms"]["last"] > 0 and s["settles"] == 3


def test_young_objects_are_collected_as_before(clock):
    pacer = GcPacer(10.0, clock=lambda: clock[0])
    pacer.settle()
    ref = _cycle()  # made after the freeze: an ordinary collection frees it
    gc.collect()
    assert ref() is None and pacer.num_thorough == 0


def test_a_cycle_dropped_before_the_settle_is_freed_not_frozen(clock):
    """What a tick made and dropped in a cycle is garbage at the settle: collected then (only what is not frozen is
    walked), not frozen until the next thorough pass."""
    pacer = GcPacer(10.0, clock=lambda: clock[0])
    pacer.settle()
    held, ref = _live_cycle()  # (a cycle the tick made: in the collector's young generation)
    gc.disable()  # (no automatic collection between: the settle's own frees it)
    try:
        del held
        pacer.settle()
        assert ref() is None and pacer.young_freed >= 2 and pacer.num_thorough == 0
    finally:
        gc.enable()
    s = pacer.summary()
    assert s["young_freed"] == pacer.young_freed and s["young_ms"]["max"] >= s["young_ms"]["last"] > 0


def test_release_gives_the_heap_back(clock):
    pacer = GcPacer(10.0, clock=lambda: clock[0])
    held, ref = _live_cycle()
    pacer.settle()
    del held
    pacer.release()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_a_period_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="thorough_every_s"):
        GcPacer(bad)


def test_the_coordinator_config_checks_its_period():
    from radix_sync.coordinator.server import CoordinatorConfig

    assert CoordinatorConfig().gc_thorough_every_s == 0.0  # a coordinator made in a library leaves gc alone
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="gc_thorough_every_s"):
            CoordinatorConfig(gc_thorough_every_s=bad)


def test_heap_frozen_keeps_what_lived_before_out_of_collections_until_the_block_ends(clock):
    from radix_sync.gc_pacing import frozen_during, heap_frozen

    ref = _cycle()
    with heap_frozen():
        gc.collect()
        assert ref() is not None and gc.get_freeze_count() > 0
        young = _cycle()  # made inside: collected as usual
        gc.collect()
        assert young() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None

    @frozen_during
    def boom():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        boom()
    assert gc.get_freeze_count() == 0 and boom.__name__ == "boom"  # given back on the way out, whatever happened


def test_heap_frozen_inside_a_paced_process_leaves_the_pacer_s_freeze_alone(clock):
    """A simulation run in a process whose pacer froze the heap: the block's end does not give back what the pacer
    froze (its next settle would not know; the frozen heap would be walked again by every full collection)."""
    from radix_sync.gc_pacing import heap_frozen

    pacer = GcPacer(10.0, clock=lambda: clock[0])
    held, ref = _live_cycle()
    pacer.settle()
    frozen = gc.get_freeze_count()
    with heap_frozen():
        pass
    assert gc.get_freeze_count() == frozen > 0
    del held
    gc.collect()
    assert ref() is not None  # still the pacer's, out of the collection's sight


def test_a_simulation_runs_with_the_heap_frozen_and_gives_it_back():
    from radix_sync.sim.engine import Engine

    seen = []
    orig = Engine._arrive

    def arrive(self, req, now):
        seen.append(gc.get_freeze_count())
        return orig(self, req, now)

    from radix_sync.sim import engine as engine_mod
    import unittest.mock as mock

    with mock.patch.object(engine_mod.Engine, "_arrive", arrive):
        from radix_sync.cli import main

        assert main(["sim", "--generator", "agent", "--rate", "5", "--duration-s", "5", "--workers", "2",
                     "--policies", "cache_aware", "--seeds", "1"]) in (0, None)
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
