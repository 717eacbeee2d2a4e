"""The predictive planner (`radix_sync.policy.KvrepPlanner`) hooked to the live coordinator.

Builds the planner's `ClusterSnapshot` from the coordinator's exact state (directory, loads, replications in
flight, prefix hits, router arrivals, hints, and the responses the router saw end), runs the very same planner
object the simulator runs, and maps its `Replicate` commands back to worker ids and token ids. Completed
replications calibrate the cost model's transfer estimate online. Who calls it: `Coordinator._tick` under the
state lock.

Session continuation: each finished response (its prompt's pages, how it ended, the tenant's class) becomes a
node of the simulator's own `NodeTracker` (`radix_sync.policy.tracker`); an arrival whose held prefix runs
through such a node is its follow-up, and the gap feeds the predictor's per-(class, stop) gap model online. Open
session nodes are offered to the planner with their last finish, as the simulator offers them: when every worker
holding one is busy (`radix_sync.policy.candidates`, the one candidate rule).

Who builds it: `radix_sync.coordinator.policies` registers it as the live policy `kvrep`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional

from radix_sync.coordinator.demand import CandidateDemand, ViewCache, candidate_demand
from radix_sync.coordinator.replications import ORIGIN_PULL
from radix_sync.coordinator.state import DONE, FAILED, PENDING, RUNNING, ClusterState
from radix_sync.coordinator.workers import kv_bytes_per_token
from radix_sync.directory import REPLICA
from radix_sync.integrity import IntegrityError
from radix_sync.policy.calibration import UseCalibration
from radix_sync.policy.candidates import all_busy, busy_mask, is_candidate
from radix_sync.policy.cost import CostModel, load_profile
from radix_sync.policy.demotion import DemotionGate
from radix_sync.policy.forecast import drained
from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
from radix_sync.policy.snapshot import ClusterSnapshot, HolderView, PrefixView, WorkerView
from radix_sync.policy.tracker import NodeTracker

log = logging.getLogger("kvrep.planner")

LIVE_SCORING_BUDGET = 2048
"""The live planner's `PlannerConfig.max_scored_per_tick`: (prefix, target) pairs scored per tick, the rest
carried to the next (docs/coordinator-scale.md: ~3-7 us a pair, so a tick of tens of ms at most, whatever the
fleet and its demand)."""

@dataclass(frozen=True)
class LiveDecision:
    source: str
    target: str
    namespace: str
    block_hash: int
    depth_len: int
    ttl_s: float
    gain_s: float


_new_worker_view = functools.partial(tuple.__new__, WorkerView)
"""A `WorkerView` from all its fields, in order (`LivePlanner._worker_views`)."""
if WorkerView._fields != (
        "worker_id", "fingerprint", "num_running", "num_waiting", "waiting_new_tokens", "waiting_cached_tokens",
        "waiting_attn_pairs", "running_ctx_tokens", "busy_until_s", "free_tokens", "replica_budget_tokens",
        "egress_busy_until_s", "ingress_busy_until_s", "nic_bandwidth_bytes_per_s", "waiting_cached_pairs",
        "replica_tokens", "demoted_tokens", "egress_pending_bytes", "ingress_pending_bytes", "incoming_tokens",
        "waited_evict_first_tokens", "egress_pull_rate_per_s", "ingress_pull_rate_per_s"):
    raise ImportError("WorkerView's fields changed: LivePlanner._worker_views builds it positionally")

"""A holding's (role, expiry): with the holders' worker ids, what a kept view depends on of its page's holders."""


def _holder_bits(holders, index: dict[str, int]) -> int:
    """Returns: the holders (worker ids) as a bitmask by worker index.

    NOTE: 0 (no holder busy) when one is not a known worker: a forgotten worker's pages leave the directory with
    it (`ClusterState._forget_worker`), so this does not happen."""
    bits = 0
    for w in holders:
        i = index.get(w)
        if i is None:
            return 0
        bits |= 1 << i
    return bits


class LivePlanner:
    name = "kvrep"
    replicas_ordinary = False
    """Its copies land evict-first (`kvrep_lru`: as ordinary cache)."""

    PULL_WINDOW_S = 30.0
    """Routers' pulls (critical copies, origin `pull`) within this long make the planner value a pre-copy against
    a pull, and give each link its recent pull rate, s."""
    DECIDED_KEPT_S = 10.0
    """A decision not recorded as a replication within this long was not made (held out, refused), s."""
    WANTED_AFTER_LANDING_S = 5.0
    """A pull's replica counts as wanted (its request, sent when it landed, queued there) this long after, s."""

    def __init__(self, profile: str = "cpu-local",
                 cfg: PlannerConfig = PlannerConfig(endpoint_wait=True, max_scored_per_tick=LIVE_SCORING_BUDGET),
                 router_pulls: Optional[bool] = None) -> None:
        """`router_pulls`: whether the routers in front copy a missing prefix on the request's path (`kvrep router
        --pull`); None (the default): yes while a pull was asked for within `PULL_WINDOW_S`. The planner then
        values a pre-copy against that pull (`PlannerConfig.allow_pull`, as the simulator's `kvrep`), else
        against waiting for the holder or recomputing. `cfg.allow_pull` is overridden by it."""
        # NOTE: with pulls assumed where no router pulls, a pre-copy for requests due now could never beat the
        # (imaginary) pull and the planner would stay idle; without them where the router does pull, it copies
        # ahead what the pull would bring as fast, and takes the links the pulls need.
        self.profile = load_profile(profile)
        self.cost = CostModel(self.profile)
        self.router_pulls = router_pulls
        self._cfgs = {allow: dataclasses.replace(cfg, allow_pull=allow) for allow in (False, True)}
        self.planner = KvrepPlanner(self.cost, cfg=self._cfgs[False], calibration=UseCalibration())
        """`planner.calibration`: each kind of demand's copies used against predicted, from the replications'
        records (`observe`); None: not learned (every prediction taken as it is)."""
        self.tracker = NodeTracker(self.planner.predictor)
        self._observed: set[str] = set()
        self._decided: dict[tuple[int, str], tuple[str, float, float]] = {}
        """(prefix, target) -> (kind, expected count, when) of copies not recorded yet (`_calibrated`: recorded)."""
        self._calibrated: set[str] = set()
        self._carried: dict[int, int] = {}
        """The prefixes the last pass left unscored (its budget spent): scored first in the next."""
        self._views = ViewCache()
        self._holder_views: dict[tuple, HolderView] = {}
        """Landed holdings' views by their fields (`_prefix_view`), at most 65,536."""
        self._namespaces: dict[str, int] = {"": 0}
        self.hint_grace_s = 1.0
        """A fan-out hint stops asking for copies this long after its branches were due, s."""
        self.num_followups = 0  # arrivals recognised as the next turn of a finished response
        self.speed_calibrated = True  # prefill priced at the routers' measured speed (`kvrep_fixed`: the profile's)
        self.last_pass: dict[str, int] = {}
        """The last tick's candidates, (prefix, target) pairs scored and prefixes deferred (for `/status`)."""
        self.num_sessions_ended = 0
        """Open sessions closed by an `end` hint (`kvrep.session_end`)."""
        self.hint_outcomes: dict[int, list[tuple[float, str]]] = {}
        """Hinted prefix -> what the planner made of it, each change with its time (for `/status`)."""
        self.demote_stale = True
        """Demote a session's old copies when its next turn moves to another worker (the simulator's
        `PolicyBundle.demote_stale` of `kvrep`): an arrival recognised as a finished turn's follow-up, routed to a
        worker that held all of that turn, demotes the other workers' copies that held exactly as much (both taken
        when it arrived, `ClusterState._copies_ending_at`; as `Engine._demote_others` at admission)."""
        self._demotions: list[tuple[str, str, int]] = []
        self.demotion_gate: Optional[DemotionGate] = DemotionGate()
        """Sends those demotions only while moved sessions seldom come back (`radix_sync.policy.demotion`); None:
        sends every one."""

    def _ns(self, namespace: str) -> int:
        return self._namespaces.setdefault(namespace, len(self._namespaces))

    def observe(self, state: ClusterState, now_s: float) -> None:
        """One pass over the replication records: calibrates transfer costs from the copies that completed since
        the last call, and hands the planner's own copies to `planner.calibration` once recorded (a decision held
        out or refused never is: forgotten after `DECIDED_KEPT_S`), with their uses (a promotion) and failures.

        NOTE: costs from the data plane's own work (gather, the wire, scatter, insert), not from the copy's
        end-to-end time: on a busy worker a copy mostly waits for the scheduler's iteration to end (seconds on a
        CPU), which the planner prices separately from each end's reported iteration length. Calibrated on
        end-to-end times, one slow copy to a busy worker made every copy look slower than recomputing, even to idle
        workers."""
        self.cost.prefill_scale = state.speed.scale(self.profile) if self.speed_calibrated else 1.0
        cal = self.planner.calibration
        decided, seen = self._decided, self._calibrated
        for rep in state.replications.values():
            if rep.state == "done" and rep.id not in self._observed and rep.finished_s is not None:
                self._observed.add(rep.id)
                t = rep.timings_s
                if rep.num_bytes > 0 and "receive_s" in t:
                    work = (t.get("gather_s", 0.0) + max(t.get("send_s", 0.0), t["receive_s"])
                            + t.get("scatter_s", 0.0) + t.get("insert_s", 0.0))
                    # NOTE: the decoder bounds every timing; this guards the cost model itself (one inf or NaN
                    # sample would stay in its estimate for good)
                    if math.isfinite(work) and 0 < work <= 3600.0:
                        self.cost.observe_transfer(rep.num_bytes, work)
            if cal is None or rep.origin != self.name:
                continue
            if rep.id not in seen:
                # (a record older than the decision is an earlier copy: an earlier planner's, after a policy reset)
                entry = decided.get(key := (rep.block_hash, rep.target))
                if entry is None or rep.created_s < entry[2]:
                    continue
                del decided[key]
                seen.add(rep.id)
                cal.decided(rep.id, *entry, prefix=rep.block_hash, target=rep.target)
            if rep.promoted_tokens > 0:
                cal.used(rep.id, now_s)
            elif rep.state == FAILED:
                cal.dropped(rep.id)
        if cal is None:
            return
        if decided:
            self._decided = {k: v for k, v in decided.items() if now_s - v[2] <= self.DECIDED_KEPT_S}
        if len(seen) > 2 * len(state.replications) + 1024:
            self._calibrated = {i for i in seen if i in state.replications}
        cal.tick(now_s)

    def consume(self, state: ClusterState, now_s: float) -> None:
        """Feeds the finishes and arrivals recorded since the last call to the session tracker, in order."""
        events = state.demand_events
        page_len = max(1, state._page_size())
        tracker = self.tracker
        while events:
            kind, rec, hashes, held, (routed_len, stale) = events.popleft()
            if kind == "finish":
                tracker.on_finish(hashes, rec.class_key, self._ns(rec.namespace), rec.stop, rec.time_s)
                continue
            if kind == "end":
                self.num_sessions_ended += tracker.on_end(hashes[-1])
                continue
            if self.planner.calibration is not None:  # (the requests a popular prefix's copies were planned for)
                self.planner.calibration.requested(hashes, held, rec.time_s)
            gate = self.demotion_gate
            if self.demote_stale and gate is not None:  # what earlier demotions' sessions did, before this decides
                gate.observe(hashes, rec.worker_id, rec.time_s)
            # the deepest finished prompt this arrival's held prefix runs through is the turn it follows (a
            # worker also caches the response's own tokens, so the match usually runs past the prompt)
            nodes, abandoned = tracker.nodes, tracker.abandoned
            for i in range(held - 1, -1, -1):
                h = hashes[i]
                node = nodes.get(h)
                open_session = node is not None and node.last_finish_s is not None
                if open_session or h in abandoned:
                    self.num_followups += open_session
                    if open_session and self.planner.calibration is not None:  # (the turn its copies are for)
                        self.planner.calibration.arrived(h, rec.worker_id, rec.time_s)
                    # only when the worker it went to held all of the turn it follows (not just a shared part)
                    if open_session and self.demote_stale and stale and routed_len >= i + 1:
                        last = hashes[routed_len - 1]
                        if gate is None or gate.decide(last, stale, rec.time_s):
                            self._demotions.extend((w, rec.namespace, last) for w in stale)
                    tracker.on_arrival(hashes, i + 1, rec.class_key, self._ns(rec.namespace), rec.prompt_len,
                                       page_len, rec.time_s)
                    break
        tracker.prune(now_s)

    def take_demotions(self) -> list[tuple[str, str, int]]:
        """(worker, namespace, block hash of the prefix's last page) decided since the last call."""
        out, self._demotions = self._demotions, []
        return out

    def session_stats(self) -> dict:
        """Open session nodes and what the gap models learned, for `/status`."""
        open_nodes = sum(1 for n in self.tracker.nodes.values() if n.last_finish_s is not None)
        models = {f"{cls or '-'}/{'tool' if tool else 'other'}": {
            "p_continue": round(m.p_continue, 3), "median_gap_s": round(m.quantile(0.5), 3),
            "followups": round(m.num_continued, 1), "ended": round(m.num_ended, 1)}
            for (cls, tool), m in self.planner.predictor.gap_models().items()}
        return {"open": open_nodes, "followups": self.num_followups, "abandoned": len(self.tracker.abandoned),
                "ended_by_hint": self.num_sessions_ended, "gap_models": models,
                "prefill_scale": round(self.cost.prefill_scale, 4), "verdicts": dict(self.planner.session_verdicts),
                "demotion_gate": self.demotion_gate.status() if self.demotion_gate is not None else None,
                "copy_use": self.planner.calibration.status() if self.planner.calibration is not None else None}

    def snapshot(self, state: ClusterState, now_s: float, cached: bool = True) -> tuple[ClusterSnapshot, list[str]]:
        """The planner's view of the cluster now. `cached`: reuse what earlier ticks derived from facts that have
        not changed since (`ViewCache`); False: derive everything again (the same snapshot: `check_views`).

        Returns:
            the snapshot (workers by dense index, in worker-id order) and the worker ids by that index.
        """
        self.consume(state, now_s)
        ids = sorted(state.workers)
        index = {wid: i for i, wid in enumerate(ids)}
        in_flight = [r for r in state.replications.values() if r.state in (PENDING, RUNNING)]
        kvb = next((b for b in (kv_bytes_per_token(state.workers[w].hello.fingerprint_fields) for w in ids) if b),
                   self.profile.kv_bytes_per_token)
        busy = self._link_busy_until(in_flight, kvb, now_s)
        pulls = [r for r in state.replications.values()
                 if r.origin == ORIGIN_PULL and now_s - r.created_s <= self.PULL_WINDOW_S]
        workers = self._worker_views(state, ids, in_flight, busy, now_s, pulls)
        self.planner.cfg = self._cfgs[self.pulls_assumed(pulls)]
        page_len = min((state.workers[w].hello.page_size for w in ids), default=1)
        cache = self._views if cached else None
        if cache is not None:
            cache.begin((state.directory, state.demand.by_prefix, tuple(ids), page_len), state.demand.stamps)
        demand = candidate_demand(state.demand, cache)
        self._add_hints(state, demand, now_s)
        self._add_busy_sessions(state, workers, index, demand, now_s)
        flights: dict[int, list] = {}  # copies in flight by prefix (each candidate's own, in creation order)
        for r in in_flight:
            if r.block_hash is not None:
                flights.setdefault(r.block_hash, []).append(r)
        # NOTE: a prefix no hint names, with no open session and no copy in flight, is a candidate by its
        # popularity alone, and its view depends only on its demand entries and its directory page: kept from the
        # last tick while those are the same (`ViewCache`); the others are built each tick.
        times, sessions = demand.times, demand.sessions
        fanout, keepalive = demand.fanout, demand.keepalive
        node_of = state.directory.node
        entries = cache.entries if cache is not None else {}
        slow = {h.block_hash for h in state.hints}
        slow.update(sessions)
        slow.update(flights)
        prefixes = []
        for block_hash in demand.in_log_order():
            kept = entries.get(block_hash) if block_hash not in slow else None
            if kept is not None:
                if len(kept[1]) < 2:  # (`is_candidate`: no hint names it, no open session)
                    continue
                node = node_of(block_hash)
                if node is None:
                    continue
                # (the kept view while its page and holders are the same: `ViewCache`)
                if kept[4] is not node or kept[5] != node.depth or kept[6] != node.version:
                    kept[4], kept[5], kept[6] = node, node.depth, node.version
                    kept[7] = self._prefix_view(state, block_hash, demand, index, (), busy, page_len, now_s)
                view = kept[7]
            else:
                if not is_candidate(len(times[block_hash]), block_hash in fanout or block_hash in keepalive,
                                    block_hash in sessions):
                    continue
                view = self._prefix_view(state, block_hash, demand, index, flights.get(block_hash, ()), busy,
                                         page_len, now_s)
            if view is not None:
                prefixes.append(view)
        snap = ClusterSnapshot(workers=tuple(workers), prefixes=tuple(prefixes), page_len=page_len,
                               kv_bytes_per_token=kvb, carried=self._carried, worker_keys=tuple(ids))
        if cache is not None:
            cache.end()
        return snap, ids

    def check_views(self, state: ClusterState, now_s: float) -> None:
        """Raises IntegrityError unless the snapshot built with what earlier ticks kept (`ViewCache`) equals one
        built from scratch. Call it where `decide` would be called (it drains the demand events, as a tick does)."""
        fresh, _ = self.snapshot(state, now_s, cached=False)
        kept, _ = self.snapshot(state, now_s)
        if fresh != kept:
            diff = [(a.node_id, a, b) for a, b in zip(fresh.prefixes, kept.prefixes) if a != b][:3]
            raise IntegrityError(f"kept candidate views differ from fresh ones ({len(fresh.prefixes)} vs "
                                 f"{len(kept.prefixes)} prefixes; first differences {diff})")

    def _link_busy_until(self, in_flight: list, kvb: int, now_s: float) -> dict[str, float]:
        """Returns: per worker, when the copies queued on its link end (both ends of a copy are busy with it)."""
        bw = self.profile.nic_bandwidth_bytes_per_s
        busy: dict[str, float] = {}
        for r in in_flight:
            seconds = r.num_tokens * kvb / bw if bw > 0 else 0.0
            for wid in (r.source, r.target):
                busy[wid] = max(busy.get(wid, now_s), now_s) + seconds
        return busy

    def pulls_assumed(self, pulls: list) -> bool:
        """Whether the planner values pre-copies against a pull: `router_pulls`, or, unset, whether `pulls` (the
        recent critical copies) is not empty."""
        return self.router_pulls if self.router_pulls is not None else bool(pulls)

    def _worker_views(self, state: ClusterState, ids: list[str], in_flight: list, busy: dict[str, float],
                      now_s: float, pulls: list = ()) -> list[WorkerView]:
        """Returns: each worker's last load report as the planner sees it, in `ids` order, with the gate's fields
        (`radix_sync.policy.gate`) from what the coordinator knows: the copies coming in (`incoming_tokens`), the
        replica and demoted tokens the worker reported, the pulls of the last `PULL_WINDOW_S` per link (rates) and
        the replicas pulls landed within `WANTED_AFTER_LANDING_S` (wanted: their requests are queued there). No
        copy is decided but unbooked live (every one in flight is booked on its links): the pending bytes stay 0."""
        bw = self.profile.nic_bandwidth_bytes_per_s
        incoming: dict[str, int] = {}  # replica tokens on their way to each worker (not in its load report yet)
        for r in in_flight:
            incoming[r.target] = incoming.get(r.target, 0) + r.num_tokens
        egress_pulls, ingress_pulls, wanted = {}, {}, {}  # pulls per source, per target; tokens they landed per target
        for r in pulls:
            egress_pulls[r.source] = egress_pulls.get(r.source, 0) + 1
            ingress_pulls[r.target] = ingress_pulls.get(r.target, 0) + 1
            if r.state == DONE and r.finished_s is not None and now_s - r.finished_s <= self.WANTED_AFTER_LANDING_S:
                wanted[r.target] = wanted.get(r.target, 0) + r.inserted_len
        window = self.PULL_WINDOW_S
        workers = []
        for i, wid in enumerate(ids):
            rec = state.workers[wid]
            load = rec.load
            hello = rec.hello
            link_busy = busy.get(wid, now_s)
            # NOTE: positional, in `WorkerView._fields` order (checked where `_new_worker_view` is defined): a
            # NamedTuple's keyword constructor is a Python call, ~3x the time, for every worker every tick
            if load:
                v = _new_worker_view((
                    i, hello.fingerprint, load.num_running_reqs, load.num_waiting_reqs, load.num_waiting_tokens,
                    0, 0.0, 0,
                    # a busy worker is, on average, half-way through an iteration
                    now_s + (0.5 * load.iteration_s if load.num_running_reqs + load.num_waiting_reqs else 0.0),
                    load.available_tokens,
                    max(0, hello.replica_budget_tokens - load.replica_tokens - incoming.get(wid, 0)),
                    link_busy, link_busy,
                    0.0 if rec.plain else bw,  # (a plain worker: no copy ever ends there)
                    0.0, load.replica_tokens, load.demoted_tokens, 0, 0, incoming.get(wid, 0), wanted.get(wid, 0),
                    egress_pulls.get(wid, 0) / window, ingress_pulls.get(wid, 0) / window))
                # (the report was taken `age` ago, between iterations: its queued prefills have computed since)
                workers.append(drained(self.cost, v, now_s - rec.load_s, now_s) if load.num_waiting_reqs else v)
            else:
                workers.append(_new_worker_view((
                    i, hello.fingerprint, 0, 0, 0, 0, 0.0, 0, now_s + 0.0, 0,
                    max(0, hello.replica_budget_tokens - 0 - incoming.get(wid, 0)), link_busy, link_busy,
                    0.0 if rec.plain else bw, 0.0, -1, 0, 0, 0, incoming.get(wid, 0), wanted.get(wid, 0),
                    egress_pulls.get(wid, 0) / window, ingress_pulls.get(wid, 0) / window)))
        return workers

    def _add_hints(self, state: ClusterState, demand: CandidateDemand, now_s: float) -> None:
        """Adds every hinted prefix to `demand.times` (its namespace to `demand.namespaces`), the live fan-outs to
        `demand.fanout` and the keep-alives to `demand.keepalive`."""
        namespaces, fanout, keepalive = demand.namespaces, demand.fanout, demand.keepalive
        for hint in state.hints:
            if hint.block_hash is None:
                continue
            namespaces[hint.block_hash] = hint.namespace
            demand.add(hint.block_hash)
            if hint.kind == "fanout" and now_s - hint.time_s < hint.ttl_s:
                # NOTE: the branches follow the trunk's answer, so they are due `delay_s` after its pages show up
                # in the directory (a prefill done), not at the hint's own time (sent with the trunk, before
                # it is computed: taken as due at once, no copy could ever land in time). Once that moment is
                # past by more than the grace, the branches have come: the hint asks for nothing more.
                seen = state.hint_times.get(hint.block_hash, {}).get("stored_s")
                if seen is None:
                    continue
                due = max(hint.time_s, seen) + hint.delay_s
                if now_s <= due + self.hint_grace_s:
                    fanout[hint.block_hash] = (hint.k, due)
            elif hint.kind == "keepalive":
                keepalive[hint.block_hash] = max(keepalive.get(hint.block_hash, 0.0), hint.time_s + hint.ttl_s)

    def _add_busy_sessions(self, state: ClusterState, workers: list[WorkerView], index: dict[str, int],
                           demand: CandidateDemand, now_s: float) -> None:
        """Adds the open session nodes whose every holder is busy (`radix_sync.policy.candidates`, as the simulator
        selects them) to `demand.sessions` and `demand.times` (their namespace to `demand.namespaces`)."""
        busy = None  # (taken at the first open session with a page: none, most ticks)
        sessions, namespaces = demand.sessions, demand.namespaces
        for n in self.tracker.nodes.values():
            if n.last_finish_s is None:
                continue
            dnode = state.directory.node(n.node_id)
            if dnode is None:
                continue
            if busy is None:
                busy = busy_mask(self.cost, workers, now_s, self.planner.cfg.min_gain_s)
            if all_busy(_holder_bits(dnode.holders, index), busy):
                sessions[n.node_id] = n
                demand.add(n.node_id)
                namespaces.setdefault(n.node_id, dnode.namespace)

    def _prefix_view(self, state: ClusterState, block_hash: int, demand: CandidateDemand, index: dict[str, int],
                     in_flight, busy: dict[str, float], page_len: int, now_s: float) -> Optional[PrefixView]:
        """Returns: the candidate prefix with its holders (`in_flight`: the copies of it in flight included), or
        None when nobody holds it (or its tokens are not known yet): nothing to copy."""
        node = state.directory.node(block_hash)
        if node is None or not node.tokens:
            return None
        token_len = node.depth * page_len
        # (a landed holding's view is a value: one object for all the prefixes alike there, kept across ticks)
        kept, holders = self._holder_views, []
        for w, h in node.holders.items():
            if w in index:
                key = (index[w], h.role, token_len, h.expires_at_s if h.role == REPLICA else None)
                view = kept.get(key)
                if view is None:
                    if len(kept) >= 65_536:
                        kept.clear()
                    view = kept[key] = HolderView(*key)
                holders.append(view)
        for r in in_flight:
            if r.block_hash == block_hash and r.target in index:
                eta = busy.get(r.target, now_s)
                holders.append(HolderView(index[r.target], REPLICA, r.num_tokens, now_s + r.ttl_s, eta))
        session = demand.sessions.get(block_hash)
        k, hint_at = demand.fanout.get(block_hash, (0, None))
        ewma = self.tracker.new_len_ewma
        return PrefixView(
            node_id=block_hash, token_len=token_len, namespace=self._ns(demand.namespaces.get(block_hash, "")),
            class_key=session.class_key if session else "",
            holders=tuple(holders), recent_hit_times_s=tuple(sorted(demand.times[block_hash])),
            last_finish_s=session.last_finish_s if session else None,
            last_stop=session.last_stop if session else None,
            expected_new_len=int(ewma.get(session.class_key, 0)) if session else 0,
            fanout_hint=k, hint_at_s=hint_at, keepalive_until_s=demand.keepalive.get(block_hash))

    def decide(self, state: ClusterState, now_s: float) -> list[LiveDecision]:
        self.observe(state, now_s)
        snap, ids = self.snapshot(state, now_s)
        out = []
        commands = self.planner.plan(snap, now_s)
        self._carried = self.planner.deferred
        self.last_pass = {"candidates": len(snap.prefixes), "scored_pairs": self.planner.num_scored,
                          "deferred": len(self.planner.deferred)}
        for prefix in snap.prefixes:
            if prefix.fanout_hint:
                seen = self.hint_outcomes.setdefault(prefix.node_id, [])
                what = self.planner.outcomes.get(prefix.node_id, "not planned")
                if not seen or seen[-1][1] != what:
                    seen.append((now_s, what))
                    del seen[:-6]
        live = {h.block_hash for h in state.hints}
        if len(self.hint_outcomes) > len(live):
            self.hint_outcomes = {b: v for b, v in self.hint_outcomes.items() if b in live}
        for cmd in commands:
            node = state.directory.node(cmd.node_id)
            if node is None:
                continue
            out.append(LiveDecision(ids[cmd.source], ids[cmd.target], node.namespace, cmd.node_id, cmd.depth_len,
                                    cmd.ttl_s, cmd.gain_s))
            key = (cmd.node_id, ids[cmd.target])  # (the same decision again, each tick: at debug level)
            log.log(logging.DEBUG if key in self._decided else logging.INFO,
                    "copy %s %x: %d tokens %s -> %s, gain %.3f s, %.2f requests predicted", cmd.kind,
                    cmd.node_id, cmd.depth_len, ids[cmd.source], ids[cmd.target], cmd.gain_s, cmd.expected_count)
            self._decided[key] = (cmd.kind, cmd.expected_count, now_s)
        return out
