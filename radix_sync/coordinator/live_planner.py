"""The predictive planner (`radix_sync.policy.KvrepPlanner`) hooked to the live coordinator.

Builds the planner's `ClusterSnapshot` from the coordinator's exact state (directory, loads, replications in
flight, prefix hits, router arrivals, hints, and the responses the router saw end), runs the very same planner
object the simulator runs, and maps its `Replicate` commands back to worker ids and token ids. Completed
replications calibrate the cost model's transfer estimate online. Who calls it: `Coordinator._tick` under the
state lock.

Session continuation: each finished response (its prompt's pages, how it ended, the tenant's class) becomes a
node of the simulator's own `NodeTracker`; an arrival whose held prefix runs through such a node is its
follow-up, and the gap feeds the predictor's per-(class, stop) gap model online. Open session nodes are offered
to the planner with their last finish, as the simulator offers them: when every worker holding one is busy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radix_sync.coordinator.state import PENDING, RUNNING, ClusterState
from radix_sync.directory import REPLICA
from radix_sync.policy.cost import CostModel, load_profile
from radix_sync.policy.forecast import queue_wait_s
from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
from radix_sync.policy.snapshot import ClusterSnapshot, HolderView, PrefixView, WorkerView
from radix_sync.sim.tracker import NodeTracker

_ITEMSIZE = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.uint8": 1}


@dataclass(frozen=True)
class LiveDecision:
    source: str
    target: str
    namespace: str
    block_hash: int
    depth_len: int
    ttl_s: float
    gain_s: float


def kv_bytes_per_token(fields: dict[str, str]) -> Optional[int]:
    """KV bytes per token from a worker's fingerprint fields (MHA: 2 x layers x heads x dim x itemsize)."""
    try:
        dims = [int(x) for x in fields["kv_geometry"].strip("()").split(",") if x.strip()]
        per_row = 1
        for d in dims:
            per_row *= d
        factor = 1 if fields.get("mla") == "True" else 2
        return factor * int(fields["num_layers"]) * per_row * _ITEMSIZE[fields["kv_store_dtype"]]
    except (KeyError, ValueError):
        return None


def _drop_explained(times: list[float], since_s: float, k: int) -> list[float]:
    """`times` without the first `k` at or after `since_s` (the arrivals a fan-out hint announced)."""
    out = []
    for t in sorted(times):
        if k > 0 and t >= since_s:
            k -= 1
            continue
        out.append(t)
    return out


class LivePlanner:
    name = "kvrep"

    def __init__(self, profile: str = "cpu-local",
                 cfg: PlannerConfig = PlannerConfig(allow_pull=False, endpoint_wait=True)) -> None:
        # NOTE: allow_pull=False because no live router copies on the request's path yet; with pulls assumed, a
        # pre-copy for requests due now could never beat the (imaginary) pull and the planner would stay idle.
        self.profile = load_profile(profile)
        self.cost = CostModel(self.profile)
        self.planner = KvrepPlanner(self.cost, cfg=cfg)
        self.tracker = NodeTracker(self.planner.predictor)
        self._observed: set[str] = set()
        self._namespaces: dict[str, int] = {"": 0}
        self.hint_grace_s = 1.0
        """A fan-out hint stops asking for copies this long after its branches were due, s."""
        self.num_followups = 0
        """Arrivals recognised as the next turn of a finished response."""
        self.hint_outcomes: dict[int, list[tuple[float, str]]] = {}
        self.demote_stale = True
        """Demote a session's old copies when its next turn moves to another worker (the simulator's
        `PolicyBundle.demote_stale` of `kvrep`): an arrival recognised as a finished turn's follow-up, routed to a
        worker that held all of that turn, demotes the other workers' copies that held exactly as much (both taken
        when it arrived, `ClusterState._copies_ending_at`; as `Engine._demote_others` at admission)."""
        self._demotions: list[tuple[str, str, int]] = []
        """Hinted prefix -> what the planner made of it, each change with its time (for `/status`)."""

    def _ns(self, namespace: str) -> int:
        return self._namespaces.setdefault(namespace, len(self._namespaces))

    def observe(self, state: ClusterState) -> None:
        """Calibrate transfer costs from replications that completed since the last call.

        NOTE: from the data plane's own work (gather, the wire, scatter, insert), not from the copy's end-to-end
        time: on a busy worker a copy mostly waits for the scheduler's iteration to end (seconds on a CPU), which
        the planner prices separately from each end's reported iteration length. Calibrated on end-to-end times,
        one slow copy to a busy worker made every copy look slower than recomputing, even to idle workers."""
        for rep in state.replications.values():
            if rep.state == "done" and rep.id not in self._observed and rep.finished_s is not None:
                self._observed.add(rep.id)
                t = rep.timings_s
                if rep.num_bytes > 0 and "receive_s" in t:
                    work = (t.get("gather_s", 0.0) + max(t.get("send_s", 0.0), t["receive_s"])
                            + t.get("scatter_s", 0.0) + t.get("insert_s", 0.0))
                    self.cost.observe_transfer(rep.num_bytes, work)

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
            # the deepest finished prompt this arrival's held prefix runs through is the turn it follows (a
            # worker also caches the response's own tokens, so the match usually runs past the prompt)
            nodes, abandoned = tracker.nodes, tracker.abandoned
            for i in range(held - 1, -1, -1):
                h = hashes[i]
                node = nodes.get(h)
                open_session = node is not None and node.last_finish_s is not None
                if open_session or h in abandoned:
                    self.num_followups += open_session
                    # only when the worker it went to held all of the turn it follows (not just a shared part)
                    if open_session and self.demote_stale and stale and routed_len >= i + 1:
                        last = hashes[routed_len - 1]
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
                "gap_models": models}

    def snapshot(self, state: ClusterState, now_s: float) -> tuple[ClusterSnapshot, list[str]]:
        self.consume(state, now_s)
        ids = sorted(state.workers)
        index = {wid: i for i, wid in enumerate(ids)}
        bw = self.profile.nic_bandwidth_bytes_per_s
        in_flight = [r for r in state.replications.values() if r.state in (PENDING, RUNNING)]
        kvb = next((b for b in (kv_bytes_per_token(state.workers[w].hello.fingerprint_fields) for w in ids) if b),
                   self.profile.kv_bytes_per_token)
        busy: dict[str, float] = {}
        incoming: dict[str, int] = {}  # replica tokens on their way to each worker (not in its load report yet)
        for r in in_flight:
            incoming[r.target] = incoming.get(r.target, 0) + r.num_tokens
        for r in in_flight:  # queued copies keep both ends of the link busy
            seconds = r.num_tokens * kvb / bw if bw > 0 else 0.0
            for wid in (r.source, r.target):
                busy[wid] = max(busy.get(wid, now_s), now_s) + seconds
        workers = []
        for wid in ids:
            rec = state.workers[wid]
            load = rec.load
            workers.append(WorkerView(
                worker_id=index[wid], fingerprint=rec.hello.fingerprint,
                num_running=load.num_running_reqs if load else 0, num_waiting=load.num_waiting_reqs if load else 0,
                waiting_new_tokens=load.num_waiting_tokens if load else 0,
                # a busy worker is, on average, half-way through an iteration
                busy_until_s=now_s + (0.5 * load.iteration_s if load and load.num_running_reqs + load.num_waiting_reqs
                                      else 0.0),
                free_tokens=load.available_tokens if load else 0,
                replica_budget_tokens=max(0, rec.hello.replica_budget_tokens - (load.replica_tokens if load else 0)
                                          - incoming.get(wid, 0)),
                egress_busy_until_s=busy.get(wid, now_s), ingress_busy_until_s=busy.get(wid, now_s),
                nic_bandwidth_bytes_per_s=bw))
        page_len = min((state.workers[w].hello.page_size for w in ids), default=1)
        # candidate prefixes: what was hit, what the router saw arriving, what a hint announced
        # NOTE: with a router in front, one request shows up twice: as the router's arrival and as the worker's
        # prefix hit, both on the prefix it reuses. A prefix's demand is its arrivals when the router reported
        # any, else its hits (workers without our router), never the sum.
        by_arrival: dict[int, list[float]] = {}
        by_hit: dict[int, list[float]] = {}
        namespaces: dict[int, str] = {}
        for log, out in ((state.hits, by_hit), (state.arrivals, by_arrival)):
            for rec in log:
                if rec.block_hash is not None:
                    out.setdefault(rec.block_hash, []).append(rec.time_s)
                    namespaces[rec.block_hash] = rec.namespace
        # NOTE: a fan-out's branches are explained by its hint, not popularity (the simulator's tracker rule):
        # counted as hits, the K branches of a finished tree made its trunk look hot for the whole window and it
        # was copied again after its replicas expired (~half the copies of a fan-out run were such re-copies).
        for hint in state.hints:
            if hint.kind == "fanout" and hint.block_hash is not None:
                for out in (by_arrival, by_hit):
                    seen = out.get(hint.block_hash)
                    if seen:
                        out[hint.block_hash] = _drop_explained(seen, hint.time_s, hint.k)
        times = {b: by_arrival.get(b) or by_hit.get(b, []) for b in {**by_hit, **by_arrival}}
        fanout: dict[int, tuple[int, float]] = {}
        keepalive: dict[int, float] = {}
        for hint in state.hints:
            if hint.block_hash is None:
                continue
            namespaces[hint.block_hash] = hint.namespace
            times.setdefault(hint.block_hash, [])
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
        # open sessions whose every holder is busy (queue wait above the least-loaded worker's by the planner's
        # minimum gain): the simulator's selection (`Engine._prefix_views`)
        waits = {ids[w.worker_id]: queue_wait_s(self.cost, w, now_s) for w in workers}
        floor = min(waits.values(), default=0.0) + self.planner.cfg.min_gain_s
        sessions = {}
        for n in self.tracker.nodes.values():
            if n.last_finish_s is None:
                continue
            dnode = state.directory.node(n.node_id)
            if dnode is not None and dnode.holders and all(waits.get(w, 0.0) >= floor for w in dnode.holders):
                sessions[n.node_id] = n
                namespaces.setdefault(n.node_id, dnode.namespace)
                times.setdefault(n.node_id, [])
        ewma = self.tracker.new_len_ewma
        prefixes = []
        for block_hash, hit_times in times.items():
            session = sessions.get(block_hash)
            if len(hit_times) < 2 and block_hash not in fanout and block_hash not in keepalive and session is None:
                # NOTE: as the simulator's tracker prunes them: one request on a prefix says nothing about the
                # next (a session's turn reuses its previous turn once, then moves on to a longer prefix); a
                # prefix needs repeated demand, a hint or an open session before it is worth a copy.
                continue
            node = state.directory.node(block_hash)
            if node is None or not node.token_ids:
                continue  # nobody holds it (or its tokens are not known yet): nothing to copy
            token_len = node.depth * page_len
            holders = [HolderView(index[w], h.role, token_len, h.expires_at_s if h.role == REPLICA else None)
                       for w, h in node.holders.items() if w in index]
            for r in in_flight:
                if r.block_hash == block_hash and r.target in index:
                    eta = busy.get(r.target, now_s)
                    holders.append(HolderView(index[r.target], REPLICA, r.num_tokens, now_s + r.ttl_s, eta))
            k, hint_at = fanout.get(block_hash, (0, None))
            prefixes.append(PrefixView(
                node_id=block_hash, token_len=token_len, namespace=self._ns(namespaces.get(block_hash, "")),
                class_key=session.class_key if session else "",
                holders=tuple(holders), recent_hit_times_s=tuple(sorted(hit_times)),
                last_finish_s=session.last_finish_s if session else None,
                last_stop=session.last_stop if session else None,
                expected_new_len=int(ewma.get(session.class_key, 0)) if session else 0,
                fanout_hint=k, hint_at_s=hint_at, keepalive_until_s=keepalive.get(block_hash)))
        snap = ClusterSnapshot(workers=tuple(workers), prefixes=tuple(prefixes), page_len=page_len,
                               kv_bytes_per_token=kvb)
        return snap, ids

    def decide(self, state: ClusterState, now_s: float) -> list[LiveDecision]:
        self.observe(state)
        snap, ids = self.snapshot(state, now_s)
        out = []
        commands = self.planner.plan(snap, now_s)
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
        return out
