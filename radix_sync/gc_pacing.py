"""`GcPacer`: keeps CPython's cycle collector from walking a long-running process's whole heap on its hot path.

Why: the coordinator holds hundreds of thousands of directory entries and demand records. Their own objects are
out of the collector's sight already (pages are bytes, records are untracked structs), but the containers holding
them (dicts of 200,000 pages, a deque per prefix) are walked by every full collection: 60-77 ms at 400,000 page
holdings (`scripts/bench_directory_gc.py`), on whichever thread allocated last -- the loop thread in the middle of
a plan tick, the admin thread in the middle of a lookup. CPython starts a full collection once ten younger ones
have run and the objects that survived them reach a quarter of the oldest generation, so a coordinator taking
steady demand meets one every few seconds (docs/coordinator-scale.md, "The cycle collector, paced").

What: the loop thread calls `settle()` after each plan tick. It first collects what is not frozen (the objects
made since the last settle, a few thousand: cycles made garbage during the tick are freed now, not frozen),
then `gc.freeze()` moves every object alive into the permanent generation (a list splice, O(1)), which no
automatic collection walks; objects made later are collected as before, and reference counting frees anything
acyclic at once whatever its generation. What freezing defers: a cycle of frozen objects that becomes garbage
later is freed only by a thorough pass. Every `thorough_every_s`,
`settle()` unfreezes, collects the whole heap once (the pause a full collection always cost, now once a period
and right after a tick, when the next one is furthest away) and freezes again; its pause, what it freed and what
is frozen are reported (`summary()`, the coordinator's `/status` `loop.gc`).

A process-wide decision: the coordinator makes a pacer only when its owner asks (`kvrep coordinator` does; a
coordinator built in a test or a library leaves the collector alone).

`heap_frozen()` is the batch job's form: what lives when the block starts (the simulator's workload, traces and
policy) stays out of every collection until it ends.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import time
from typing import Callable, Iterator, TypeVar

_F = TypeVar("_F", bound=Callable)

PROCESS_THOROUGH_EVERY_S = 300.0
"""`kvrep coordinator --gc-thorough-every-s`'s default: one whole-heap pause (~60-80 ms at 400,000 page holdings) in
five minutes."""


class GcPacer:
    """Freezes what lives after each unit of work; a thorough collection every `thorough_every_s`. One thread
    calls `settle()`; `summary()` may be read from any (plain int and float reads)."""

    def __init__(self, thorough_every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < thorough_every_s < float("inf"):
            raise ValueError(f"thorough_every_s must be > 0 and finite, got {thorough_every_s}")
        self.thorough_every_s = thorough_every_s
        self.clock = clock
        self.last_thorough_s = clock()
        self.num_settles = 0
        self.num_thorough = 0
        self.last_pause_s = 0.0
        self.max_pause_s = 0.0
        self.last_freed = 0
        self.total_freed = 0
        self.young_freed = 0
        """Objects the young collections before each freeze freed (cycles made garbage during a tick)."""
        self.young_s = self.max_young_s = 0.0
        """The last and longest of those collections (and the freeze after it), s."""
        self.frozen = 0
        """Objects frozen after the last thorough pass (counted then: `gc.get_freeze_count` walks the frozen list, too
        long a walk for every `/status`)."""

    def settle(self) -> float:
        """After a unit of work: freeze what lives now; every `thorough_every_s` first collect the whole heap
        (frozen objects included). Returns the seconds a thorough pass took (0.0 when none ran)."""
        self.num_settles += 1
        pause = 0.0
        now = self.clock()
        if now - self.last_thorough_s >= self.thorough_every_s:
            t0 = time.perf_counter()
            gc.unfreeze()
            freed = gc.collect()
            pause = time.perf_counter() - t0
            self.last_thorough_s = now
            self.num_thorough += 1
            self.last_pause_s, self.max_pause_s = pause, max(self.max_pause_s, pause)
            self.last_freed, self.total_freed = freed, self.total_freed + freed
            gc.freeze()
            self.frozen = gc.get_freeze_count()
            return pause
        # (what the tick made and dropped in cycles: not frozen with the rest; a collection walks only what is
        # not frozen, what was made since the last freeze)
        t0 = time.perf_counter()
        self.young_freed += gc.collect()
        gc.freeze()
        self.young_s = time.perf_counter() - t0
        self.max_young_s = max(self.max_young_s, self.young_s)
        return pause

    def release(self) -> None:
        """The process stops pacing (the coordinator stopped): everything frozen is the collector's again."""
        gc.unfreeze()

    def summary(self) -> dict:
        return {"frozen_at_thorough": self.frozen, "settles": self.num_settles, "young_freed": self.young_freed,
                "young_ms": {"last": round(self.young_s * 1e3, 3), "max": round(self.max_young_s * 1e3, 3)},
                "thorough_every_s": self.thorough_every_s, "thorough_passes": self.num_thorough,
                "thorough_ms": {"last": round(self.last_pause_s * 1e3, 2), "max": round(self.max_pause_s * 1e3, 2)},
                "freed": {"last": self.last_freed, "total": self.total_freed}}


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Freezes what lives now for the duration of the block, then gives it back to the collector. A simulation run:
    its full collections walked the workload built before it (4 passes, 443 ms of a 6 s run); frozen, 22 ms.
    Where something is frozen already (a `GcPacer`'s process, an enclosing block) the block leaves the collector
    alone: `gc.unfreeze` at its end would give back what the other froze."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def frozen_during(fn: _F) -> _F:
    """`fn` runs inside `heap_frozen()` (the simulator's `Engine.run`)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with heap_frozen():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]
