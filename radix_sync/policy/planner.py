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
from typing import Optional

from radix_sync.policy.cost import CostModel
from radix_sync.policy.forecast import WaitForecast
from radix_sync.policy.gate import landing_room_tokens, link_free_s, pull_delay_s
from radix_sync.policy.predictor import Demand, DemandPredictor
from radix_sync.policy.snapshot import REPLICA, ClusterSnapshot, PrefixView, Replicate, WorkerView
from radix_sync.policy.spread import Spread, num_spread, spread_s


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
    agent gathers and installs between scheduler iterations, which on a CPU worker last seconds. Off in the
    simulator, whose executor moves pages without the schedulers (GPU iterations are milliseconds)."""
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


class KvrepPlanner:
    """Scores replication candidates and returns the copies to make this tick."""

    def __init__(self, cost: CostModel, predictor: Optional[DemandPredictor] = None,
                 cfg: PlannerConfig = PlannerConfig()) -> None:
        self.cost = cost
        self.predictor = predictor or DemandPredictor()
        self.cfg = cfg
        self._page_len = 1
        self.outcomes: dict[int, str] = {}
        """Node id -> what the last `plan` made of it (copies, or why none): for operators, not for decisions."""
        self.deferred: dict[int, int] = {}
        """Node ids the last `plan` did not score, its `max_scored_per_tick` spent, each with the passes in a row it
        has waited, this one included (the caller carries them over: `ClusterSnapshot.carried`)."""
        self.num_scored = 0
        """(prefix, target) pairs the last `plan` scored."""

    # ---- expected TTFT of the demand of one node, given its holders ----
    def _option_s(self, np_: _NodePlan, w: int, fc: WaitForecast, workers: tuple[WorkerView, ...],
                  kv_bytes: int, wait: Optional[float] = None, costs: Optional["_Costs"] = None
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
    def _node_plans(self, snap: ClusterSnapshot, now: float) -> list[_NodePlan]:
        plans = []
        for node in snap.prefixes:
            if node.token_len <= 0 or not node.holders:
                continue
            demand = self.predictor.predict(node, now, self.cfg.horizon_s)
            if demand.expected_count <= 0.0:
                self.outcomes[node.node_id] = "no demand predicted"
                continue
            depth, eta = {}, {}
            for h in node.holders:
                if h.depth_len > depth.get(h.worker_id, 0):
                    depth[h.worker_id] = h.depth_len
                    if h.eta_s is not None:
                        eta[h.worker_id] = h.eta_s
                    else:
                        eta.pop(h.worker_id, None)
            if not depth or (not self.cfg.chain_sources and len(eta) == len(depth)):
                self.outcomes[node.node_id] = "no holder has the pages yet"
                continue
            source = min(depth, key=lambda w: (w in eta and not self.cfg.chain_sources, -depth[w], eta.get(w, now), w))
            new_len = node.expected_new_len or self.cfg.default_new_len
            plans.append(_NodePlan(node, demand, new_len, depth, eta, source))
        return plans

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
        plans = self._node_plans(snap, now)
        # Predicted work of every node lands on its best current option (its primary holder).
        own: dict[int, tuple[int, float, float]] = {}
        for np_ in plans:
            w = min(np_.depth, key=lambda i: (fc.base_s[i], i))
            work = np_.demand.expected_count * self.cost.prefill_s(np_.new_len, np_.node.token_len)
            fc.add_work(w, np_.demand.arrival_s, work)
            own[id(np_)] = (w, np_.demand.arrival_s, work)
        # the gate (`radix_sync.policy.gate`): links free after what is booked and what is decided but not booked;
        # landing room that evicts no wanted page (requests routed there wait for it, or predicted demand for a
        # replica or for an ordinary prefix held there)
        egress = [link_free_s(w.egress_busy_until_s, w.egress_pending_bytes, w.nic_bandwidth_bytes_per_s, now)
                  for w in workers]
        ingress = [link_free_s(w.ingress_busy_until_s, w.ingress_pending_bytes, w.nic_bandwidth_bytes_per_s, now)
                   for w in workers]
        budget = [w.replica_budget_tokens for w in workers]
        free = [w.free_tokens for w in workers]
        wanted = [0] * len(workers)
        wanted_ordinary = [0] * len(workers)
        for np_ in plans:
            for h in np_.node.holders:
                if h.eta_s is None and 0 <= h.worker_id < len(workers):
                    if h.role == REPLICA:
                        wanted[h.worker_id] += h.depth_len
                    else:
                        wanted_ordinary[h.worker_id] += h.depth_len
        room = _Room(workers, wanted, wanted_ordinary)
        out: list[Replicate] = []
        carried = snap.carried
        deferred: dict[int, int] = {}
        # NOTE: due within `urgent_s` first, soonest first; then the longest carried over (no budget earlier)
        urgent_by = now + cfg.urgent_s
        order = sorted(plans, key=lambda p: (0, p.demand.arrival_s, 0, p.node.node_id)
                       if p.demand.arrival_s <= urgent_by
                       else (1, -carried.get(p.node.node_id, 0), p.demand.arrival_s, p.node.node_id))
        for np_ in order:
            if len(out) >= cfg.max_copies_per_tick:
                break
            if cfg.max_scored_per_tick and self.num_scored and self.num_scored >= cfg.max_scored_per_tick:
                deferred[np_.node.node_id] = carried.get(np_.node.node_id, 0) + 1
                self.outcomes[np_.node.node_id] = "deferred (the pass's scoring budget is spent)"
                continue
            # A node's own predicted work must not count against itself.
            fc.remove_work(*own[id(np_)])
            try:
                self._plan_node(np_, fc, workers, kvb, egress, ingress, budget, free, room, now, out)
            finally:
                fc.add_work(*own[id(np_)])
        self.deferred = deferred
        return out

    def _plan_node(self, np_: _NodePlan, fc: WaitForecast, workers: tuple[WorkerView, ...], kvb: int,
                   egress: list[float], ingress: list[float], budget: list[int], free: list[int], room: "_Room",
                   now: float, out: list[Replicate]) -> None:
        """Adds copies of one node while the marginal gain of one more holder clears the bar."""
        cfg = self.cfg
        count = np_.demand.expected_count
        if cfg.allow_pull:
            # With copies on the critical path available, a pre-copy saves at most the copy's time per request.
            src = workers[np_.source]
            if count * self.cost.transfer_s(np_.node.token_len * kvb, src.nic_bandwidth_bytes_per_s) < cfg.min_gain_s:
                self.outcomes[np_.node.node_id] = "a copy on the request's path is as good"
                return
        # Cheap bound: even an idle target cannot save more than the holder's wait per request, plus, for several
        # requests, the time they would queue behind each other at the holder (k(k-1)/2 hit prefills).
        # Both waits at the request's arrival: the least wait *now* is larger than at arrival by up to the lead time,
        # and a bound taken with it refused copies that pay (tests/unit/test_policy_gate.py, a target 19.5 s busy).
        # (the forecast does not change while this node is planned: every worker's wait is taken once)
        waits = [fc.wait_at(w, np_.demand.arrival_s) for w in range(len(workers))]
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
            best = self._best_candidate(np_, fc, workers, kvb, egress, ingress, budget, free, room, now, why, waits)
            if best is None:
                break
            made += 1
            gain, target, depth, src, land = best
            egress[src] = ingress[target] = land
            budget[target] -= depth - np_.depth.get(target, 0)
            free[target] = max(0, free[target] - (depth - np_.depth.get(target, 0)))
            room.add(target, depth - np_.depth.get(target, 0))
            np_.depth[target] = depth
            np_.eta[target] = land
            out.append(Replicate(np_.node.node_id, src, target, depth, self._ttl_s(np_, land, now), gain))
        self.outcomes[np_.node.node_id] = (f"{made} cop{'y' if made == 1 else 'ies'}; then no target: "
                                           + (", ".join(f"{k} x{v}" for k, v in sorted(why.items()))
                                              or "every compatible worker holds it or has it coming"))

    def _best_candidate(self, np_: _NodePlan, fc: WaitForecast, workers: tuple[WorkerView, ...], kvb: int,
                        egress: list[float], ingress: list[float], budget: list[int], free: list[int],
                        room: "_Room", now: float, why: Optional[dict[str, int]] = None,
                        waits: Optional[list[float]] = None) -> Optional[tuple[float, int, int, int, float]]:
        """Returns: (gain, target, depth, source, landing time) of the best copy by gain per byte, or None.
        `why` counts the reasons candidates were turned down; `waits`: every worker's `fc.wait_at` the node's
        predicted arrival, when the caller has them."""
        def no(reason: str) -> None:
            if why is not None:
                why[reason] = why.get(reason, 0) + 1

        cfg, L = self.cfg, np_.node.token_len
        limit = now + cfg.max_link_backlog_s
        # a link's backlog counts from when its holder has the pages (a prefill or copy in flight is no backlog)
        sources = [(max(np_.eta.get(s, now), egress[s]), s) for s in np_.depth
                   if (cfg.chain_sources or s not in np_.eta)
                   and egress[s] <= max(now, np_.eta.get(s, now)) + cfg.max_link_backlog_s]
        if not sources:
            no("every source's link is booked")
            return None
        sources.sort()
        t_a = np_.demand.arrival_s
        costs = _Costs(self.cost)
        if waits is None:
            waits = [fc.wait_at(w, t_a) for w in range(len(workers))]
        opts = [self._option_s(np_, w, fc, workers, kvb, waits[w], costs) for w in range(len(workers))]
        count = np_.demand.expected_count
        spread = Spread(opts, num_spread(count, cfg.max_spread))
        base = spread.base_s
        fp = workers[np_.source].fingerprint
        page = self._page_len

        def score(w: WorkerView, t: int) -> tuple[Optional[tuple[float, int, int, float, int]], list[str]]:
            """(gain, depth, source, landing time, bytes) of the best copy to `t` (None: none clears the bar), and
            the reasons candidates to `t` were turned down."""
            held = np_.depth.get(t, 0)
            wait_t = waits[t]
            target_best = None
            reasons: list[str] = []
            for frac in cfg.depth_fractions:
                depth = int(L * frac)
                depth -= depth % page
                if depth <= held:
                    continue
                tokens = depth - held
                if tokens > budget[t]:
                    reasons.append("replica budget")
                    continue
                if tokens > room.tokens[t]:
                    reasons.append("would evict a wanted page")
                    continue
                nbytes = tokens * kvb
                # the source that lands the copy first (a holder is a source from its own arrival on)
                src, land, xfer = -1, math.inf, 0.0
                for ready, s in sources:
                    if ready >= land:
                        break
                    if s == t or np_.depth[s] < depth:
                        continue
                    x = costs.transfer_s(nbytes, min(workers[s].nic_bandwidth_bytes_per_s,
                                                     w.nic_bandwidth_bytes_per_s))
                    end = max(now, ready, ingress[t]) + x
                    if cfg.endpoint_wait:  # gathered after the source's iteration, installed after the target's
                        end = max(max(now, ready, ingress[t], workers[s].busy_until_s) + x, w.busy_until_s)
                    if end < land:
                        src, land, xfer = s, end, x
                if src < 0:
                    reasons.append("no source")
                    continue
                svc = costs.prefill_s(np_.new_len + L - depth, depth)
                new_opt = (max(wait_t, land - t_a) + svc, svc)
                if new_opt[0] >= opts[t][0]:
                    reasons.append("no faster there")
                    continue
                with_s = spread.with_option(t, new_opt)
                displaced = max(0, tokens - free[t])
                mem_cost = cfg.displaced_reuse_prob * costs.prefill_s(displaced, 0) if displaced else 0.0
                # the delay it imposes on the critical-path pulls that want the two links meanwhile
                harm = (pull_delay_s(workers[src].egress_pull_rate_per_s, land - xfer, xfer, now)
                        + pull_delay_s(w.ingress_pull_rate_per_s, land - xfer, xfer, now))
                gain = count * (base - with_s) - cfg.link_cost_weight * xfer - mem_cost - harm
                # depth by marginal gain: the deepest copy wins unless a shallower one nets more
                if gain < cfg.min_gain_s:
                    reasons.append("gain below minimum")
                elif target_best is None or gain > target_best[0]:
                    target_best = (gain, depth, src, land, nbytes)
            return target_best, reasons

        # NOTE: targets alike in everything `score` reads score alike (the idle workers, mostly): each kind is
        # scored once. The key holds every per-target input of `score`; a holder's own id too (it is no source
        # to itself). `spread.with_option` depends on `opts[t]`, not on `t` (see `radix_sync.policy.spread`).
        scored: dict[tuple, tuple[Optional[tuple[float, int, int, float, int]], list[str]]] = {}
        best: Optional[tuple[float, int, int, int, float]] = None
        best_ratio = 0.0
        for w in workers:
            t = w.worker_id
            if w.fingerprint != fp or w.nic_bandwidth_bytes_per_s <= 0:
                continue
            if ingress[t] > limit:
                no("target link booked")
                continue
            key = (t if t in np_.depth else -1, ingress[t], budget[t], room.tokens[t], free[t], opts[t], waits[t],
                   w.nic_bandwidth_bytes_per_s, w.busy_until_s, w.ingress_pull_rate_per_s)
            result = scored.get(key)
            if result is None:
                result = scored[key] = score(w, t)
            target_best, reasons = result
            for reason in reasons:
                no(reason)
            if target_best is not None:
                gain, depth, src, land, nbytes = target_best
                ratio = gain / nbytes
                if ratio > best_ratio:
                    best, best_ratio = (gain, t, depth, src, land), ratio
        return best


class _Costs:
    """One candidate's memo of the cost model's answers (the same few arguments come back for every target):
    the same values, computed once."""

    def __init__(self, cost: CostModel) -> None:
        self._cost = cost
        self._prefill: dict[tuple[int, int], float] = {}
        self._transfer: dict[tuple[float, float], float] = {}

    def prefill_s(self, new_len: int, cached_len: int) -> float:
        key = (new_len, cached_len)
        v = self._prefill.get(key)
        if v is None:
            v = self._prefill[key] = self._cost.prefill_s(new_len, cached_len)
        return v

    def transfer_s(self, num_bytes: float, bandwidth_bytes_per_s: float = 0.0) -> float:
        key = (num_bytes, bandwidth_bytes_per_s)
        v = self._transfer.get(key)
        if v is None:
            v = self._transfer[key] = self._cost.transfer_s(num_bytes, bandwidth_bytes_per_s)
        return v


class _Room:
    """Per target, the tokens a copy may still bring without evicting a wanted page (`gate.landing_room_tokens`),
    updated as the pass accepts copies (each one is incoming, then wanted)."""

    def __init__(self, workers: tuple[WorkerView, ...], wanted: list[int], wanted_ordinary: list[int]) -> None:
        self._workers = workers
        self._wanted = wanted
        self._ordinary = wanted_ordinary
        self._incoming = [0] * len(workers)
        self.tokens = [landing_room_tokens(w, wanted[i], wanted_ordinary[i]) for i, w in enumerate(workers)]

    def add(self, target: int, tokens: int) -> None:
        """A copy of `tokens` to `target` was accepted."""
        self._incoming[target] += tokens
        self._wanted[target] += tokens
        w = self._workers[target]
        self.tokens[target] = landing_room_tokens(
            w._replace(incoming_tokens=w.incoming_tokens + self._incoming[target]), self._wanted[target],
            self._ordinary[target])
