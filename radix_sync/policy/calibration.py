"""Whether the planner's copies get used as often as it predicts: `UseCalibration`, the same object live
(`radix_sync.coordinator.live_planner.LivePlanner`) and simulated (`radix_sync.sim.engine.Engine`).

A speculative copy is a bet that a request will use it: the planner weighs its gain by the predicted number of
requests (`Demand.expected_count`) and sends it where it forecasts they will go. Both can be wrong in ways the
planner cannot see from one snapshot: on the two-worker CPU testbed (stop 33, agent sessions, `kvrep bench`) 3% of
one round's planned copies' tokens were used, 25% of another's, while each copy took the target's memory from
sessions that did come back (10-12K fewer cached tokens a round than reactive pulls alone; mean TTFT 1.16x).

So each copy is an outcome to learn from, by the kind of demand that asked for it (`Demand.source`: `session`,
`hint`, `popularity`): `judge_after_s` after it was decided (the planner's horizon, within which it predicted the
use) it is *used* if a request hit it by then, else *unused* (a use after that flips it back to used). Every copy
is judged at the same age, so copies used soon do not crowd those judged later out of the window; a session's
copy is judged when the turn it was made for arrives (`arrived`: used if that turn went to the copy's worker),
or at `judge_after_s` if none came. Per kind, over the last `window` outcomes within `outcome_window_s`:

    factor = (uses + prior) / (predicted uses + prior),  at most 1

where a copy's predicted use is min(1, the expected count it was planned for) and `prior` pseudo-copies are used
as predicted. That judges whether a copy is used at all; for a kind whose expected count can be many requests (a
popular prefix: `demand_kinds`) the count itself is judged too: every request that reuses the copied prefix (any
worker, `requested`) within `judge_after_s` of the decision is counted against the count the copy was planned for,

    demand factor = (requests seen + prior) / (requests predicted + prior),  at most 1

and the kind's factor is the product of the two. Without it the use factor, a probability of at least one use,
scaled a count it does not measure: live on agent sessions (stop 37) two requests on a prefix within the burst
window predicted 20 in the next 30 s, the popular prefixes' copies were used 0-4 times in 18-32 a round (use factor
0.06-0.3), and at 0.077, 20 x 0.077 = 1.5 requests still cleared the gain bar with gains of 50-95 s on paper.

The planner multiplies the kind's expected counts by the factor (`KvrepPlanner.calibration`), so a kind whose
copies go unused stops clearing the gain bar. Outcomes fade (`half_life_s`), so a stopped kind is probed again later,
more and more as its evidence ages. The factor never goes above 1: copies used more than predicted are no reason to
copy more.
What was judged outlives the planner (`learned`): a policy switch or restart of the coordinator's planner hands it
to the next one (`Coordinator._carry_learned`), so only a coordinator's start bets cold.

Only the kinds in `UseCalibrationConfig.kinds` are scaled: `session` (a session's next turn is one request, and
its copy is used or not, against a predicted probability) and `popularity` (a prefix hit often lately, predicted to
be hit again: live on agent sessions these were most of the planner's copies and 0-25% of them were used, stop 34,
where the session copies were used about as often as predicted). A fan-out hint is not: the client declared its K
branches, and a hint copy left unused is the spread's last, marginal holder, not a wrong prediction (the
simulator's fan-out, K=32 at rate 40 on 16 workers: 70% of hint copies used; a first version that scaled hints made
a quarter fewer copies there, mean TTFT 0.318 s vs 0.306 s, seed 1). Its outcomes are still counted, for `/status`.

Pure: takes events and `now`, returns numbers; no clock, no I/O.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Hashable, Optional

SESSION = "session"
"""`Demand.source` of a session's next turn: one request, so its copy is judged when that turn arrives."""


@dataclass(frozen=True)
class UseCalibrationConfig:
    judge_after_s: float = 30.0
    """A copy is judged this long after it was decided: used if a request hit it by then (the planner's horizon)."""
    kinds: tuple[str, ...] = (SESSION, "popularity")
    """The kinds of demand whose expected counts are scaled (the others' outcomes are only counted). With
    `popularity` the simulator's fan-out (K=32, rate 40, 16 workers, seeds 1-3) went from mean 0.305 +- 0.019 /
    P99 1.205 +- 0.065 s to 0.292 +- 0.032 / 1.219 +- 0.029 s, its flash crowd and agent runs unchanged (their
    popular prefixes' copies are all used there)."""
    demand_kinds: tuple[str, ...] = ("popularity",)
    """The kinds whose predicted request counts are also judged against the requests that came (the demand factor);
    a session's next turn is one request, a fan-out hint's branches are the client's word."""
    window: int = 32
    """Outcomes per kind the factor is taken over (the most recent)."""
    prior: float = 2.0
    """Pseudo-copies used as predicted (a kind starts at factor 1 and one unused copy moves it only so far)."""
    outcome_window_s: float = 3600.0
    """Outcomes older than this are forgotten."""
    half_life_s: float = 600.0
    """Given `now`, an outcome weighs 0.5 ** (its age / this): a stopped kind is probed again as its evidence fades,
    gradually, not all at once when the outcomes leave the window (with a 600 s window and no decay the benchmark's
    `active` cells, ~6 min apart, started cold every other time: 31 bets in a cell, stop 37)."""
    max_pending: int = 100_000
    """Copies awaiting their outcome, at most (the oldest are judged unused first)."""

    def __post_init__(self) -> None:
        for name in ("judge_after_s", "outcome_window_s", "prior", "half_life_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("window", "max_pending"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")


class _Outcome:
    __slots__ = ("key", "kind", "at", "predicted", "used", "demand", "seen")

    def __init__(self, key: Hashable, kind: str, at: float, predicted: float, used: bool, demand: float = 0.0,
                 seen: int = 0) -> None:
        self.key, self.kind, self.at, self.predicted, self.used = key, kind, at, predicted, used
        self.demand, self.seen = demand, seen
        """(demand kinds) the requests the copy was planned for, and those that reused its prefix in time"""


class UseCalibration:
    """Learns, per kind of demand, how often the planner's copies are used against how often it predicted."""

    def __init__(self, cfg: UseCalibrationConfig = UseCalibrationConfig()) -> None:
        self.cfg = cfg
        self._pending: "collections.OrderedDict[Hashable, list]" = collections.OrderedDict()
        """Copy key -> [kind, predicted use, when decided, used yet, prefix, target, predicted requests (demand
        kinds), requests seen], oldest first."""
        self._by_prefix: dict[Hashable, list] = {}
        """Prefix -> the keys of its pending `session` copies (`arrived`)."""
        self._demand_of: dict[Hashable, list] = {}
        """Prefix -> the keys of its pending copies of a demand kind (`requested`)."""
        self._to: dict[tuple, list] = {}
        """(prefix, target) -> the keys of the copies of that prefix to that target still pending (`betting`)."""
        self._outcomes: dict[str, collections.deque] = {}
        """Kind -> its last `window` outcomes, oldest first."""
        self._judged: dict[Hashable, _Outcome] = {}
        """Judged copies whose outcome is still in a window: a late use flips an unused one; a copy that fails
        after its judgement (judged used at its turn's arrival, still in flight) takes its outcome back."""
        self.stats = {"decided": 0, "used": 0, "unused": 0, "late_used": 0, "dropped": 0}

    def learned(self) -> "UseCalibration":
        """A fresh calibration holding what this one has judged (the outcomes in its windows), not its bets still
        pending or its counts: what a new planner takes over from the one it replaces (`Coordinator.set_policy`),
        so a policy restart does not bet cold again. The pending bets are the old planner's: it is gone, so nobody
        would report their use (and carried, every one of them would be judged unused)."""
        out = UseCalibration(self.cfg)
        for kind, q in self._outcomes.items():
            out._outcomes[kind] = collections.deque(_Outcome(o.key, o.kind, o.at, o.predicted, o.used, o.demand,
                                                             o.seen) for o in q)
        return out

    def decided(self, key: Hashable, kind: str, expected_count: float, now: float, prefix: Hashable = None,
                target: Hashable = None) -> None:
        """A copy of `prefix` to `target` was made (`key`: anything the caller finds it by later) for demand of
        `kind` that predicted `expected_count` requests."""
        self._expire(now)
        if self._take(key) is not None:  # (a key made twice: the first is dropped)
            self.stats["dropped"] += 1
        count = max(0.0, float(expected_count))
        # (a copy named without its prefix cannot see its requests: no demand outcome)
        self._pending[key] = [kind, min(1.0, count), now, False, prefix, target, count if prefix is not None else 0.0,
                              0]
        if prefix is not None:
            self._to.setdefault((prefix, target), []).append(key)
        if kind == SESSION and prefix is not None:
            self._by_prefix.setdefault(prefix, []).append(key)
        elif kind in self.cfg.demand_kinds and prefix is not None:
            self._demand_of.setdefault(prefix, []).append(key)
        self.stats["decided"] += 1
        while len(self._pending) > self.cfg.max_pending:
            old = next(iter(self._pending))
            self._record(old, self._take(old))

    def used(self, key: Hashable, now: float) -> None:
        """A request hit the copy (its first hit; later ones change nothing)."""
        entry = self._pending.get(key)
        if entry is not None:
            entry[3] = True
            return
        late = self._judged.get(key)
        if late is not None and not late.used:
            late.used = True
            self.stats["late_used"] += 1

    def requested(self, pages, num_pages: int, now: float) -> None:
        """A request arrived reusing the first `num_pages` of `pages` (held by some worker): it counts for every
        pending copy of a demand kind whose prefix is one of them (the prediction was for requests on the prefix,
        wherever they go)."""
        demand_of = self._demand_of
        if not demand_of:
            return
        pending = self._pending
        for i in range(min(num_pages, len(pages))):
            keys = demand_of.get(pages[i])
            if keys is not None:
                for key in keys:
                    pending[key][7] += 1

    def arrival(self, pages, num_pages: int, followup_worker: Hashable, now: float) -> None:
        """A request reusing the first `num_pages` of `pages` (`requested`), the next turn of the session whose
        history ends there routed to `followup_worker` (`arrived`; None: no session's next turn)."""
        self.requested(pages, num_pages, now)
        if followup_worker is not None and num_pages > 0:
            self.arrived(pages[num_pages - 1], followup_worker, now)

    def arrived(self, prefix: Hashable, worker: Hashable, now: float) -> None:
        """The next turn of the session whose history is `prefix` was routed to `worker`: that session's copies
        are judged now, used where they went to `worker` (the turn a `session` copy was made for has come)."""
        for key in self._by_prefix.get(prefix, ())[:]:
            entry = self._take(key)
            entry[3] = entry[3] or entry[5] == worker
            self._record(key, entry)

    def dropped(self, key: Hashable) -> None:
        """The copy never landed (it failed, was refused or cancelled): no outcome (one already judged is taken
        back)."""
        if self._take(key) is not None:
            self.stats["dropped"] += 1
            return
        out = self._judged.pop(key, None)
        if out is not None:
            self._outcomes[out.kind].remove(out)
            self.stats["dropped"] += 1
            self.stats["used" if out.used else "unused"] -= 1

    def tick(self, now: float) -> None:
        """Judges the copies decided `judge_after_s` ago or more; forgets outcomes older than the window."""
        self._expire(now)

    def betting(self, prefix: Hashable, target: Hashable) -> bool:
        """Whether a copy of `prefix` to `target` is still a bet: decided less than `judge_after_s` ago and not used
        yet. The planner makes no second one meanwhile: the first one's pages, gone from the target before any
        request came (evicted under memory pressure), are no evidence that a second copy would be used (live, the
        demo's agent sessions: one 384-token prefix copied to one worker five times in 19 s, each landing whole,
        none used)."""
        keys = self._to.get((prefix, target))
        return bool(keys) and any(not self._pending[k][3] for k in keys)

    def bets(self) -> dict[Hashable, set]:
        """Prefix -> the targets a copy of it to is still a bet (`betting`), every pair at once: what one planning
        pass leaves out, per prefix, of the targets it scores."""
        out: dict[Hashable, set] = {}
        pending = self._pending
        for (prefix, target), keys in self._to.items():
            if any(not pending[k][3] for k in keys):
                out.setdefault(prefix, set()).add(target)
        return out

    def _take(self, key: Hashable) -> Optional[list]:
        entry = self._pending.pop(key, None)
        if entry is not None and entry[4] is not None:
            pair = (entry[4], entry[5])
            keys = self._to.get(pair)
            if keys is not None and key in keys:
                keys.remove(key)
                if not keys:
                    del self._to[pair]
            by = self._by_prefix if entry[0] == SESSION else self._demand_of
            keys = by.get(entry[4])
            if keys is not None and key in keys:
                keys.remove(key)
                if not keys:
                    del by[entry[4]]
        return entry

    def _expire(self, now: float) -> None:
        pending, cutoff = self._pending, now - self.cfg.judge_after_s
        while pending:
            key, entry = next(iter(pending.items()))
            if entry[2] > cutoff:
                break
            self._take(key)
            self._record(key, entry)
        horizon = now - self.cfg.outcome_window_s
        for q in self._outcomes.values():
            while q and q[0].at < horizon:
                self._forget(q.popleft())

    def _record(self, key: Hashable, entry: list) -> None:
        kind, used = entry[0], entry[3]
        q = self._outcomes.get(kind)
        if q is None:
            q = self._outcomes[kind] = collections.deque()
        demand = kind in self.cfg.demand_kinds
        out = _Outcome(key, kind, entry[2], entry[1], used, entry[6] if demand else 0.0, entry[7] if demand else 0)
        q.append(out)
        if len(q) > self.cfg.window:
            self._forget(q.popleft())
        self._judged[key] = out
        self.stats["used" if used else "unused"] += 1

    def _forget(self, out: _Outcome) -> None:
        if self._judged.get(out.key) is out:  # (a judged copy's entry goes with its outcome)
            del self._judged[out.key]

    def factor(self, kind: str, now: Optional[float] = None) -> float:
        """(uses + prior) / (predicted uses + prior) over the kind's window, at most 1, times, for a demand kind,
        (requests seen + prior) / (requests predicted + prior), at most 1 (1 with no evidence, or for a kind not
        in `cfg.kinds`).

        `now`: every outcome weighs 0.5 ** (age / `half_life_s`) (without it, 1), and the demand factor also takes
        the copies still pending, each with the requests seen so far against
        the part of its prediction due by `now` (the prediction is a rate over the horizon: `elapsed /
        judge_after_s` of it), so a burst of bets on a wrong count is corrected within seconds, not after the
        first judgement (live, stop 37: 77 popular-prefix copies in a cell's first 30 s, 2 requests seen of 309
        predicted)."""
        if kind not in self.cfg.kinds:
            return 1.0
        q = self._outcomes.get(kind, ())
        prior = self.cfg.prior
        if now is None:
            weights = [1.0] * len(q)
        else:
            half = self.cfg.half_life_s
            weights = [0.5 ** (max(0.0, now - o.at) / half) for o in q]
        use = 1.0
        if q:
            used = sum(w for w, o in zip(weights, q) if o.used)
            use = min(1.0, (used + prior) / (sum(w * o.predicted for w, o in zip(weights, q)) + prior))
        if kind not in self.cfg.demand_kinds:
            return use
        seen = sum(w * o.seen for w, o in zip(weights, q))
        demand = sum(w * o.demand for w, o in zip(weights, q))
        if now is not None and self._demand_of:
            span, pending = self.cfg.judge_after_s, self._pending
            for keys in self._demand_of.values():
                for key in keys:
                    e = pending[key]
                    if e[0] == kind:
                        seen += e[7]
                        demand += e[6] * min(1.0, max(0.0, now - e[2]) / span)
        return use * min(1.0, (seen + prior) / (demand + prior))

    def factors(self, now: Optional[float] = None) -> dict[str, float]:
        """Every scaled kind with outcomes (or, given `now`, a pending copy of a demand kind), and its factor."""
        kinds = set(self._outcomes)
        if now is not None:
            kinds.update(self._pending[keys[0]][0] for keys in self._demand_of.values() if keys)
        return {kind: self.factor(kind, now) for kind in kinds if kind in self.cfg.kinds}

    def status(self) -> dict:
        kinds = {}
        for kind, q in self._outcomes.items():
            kinds[kind] = {"outcomes": len(q), "used": sum(o.used for o in q),
                           "predicted": round(sum(o.predicted for o in q), 2), "factor": round(self.factor(kind), 4),
                           "scaled": kind in self.cfg.kinds}
            if kind in self.cfg.demand_kinds:
                kinds[kind]["requests_predicted"] = round(sum(o.demand for o in q), 2)
                kinds[kind]["requests_seen"] = sum(o.seen for o in q)
        return {**self.stats, "pending": len(self._pending),
                "pending_used": sum(1 for e in self._pending.values() if e[3]), "kinds": kinds}
