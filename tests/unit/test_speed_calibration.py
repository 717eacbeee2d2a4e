"""The fleet's prefill speed learned from requests that ran alone (`radix_sync.policy.speed`), and who feeds it: the
live router (`Decision.idle`, `Router._ran_alone`), the coordinator (finish reports' `alone_*` fields, the planner's
cost model) and the simulated router (`ExpectedTtftRouter.speed`)."""
import dataclasses
import math
import statistics

import msgspec
import pytest

from radix_sync import api
from radix_sync.coordinator.policies import LIVE_POLICIES
from radix_sync.coordinator.state import ClusterState, StateConfig
from radix_sync.policy.cost import CostModel, load_profile
from radix_sync.policy.routers import ExpectedTtftRouter
from radix_sync.policy.snapshot import RequestView, WorkerView
from radix_sync.policy.speed import SpeedCalibration, runs_alone
from radix_sync.router.policy import DIRECTORY, Decision, WorkerState, rank_by_ttft

PROFILE = load_profile("cpu-wide")


def test_the_scale_is_one_until_enough_requests_ran_alone_then_their_median_ratio():
    cal = SpeedCalibration(window=16, min_samples=4)
    shapes = [(2000, 0), (32, 2000), (500, 500), (1000, 0), (8, 3000)]
    ratios = [0.3, 0.35, 0.4, 0.33, 5.0]  # the last one met a burst the router did not see
    for (n, c), r in zip(shapes[:3], ratios[:3]):
        assert cal.observe(n, c, r * PROFILE.prefill_s(n, c))
        assert cal.scale(PROFILE) == 1.0
    for (n, c), r in zip(shapes[3:], ratios[3:]):
        cal.observe(n, c, r * PROFILE.prefill_s(n, c))
    assert cal.scale(PROFILE) == pytest.approx(statistics.median(ratios))  # 0.35: the outlier moves it little
    assert cal.status(PROFILE) == {"scale": round(statistics.median(ratios), 4), "samples": 5, "observed": 5,
                                   "min_samples": 4}
    # another profile prices the same samples anew
    other = dataclasses.replace(PROFILE, name="other", prefill_s_per_token=2 * PROFILE.prefill_s_per_token)
    assert cal.scale(other) < cal.scale(PROFILE)


def test_the_window_keeps_the_last_requests_and_the_scale_stays_in_bounds():
    cal = SpeedCalibration(window=4, min_samples=2, lo=0.1, hi=10.0)
    for _ in range(4):
        cal.observe(1000, 0, 0.001 * PROFILE.prefill_s(1000, 0))
    assert cal.scale(PROFILE) == 0.1  # far faster than the profile: bounded
    for _ in range(4):  # the machine slowed down: the old samples leave the window
        cal.observe(1000, 0, 100.0 * PROFILE.prefill_s(1000, 0))
    assert cal.scale(PROFILE) == 10.0 and len(cal.samples) == 4 and cal.num_observed == 8
    for _ in range(3):
        cal.observe(1000, 0, 2.0 * PROFILE.prefill_s(1000, 0))
    assert cal.scale(PROFILE) == pytest.approx(2.0)  # the window: one slow sample and three at 2x


@pytest.mark.parametrize("sample", [(-1, 0, 0.1), (10, -1, 0.1), (10, 0, 0.0), (10, 0, -0.1), (10, 0, math.nan),
                                    (10, 0, math.inf), (10, 0, 3601.0)])
def test_a_sample_that_cannot_be_a_prefill_is_not_kept(sample):
    cal = SpeedCalibration(window=4, min_samples=1)
    assert not cal.observe(*sample)
    assert cal.num_observed == 0 and cal.scale(PROFILE) == 1.0


def test_bad_bounds_are_refused():
    for kwargs in ({"window": 0}, {"window": 4, "min_samples": 5}, {"min_samples": 0}, {"lo": 0.0},
                   {"lo": 2.0}, {"hi": 0.5}):
        with pytest.raises(ValueError):
            SpeedCalibration(**kwargs)


def test_a_request_runs_alone_only_where_nothing_runs_waits_or_iterates():
    idle = WorkerView(0)
    assert runs_alone(idle, now=10.0)
    assert not runs_alone(idle._replace(num_running=1), 10.0)
    assert not runs_alone(idle._replace(num_waiting=1), 10.0)
    assert not runs_alone(idle._replace(waiting_new_tokens=5), 10.0)
    assert not runs_alone(idle._replace(busy_until_s=10.5), 10.0)
    assert runs_alone(idle._replace(busy_until_s=9.5), 10.0)


def test_the_live_router_marks_the_workers_a_request_would_run_alone_at():
    model = CostModel(PROFILE)
    workers = [WorkerState("http://a"), WorkerState("http://b", num_running=1),
               WorkerState("http://c", num_waiting=1, num_waiting_tokens=100), WorkerState("http://d")]
    d = rank_by_ttft(workers, {"http://a": 512}, (), 600, "", 100.0, model)
    assert d.idle == frozenset({"http://a", "http://d"}) and d.ranked[0] == "http://a"


def _router(calibrated=True):
    """A `Router` without its network parts: what `_ran_alone` reads (its config's switch, its cost model)."""
    from radix_sync.router.config import RouterConfig
    from radix_sync.router.metrics import RouterMetrics
    from radix_sync.router.service import Router

    r = Router.__new__(Router)
    r.cfg = RouterConfig(worker_urls=("http://a",), speed_calibration=calibrated, profile="cpu-wide")
    r.model = CostModel(PROFILE)
    r.speed = SpeedCalibration() if calibrated else None
    r.metrics = RouterMetrics()
    return r


def test_the_live_router_learns_from_lone_requests_only_and_rescales_its_prefill_terms():
    r = _router()
    d = Decision(("http://a", "http://b"), (0.5, 0.9), DIRECTORY, 512, cached_by_worker=(512, 0),
                 idle=frozenset({"http://a"}))
    measured = 0.4 * PROFILE.prefill_s(88, 512)
    assert r._ran_alone("http://a", d, 600, measured) == (88, 512)
    assert r._ran_alone("http://b", d, 600, measured) is None  # not idle when sent there (a failover, say)
    assert r._ran_alone("http://a", dataclasses.replace(d, wait_inflight=True), 600, measured) is None
    assert r._ran_alone("http://a", dataclasses.replace(d, mode="fallback"), 600, measured) is None
    assert r._ran_alone("http://a", d, 600, None) is None
    assert r.speed.num_observed == 1 and r.model.prefill_scale == 1.0  # (too few yet)
    for _ in range(7):
        r._ran_alone("http://a", d, 600, measured)
    assert r.model.prefill_scale == pytest.approx(0.4)
    assert r.metrics.registry.get_sample_value("kvrep_router_prefill_speed_scale") == pytest.approx(0.4)
    assert r.model.prefill_s(88, 512) == pytest.approx(measured)
    off = _router(calibrated=False)
    assert off._ran_alone("http://a", d, 600, measured) is None and off.model.prefill_scale == 1.0


def test_finish_reports_carry_the_lone_requests_counts_bounded():
    ok = api.convert({"input_ids": [1, 2], "ttft_s": 0.2, "alone_new_tokens": 2, "alone_cached_tokens": 0},
                     api.FinishReport)
    assert (ok.alone_new_tokens, ok.alone_cached_tokens) == (2, 0)
    for bad in ({"alone_new_tokens": -1}, {"alone_cached_tokens": 10 ** 9}, {"alone_new_tokens": "2"}):
        with pytest.raises((api.AdminError, msgspec.ValidationError)):
            api.convert({"input_ids": [1, 2], **bad}, api.FinishReport)


def test_the_coordinator_prices_its_planner_at_the_speed_its_routers_measured():
    state = ClusterState(StateConfig())
    kvrep = LIVE_POLICIES.create("kvrep", rules=None, profile="cpu-wide")
    fixed = LIVE_POLICIES.create("kvrep_fixed", rules=None, profile="cpu-wide")
    prompt = list(range(100, 164))
    for i in range(8):
        n, c = 64, 0
        finish = {"input_ids": prompt, "worker": "w0", "ttft_s": 0.25 * kvrep.profile.prefill_s(n, c),
                  "alone_new_tokens": n, "alone_cached_tokens": c}
        _, done, errors = state.record_demand([], [finish, {"input_ids": prompt, "worker": "w0", "ttft_s": 9.0}],
                                              float(i))
        assert done == 2 and not errors
    assert state.speed.num_observed == 8  # (a finish without the counts is no sample)
    kvrep.observe(state, 10.0)
    fixed.observe(state, 10.0)
    assert kvrep.cost.prefill_scale == pytest.approx(0.25) and kvrep.session_stats()["prefill_scale"] == 0.25
    assert fixed.cost.prefill_scale == 1.0


def _view(rid, prompt_len, cached):
    return RequestView(rid, prompt_len, cached_len=cached)


def test_the_simulated_router_learns_the_same_way_and_its_planner_shares_the_scale():
    cost = CostModel(PROFILE)
    router = ExpectedTtftRouter(cost, PROFILE.kv_bytes_per_token)
    router.speed = SpeedCalibration(min_samples=2)
    idle, busy = WorkerView(0), WorkerView(1, num_running=1, busy_until_s=1e9)
    # a request to an idle worker is a sample at its first token; one to a busy worker is not
    assert router.route(_view(1, 600, (512, 0)), [idle, busy], 0.0).worker_id == 0
    router.on_first_token(0, 1, 0.5 * PROFILE.prefill_s(88, 512))
    assert router.route(_view(2, 600, (0, 0)), [idle, busy], 0.0).worker_id == 0
    router.on_finished(0, 2, 5.0)  # rejected before its first token: no sample
    assert router.speed.num_observed == 1 and cost.prefill_scale == 1.0
    router.route(_view(3, 1000, (0, 0)), [idle, busy], 10.0)
    router.on_first_token(0, 3, 10.0 + 0.3 * PROFILE.prefill_s(1000, 0))
    assert router.speed.num_observed == 2 and cost.prefill_scale == pytest.approx(0.4)
    # without a calibration (the default) nothing is learned
    plain = ExpectedTtftRouter(CostModel(PROFILE), PROFILE.kv_bytes_per_token)
    plain.route(_view(1, 600, (512, 0)), [idle, busy], 0.0)
    plain.on_first_token(0, 1, 0.01)
    assert plain.cost.prefill_scale == 1.0 and plain.speed is None


def test_a_request_held_for_a_copy_in_flight_records_how_long():
    """`Decision.wait_inflight`: the decision's record says how long the request waited for the copy (`held_s`);
    a request not held records nothing; a failover's record (attempt 1) neither."""
    import asyncio
    from types import SimpleNamespace

    r = _router()
    recorded = []
    r._on_dispatched = lambda url, *args: recorded.append((url, args[6], args[-1]))  # (url, attempt, held_s)

    async def slow_copy(url, copy=None):
        await asyncio.sleep(0.05)
    r._wait_for_copy = slow_copy

    class Proxy:
        async def forward(self, request, path, body, decision, prompt_len, wait_for_copy, dispatched, finished,
                          pages=()):
            if decision.wait_inflight:
                await wait_for_copy(decision.ranked[0])
            dispatched(decision.ranked[0], 0)
            dispatched(decision.ranked[1], 1)
    r.proxy = Proxy()
    request = SimpleNamespace(headers={})
    d = Decision(("http://a", "http://b"), (0.5, 0.9), DIRECTORY, 512, cached_by_worker=(512, 0))
    for wait in (True, False):
        asyncio.run(r.forward(request, "/generate", {}, dataclasses.replace(d, wait_inflight=wait), "generate",
                              [1] * 600, [], None))
    (a0, b0, a1, b1) = recorded
    assert a0[0] == "http://a" and a0[1] == 0 and a0[2] >= 0.05 and b0[2] is None
    assert a1[2] is None and b1[2] is None
