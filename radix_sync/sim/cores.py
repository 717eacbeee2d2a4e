"""CPU work beside the workers on shared cores (`EngineConfig.frontend_cpu_s`): each request's front-end job (the
front door, the coordinator, SGLang's HTTP/tokenizer and detokenizer processes, the client) runs from its arrival
on the cores the workers use, by processor sharing with them (`Engine.core_speed`)."""

from __future__ import annotations

import heapq
from typing import Optional


class FrontEndJobs:
    """The front-end jobs running. They all progress at the same speed, so each is the common progress (work
    seconds done by every job since the start) at which it ends, in a heap."""

    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s
        self._ends: list[float] = []
        self._work = 0.0
        self._t = 0.0
        self._speed = 1.0
        self.version = 0
        """Of the next end event scheduled; an event of an older version is stale."""

    def __len__(self) -> int:
        return len(self._ends)

    def advance(self, now: float) -> None:
        """Moves the common progress to `now`, at the speed set last."""
        if self._ends:
            self._work += (now - self._t) * self._speed
        self._t = now

    def start(self, now: float) -> None:
        """A request arrived at `now`: its job starts (the caller re-times everything: the cores are shared by one
        more)."""
        self.advance(now)
        heapq.heappush(self._ends, self._work + self.cpu_s)

    def finish(self, now: float) -> None:
        """The end event scheduled last fired at `now`: drops the jobs done."""
        self.advance(now)
        ends = self._ends
        while ends and ends[0] <= self._work + 1e-12:
            heapq.heappop(ends)

    def respeed(self, now: float, speed: float) -> Optional[float]:
        """From `now` the jobs run at `speed` (the caller advanced them to `now` at the old one). Returns: when the
        next one ends (schedule it with `version`), or None when none runs."""
        self._speed = speed
        if not self._ends:
            return None
        self.version += 1
        return now + max(0.0, self._ends[0] - self._work) / speed
