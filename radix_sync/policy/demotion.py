"""Whether demoting a moved session's old copies pays here: `DemotionGate`, the same object live
(`radix_sync.coordinator.live_planner.LivePlanner`) and simulated (`radix_sync.sim.engine.Engine`).

Demotion (design.md): when a session's next turn runs on another worker that holds all of its history, the copies
of that history left on the other workers become evict-first. It pays when the session stays where it went: the
cluster keeps one live copy of each history instead of losing other sessions' only copies to LRU. It costs when the
session comes back: its old worker has evicted the history it now needs. On a fleet of many workers a session that
moved seldom returns; on two workers under load it returns often (measured live on the CPU testbed, stop 32:
demotion added 1.30x [1.09-1.56] to reactive pulls' P99 on agent sessions, 3-22K fewer cached tokens a round).

So each demotion decided is an outcome to learn from: the next arrival that carries the demoted history either goes
to one of the demoted workers (it *returned*) or elsewhere (it *moved on*); a history no arrival carries again
within `outcome_window_s` moved on too (its session ended: freeing it early was right). Demotions are sent only
while the return rate, estimated from outcomes the gate did not influence, is at most `max_return_rate`:

- *controls*: while the gate is closed every decision is a control (decided, not sent: inert); while it is open, one
  decision in `control_every` (by the hash of the history's last page: reproducible) stays a control, so the
  estimate keeps coming from histories that were not evicted. A sent demotion biases its own outcome (its history
  gone from the old worker, a cache-aware router stops sending the session back there), so only controls count.
- the estimate: (returns + 1) / (outcomes + 2) over the last `window` controls; open once `min_outcomes` are in.

Pure: takes the events and `now`, returns decisions; no clock, no I/O.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass(frozen=True)
class DemotionGateConfig:
    max_return_rate: float = 0.4
    """Send demotions while at most this fraction of moved sessions come back to a worker they left. Where the
    simulator says demotion pays (agent sessions on 16 workers, `llama3.1-8b-h200`, rate 100: P99 0.58 s demoting
    every time vs 0.76 s never) 18-33% came back; 0.25 kept the gate shut half the time and cost most of the gain
    (P99 0.65-0.77 s), 0.4 and 0.5 keep it open there (the same runs). On the two-worker CPU testbed, where
    demotion cost, 15 of 29 came back (0.52): docs/bench.md, "The demotion gate" (scripts/demotion_gate_sweep.py)."""
    min_outcomes: int = 8
    """Control outcomes needed before any demotion is sent."""
    window: int = 64
    """Control outcomes the estimate is taken over (the most recent)."""
    control_every: int = 16
    """While open, one decision in this many stays a control (each costs what a demotion would have given: one in 4
    cost the simulator's P99 above 0.03-0.06 s more than one in 16)."""
    outcome_window_s: float = 600.0
    """A demoted history no arrival carries within this long counts as moved on (its session ended)."""
    max_pending: int = 100_000
    """Decisions awaiting their outcome, at most (the oldest resolved as moved on first)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_return_rate <= 1.0:
            raise ValueError(f"max_return_rate must be in [0, 1], got {self.max_return_rate}")
        for name in ("min_outcomes", "window", "control_every", "max_pending"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.outcome_window_s > 0:
            raise ValueError(f"outcome_window_s must be > 0, got {self.outcome_window_s}")


class DemotionGate:
    """Learns whether moved sessions come back (see the module docstring) and says whether to send a demotion."""

    def __init__(self, cfg: DemotionGateConfig = DemotionGateConfig()) -> None:
        self.cfg = cfg
        self._pending: "collections.OrderedDict[int, tuple[frozenset, float, bool]]" = collections.OrderedDict()
        """Last page hash of a demoted history -> (the workers it was decided on, when, whether it is a control)."""
        self._outcomes: "collections.deque[bool]" = collections.deque(maxlen=cfg.window)
        """Controls' outcomes, oldest first: True = the session came back."""
        self.stats = {"decided": 0, "sent": 0, "controls": 0, "returned": 0, "moved_on": 0, "expired": 0,
                      "sent_returned": 0, "sent_moved_on": 0}

    def return_rate(self) -> float:
        """(returns + 1) / (outcomes + 2) over the window's controls."""
        return (sum(self._outcomes) + 1.0) / (len(self._outcomes) + 2.0)

    def is_open(self) -> bool:
        return len(self._outcomes) >= self.cfg.min_outcomes and self.return_rate() <= self.cfg.max_return_rate

    def observe(self, hashes: Iterable[int], worker: Hashable, now: float) -> None:
        """An arrival routed to `worker` with the prompt's page hashes: resolves the decisions on histories it
        carries (before any decision of its own: `decide`), and expires old ones."""
        self._expire(now)
        pending = self._pending
        if not pending:
            return
        for h in hashes:
            entry = pending.pop(h, None)
            if entry is not None:
                self._resolve(worker in entry[0], entry[2])

    def decide(self, last_hash: int, workers: Iterable[Hashable], now: float) -> bool:
        """A moved session's history, ending at page `last_hash`, is stale on `workers`: whether to demote it there
        (False: only recorded, its outcome a control)."""
        control = not self.is_open() or last_hash % self.cfg.control_every == 0
        self._pending[last_hash] = (frozenset(workers), now, control)
        self._pending.move_to_end(last_hash)
        while len(self._pending) > self.cfg.max_pending:
            _, (_, _, was_control) = self._pending.popitem(last=False)
            self._resolve(False, was_control, expired=True)
        self.stats["decided"] += 1
        self.stats["controls" if control else "sent"] += 1
        return not control

    def _expire(self, now: float) -> None:
        horizon = now - self.cfg.outcome_window_s
        pending = self._pending
        while pending:
            h, (_, at, control) = next(iter(pending.items()))
            if at > horizon:
                break
            del pending[h]
            self._resolve(False, control, expired=True)

    def _resolve(self, returned: bool, control: bool, expired: bool = False) -> None:
        if control:
            self._outcomes.append(returned)
            self.stats["returned" if returned else "moved_on"] += 1
            self.stats["expired"] += expired
        else:
            self.stats["sent_returned" if returned else "sent_moved_on"] += 1

    def status(self) -> dict:
        return {**self.stats, "pending": len(self._pending), "window_outcomes": len(self._outcomes),
                "return_rate": round(self.return_rate(), 4), "open": self.is_open(),
                "max_return_rate": self.cfg.max_return_rate}
