"""Live-like load views (`radix_sync.sim.views`): stale reports merged with the router's own sends, hint error."""

import pytest

from radix_sync.policy.cost import load_profile
from radix_sync.policy.forecast import queue_wait_s
from radix_sync.policy.snapshot import Route, WorkerView
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import FanoutWorkload, GeneratorConfig
from radix_sync.sim.policies import build_policy
from radix_sync.sim.views import hint_error
from radix_sync.sim.workload import SimRequest

PROFILE = load_profile("llama3.1-8b-h200")


def engine(staleness, policy="kvrep_pull", rate=2.0, duration_s=5.0):
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=rate, duration_s=duration_s, seed=1,
                        max_context_len=PROFILE.max_context_len)
    return Engine(PROFILE, wl, build_policy(policy, PROFILE, wl.page_len, 1),
                  EngineConfig(num_workers=4, duration_s=duration_s, view_staleness_s=staleness))


def test_reports_are_phased_per_worker():
    eng = engine(0.2)
    assert [eng.loads.first_report_s(i) for i in range(4)] == pytest.approx([0.0, 0.05, 0.1, 0.15])


def test_a_stale_view_is_the_last_report_raised_by_the_routers_own_sends():
    eng = engine(0.2)
    cost = eng.policy.router.cost
    req = SimRequest(0, 1000, 10, [], arrival_s=0.0)
    eng._execute_route(req, Route(1), 0.0)
    v = eng.worker_views(0.0)[1]
    exact = eng.loads.exact(eng.workers[1], 0.0, *eng.loads._consts())
    # the worker admitted it at once (running 1, nothing waiting); no report yet: the router's own count says 1
    # queued request of 1000 new tokens, 1000 x 1001 / 2 attention pairs, as the live router counts it; its prefill
    # is in progress (the iteration a copy waits for: `split_iteration`), the wait the same
    assert (exact.num_running, exact.num_waiting) == (1, 0)
    own = queue_wait_s(cost, WorkerView(1, num_waiting=1, waiting_new_tokens=1000, waiting_attn_pairs=500500.0), 0.0)
    assert v.num_running == 0 and queue_wait_s(cost, v, 0.0) == pytest.approx(own)
    assert v.busy_until_s == pytest.approx(own - cost.profile.prefill_overhead_s * cost.prefill_scale)
    assert eng.worker_views(0.0)[0].num_waiting == 0
    # worker 1 reports at 0.005, prefilling: SGLang's waiting queue is empty and its decode batch too (as the live
    # agent reports them); the router's own count still says what it sent (the prefill is not counted twice)
    eng.loads.report(1, 0.005)
    assert eng.workers[1].num_admitted == 1
    r = eng.loads.reports[1]
    assert (r.num_running, r.num_waiting, r.waiting_new_tokens, r.waiting_attn_pairs) == (0, 0, 0, 0.0)
    # the worker has been computing it since it went there idle: only what is left of it counts
    assert queue_wait_s(cost, eng.worker_views(0.005)[1], 0.005) == pytest.approx(own - 0.005)
    # the first token: the router stops counting its prefill; a report while it decodes says running 1
    eng.loads.on_started(req)
    assert eng.loads.own[0].queued_tokens[1] == 0 and eng.loads.own[0].outstanding[1] == 1 and eng.loads.own[0].alone_since[1] is None
    eng.workers[1].running.append((99, 0, req))
    eng.loads.report(1, 0.06)
    v = eng.worker_views(0.06)[1]
    assert (v.num_running, v.num_waiting, v.waiting_new_tokens) == (1, 0, 0)
    assert v.busy_until_s == pytest.approx(0.06 + PROFILE.decode_step_s)  # a decode step, as the live router
    eng.workers[1].running.pop()
    eng.loads.on_done(req)
    assert eng.loads.own[0].outstanding[1] == 0


def test_a_request_sent_to_a_busy_worker_does_not_start_its_clock():
    eng = engine(0.2)
    a, b = SimRequest(0, 1000, 10, [], arrival_s=0.0), SimRequest(1, 500, 10, [], arrival_s=0.0)
    eng._execute_route(a, Route(1, wait_inflight=True), 0.0)  # held for a copy: it does not start at once
    assert eng.loads.own[0].alone_since[1] is None
    eng._execute_route(b, Route(2), 0.0)
    eng._execute_route(SimRequest(2, 500, 10, [], arrival_s=0.0), Route(2), 0.1)  # behind b: the clock stays
    assert eng.loads.own[0].alone_since[2] == 0.0


def test_links_are_always_as_booked_now():
    eng = engine(0.2)
    eng.net.book(0, 2, 10 ** 9, 0.0)
    v = eng.worker_views(0.0)
    assert v[0].egress_busy_until_s == eng.net.egress_free_s[0] > 0 and v[2].ingress_busy_until_s > 0


def test_zero_staleness_is_the_exact_state():
    eng = engine(0.0)
    req = SimRequest(0, 1000, 10, [], arrival_s=0.0)
    eng._execute_route(req, Route(1), 0.0)
    v = eng.worker_views(0.0)
    assert v == tuple(eng.loads.exact(w, 0.0, *eng.loads._consts()) for w in eng.workers)
    assert eng.loads.own[0].outstanding == [0, 0, 0, 0]  # nothing to merge


def test_stale_runs_complete_and_stay_deterministic():
    a = engine(0.2, "kvrep", 6.0, 20.0).run().to_dict()
    b = engine(0.2, "kvrep", 6.0, 20.0).run().to_dict()
    assert a == b and a["num_requests"] == a["num_arrived"] > 0
    assert a["ttft_s"] != engine(0.0, "kvrep", 6.0, 20.0).run().to_dict()["ttft_s"]


def test_hint_error_is_a_pure_function_of_the_request():
    assert hint_error("k", 0.0) == (1.0, 1.0)
    a = hint_error("0:100:1:abcd", 0.25)
    assert a == hint_error("0:100:1:abcd", 0.25) and a != hint_error("0:100:1:abce", 0.25)
    assert all(0.2 < f < 5.0 for f in a)  # within 6.4 sigma at sigma 0.25


def test_hint_jitter_changes_the_hints_the_planner_gets():
    seen = {}
    for jitter in (0.0, 0.5):
        wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=10.0, seed=1,
                            max_context_len=PROFILE.max_context_len)
        eng = Engine(PROFILE, wl, build_policy("kvrep", PROFILE, wl.page_len, 1),
                     EngineConfig(num_workers=4, duration_s=10.0, hint_jitter=jitter))
        hints = seen[jitter] = []
        on_hint = eng.tracker.on_hint
        eng.tracker.on_hint = lambda *a, _f=on_hint, _h=hints: (_h.append(a[3]), _f(*a))[1]
        eng.run()
    assert seen[0.0] and set(seen[0.0]) == {8}
    assert len(seen[0.5]) == len(seen[0.0]) and set(seen[0.5]) != {8}


def test_gate_fields_are_what_the_control_plane_booked_and_sent():
    from radix_sync.sim.network import Transfer, reestimate_pending
    from radix_sync.sim.views import PULL_RATE_WINDOW_S, gate_fields

    eng = engine(0.2, policy="kvrep")
    page = eng.page_len
    # worker 1 holds a 3-page replica that a queued (not admitted) request was routed to use, and an ordinary
    # 2-page prefix another queued request uses (not evict-first: not counted)
    eng.workers[1].cache.insert([11, 12, 13], 3, 0.0, replica=True)
    eng.workers[1].cache.insert([21, 22], 2, 0.0)
    for rid, pages in ((5, [11, 12, 13]), (6, [11, 12, 13]), (7, [21, 22])):
        r = SimRequest(rid, len(pages) * page + 10, 1, pages)
        r.est_cached = len(pages) * page
        eng.workers[1].waiting.append(r)
    # a copy 0 -> 2 decided but waiting for its source's pages (2 pages), and one booked 3 -> 2 (1 page)
    pend = Transfer("replica", 0, 2, [31, 32], 0, 2, 2 * page * PROFILE.kv_bytes_per_token, 0.0, 0.0, pending=True)
    eng.pending.append(pend)
    eng.inflight.append(pend)
    eng.workers[3].cache.insert([41], 1, 0.0)
    eng._start_transfer("replica", 3, 2, [41], 0, 1, 0.0)
    eng.pull_log.extend([(-100.0, 0, 3), (0.5, 3, 1)])  # the first is older than the window
    v = gate_fields(eng, eng.worker_views(1.0), 1.0)
    assert (v[0].egress_pending_bytes, v[2].ingress_pending_bytes) == (pend.num_bytes, pend.num_bytes)
    assert v[1].egress_pending_bytes == v[3].ingress_pending_bytes == 0
    assert v[2].incoming_tokens == 3 * page and v[1].incoming_tokens == 0
    assert v[1].waited_evict_first_tokens == 3 * page  # counted once for the two requests, the ordinary one not
    assert v[3].egress_pull_rate_per_s == v[1].ingress_pull_rate_per_s == pytest.approx(1 / PULL_RATE_WINDOW_S)
    assert v[0].egress_pull_rate_per_s == v[3].ingress_pull_rate_per_s == 0.0
    assert len(eng.pull_log) == 1
    # the routers' views at an arrival carry none of it
    assert eng.worker_views(1.0)[2].incoming_tokens == 0


def test_pending_copies_are_re_estimated_in_line_on_their_links():
    from radix_sync.sim.network import Transfer, reestimate_pending

    eng = engine(0.2, policy="kvrep")
    nbytes = 10 ** 9
    xfer = PROFILE.transfer_latency_s + nbytes / PROFILE.nic_bandwidth_bytes_per_s
    eng.net.book(0, 3, nbytes, 0.0)  # egress 0 busy until xfer
    a = Transfer("replica", 0, 1, [1], 0, 1, nbytes, 0.0, 0.0, pending=True)  # planned estimates: stale (0)
    b = Transfer("replica", 0, 2, [1], 0, 1, nbytes, 0.0, 0.0, pending=True)
    c = Transfer("replica", 1, 2, [1], 0, 1, nbytes, 0.0, 0.0, pending=True, parent=a)  # chained on a
    eng.pending.extend([a, b, c])
    reestimate_pending(eng.pending, eng.net, eng.tracker.nodes, 0.0)
    # a queues behind the booked copy on egress 0, b behind a; c starts when a has landed on 1 and b left ingress 2
    assert (a.end_s, b.end_s, c.end_s) == pytest.approx((2 * xfer, 3 * xfer, 4 * xfer))


def test_prompt_token_reports_count_waiting_prompts_whole_as_the_live_agent_does():
    """The live agent reports SGLang's waiting queue as the sum of its prompts (`origin_input_ids`; SGLang matches
    a prefix only when it schedules the request); with `prompt_token_reports` the simulated reports do the same,
    cached prefixes included, with no attention work; without it they carry the uncached tokens."""
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=20.0, seed=1,
                        max_context_len=PROFILE.max_context_len)
    seen = {"reports": 0, "cached_counted": 0, "admitted": 0}
    for whole in (True, False):
        eng = Engine(PROFILE, wl, build_policy("kvrep_pull", PROFILE, wl.page_len, 1),
                     EngineConfig(num_workers=2, duration_s=20.0, view_staleness_s=0.2, prompt_token_reports=whole))
        real = eng.loads.report

        def report(wid, now, eng=eng, real=real, whole=whole):
            real(wid, now)
            r, w = eng.loads.reports[wid], eng.workers[wid]
            exact = eng.loads.exact(w, now, *eng.loads._consts())
            waiting = [q for q in w.waiting if not q.admitted]
            assert (r.num_running, r.num_waiting) == (len(w.running), len(waiting))  # SGLang's decode batch, queue
            if not whole:  # the queue's uncached tokens and attention work (not the requests being prefilled)
                assert r.waiting_new_tokens == sum(q.est_new for q in waiting)
                assert r.waiting_attn_pairs == pytest.approx(sum(q.est_pairs for q in waiting))
                assert r._replace(num_running=exact.num_running, waiting_new_tokens=exact.waiting_new_tokens,
                                  waiting_cached_tokens=exact.waiting_cached_tokens,
                                  waiting_attn_pairs=exact.waiting_attn_pairs) == exact
                seen["admitted"] += w.num_admitted > 0
                return
            assert r.waiting_new_tokens == sum(q.prompt_len for q in waiting)
            assert (r.waiting_cached_tokens, r.waiting_attn_pairs) == (0, 0.0)
            seen["reports"] += 1
            seen["cached_counted"] += r.waiting_new_tokens > exact.waiting_new_tokens

        eng.loads.report = report
        eng.run()
    # the check above ran, and some reports counted queued cache hits' prefixes (fan-out branches share a trunk)
    assert seen["reports"] > 0 and seen["cached_counted"] > 0 and seen["admitted"] > 0


def test_a_crowds_second_request_waits_for_the_prefix_its_first_is_computing_as_the_live_router_decides():
    """A flash crowd's first request computes a 2,048-token prefix cold on an idle worker; the second arrives
    0.4 s later. The live router (`rank_by_ttft`, stop 53) sends it to the same worker: what is left of the first
    prefill plus a short extension beats computing the prefix cold elsewhere. The simulated router, on the simulated
    views, decides the same (before stop 54 its view counted the prefill in progress twice: the rest of the
    iteration as busy and the whole prefill as queued, and it computed the prefix cold on the other worker)."""
    from radix_sync.sim.workload import Workload

    prof = load_profile("cpu-wide")
    wl = Workload()
    wl.page_len = 16
    prefix = list(range(1, 129))  # 128 pages: 2,048 tokens
    for rid, (t, tail) in enumerate(((0.0, 1000), (0.4, 2000))):
        wl.open_requests.append(SimRequest(rid, 2048 + 20, 4, prefix + [tail], arrival_s=t))
    eng = Engine(prof, wl, build_policy("kvrep_shadow", prof, 16, 1),
                 EngineConfig(num_workers=2, duration_s=30.0, view_staleness_s=0.2, overlap_lag=False,
                              record_requests=True))
    assert prof.prefill_s(2068, 0) > 0.8  # the first is still computing when the second arrives
    res = eng.run().to_dict()
    first, second = sorted(res["requests"], key=lambda q: q["sent_s"])
    assert first["worker"] == second["worker"] and second["cached_tokens"] == 2048


def test_the_planner_sees_the_last_report_as_the_live_coordinator_does():
    """The live coordinator plans on the workers' load reports alone (`LivePlanner._worker_views`: no router's
    counts, no attention work, busy half an iteration from now when the report shows requests); so does the
    simulated planner (`LoadViews.planner_views`), while the simulated router ranks on the merged view."""
    eng = engine(0.2)
    req = SimRequest(0, 1000, 10, [], arrival_s=0.0)
    eng._execute_route(req, Route(1), 0.0)
    # the worker took it in between iterations and reported it waiting there (the live agent's report, taken after
    # SGLang's `ingest_requests`, before the batch is formed)
    p = eng.loads.planner_views(0.0)[1]
    assert (p.num_running, p.num_waiting, p.waiting_new_tokens, p.busy_until_s) == (0, 1, 1000, 0.0)
    assert eng.loads.own[0].queued_tokens[1] == 1000 and queue_wait_s(eng.policy.router.cost, eng.worker_views(0.0)[1], 0.0)
    # through its prefill no report (the timer finds it prefilling); the planner takes that report's work as done for
    # its age, as the live coordinator does (`LoadReported.age_s`)
    cost = eng.policy.router.cost
    whole = queue_wait_s(cost, p, 0.0)
    assert eng.loads.periodic(1, 0.2) > 0.2 and eng.loads.last_report_s[1] == 0.0
    assert queue_wait_s(cost, eng.loads.planner_views(0.02)[1], 0.02) == pytest.approx(whole - 0.02)
    assert queue_wait_s(cost, eng.loads.planner_views(whole + 1.0)[1], whole + 1.0) == 0.0
    w = eng.workers[1]
    w.iteration_s = 0.3
    w.running.append((99, 0, req))
    eng.loads.report(1, 0.01)
    p = eng.loads.planner_views(0.02)[1]
    assert (p.num_running, p.waiting_attn_pairs, p.running_ctx_tokens) == (1, 0.0, 0)
    assert p.busy_until_s == pytest.approx(0.02 + 0.15)
    w.running.pop()
    assert engine(0.0).loads.planner_views(0.0) == engine(0.0).loads.views(0.0)  # exact views: the same for both


def test_a_workers_iteration_time_is_the_agents_moving_average_per_step():
    from radix_sync.sim.worker import DECODE, IDLE, SimWorker

    eng = engine(0.2, "kvrep", 6.0, 10.0)
    seen = {"steps": 0, "decode": 0}
    real = SimWorker.on_iter_end

    def on_iter_end(w, now):
        state, steps = w.state, (w._macro_k if w.state == DECODE else 1)
        took, before = (now - w.iter_start_s) / steps, w.iteration_s
        real(w, now)
        if state != IDLE:
            keep = 0.8 ** steps
            want = took if before == 0.0 else keep * before + (1 - keep) * took
            assert w.iteration_s == pytest.approx(want)
            seen["steps"] += 1
            seen["decode"] += steps > 1

    SimWorker.on_iter_end = on_iter_end
    try:
        eng.run()
    finally:
        SimWorker.on_iter_end = real
    assert seen["steps"] > 50 and seen["decode"] > 0 and all(w.iteration_s > 0 for w in eng.workers)


def test_workers_report_between_iterations_never_in_a_prefill():
    """As the live agent (its hook after SGLang's `ingest_requests`): a report is taken between iterations or in a
    decode stretch, never while a prefill runs; one is due `view_staleness_s` after the last, and a worker going
    idle reports at once."""
    from radix_sync.sim.views import LoadViews
    from radix_sync.sim.worker import PREFILL

    eng = engine(0.2, "kvrep", 6.0, 10.0)
    taken, real = [], LoadViews.report

    def report(views, wid, now):
        w = eng.workers[wid]
        taken.append((wid, now, w.state, bool(w.waiting or w.running)))
        real(views, wid, now)

    eng.loads.report = report.__get__(eng.loads)
    eng.run()
    assert taken and all(state != PREFILL for _, _, state, _ in taken)
    for wid in range(4):
        mine = [(t, busy) for w, t, _, busy in taken if w == wid]
        gaps = [b[0] - a[0] for a, b in zip(mine, mine[1:]) if b[1]]  # (a report on going idle may come sooner)
        assert min(gaps) >= 0.2 - 1e-9
        assert any(not busy for _, busy in mine[1:])
