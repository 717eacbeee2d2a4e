"""The predictive replication planner: which prefix to copy where, how deep and for how long.

For a candidate (prefix p, target w, depth d) at `now` on a snapshot:

    gain = E[requests extending p within the horizon] x [TTFT_without(p) - TTFT_with_replica(p, w, d)]
           - copy_cost(bytes, link load) - memory_cost(w, bytes) - delay imposed on the pulls behind it

The gate (`radix_sync.policy.gate`, issue 16's "never worse"): a copy starts when both links are free of what is
booked, what is decided and not booked yet, and what this pass planned (and not at all if that is more than
`max_link_backlog_s` ahead); it pays the delay it imposes on the critical-path pulls that want those links
meanwhile; it may not land where it would evict a page that is wanted (requests routed there wait for it, or the
planner predicts demand for that replica, or for an ordinary prefix held there, which a copy taking ordinary pages
in LRU order may reach), after the copies still coming in and the queued prompts have taken their memory. When no
copy clears `min_gain_s` net of all that, nothing is copied.

TTFT_without is the best of waiting at a holder, copying on the critical path (if the router may pull) and
recomputing elsewhere, with queue waits taken from a per-worker forecast at the predicted arrival time (the
current backlog draining, plus the predicted work of other prefixes). Several expected requests (a fan-out hint,
a hot prefix) are spread over the holders, each one waiting behind the previous. Candidates are taken greedily by
gain per byte under per-link backlog and per-worker replica budgets; after each accepted copy the prefix's
candidates are re-scored (the marginal gain of one more holder). Copies are chained: every holder is a source,
including one whose copy (or the prefill of the prefix itself) is still in flight, from its arrival on, so a
fan-out spreads as a broadcast tree instead of queueing on the first holder's link:

    t=0      holder 0 ──▶ 1
    t=x      0 ──▶ 2     1 ──▶ 3                 (x: one copy's time; k rounds reach 2^k holders)
    t=2x     0 ──▶ 4     1 ──▶ 5    2 ──▶ 6    3 ──▶ 7

Depth is chosen among a few page-aligned fractions by net gain; the TTL covers the predicted reuse window.

Pure: `plan(snapshot, now)` reads nothing else than the snapshot, `now` and the learned gap models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Optional

from radix_sync.policy.calibration import UseCalibration
from radix_sync.policy.cost import CostModel
from radix_sync.policy.forecast import WaitForecast
from radix_sync.policy.gate import link_free_s
from radix_sync.policy.predictor import Demand, DemandPredictor
from radix_sync.policy.snapshot import REPLICA, ClusterSnapshot, PrefixView, Replicate, WorkerView
from radix_sync.policy.scoring import (CostMemo, LandingRoom, PassTargets, best_candidate, source_iteration_bound_s,
                                      source_iteration_s)
from radix_sync.policy.spread import num_spread, spread_s


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the planner; defaults are what `kvrep` runs with."""

    horizon_s: float = 30.0
    """Prediction window, s."""
    min_gain_s: float = 0.05
    """A copy must save at least this much expected TTFT (s) net of costs."""
    default_new_len: int = 1024
    """Tokens a follow-up adds when the snapshot does not say."""
    depth_fractions: tuple[float, ...] = (1.0, 0.5)
    """Candidate depths, as fractions of the prefix (page-aligned)."""
    link_cost_weight: float = 0.05
    """Seconds of TTFT charged per second of link time a copy occupies (copies are off the critical path)."""
    displaced_reuse_prob: float = 0.3
    """Probability that a cache entry the replica displaces would have been reused (memory cost)."""
    max_link_backlog_s: float = 0.5
    """Skip sources/targets whose link is booked (or promised to copies decided, not booked yet) further than this
    ahead, s: a speculative copy must not queue critical-path pulls behind much more than this (2.0 before issue
    16's gate: fan-out K=32 rate 40, 12 GB/s, 3 seeds, kvrep P99 1.244 +- 0.496 at 2.0 s, 1.132 +- 0.148 at 0.5 s;
    kvrep_pull 1.143)."""
    host_copies: bool = True
    """Where the targets have a host-memory tier (`KvrepPlanner.host_load_bytes_per_s`), also consider copies into
    it (False: device copies only, the ablation)."""
    max_copies_per_tick: int = 16
    """Most copies one planning pass may issue."""
    max_spread: int = 32
    """Most requests of one prefix modelled individually when spreading them over holders."""
    max_scored_per_tick: int = 0
    """Most (prefix, target worker) pairs one pass scores (each prefix that gets past the cheap bounds costs one
    pair per worker, per copy it makes); the prefixes left over are not planned this pass (`KvrepPlanner.deferred`,
    outcome `deferred`) and come first in the next one (`ClusterSnapshot.carried`). At least one prefix is always
    scored. 0: no bound (the simulator's default; the live coordinator sets one, so that a tick, which holds its
    lock, stays short however many prefixes are hot)."""
    urgent_s: float = 2.0
    """Prefixes due within this many s are scored first, before those a spent scoring budget carried over."""
    min_ttl_s: float = 5.0
    """Shortest replica TTL, s."""
    max_ttl_s: float = 600.0
    """Longest replica TTL, s."""
    ttl_quantile: float = 0.9
    """TTL covers the predicted arrival up to this quantile of the gap distribution."""
    hint_ttl_s: float = 15.0
    """TTL after the hinted arrival time, s (a hint's time is an estimate; a hit promotes the replica anyway)."""
    allow_pull: bool = True
    """Whether the router may copy on the critical path (then a pre-copy saves only the copy's wait)."""
    endpoint_wait: bool = False
    """Whether a copy also waits for its source's and its target's iteration in progress (`busy_until_s`): a live
    agent gathers and installs between scheduler iterations, which on a CPU worker last up to seconds. Off by
    default in the simulator, whose executor then moves pages without the schedulers; `EngineConfig.endpoint_wait`
    makes its executor wait too (`kvrep bench --simulate`, which mirrors the live testbed, sets both)."""
    chain_sources: bool = False
    """Whether a holder whose pages are still in flight (a copy to it, its own prefill, or a copy planned in the
    same pass) may be a `Replicate.source`. Only for an executor that defers such a copy until the source holds
    the pages (the simulator does); off, every source holds the pages when the command is issued."""
    demote_idle_p: float = 0.0
    """Demote a finished response's cached history (evict-first everywhere it is held) once the predictor's
    probability that its session's next turn arrives within `demote_horizon_s` (`GapModel.p_within`, given the
    silence so far) falls below this; 0 turns it off."""
    demote_horizon_s: float = 1e9
    """See `demote_idle_p` (the default: whether the session continues at all, `GapModel.p_alive`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.demote_idle_p < 1:
            raise ValueError(f"demote_idle_p={self.demote_idle_p!r} must be in [0, 1)")
        for name in ("horizon_s", "min_ttl_s", "max_ttl_s", "max_link_backlog_s", "hint_ttl_s", "demote_horizon_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.min_ttl_s > self.max_ttl_s:
            raise ValueError(f"min_ttl_s={self.min_ttl_s!r} > max_ttl_s={self.max_ttl_s!r}")
        if self.min_gain_s < 0 or self.link_cost_weight < 0 or self.default_new_len < 0:
            raise ValueError(f"min_gain_s={self.min_gain_s!r}, link_cost_weight={self.link_cost_weight!r}, "
                             f"default_new_len={self.default_new_len!r} must be >= 0")
        if not self.depth_fractions or any(not 0 < f <= 1 for f in self.depth_fractions):
            raise ValueError(f"depth_fractions={self.depth_fractions!r} must be non-empty, each in (0, 1]")
        if not 0 <= self.displaced_reuse_prob <= 1 or not 0 < self.ttl_quantile < 1:
            raise ValueError(f"displaced_reuse_prob={self.displaced_reuse_prob!r} must be in [0, 1], "
                             f"ttl_quantile={self.ttl_quantile!r} in (0, 1)")
        if self.max_scored_per_tick < 0:
            raise ValueError(f"max_scored_per_tick={self.max_scored_per_tick!r} must be >= 0 (0: no bound)")
        if self.max_copies_per_tick < 1 or self.max_spread < 1:
            raise ValueError(f"max_copies_per_tick={self.max_copies_per_tick!r}, max_spread={self.max_spread!r}"
                             " must be >= 1")


@dataclass
class _NodePlan:
    node: PrefixView
    demand: Demand
    new_len: int
    depth: dict[int, int]  # worker -> tokens held (landed or in flight)
    eta: dict[int, float]  # worker -> when its copy lands (absent: landed)
    source: int  # the deepest holder that is ready first (for pull estimates)
    wanted: list = ()  # its landed holdings, (worker, replica?, tokens): predicted demand wants them there
    predicted: float = 0.0  # the expected count before calibration (`demand`'s is scaled)


def verdict(outcome: str) -> str:
    """An outcome (`KvrepPlanner.outcomes`) without its numbers: "copied", "no target", or its reason."""
    if outcome[:1].isdigit():
        return "no target" if outcome.startswith("0 ") else "copied"
    return outcome.split(" (", 1)[0]


class KvrepPlanner:
    """Scores replication candidates and returns the copies to make this tick."""

    def __init__(self, cost: CostModel, predictor: Optional[DemandPredictor] = None,
                 cfg: PlannerConfig = PlannerConfig(), calibration: Optional[UseCalibration] = None) -> None:
        self.cost = cost
        self.predictor = predictor or DemandPredictor()
        self.cfg = cfg
        self.calibration = calibration
        """How often each kind of demand's copies were used against predicted (`radix_sync.policy.calibration`):
        a kind's expected counts are scaled by its factor. The caller feeds it the copies' outcomes; None: not
        scaled."""
        self._page_len = 1
        self.host_load_bytes_per_s = 0.0
        """Load-back rate of the targets' host-memory tiers, bytes/s: > 0 scores copies into them too (`tier`
        `host`; set by the simulator's engine when its workers have one); 0: device copies only (live)."""
        self.outcomes: dict[int, str] = {}
        """Node id -> what the last `plan` made of it (copies, or why none): for operators, not for decisions."""
        self.deferred: dict[int, int] = {}
        """Node ids the last `plan` did not score, its `max_scored_per_tick` spent, each with the passes in a row it
        has waited, this one included (the caller carries them over: `ClusterSnapshot.carried`)."""
        self.num_scored = 0
        """(prefix, target) pairs the last `plan` scored."""
        self.session_verdicts: dict[str, int] = {}
        """Open sessions' nodes (candidates with a last finish) by what each pass made of them (`verdict`), summed
        over passes: for operators and for comparing the live planner with the simulated one."""
        self._kept: dict[int, tuple] = {}
        """Node id -> what the last pass took from its view alone (`_node_plans`)."""
        self._kept_scope: tuple = ()
        self._wanted_last: tuple = ((), {}, ([], []))
        """(scope, wanted holdings by node id, the sums) of the last pass (`_wanted`)."""
        self._targets: Optional[PassTargets] = None
        """What the pass's scoring reads of each target (`radix_sync.policy.scoring`)."""
        self._bets: dict[Hashable, set[int]] = {}
        """Prefix -> the targets (indices) a copy of it to is still a bet, this pass (`UseCalibration.bets`)."""

    # ---- expected TTFT of the demand of one node, given its holders ----
    def _option_s(self, np_: _NodePlan, w: int, fc: WaitForecast, workers: tuple[WorkerView, ...],
                  kv_bytes: int, wait: Optional[float] = None, costs: Optional[CostMemo] = None
                  ) -> tuple[float, float]:
        """Returns (TTFT of the first request at `w`, service time of each further one). `wait`: `w`'s wait at the
        arrival, when the caller has it; `costs`: the pass's memo of cost-model answers."""
        L, n, t_a = np_.node.token_len, np_.new_len, np_.demand.arrival_s
        if wait is None:
            wait = fc.wait_at(w, t_a)
        prefill_s = costs.prefill_s if costs is not None else self.cost.prefill_s
        held = np_.depth.get(w, 0)
        if held > 0:
            ready = np_.eta.get(w, fc.now)
            svc = prefill_s(n + L - held, held)
            return max(wait, ready - t_a) + svc, svc
        full = prefill_s(n + L, 0)
        best = wait + full
        svc = prefill_s(n, L)
        src = workers[np_.source]
        if self.cfg.allow_pull and workers[w].nic_bandwidth_bytes_per_s > 0 and src.nic_bandwidth_bytes_per_s > 0:
            bw = min(src.nic_bandwidth_bytes_per_s, workers[w].nic_bandwidth_bytes_per_s)
            pull = (costs.transfer_s if costs is not None else self.cost.transfer_s)(L * kv_bytes, bw)
            if self.cfg.endpoint_wait:  # (the source's wait is read only when it counts)
                pull += source_iteration_s(self.cfg, self.cost, fc.wait_at(np_.source, t_a))
            best = min(best, max(wait, pull) + svc)
        return best, full

    def _spread_s(self, opts: list[tuple[float, float]], count: float) -> float:
        """Mean TTFT of `count` requests spread greedily over per-worker options (first TTFT, service time):
        each further request on a worker waits for the previous one's prefill (`radix_sync.policy.spread`)."""
        return spread_s(opts, num_spread(count, self.cfg.max_spread))

    def expected_ttft_s(self, np_: _NodePlan, fc: WaitForecast, workers: tuple[WorkerView, ...],
                        kv_bytes: int) -> float:
        """Mean TTFT of the node's expected requests given its current holders."""
        opts = [self._option_s(np_, w, fc, workers, kv_bytes) for w in range(len(workers))]
        return self._spread_s(opts, np_.demand.expected_count)

    # ---- planning ----
    def _node_plans(self, snap: ClusterSnapshot, now: float, fc: WaitForecast) -> tuple[list[tuple], list[tuple],
                                                                                        list[int], list[int]]:
        """The prefixes with predicted demand and a holder to copy from, as (view, demand, depths, arrivals,
        source, new tokens, wanted holdings, its own predicted work (primary holder, arrival, seconds), passes it
        has waited), each one's own work added to `fc`; their order keys (`plan`); and the tokens per worker of
        replicas and of ordinary prefixes that predicted demand wants there.

        NOTE: what a prefix's plan takes from its view alone (depths, arrivals, the source when it does not depend
        on `now`, what it holds that is wanted) is kept from the last pass while the snapshot carries the same view
        object (views are frozen: the live coordinator hands the same object again while nothing it was built
        from changed); the prediction and the primary holder, which depend on `now` and the loads, are made
        again. A `_NodePlan` is made only for a prefix the pass scores."""
        cfg = self.cfg
        chain, horizon, n = cfg.chain_sources, cfg.horizon_s, len(snap.workers)
        scope = (chain, cfg.default_new_len, n)
        kept = self._kept if scope == self._kept_scope else {}
        keep: dict[int, tuple] = {}
        outcomes = self.outcomes
        plans, keys = [], []
        carried = snap.carried
        urgent_by = now + cfg.urgent_s
        wanting: dict[int, list] = {}
        base_s, owns = fc.base_s, []
        prefill: dict[tuple[int, int], float] = {}  # (the cost model's answers, memoised for the pass)
        nodes = [node for node in snap.prefixes if node.token_len > 0 and node.holders]
        for node, demand in zip(nodes, self.predictor.predict_all(nodes, now, horizon)):
            count = demand.expected_count
            node_id = node.node_id
            if count <= 0.0:
                outcomes[node_id] = "no demand predicted"
                continue
            entry = kept.get(node_id)
            if entry is None or entry[0] is not node:
                entry = self._node_entry(node, n)
            keep[node_id] = entry
            _, depth, eta, source, held, new_len, prefill_key, w, others = entry
            if source is None:
                if not depth or (not chain and len(eta) == len(depth)):
                    outcomes[node_id] = "no holder has the pages yet"
                    continue
                source = min(depth, key=lambda w: (w in eta and not chain, -depth[w], eta.get(w, now), w))
            # Predicted work of every node lands on its best current option (its primary holder): the holder with
            # the least wait, the lowest index among equals.
            if others:
                wait = base_s[w]
                for i in others:
                    if base_s[i] < wait or (base_s[i] == wait and i < w):
                        w, wait = i, base_s[i]
            one = prefill.get(prefill_key)
            if one is None:
                one = prefill[prefill_key] = self.cost.prefill_s(*prefill_key)
            arrival = demand.arrival_s
            own = (w, arrival, count * one)
            owns.append(own)
            wanting[node_id] = held
            waited = carried.get(node_id, 0)
            plans.append((node, demand, depth, eta, source, new_len, held, own, waited))
            # NOTE: due within `urgent_s` first, soonest first; then the longest carried over (no budget earlier)
            keys.append((0, arrival, 0, node_id) if arrival <= urgent_by else (1, -waited, arrival, node_id))
        fc.add_all(owns)  # (in this order: a worker's arrivals at one time are served in the order added)
        wanted, wanted_ordinary = self._wanted(scope, wanting, plans)
        self._kept, self._kept_scope = keep, scope
        return plans, keys, wanted, wanted_ordinary

    def _wanted(self, scope: tuple, wanting: dict[int, list], plans: list[tuple]) -> tuple[list[int], list[int]]:
        """Per worker, the replica and the ordinary tokens there that the plans' predicted demand wants (the sums
        of their wanted holdings, `wanting`, by node id): the last pass's sums, less the holdings of the plans
        that are gone or changed, plus those of the new or changed ones (integers: the same sums), or summed
        afresh (another scope, a node id twice). Returns copies (the pass adds to them)."""
        last_scope, last, sums = self._wanted_last
        if len(wanting) != len(plans):  # (a node id twice: each plan's holdings)
            sums = ([0] * scope[2], [0] * scope[2])
            for plan in plans:
                for i, replica, tokens in plan[6]:
                    sums[not replica][i] += tokens
            self._wanted_last = ((), {}, sums)
            return list(sums[0]), list(sums[1])
        if scope == last_scope and wanting == last:  # (the same holdings wanted: C compares them, mostly by identity)
            self._wanted_last = (scope, wanting, sums)
            return list(sums[0]), list(sums[1])
        if scope != last_scope:
            sums = ([0] * scope[2], [0] * scope[2])
            last = {}
        else:
            sums = (list(sums[0]), list(sums[1]))
        for node_id, held in last.items():
            if wanting.get(node_id) is not held:
                for i, replica, tokens in held:
                    sums[not replica][i] -= tokens
        for node_id, held in wanting.items():
            if last.get(node_id) is not held:
                for i, replica, tokens in held:
                    sums[not replica][i] += tokens
        self._wanted_last = (scope, wanting, sums)
        return list(sums[0]), list(sums[1])

    def _node_entry(self, node: PrefixView, num_workers: int) -> tuple:
        """(the view, its holders' depths and arrivals, the source if it does not depend on `now` else None, its
        landed holdings that predicted demand wants there as (worker, replica?, tokens), the tokens a request adds
        to it, the prefill its predicted work is made of, its first holder and the others) (see `_node_plans`; the
        depths and arrivals are shared: a plan copies them before it adds to them)."""
        depth: dict[int, int] = {}
        eta: dict[int, float] = {}
        for h in node.holders:
            if h.depth_len > depth.get(h.worker_id, 0):
                depth[h.worker_id] = h.depth_len
                if h.eta_s is not None:
                    eta[h.worker_id] = h.eta_s
                else:
                    eta.pop(h.worker_id, None)
        source = None
        if depth and not self.cfg.chain_sources and len(eta) < len(depth):
            # (without chained sources, a holder with pages in flight is never the source: the order among the
            # others does not depend on `now`)
            # (`min` by (in flight, -depth, `now`, worker), without a call per holder: the deepest landed holder,
            # the lowest index among equals)
            best = -1
            for w, d in depth.items():
                if w not in eta and (d > best or (d == best and w < source)):
                    source, best = w, d
        wanted = [(h.worker_id, h.role == REPLICA, h.depth_len) for h in node.holders
                  if h.eta_s is None and 0 <= h.worker_id < num_workers]
        new_len = node.expected_new_len or self.cfg.default_new_len
        holding = tuple(depth) or (-1,)  # (no holder: the plan stops at `source` first)
        return node, depth, eta, source, wanted, new_len, (new_len, node.token_len), holding[0], holding[1:]

    def _ttl_s(self, np_: _NodePlan, land_s: float, now: float) -> float:
        d, node = np_.demand, np_.node
        if d.source == "session" and node.last_finish_s is not None:
            m = self.predictor.gap_model(node.class_key, node.last_stop)
            f0 = m.cdf(max(0.0, now - node.last_finish_s))
            q = f0 + self.cfg.ttl_quantile * (1.0 - f0)
            until = node.last_finish_s + m.quantile(min(q, 0.999))
        else:
            until = max(d.arrival_s, now) + (self.cfg.hint_ttl_s if d.source == "hint" else self.cfg.horizon_s)
        return min(self.cfg.max_ttl_s, max(self.cfg.min_ttl_s, until - land_s))

    def plan(self, snap: ClusterSnapshot, now: float) -> list[Replicate]:
        """Chooses this tick's copies.

        Args:
            snap: the cluster snapshot (workers indexed by id).
            now: current time, s.
        Returns:
            the copies to make, best first.
        """
        cfg, workers, kvb = self.cfg, snap.workers, snap.kv_bytes_per_token
        self.outcomes = {}
        self.deferred, self.num_scored = {}, 0
        if kvb <= 0 or len(workers) < 2:
            return []
        self._page_len = max(1, snap.page_len)
        fc = WaitForecast(self.cost, workers, now)
        plans, keys, wanted, wanted_ordinary = self._node_plans(snap, now, fc)
        # the gate (`radix_sync.policy.gate`): links free after what is booked and what is decided but not booked;
        # landing room that evicts no wanted page (requests routed there wait for it, or predicted demand for a
        # replica or for an ordinary prefix held there)
        egress = [link_free_s(w.egress_busy_until_s, w.egress_pending_bytes, w.nic_bandwidth_bytes_per_s, now)
                  for w in workers]
        ingress = [link_free_s(w.ingress_busy_until_s, w.ingress_pending_bytes, w.nic_bandwidth_bytes_per_s, now)
                   for w in workers]
        budget = [w.replica_budget_tokens for w in workers]
        free = [w.free_tokens for w in workers]
        room = LandingRoom(workers, wanted, wanted_ordinary)
        self._targets = PassTargets(workers, ingress, budget, free, room)
        out: list[Replicate] = []
        deferred: dict[int, int] = {}
        order = sorted(range(len(plans)), key=keys.__getitem__)
        budget_spent = False
        factors = self.calibration.factors(now) if self.calibration is not None else {}
        # one bet per prefix and target until it is judged (`UseCalibration.betting`): left out of the targets
        # `best_candidate` scores for that prefix, so the pass's copy goes where it may instead
        self._bets = {}
        if self.calibration is not None:
            bets = self.calibration.bets()
            if bets:
                index = {k: i for i, k in enumerate(snap.worker_keys or range(len(workers)))}
                self._bets = {p: {index[k] for k in ks if k in index} for p, ks in bets.items()}
        for n, j in enumerate(order):
            if len(out) >= cfg.max_copies_per_tick:
                break
            if cfg.max_scored_per_tick and self.num_scored and self.num_scored >= cfg.max_scored_per_tick:
                # (and so for every one left: the count only grows, the copies stay as many)
                budget_spent = True
                break
            node, demand, depth, eta, source, new_len, held, own, _ = plans[j]
            # (the plan adds to its depths and arrivals: its own copies, not those `_node_plans` keeps)
            predicted, f = demand.expected_count, factors.get(demand.source, 1.0)
            if f < 1.0:  # (the kind's copies were used less often than predicted)
                demand = demand._replace(expected_count=predicted * f)
            np_ = _NodePlan(node, demand, new_len, dict(depth), dict(eta), source, held, predicted)
            # A node's own predicted work must not count against itself.
            fc.remove_work(*own)
            try:
                self._plan_node(np_, fc, workers, kvb, egress, ingress, budget, free, room, now, out)
            finally:
                fc.add_work(*own)
        if budget_spent:
            left = [plans[j] for j in order[n:]]
            deferred = {p[0].node_id: p[8] + 1 for p in left}
            self.outcomes.update(dict.fromkeys(deferred, "deferred (the pass's scoring budget is spent)"))
        self.deferred = deferred
        tally = self.session_verdicts
        for node in snap.prefixes:
            if node.last_finish_s is not None:
                why = verdict(self.outcomes.get(node.node_id, "not planned"))
                tally[why] = tally.get(why, 0) + 1
        return out

    def _plan_node(self, np_: _NodePlan, fc: WaitForecast, workers: tuple[WorkerView, ...], kvb: int,
                   egress: list[float], ingress: list[float], budget: list[int], free: list[int], room: LandingRoom,
                   now: float, out: list[Replicate]) -> None:
        """Adds copies of one node while the marginal gain of one more holder clears the bar."""
        cfg = self.cfg
        count = np_.demand.expected_count
        if cfg.allow_pull:
            # With copies on the critical path available, a pre-copy saves at most the copy's time per request, and
            # with endpoint waits what the copy waits for at its source (`source_iteration_s`: one chunk at most).
            src = workers[np_.source]
            pull = (self.cost.transfer_s(np_.node.token_len * kvb, src.nic_bandwidth_bytes_per_s)
                    + source_iteration_bound_s(cfg, self.cost))
            if count * pull < cfg.min_gain_s:
                self.outcomes[np_.node.node_id] = "a copy on the request's path is as good"
                return
        # Cheap bound: even an idle target cannot save more than the holder's wait per request, plus, for several
        # requests, the time they would queue behind each other at the holder (k(k-1)/2 hit prefills).
        # Both waits at the request's arrival: the least wait *now* is larger than at arrival by up to the lead time,
        # and a bound taken with it refused copies that pay (tests/unit/test_policy_gate.py, a target 19.5 s busy).
        # (the forecast does not change while this node is planned: every worker's wait is taken once)
        waits = fc.waits_at(np_.demand.arrival_s)
        holder_wait = min(waits[w] for w in np_.depth)
        min_wait = min(waits)
        k = max(1, min(cfg.max_spread, math.ceil(count - 1e-9)))
        self_queue = self.cost.prefill_s(np_.new_len, np_.node.token_len) * k * (k - 1) / 2.0
        if (holder_wait - min_wait) * count + self_queue < cfg.min_gain_s:
            self.outcomes[np_.node.node_id] = f"holders not busy enough (wait {holder_wait:.2f} s, {count:.1f} requests)"
            return
        made = 0
        why: dict[str, int] = {}
        while len(out) < cfg.max_copies_per_tick:
            self.num_scored += len(workers)
            best = best_candidate(cfg, self.cost, self._page_len, self._targets, np_, fc, workers, kvb, egress,
                                  ingress, budget, free, room, now, why, waits,
                                  kvb / self.host_load_bytes_per_s if self.host_load_bytes_per_s and cfg.host_copies
                                  else 0.0, self._bets.get(np_.node.node_id))
            if best is None:
                break
            made += 1
            gain, target, depth, src, land, tier = best
            egress[src] = ingress[target] = land
            if not tier:  # (a copy into host memory takes none of the device's budget, memory or room)
                budget[target] -= depth - np_.depth.get(target, 0)
                free[target] = max(0, free[target] - (depth - np_.depth.get(target, 0)))
                room.add(target, depth - np_.depth.get(target, 0))
            self._targets.changed(target)
            np_.depth[target] = depth
            np_.eta[target] = land
            out.append(Replicate(np_.node.node_id, src, target, depth, self._ttl_s(np_, land, now), gain,
                                 np_.demand.source, np_.predicted, "host" if tier else "device"))
        self.outcomes[np_.node.node_id] = (f"{made} cop{'y' if made == 1 else 'ies'}; then no target: "
                                           + (", ".join(f"{k} x{v}" for k, v in sorted(why.items()))
                                              or "every compatible worker holds it or has it coming"))
