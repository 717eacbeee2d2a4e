"""Live-like load views (`radix_sync.sim.views`): stale reports merged with the router's own sends, hint error."""

import pytest

from radix_sync.policy.cost import load_profile
from radix_sync.policy.snapshot import Route
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
    req = SimRequest(0, 1000, 10, [], arrival_s=0.0)
    eng._execute_route(req, Route(1), 0.0)
    v = eng.worker_views(0.0)[1]
    exact = eng.loads.exact(eng.workers[1], 0.0, *eng.loads._consts())
    # the worker admitted it at once (running 1, nothing waiting); no report yet: the router's own count says 1
    # queued request of 1000 new tokens, 1000 x 1001 / 2 attention pairs
    assert (exact.num_running, exact.num_waiting) == (1, 0)
    assert (v.num_running, v.num_waiting, v.waiting_new_tokens, v.waiting_attn_pairs) == (0, 1, 1000, 500500.0)
    assert eng.worker_views(0.0)[0].num_waiting == 0
    # worker 1 reports at 0.05: running 1, and the router's count no longer adds a waiting request
    eng.loads.report(1, 0.05)
    v = eng.worker_views(0.05)[1]
    assert (v.num_running, v.num_waiting, v.waiting_new_tokens) == (1, 0, 1000)
    # the first token: the router stops counting its prefill; the report still says what it said
    eng.loads.on_started(req)
    assert eng.loads.queued_tokens[1] == 0 and eng.loads.outstanding[1] == 1
    assert eng.worker_views(0.06)[1].waiting_new_tokens == 1000
    eng.loads.on_done(req)
    assert eng.loads.outstanding[1] == 0


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
    assert eng.loads.outstanding == [0, 0, 0, 0]  # nothing to merge


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
