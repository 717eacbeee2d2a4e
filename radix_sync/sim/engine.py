"""The discrete-event engine: arrivals, worker iterations, copies, replica expiry and planner ticks, in time
order (ties broken by insertion order, so a run is deterministic for a seed).

The engine plays the coordinator and router of the real system: it builds `RequestView`s and `ClusterSnapshot`s
from its model and executes the decisions of the policy objects, which never see the model."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable, Optional

from radix_sync.gc_pacing import frozen_during
from radix_sync.policy.calibration import UseCalibration
from radix_sync.policy.cost import CostProfile
from radix_sync.policy.demotion import DemotionGate
from radix_sync.policy.ledger import CopyLedger, LedgerConfig
from radix_sync.policy.snapshot import REPLICA, ClusterSnapshot, HolderView, RequestView, Route, WorkerView
from radix_sync.policy.tracker import NodeTracker
from radix_sync.sim.cache import Directory, worker_cache
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.cores import FrontEndJobs
from radix_sync.sim.demote import demote_on, demote_others
from radix_sync.sim.metrics import RunStats
from radix_sync.sim.network import CopyRecord, Network, Transfer, reestimate_pending
from radix_sync.sim.policies import PolicyBundle
from radix_sync.sim.views import (LoadViews, cached_lens, gate_fields, hint_planner, hinted, host_lens, prefix_views,
                                  shadow_hit)
from radix_sync.sim.worker import IDLE, SimWorker
from radix_sync.sim.workload import SimRequest, Workload

ARRIVE, ITER, XFER, EXPIRE, TICK, START, REPORT, POLL, FRONTEND = range(9)
PERIODIC = (TICK, REPORT, POLL, FRONTEND)
PENDING_TIMEOUT_S = 30.0
"""A planned copy whose source has not got the pages this long after the expected time is dropped, s."""


class Engine:
    """Runs one policy over one workload. Owns the workers, the directory, the network and the event heap."""

    def __init__(self, profile: CostProfile, workload: Workload, policy: PolicyBundle, cfg: EngineConfig,
                 progress: Optional[Callable[[float], None]] = None) -> None:
        self.p = profile
        self.wl = workload
        self.policy = policy
        self.cfg = cfg
        self.page_len = workload.page_len
        self.directory = Directory()
        self.host_directory = Directory()  # pages in the workers' host tiers (`EngineConfig.host_tier_ratio`)
        oracle_pages = set() if policy.oracle else None
        self.workers = [SimWorker(i, profile, worker_cache(i, profile, cfg, self.page_len, self.directory,
                                                           self.host_directory, oracle_pages), self)
                        for i in range(cfg.num_workers)]
        self.routers = policy.doors or (policy.router,)  # (N front doors: the k-th request to door k mod N)
        self._doors = itertools.count()
        for priced in (*self.routers, policy.planner) if cfg.host_tier_ratio and cfg.host_tier_priced else ():
            if hasattr(priced, "host_load_bytes_per_s"):
                priced.host_load_bytes_per_s = cfg.host_load_bytes_per_s
        self.net = Network(cfg.num_workers, profile.nic_bandwidth_bytes_per_s, profile.transfer_latency_s)
        self.stats = RunStats(policy.name, profile, self.page_len, cfg.record_requests)
        predictor = policy.planner.predictor if policy.planner else policy.predictor
        self.tracker = NodeTracker(predictor) if predictor is not None else None
        gate = policy.demotion_gate if policy.demote_stale else None
        self.demotion_gate = DemotionGate(gate) if gate is not None else None
        cal = policy.use_calibration if policy.planner is not None else None
        self.calibration = UseCalibration(cal) if cal is not None else None  # (fed here, read by the planner)
        if policy.planner is not None:
            policy.planner.calibration = self.calibration
        self.ledger = CopyLedger(LedgerConfig(holdout=cfg.ledger_holdout)) if cfg.ledger_holdout and \
            policy.planner is not None and not policy.shadow else None  # (the coordinator's, as live)
        self._copy_ids = itertools.count(1)
        self.inflight: list[Transfer] = []
        self.pending: list[Transfer] = []
        """Planned copies waiting for their source to hold the pages (also listed in `inflight`)."""
        self.copies: list[dict[int, list[CopyRecord]]] = [{} for _ in range(cfg.num_workers)]
        """Per worker, the copies it received and still counts, by each record's first page."""
        self.copy_starts: list[dict[int, int]] = [{} for _ in range(cfg.num_workers)]
        """Per worker, how many of its copy records start at each page index (`lo`): the few places to look."""
        self.shadow: list[dict] = []
        self._heap: list = []
        self._seq = 0
        self.now = 0.0
        self._progress = progress
        self._needs_cached = policy.router.uses_cached_len or self.tracker is not None
        self._no_views = (None,) * cfg.num_workers
        self.loads = LoadViews(self)
        self.on_boundary = self.loads.at_boundary  # (`WorkerHost.on_boundary`: where the live agent reports)
        self.frontend = FrontEndJobs(cfg.frontend_cpu_s if cfg.shared_cores > 0 else 0.0)
        self._num_events = 0
        """Events in the heap other than the periodic ones (ticks, load reports): the run ends when none is left."""
        self.pull_log: deque = deque()
        """(start, source, target) of the critical-path pulls, oldest first (trimmed by `views.gate_fields`)."""

    # ---- events ----
    def _push(self, t: float, kind: int, obj, version: int = 0) -> None:
        if kind not in PERIODIC:
            self._num_events += 1
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj, version))

    def core_speed(self) -> float:
        """Speed of an iteration now (1.0 = the profile's time) when the workers share `EngineConfig.shared_cores`
        cores: min(1, cores / (busy workers + front-end jobs running))."""
        busy = sum(1 for w in self.workers if w.state != IDLE) + len(self.frontend)
        return min(1.0, self.cfg.shared_cores / busy) if busy else 1.0

    def on_busy_changed(self, now: float) -> None:
        """A worker or a front-end job started or stopped (`shared_cores` only): every iteration in progress
        (prefill or decode) and every front-end job continues at the speed the cores now allow."""
        fe = self.frontend if self.frontend.cpu_s > 0 else None
        if fe is not None:
            fe.advance(now)
        speed = self.core_speed()
        for w in self.workers:
            if w.state != IDLE and w.ps_speed != speed:
                w.reshare(now, speed)
        if fe is not None and (t := fe.respeed(now, speed)) is not None:
            self._push(t, FRONTEND, None, fe.version)

    def schedule_iter_end(self, worker: SimWorker, t: float) -> None:
        self._push(t, ITER, worker, worker.version)

    @frozen_during  # (the workload and what the engine built from it, out of the collector's walks)
    def run(self) -> RunStats:
        """Runs to completion. Returns: the statistics."""
        for r in self.wl.open_requests:
            self._push(r.arrival_s, ARRIVE, r)
        for t, s in self.wl.session_starts:
            self._push(t, START, s)
        if self.policy.planner is not None:
            self._push(self.cfg.tick_s, TICK, None)
        if self.loads.stale:
            for w in self.workers:
                self._push(self.loads.first_report_s(w.wid), REPORT, w.wid)
        for k, r in enumerate(self.routers):  # (N gateways' polls, their phases spread over the period)
            if r.poll_period_s > 0:
                self._push(r.poll_phase_s + r.poll_period_s * k / len(self.routers), POLL, k)
        heap = self._heap
        next_report = 0.0
        while heap:
            t, _, kind, obj, version = heapq.heappop(heap)
            self.now = t
            if kind not in PERIODIC:
                self._num_events -= 1
            if kind == ITER:
                if version == obj.version:
                    obj.on_iter_end(t)
            elif kind == ARRIVE:
                self._arrive(obj, t)
            elif kind == START:
                req = self.wl.session_request(obj, t)
                if req is not None:
                    self._arrive(req, t)
            elif kind == XFER:
                self._landed(obj, t)
            elif kind == EXPIRE:
                self._expire(obj, t)
            elif kind == TICK:
                self._tick(t)
                if self._num_events:
                    self._push(t + self.cfg.tick_s, TICK, None)
            elif kind == REPORT:
                nxt = self.loads.periodic(obj, t)
                if self._num_events:
                    self._push(nxt, REPORT, obj)
            elif kind == FRONTEND:
                if version == self.frontend.version:
                    self.frontend.finish(t)
                    self.on_busy_changed(t)
            elif kind == POLL:  # a router's own poll of every worker (smg's load monitor)
                self.routers[obj].on_poll(tuple([w.loads_report(t) for w in self.workers]), t)
                if self._num_events:
                    self._push(t + self.routers[obj].poll_period_s, POLL, obj)
            if self._progress is not None and t >= next_report:
                self._progress(t)
                next_report = t + 1.0
        self.stats.finish(len(self.workers))
        return self.stats

    # ---- requests ----
    def _arrive(self, req: SimRequest, now: float) -> None:
        req.arrival_s = now
        if self.frontend.cpu_s > 0:
            self.frontend.start(now)
            self.on_busy_changed(now)
        self.stats.on_arrival(req)
        workers = self.workers
        cached: tuple = ()
        inflight: tuple = ()
        if self.pending:
            reestimate_pending(self.pending, self.net, self.tracker.nodes, now)
        if self._needs_cached:
            page = self.page_len
            cached = cached_lens(self, req)
            if self.inflight:
                n = len(req.pages)
                inflight = tuple(HolderView(x.dst, REPLICA, x.hi * page, None, x.end_s) for x in self.inflight
                                 if x.hi <= n and req.pages[x.hi - 1] == x.pages[x.hi - 1])
            req.global_match_len = max(cached) // page if cached else 0
            if self.tracker is not None:
                if req.global_match_len:
                    prev = self.tracker.nodes.get(req.pages[req.global_match_len - 1])
                    req.followup = prev is not None and prev.last_finish_s is not None
                node = self.tracker.on_arrival(req.pages, req.global_match_len, req.class_key, req.namespace,
                                               req.prompt_len, page, now)
                if node is not None and self.shadow:
                    shadow_hit(self, node.node_id, now)
        view = RequestView(req.rid, req.prompt_len, req.output_len, req.namespace, req.pages, cached, inflight,
                           req.class_key, host_lens(self, req, cached))
        router = self.routers[(door := next(self._doors) % len(self.routers))]
        req.door = door
        route = router.route(view, self.loads.views(now, door) if router.uses_worker_views else self._no_views, now)
        if self.calibration is not None:  # (the turn its session's copies are for; the requests on popular prefixes)
            self.calibration.arrival(req.pages, req.global_match_len, route.worker_id if req.followup else None, now)
        self._execute_route(req, route, now)
        if req.hint_fanout and self.policy.planner is not None:
            hint_planner(self, req, route, now)
            self._tick(now)

    def _execute_route(self, req: SimRequest, route: Route, now: float) -> None:
        w = self.workers[route.worker_id]
        req.ready_s = now
        if route.pull_from is not None and not self.policy.shadow:
            src = self.workers[route.pull_from]
            hi = min(route.pull_len // self.page_len, src.cache.match_len(req.pages))
            lo = w.cache.match_len(req.pages)
            if hi > lo:
                x = self._start_transfer("pull", route.pull_from, route.worker_id, req.pages, lo, hi, now)
                if self.policy.planner is not None:
                    self.pull_log.append((now, route.pull_from, route.worker_id))
                req.ready_s = x.end_s
                req.est_cached = hi * self.page_len
        elif route.wait_inflight:
            best = None
            for x in self.inflight:
                if (x.dst == route.worker_id and x.hi <= len(req.pages)
                        and req.pages[x.hi - 1] == x.pages[x.hi - 1]):
                    if best is None or x.hi > best.hi:
                        best = x
            if best is not None:
                req.ready_s = best.end_s
                req.est_cached = best.hi * self.page_len
                if best.pending:
                    req.ready_s = float("inf")  # until the copy is booked and lands
                    best.waiters.append(req)
        w.enqueue(req, now)
        self.loads.on_routed(req, now, route.pull_from is None and not route.wait_inflight)

    def on_admit(self, worker: SimWorker, req: SimRequest, matched_pages: int, now: float) -> None:
        """A request was admitted with `matched_pages` cached: account copies it uses."""
        if self.demotion_gate is not None:  # (what an earlier demotion's session did: before this one decides)
            self.demotion_gate.observe(req.pages, worker.wid, now)
        # only when this worker holds all of the turn it follows (not just a shared part of it)
        if (req.followup and matched_pages and matched_pages >= req.global_match_len and self.policy.demote_stale
                and worker.cache.oracle_pages is None):
            demote_others(self.workers, self.directory.holders, self.demotion_gate, worker.wid, req.pages,
                          matched_pages, now)
        by_first = self.copies[worker.wid]
        if not by_first or matched_pages == 0:
            return
        pages = req.pages
        used = 0
        # NOTE: page hashes are chained, so a record whose first page is pages[i] starts at i: the records this
        # request can use are found at the few indices where the worker's records start, not by scanning every
        # matched page or every copy the worker ever received
        hits = [rec for lo in sorted(self.copy_starts[worker.wid]) if lo < matched_pages
                for rec in by_first.get(pages[lo], ())]
        for rec in hits:
            if now <= rec.active_until_s:
                u = min(matched_pages, rec.hi) - rec.lo
                if u > 0:
                    rec.num_hits += 1
                    used += u
                    if rec.kind != "pull" and not rec.promoted and worker.cache.oracle_pages is None:
                        if rec.kind == "replica":  # (a host copy's pages came back as ordinary cache)
                            worker.cache.tree.promote(pages[matched_pages - 1])
                        rec.promoted = True
                        if self.calibration is not None:
                            self.calibration.used(rec.copy_id, now)
        if used:
            req.copy_hit_len = used * self.page_len
            self.stats.on_copy_hit(req, matched_pages * self.page_len)

    def on_first_token(self, req: SimRequest, now: float) -> None:
        self.loads.on_started(req, now)
        self.routers[req.door].on_first_token(req.worker, req.rid, now)
        if self.pending:
            self._start_pending(req.worker, now)

    def on_reject(self, req: SimRequest, now: float) -> None:
        self.stats.num_rejected += 1
        self.loads.on_done(req, now)
        self.routers[req.door].on_finished(req.worker, req.rid, now)

    def on_finish(self, req: SimRequest, now: float) -> None:
        self.stats.on_finish(req)
        self.loads.on_done(req, now)
        self.routers[req.door].on_finished(req.worker, req.rid, now)
        if self.ledger is not None and req.first_token_s >= 0:  # (the routers' `FinishReport.ttft_s`)
            self.ledger.finished(req.pages, req.first_token_s - req.arrival_s, now)
        if self.tracker is not None:
            fanout, delay = hinted(req, self.cfg.hint_jitter, req.hint_delay_s) if req.hint_fanout else (0, 0.0)
            self.tracker.on_finish(req.pages, req.class_key, req.namespace, req.stop, now, fanout, delay)
            if req.hint_fanout and self.policy.planner is not None:
                self._tick(now)  # an explicit hint triggers a planning pass at once, as the coordinator does
        s = req.session
        if s is None:
            return
        if req.hint_fanout and hasattr(self.wl, "branch_requests"):
            t = now + req.hint_delay_s
            if t <= self.cfg.duration_s:
                for r in self.wl.branch_requests(s, t):
                    self._push(t, ARRIVE, r)
            return
        think = self.wl.next_think_s(s)
        if think is None:
            return
        t = now + think
        if t <= self.cfg.duration_s:
            nxt = self.wl.session_request(s, t)
            if nxt is not None:
                self._push(t, ARRIVE, nxt)

    # ---- copies ----
    def _start_transfer(self, kind: str, src: int, dst: int, pages: list, lo: int, hi: int, now: float,
                        node_id: int = 0, ttl_s: float = 0.0) -> Transfer:
        x = Transfer(kind, src, dst, pages, lo, hi, 0, now, now, node_id, ttl_s)
        self.inflight.append(x)
        self._book(x, now)
        return x

    def _book(self, x: Transfer, now: float) -> None:
        x.num_bytes = (x.hi - x.lo) * self.page_len * self.p.kv_bytes_per_token
        if self.cfg.endpoint_wait:  # gathered after the source's iteration in progress, installed after the target's
            now = max(now, self.workers[x.src].busy_until_s(now), self.workers[x.dst].busy_until_s(now))
        x.start_s, x.end_s = self.net.book(x.src, x.dst, x.num_bytes, now)
        x.src_lock = x.pages[x.hi - 1]
        self.workers[x.src].cache.lock(x.src_lock)
        x.pending = False
        for r in x.waiters:
            r.ready_s = x.end_s
        self._push(x.end_s, XFER, x)
        self.stats.on_copy_started(x)

    def _future_source(self, worker: int, node, hi: int) -> tuple[bool, Optional[Transfer], float]:
        """Whether `worker` will hold the node's first `hi` pages (a copy to it in flight, or its own prefill of
        the hinted prompt): (yes, the copy it waits for, expected time)."""
        last = node.pages[hi - 1]
        for x in self.inflight:
            if x.dst == worker and x.hi >= hi and x.pages[hi - 1] == last:
                return True, x, x.end_s
        if node.owner == worker:
            return True, None, max(self.now, node.owner_eta_s)
        return False, None, 0.0

    def _plan_pending(self, kind: str, src: int, dst: int, node, lo: int, hi: int, parent: Optional[Transfer],
                      ready_s: float, ttl_s: float, now: float) -> Transfer:
        nbytes = (hi - lo) * self.page_len * self.p.kv_bytes_per_token
        start, end = self.net.estimate(src, dst, nbytes, max(now, ready_s))
        x = Transfer(kind, src, dst, node.pages, lo, hi, nbytes, start, end, node.node_id, ttl_s, None, True, parent)
        self.inflight.append(x)
        self.pending.append(x)
        return x

    def _start_pending(self, worker: int, now: float) -> None:
        """`worker` got new pages: books the pending copies from it whose pages it now holds."""
        cache = self.workers[worker].cache
        for x in [x for x in self.pending if x.src == worker]:
            if cache.match_len(x.pages[: x.hi]) < x.hi:
                continue
            self.pending.remove(x)
            x.lo = self.workers[x.dst].cache.match_len(x.pages[: x.hi])
            if x.lo >= x.hi:
                self._cancel(x, now)
            else:
                self._book(x, now)

    def _cancel(self, x: Transfer, now: float) -> None:
        """Drops a copy that will not happen; requests waiting for it go ahead."""
        if x.copy_id and self.calibration is not None:
            self.calibration.dropped(x.copy_id)
        if x in self.pending:
            self.pending.remove(x)
        self.inflight.remove(x)
        for r in x.waiters:
            r.ready_s = now
        if x.waiters:
            self.workers[x.dst].poke(now)
        for y in [y for y in self.pending if y.parent is x]:
            self._cancel(y, now)

    def _landed(self, x: Transfer, now: float) -> None:
        self.inflight.remove(x)
        for r in x.waiters:
            r.ready_s = min(r.ready_s, now)
        self.workers[x.src].cache.unlock(x.src_lock)
        w = self.workers[x.dst]
        cache = w.cache
        lo = cache.match_len(x.pages[: x.hi])
        host = x.kind == "host" and cache.host is not None  # (its LRU, not a TTL, decides how long it stays)
        if lo < x.hi and (host or cache.make_room((x.hi - lo) * self.page_len)):
            if host:
                cache.host.add_chain(x.pages[lo:x.hi])
            else:
                cache.insert(x.pages, x.hi, now, replica=(x.kind == "replica" and not self.policy.replicas_ordinary))
                cache.tree.touch(x.pages[x.hi - 1], now)
            until = now + x.ttl_s if x.kind == "replica" else now + 3600.0
            rec = CopyRecord(x.kind, x.dst, x.lo, x.hi, x.pages[x.lo], x.pages[x.hi - 1], x.num_bytes, until,
                             copy_id=x.copy_id, inserted=x.hi - lo)
            self.copies[x.dst].setdefault(rec.first_page, []).append(rec)
            starts = self.copy_starts[x.dst]
            starts[rec.lo] = starts.get(rec.lo, 0) + 1
            self.stats.copy_records.append(rec)
            if x.kind == "replica":
                self._push(until, EXPIRE, rec)
        elif lo < x.hi:
            self.stats.num_copy_failed += 1
            if x.copy_id and self.calibration is not None:
                self.calibration.dropped(x.copy_id)
        if self.pending:
            if cache.match_len(x.pages[: x.hi]) >= x.hi:
                self._start_pending(x.dst, now)
            else:
                for y in [y for y in self.pending if y.parent is x]:
                    self._cancel(y, now)
        w.poke(now)

    def _expire(self, rec: CopyRecord, now: float) -> None:
        by_first = self.copies[rec.worker]
        same = by_first.get(rec.first_page, [])
        if rec in same:
            same.remove(rec)
            if not same:
                del by_first[rec.first_page]
            starts = self.copy_starts[rec.worker]
            starts[rec.lo] -= 1
            if not starts[rec.lo]:
                del starts[rec.lo]
        if not rec.promoted:  # (landed as ordinary cache: at most the pages it added)
            c = self.workers[rec.worker].cache
            c.tree.drop_replica_chain(rec.last_page, c._on_evict, rec.inserted if self.policy.replicas_ordinary else 0)

    # ---- planner ----
    def worker_views(self, now: float) -> tuple[WorkerView, ...]:
        """Returns: every worker's load as the first router and the coordinator see it (`LoadViews.views`)."""
        return self.loads.views(now)

    def _tick(self, now: float) -> None:
        for x in [x for x in self.pending if now - x.start_s > PENDING_TIMEOUT_S]:
            self._cancel(x, now)  # the source never got the pages (its prefill was rejected, its copy dropped)
        planner = self.policy.planner
        for n in self.tracker.prune(now, planner.cfg.demote_idle_p, planner.cfg.demote_horizon_s):
            if not (self.policy.shadow or self.policy.oracle):
                last = n.pages[n.num_pages - 1]
                demote_on(self.workers, self.directory.holders.get(last, 0), last)
        if not self.tracker.nodes:
            return
        reestimate_pending(self.pending, self.net, self.tracker.nodes, now)
        if self.calibration is not None:
            self.calibration.tick(now)
        views = gate_fields(self, self.loads.planner_views(now), now)
        snap = ClusterSnapshot(views, prefix_views(self, views, now), (), self.page_len,
                               self.p.kv_bytes_per_token)
        for d in self.policy.planner.plan(snap, now):
            n = self.tracker.nodes.get(d.node_id)
            if n is None:
                continue
            hi = min(d.depth_len // self.page_len, n.num_pages)
            src, dst = self.workers[d.source].cache, self.workers[d.target].cache
            ready, parent, ready_s = True, None, now
            if src.match_len(n.pages[:hi]) < hi:
                ready, parent, ready_s = self._future_source(d.source, n, hi)
                if not ready:
                    continue
                ready = False
            lo = dst.match_len(n.pages[:hi])
            if lo >= hi:
                continue
            if self.policy.shadow:
                nbytes = (hi - lo) * self.page_len * self.p.kv_bytes_per_token
                _, land = self.net.estimate(d.source, d.target, nbytes, max(now, ready_s))
                self.shadow.append(dict(node=d.node_id, target=d.target, depth=hi, bytes=nbytes, land_s=land,
                                        ttl_s=d.ttl_s, useful=False))
                self.stats.on_shadow_copy(nbytes)
                continue
            if self.ledger is not None and not self.ledger.assign(d.node_id, now):
                continue  # held out, or the planner paused: its copies shown to cost (live: `Coordinator._tick`)
            kind = "host" if d.tier == "host" else "replica"  # (a copy into the target's host tier, or its pool)
            if ready:
                x = self._start_transfer(kind, d.source, d.target, n.pages, lo, hi, now, d.node_id, d.ttl_s)
            else:
                x = self._plan_pending(kind, d.source, d.target, n, lo, hi, parent, ready_s, d.ttl_s, now)
            if self.calibration is not None:
                x.copy_id = next(self._copy_ids)
                self.calibration.decided(x.copy_id, d.kind, d.expected_count, now, d.node_id, d.target)
        if self.shadow:
            self.shadow = [s for s in self.shadow if s["land_s"] + s["ttl_s"] >= now]
