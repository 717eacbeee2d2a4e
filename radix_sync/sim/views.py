"""The load views the simulated router and coordinator decide on: exact, or as stale as the live load reports.

Live, each worker reports its load every 200 ms (its own timer; SGLang's decode batch as running and its waiting
queue, without the requests being prefilled; the queue's uncached tokens, or whole prompts:
`EngineConfig.prompt_token_reports`), and the router merges the last report with what it has itself sent there
since (`radix_sync.router.policy.with_local_load`: requests sent and not finished raise the queue, the prefill work
of those not started raises the queued tokens) and ranks on it (`rank_by_ttft`: an iteration in progress is a
decode step at most; its own work at a worker that was idle when it went there has been computing since).
`LoadViews` does the same here:

    worker i reports at (k + i / N) x period          (phases spread, as independent timers are)
    view(i, now) = report(i) merged with the router's own counts for i, links as booked now

(Before stop 54 a view kept the report's end of the iteration in progress as busy and counted the prefill in
progress again in the router's own counts: the simulated router saw a worker computing a prefix as busy for the rest
of that iteration plus the whole prefill, and sent the next request with the prefix to compute it cold elsewhere,
where the live router waited for it.)

With `EngineConfig.view_staleness_s = 0` every view is the worker's exact state at `now` (the old model). Link
fields (`egress_busy_until_s`, `ingress_busy_until_s`) are always exact: the control plane books the copies itself.

Owned by the engine (`radix_sync.sim.engine.Engine`); it calls `report` on each report event and the `on_*` hooks
as requests are routed, start and finish.
"""

from __future__ import annotations

import math
import random
import zlib

from radix_sync.policy.candidates import all_busy, busy_mask, is_candidate
from radix_sync.policy.forecast import drained, own_prefill_s, split_iteration
from radix_sync.policy.routers import ExpectedTtftRouter
from radix_sync.policy.snapshot import OWNER, REPLICA, HolderView, PrefixView, WorkerView
from radix_sync.sim.worker import DECODE, PREFILL
from radix_sync.sim.workload import SimRequest, request_key

_new = tuple.__new__
_NO_GATE = (0, 0, 0, 0, 0.0, 0.0)
_NEVER = float("inf")
"""The gate's fields of a `WorkerView` (pending link bytes, incoming and waited-for tokens, pull rates), zero in the
views routers get at every arrival; `gate_fields` fills them for the planner's snapshot."""
PULL_RATE_WINDOW_S = 30.0
"""Critical-path pulls are counted over this window for the gate's pull rates, s."""


class LoadViews:
    """Per-worker views (exact, or last report + the router's own sends)."""

    def __init__(self, engine) -> None:
        """Args:
            engine: the `radix_sync.sim.engine.Engine` (its config, workers, network and profile are read)."""
        self.eng = engine
        self.period_s = engine.cfg.view_staleness_s
        n = engine.cfg.num_workers
        self.reports: list = [None] * n
        """The last report of each worker (None: none yet: the worker as it was at the start, idle and empty)."""
        self.last_report_s = [-1e18] * n
        """When each worker last reported (its next report is due `period_s` after)."""
        self.previous: list = [None] * n
        """The report before each worker's last (what a router sending at the instant of the last still saw)."""
        self.iteration_s = [0.0] * n
        """Each worker's reported iteration time (`SimWorker.iteration_s` at its last report)."""
        self.own = [OwnSends(n) for _ in range(len(engine.routers))]
        """Each front door's router's own counts (`OwnSends`), by door (`SimRequest.door`)."""
        self.relay_s = engine.cfg.door_sends_s if len(engine.routers) > 1 else None
        for router in engine.routers if self.relay_s is not None else ():
            if hasattr(router, "peers"):  # (each door hears of the others: the live relay's routers serving)
                router.peers = len(engine.routers) - 1
        self.sent: list[dict] = [{} for _ in range(n)]
        """With `EngineConfig.door_sends_s`: per worker, every door's requests sent there and not seen end by every
        door, rid -> [sent at, door, new tokens, cached tokens, attention pairs, started at, ended at] (`_NEVER`: not
        yet)."""

    @property
    def stale(self) -> bool:
        return self.period_s > 0

    def first_report_s(self, wid: int) -> float:
        """Returns: the time of worker `wid`'s first report (its phase)."""
        return self.period_s * wid / self.eng.cfg.num_workers

    def exact(self, w, now: float, budget_cap: int, page: int, bw: float) -> WorkerView:
        """Returns: the exact view of worker `w` at `now`."""
        c, tree, i, na = w.cache, w.cache.tree, w.wid, w.num_admitted
        state = w.state
        busy = w.iter_end_s if state == PREFILL else (w.busy_until_s(now) if state == DECODE else now)
        budget = budget_cap - tree.num_replica_pages * page
        net = self.eng.net
        # every field in order, through tuple.__new__: the NamedTuple's own __new__ is a Python-level call
        return _new(WorkerView, (
            i, "", len(w.running) + na, len(w.waiting) - na, w.waiting_new_tokens, w.waiting_cached_tokens,
            w.waiting_attn_pairs, w.sum_ctx, busy,
            c.capacity_tokens - len(tree.nodes) * page - c.reserved_tokens,
            budget if budget > 0 else 0, net.egress_free_s[i], net.ingress_free_s[i], bw, 0.0,
            tree.num_replica_pages * page, tree.num_evict_first_stale_pages * page) + _NO_GATE)

    def _consts(self) -> tuple[int, int, float]:
        eng = self.eng
        return int(eng.cfg.replica_budget_frac * eng.p.kv_capacity_tokens), eng.page_len, eng.p.nic_bandwidth_bytes_per_s

    def periodic(self, wid: int, now: float) -> float:
        """Worker `wid`'s report timer fired at `now`: it reports if one is due and it is not in a prefill (the live
        agent reports from SGLang's scheduler loop, between iterations: a decode step is short, a prefill is not,
        and its report waits for the boundary, `at_boundary`). Returns: when to look again."""
        due = self.last_report_s[wid] + self.period_s
        if now >= due - 1e-9 and self.eng.workers[wid].state != PREFILL:
            self.report(wid, now)
            due = now + self.period_s
        return due if due > now else now + self.period_s

    def at_boundary(self, w, now: float) -> None:
        """Worker `w` is between iterations, its arrivals queued and its next batch not formed (where the live
        agent's hook runs, after SGLang's `ingest_requests`): it reports when one is due, or at once when it has
        nothing to do and its last report had work (the agent's report on going idle)."""
        if not self.stale:
            return
        wid = w.wid
        last = self.reports[wid]
        if (now >= self.last_report_s[wid] + self.period_s - 1e-9
                or (not w.waiting and not w.running and last is not None and last[2] + last[3])):
            self.report(wid, now)

    def report(self, wid: int, now: float) -> None:
        """Worker `wid` sends its load report at `now`, as the live agent reports SGLang's scheduler: its decode batch
        as running, its waiting queue (not the requests being prefilled: SGLang has taken them off the queue) with
        their uncached tokens (or whole prompts: `EngineConfig.prompt_token_reports`)."""
        w = self.eng.workers[wid]
        r = self.exact(w, now, *self._consts())
        queue = [q for q in w.waiting if not q.admitted]
        if self.eng.cfg.prompt_token_reports:
            new, cached, pairs = sum(q.prompt_len for q in queue), 0, 0.0
        else:
            new, cached, pairs = (sum(q.est_new for q in queue), sum(q.est_cached for q in queue),
                                  sum(q.est_pairs for q in queue))
        self.iteration_s[wid] = w.iteration_s
        self.last_report_s[wid], self.previous[wid] = now, self.reports[wid]
        self.reports[wid] = r._replace(num_running=len(w.running), waiting_new_tokens=new,
                                       waiting_cached_tokens=cached, waiting_attn_pairs=pairs,
                                       waiting_cached_pairs=0.0)

    def views(self, now: float, door: int = 0) -> tuple[WorkerView, ...]:
        """Returns: every worker's view at `now`, as front door `door`'s router (the first: the coordinator's) sees
        it: the last reports merged with that router's own sends."""
        cap, page, bw = self._consts()
        workers = self.eng.workers
        if not self.stale:
            return tuple([self.exact(w, now, cap, page, bw) for w in workers])
        net = self.eng.net
        router, own = self.eng.routers[door], self.own[door]
        cost = router.cost if isinstance(router, ExpectedTtftRouter) else None
        step = self.eng.p.decode_step_s
        drain = cost is not None and router.count_sent
        out = []
        for w in workers:
            i = w.wid
            r = self.reports[i]
            if r is None:
                r = self.reports[i] = _new(WorkerView, (i, "", 0, 0, 0, 0, 0.0, 0, 0.0, w.cache.capacity_tokens,
                                                        cap, 0.0, 0.0, bw, 0.0, 0, 0) + _NO_GATE)
            # NOTE: as `with_local_load`: what this router sent and has not seen finish bounds the queue from below;
            # as the live router's ranking (`rank_by_ttft`): an iteration in progress is a decode step at most (a
            # prefill in progress is the router's own queued work until its first token)
            sent, tokens, cached, pairs = (own.outstanding[i], own.queued_tokens[i], own.queued_cached[i],
                                           own.queued_pairs[i])
            if self.relay_s is not None and self.sent[i]:  # (the other doors' events, relayed to this one)
                seen = now - self.relay_s
                for t0, d, new, c, p, started, ended in self.sent[i].values():
                    if d != door and t0 <= seen and not ended <= seen:
                        sent += 1
                        if not started <= seen:
                            tokens, cached, pairs = tokens + new, cached + c, pairs + p
            v = _new(WorkerView, (
                i, r[1], r[2], max(r[3], sent - r[2]), max(r[4], tokens), max(r[5], cached),
                max(r[6], pairs), r[7], now + step if r[2] else now, r[9], r[10],
                net.egress_free_s[i], net.ingress_free_s[i], r[13], own.queued_cpairs[i], r[15], r[16]) + _NO_GATE)
            if cost is not None and own.num_queued[i]:
                v = own.work(cost, v, i, now, drain, router.over_s(i))
            out.append(v)
        return tuple(out)

    def planner_views(self, now: float) -> tuple[WorkerView, ...]:
        """Returns: every worker's view at `now` as the live coordinator's planner sees it
        (`LivePlanner._worker_views`): the last report alone (it does not know what routers sent since), no
        attention work, busy half an iteration from now when the report shows requests, its queued work done for
        the report's age; exact views when not stale."""
        if not self.stale:
            return self.views(now)
        cap, page, bw = self._consts()
        net, cost = self.eng.net, (self.eng.policy.planner or self.eng.policy.router).cost
        out = []
        for w in self.eng.workers:
            i = w.wid
            r = self.reports[i]
            if r is None:
                out.append(_new(WorkerView, (i, "", 0, 0, 0, 0, 0.0, 0, now, w.cache.capacity_tokens, cap,
                                             net.egress_free_s[i], net.ingress_free_s[i], bw, 0.0, 0, 0) + _NO_GATE))
                continue
            busy = now + 0.5 * self.iteration_s[i] if r[2] + r[3] else now
            v = _new(WorkerView, (i, r[1], r[2], r[3], r[4], 0, 0.0, 0, busy, r[9], r[10], net.egress_free_s[i],
                                  net.ingress_free_s[i], r[13], 0.0, r[15], r[16]) + _NO_GATE)
            # (taken between iterations `age` ago: its queued prefills have computed since, as the live planner's)
            out.append(drained(cost, v, now - self.last_report_s[i], now) if r[3] else v)
        return tuple(out)

    def on_routed(self, req: SimRequest, now: float = 0.0, plain: bool = True) -> None:
        """`req` was sent to `req.worker` at `now` through front door `req.door` (after `SimWorker.enqueue` set its
        estimates); `plain`: not held for a copy (with one, it waits for the copy to land before it starts)."""
        if not self.stale:
            return
        i = req.worker
        # (a report taken at the send's instant, its arrival queued at the worker's boundary, reaches the router after)
        r = self.previous[i] if self.last_report_s[i] == now else self.reports[i]
        self.own[req.door].on_routed(req, now, plain and (r is None or not (r[2] or r[3] or r[4])))
        if self.relay_s is not None:
            sent = self.sent[i]
            if len(sent) > 64:  # (drop what every door has seen end)
                over = now - self.relay_s
                for rid in [rid for rid, rec in sent.items() if rec[6] < over]:
                    del sent[rid]
            sent[req.rid] = [now, req.door, req.est_new, req.est_cached, req.est_pairs, _NEVER, _NEVER]

    def on_started(self, req: SimRequest, now: float = 0.0) -> None:
        """`req` streamed its first token at `now`: its prefill is no longer queued work (the other doors learn it
        `EngineConfig.door_sends_s` later, as its send)."""
        self.own[req.door].on_started(req)
        if self.relay_s is not None:
            rec = self.sent[req.worker].get(req.rid)
            if rec is not None and rec[5] == _NEVER:
                rec[5] = now

    def on_done(self, req: SimRequest, now: float = 0.0) -> None:
        """`req` finished or was rejected at `now` (the other doors learn it `door_sends_s` later)."""
        if self.stale:
            self.own[req.door].on_done(req)
            if self.relay_s is not None:
                rec = self.sent[req.worker].get(req.rid)
                if rec is not None:
                    rec[6] = now


class OwnSends:
    """One router's own counts per worker: its requests sent there and not finished, and the prefill work of those not
    started (what it merges with the workers' last reports: the live router's `with_local_load`)."""

    def __init__(self, n: int) -> None:
        self.outstanding = [0] * n
        self.queued_tokens = [0] * n
        self.queued_cached = [0] * n
        self.queued_pairs = [0.0] * n
        self._queued: dict[int, tuple[int, int, int, float]] = {}  # rid -> (worker, new, cached, pairs)
        self.queued_cpairs = [0.0] * n
        self.num_queued = [0] * n
        self.alone_since: list = [None] * n
        """Per worker, when the first of the router's requests there not started went to it while it was idle (it
        has computed them since), None: none of them is left (the live router's `WorkerPool.alone_since`)."""

    def work(self, cost, v: WorkerView, i: int, now: float, drain: bool, over_s: float) -> WorkerView:
        """`v` with the router's own requests at worker `i` not started as the live router prices them: what of them
        has been computing since the worker was idle is done (`forecast.drained`, only when the router counts its
        sent prefixes), and the prefill iteration in progress is the first chunk of the rest
        (`forecast.split_iteration`: what a copy to or from `i` waits for); `over_s`: what the router prices of its
        requests' own prefixes as cached itself (`ExpectedTtftRouter.over_s`)."""
        own = own_prefill_s(cost, self.queued_tokens[i], self.queued_pairs[i], self.queued_cpairs[i])
        since = self.alone_since[i]
        if drain and since is not None:
            done = min(own, now - since)
            v, own = drained(cost, v, done, now), own - done
        return split_iteration(cost, v, now, max(0.0, own - over_s))

    def on_routed(self, req: SimRequest, now: float, idle: bool) -> None:
        """`req` was sent to `req.worker` at `now`; `idle`: not held for a copy, to a worker whose last report (and
        this router's counts) showed nothing to do."""
        i = req.worker
        if idle and self.outstanding[i] == 0:
            self.alone_since[i] = now  # the worker was idle: it computes this router's requests there from now on
        self.outstanding[i] += 1
        self.num_queued[i] += 1
        q = (i, req.est_new, req.est_cached, req.est_pairs)
        self._queued[req.rid] = q
        self.queued_tokens[i] += q[1]
        self.queued_cached[i] += q[2]
        self.queued_pairs[i] += q[3]
        self.queued_cpairs[i] += q[2] * (q[2] + 1) / 2.0

    def on_started(self, req: SimRequest) -> None:
        q = self._queued.pop(req.rid, None)
        if q is not None:
            i = q[0]
            self.queued_tokens[i] -= q[1]
            self.queued_cached[i] -= q[2]
            self.queued_pairs[i] -= q[3]
            self.queued_cpairs[i] -= q[2] * (q[2] + 1) / 2.0
            self.num_queued[i] -= 1
            if not self.num_queued[i]:
                self.alone_since[i] = None

    def on_done(self, req: SimRequest) -> None:
        self.on_started(req)
        self.outstanding[req.worker] -= 1


def gate_fields(eng, views: tuple[WorkerView, ...], now: float) -> tuple[WorkerView, ...]:
    """The planner's views with the gate's fields (`radix_sync.policy.gate`), as the control plane knows them: it
    books the copies itself (pending link bytes, tokens still coming in, pulls per link over the last
    `PULL_RATE_WINDOW_S`) and the router knows its own sends (the evict-first pages that requests routed to a worker
    and not yet admitted will use).

    Args:
        eng: the `radix_sync.sim.engine.Engine` (`pending`, `inflight`, `pull_log`, workers' queues and caches).
        views: the workers' views (`LoadViews.views`).
        now: current time, s.
    Returns:
        the views with `egress_pending_bytes`, `ingress_pending_bytes`, `incoming_tokens`,
        `waited_evict_first_tokens`, `egress_pull_rate_per_s`, `ingress_pull_rate_per_s` filled in.
    """
    n, page = len(views), eng.page_len
    eg, ig, inc, waited = [0] * n, [0] * n, [0] * n, [0] * n
    for x in eng.pending:
        eg[x.src] += x.num_bytes
        ig[x.dst] += x.num_bytes
    for x in eng.inflight:
        inc[x.dst] += (x.hi - x.lo) * page
    for w in eng.workers:
        seen = set()
        nodes = w.cache.tree.nodes
        for req in w.waiting:
            m = req.est_cached // page
            if req.admitted or m <= 0 or m > len(req.pages):
                continue
            last = req.pages[m - 1]
            if last in seen:
                continue
            seen.add(last)
            node = nodes.get(last)
            if node is not None and (node.replica or node.stale):
                waited[w.wid] += m * page
    log = eng.pull_log
    while log and log[0][0] < now - PULL_RATE_WINDOW_S:
        log.popleft()
    out_rate, in_rate = [0.0] * n, [0.0] * n
    for _, src, dst in log:
        out_rate[src] += 1.0 / PULL_RATE_WINDOW_S
        in_rate[dst] += 1.0 / PULL_RATE_WINDOW_S
    return tuple(v._replace(egress_pending_bytes=eg[i], ingress_pending_bytes=ig[i], incoming_tokens=inc[i],
                            waited_evict_first_tokens=waited[i], egress_pull_rate_per_s=out_rate[i],
                            ingress_pull_rate_per_s=in_rate[i]) for i, v in enumerate(views))


def prefix_views(eng, views: tuple[WorkerView, ...], now: float) -> tuple[PrefixView, ...]:
    """The candidate nodes (`radix_sync.policy.candidates`, the live coordinator's rule): those with a fan-out
    hint, a recent popularity signal, or whose every full holder is busy."""
    page = eng.page_len
    planner = eng.policy.planner
    busy = busy_mask(planner.cost, views, now, planner.cfg.min_gain_s)
    holders_of = eng.directory.holders
    ewma = eng.tracker.new_len_ewma
    flying: dict[int, list[HolderView]] = {}
    for x in eng.inflight:
        if x.kind != "pull":
            flying.setdefault(x.node_id, []).append(HolderView(x.dst, REPLICA, x.hi * page, None, x.end_s))
    out = []
    for n in eng.tracker.nodes.values():
        last = n.pages[n.num_pages - 1]
        bits = holders_of.get(last, 0)
        if not is_candidate(len(n.hit_times_s), bool(n.fanout_hint), all_busy(bits, busy)):
            continue
        hs = []
        i = 0
        while bits:
            if bits & 1:
                node = eng.workers[i].cache.tree.nodes.get(last)
                hs.append(HolderView(i, REPLICA if node is not None and node.replica else OWNER,
                                     n.num_pages * page))
            bits >>= 1
            i += 1
        if n.owner >= 0 and not (holders_of.get(last, 0) >> n.owner) & 1:
            hs.append(HolderView(n.owner, OWNER, n.num_pages * page, None, max(now, n.owner_eta_s)))
        hbits, i = eng.host_directory.holders.get(last, 0) & ~holders_of.get(last, 0), 0
        hbits = hbits if eng.cfg.host_tier_priced else 0
        while hbits:  # in a host tier: a holder to the planner (not a source: the engine copies from devices)
            if hbits & 1:
                hs.append(HolderView(i, REPLICA, n.num_pages * page))
            hbits >>= 1
            i += 1
        if n.node_id in flying:
            hs.extend(flying[n.node_id])
        for sc in eng.shadow:
            if sc["node"] == n.node_id and sc["land_s"] + sc["ttl_s"] >= now:
                hs.append(HolderView(sc["target"], REPLICA, sc["depth"] * page, None,
                                     sc["land_s"] if sc["land_s"] > now else None))
        if not hs:
            continue
        out.append(PrefixView(n.node_id, n.num_pages * page, n.namespace, n.class_key, tuple(hs),
                              tuple(n.hit_times_s), n.last_finish_s, n.last_stop, int(ewma.get(n.class_key, 0)),
                              n.fanout_hint, n.hint_at_s))
    return tuple(out)


def cached_lens(eng, req: SimRequest) -> tuple[int, ...]:
    """Returns: per worker, the tokens of `req`'s prompt its device pool holds (the exact directory's match; the
    `oracle` policy's: every page ever computed)."""
    page, plen = eng.page_len, req.prompt_len
    if eng.policy.oracle:
        return tuple(min(w.cache.match_len(req.pages) * page, plen) for w in eng.workers)
    return tuple(min(m * page, plen) for m in eng.directory.match_lens(req.pages, len(eng.workers)))


def host_lens(eng, req: SimRequest, cached: tuple[int, ...]) -> tuple[int, ...]:
    """Returns: per worker, the tokens of `req`'s prompt past its device match (`cached`) that its host tier holds
    (the host directory: what SGLang's hierarchical cache would load back); () without host tiers."""
    if not (eng.cfg.host_tier_ratio and eng.cfg.host_tier_priced) or not cached:
        return ()
    page, plen, holders, pages = eng.page_len, req.prompt_len, eng.host_directory.holders, req.pages
    out = []
    for i, c in enumerate(cached):
        k, bit = c // page, 1 << i
        j = k
        while j < len(pages) and holders.get(pages[j], 0) & bit:
            j += 1
        out.append(min(j * page, plen) - c if j > k else 0)
    return tuple(out)


def shadow_hit(eng, node_id: int, now: float) -> None:
    """A request extended node `node_id`: the shadow copies of it that would have landed and not expired were
    useful (once each)."""
    for s in eng.shadow:
        if s["node"] == node_id and s["land_s"] <= now <= s["land_s"] + s["ttl_s"] and not s["useful"]:
            s["useful"] = True
            eng.stats.on_shadow_useful(s["bytes"])


def hint_error(key: str, jitter: float) -> tuple[float, float]:
    """A hint's error, the same for a request under every policy (drawn from its content, not from run order).

    Args:
        key: the request's `request_key`.
        jitter: sigma of the log-normal errors (`EngineConfig.hint_jitter`; 0: exact hints).
    Returns:
        (factor on the hinted lead time, factor on the hinted number of branches), each exp(jitter x N(0, 1)).
    """
    if jitter <= 0:
        return 1.0, 1.0
    rng = random.Random(zlib.crc32(f"hint:{key}".encode()))
    return math.exp(jitter * rng.gauss(0.0, 1.0)), math.exp(jitter * rng.gauss(0.0, 1.0))


def hinted(req: SimRequest, jitter: float, lead_s: float) -> tuple[int, float]:
    """Returns: (branches, lead time) of `req`'s fan-out hint as the coordinator gets them: with the hint's error
    (`EngineConfig.hint_jitter`, `hint_error`: the same draw for the request under every policy)."""
    f_time, f_count = hint_error(request_key(req), jitter)
    return max(1, round(req.hint_fanout * f_count)), lead_s * f_time


def hint_planner(eng, req: SimRequest, route, now: float) -> None:
    """A request with a fan-out hint was routed: the coordinator learns the hint with the request (not when it
    finishes), with the expected end of its prefill (the router's estimate) and of its decode (the engine plans at
    once after: copies from the worker computing the prompt start as soon as it holds it)."""
    cost = eng.policy.planner.cost
    w = eng.workers[route.worker_id]
    prefilled = now + route.expected_ttft_s
    decode = cost.decode_steps_s(max(0, req.output_len - 1), w.num_running + 1, w.sum_ctx + req.prompt_len)
    fanout, lead = hinted(req, eng.cfg.hint_jitter, prefilled + decode + req.hint_delay_s - now)
    eng.tracker.on_hint(req.pages, req.class_key, req.namespace, fanout, now + lead, route.worker_id, prefilled,
                        now)
