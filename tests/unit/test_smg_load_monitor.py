"""smg 1.13 `cache_aware` as it runs by default: its load monitor polls SGLang's `/v1/loads` every 10 s and a miss
goes to the lowest expected wait scored from the last poll, plus 1,024 tokens per request sent since (never taken
back when a request ends); a worker over the overload thresholds is left out. And the simulator's side: the engine
polls a polling router at its phase and period, and a simulated worker reports what SGLang's `/v1/loads` would."""

import pytest

from radix_sync.policy.baselines.smg import (DEFAULT_THROUGHPUT, LOAD_MONITOR_INTERVAL_S, MEAN_PREFILL_TOKENS,
                                             SmgCacheAwareRouter)
from radix_sync.policy.cost import load_profile
from radix_sync.policy.routers import ROUTERS, RoundRobinRouter, make_router
from radix_sync.policy.snapshot import LoadsReport, RequestView, WorkerView
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import FanoutWorkload, GeneratorConfig
from radix_sync.sim.policies import PolicyBundle, build_policy

IDLE = LoadsReport()


def req(pages, rid):
    return RequestView(request_id=rid, prompt_len=len(pages), page_hashes=tuple(pages))


def two():
    return [WorkerView(0), WorkerView(1)]


def polled(*reports, seed=0, cls="cache_aware"):
    r = make_router(cls, page_len=1, seed=seed)
    r.on_poll(reports, 0.0)
    return r


def test_defaults_and_the_engine_polls_it():
    r = make_router("cache_aware", page_len=1, seed=3)
    assert r.poll_period_s == LOAD_MONITOR_INTERVAL_S == 10.0 and 0.0 <= r.poll_phase_s <= 10.0
    assert make_router("cache_aware_inflight", page_len=1).poll_period_s == 0.0
    with pytest.raises(ValueError):
        SmgCacheAwareRouter(load_monitor_s=-1.0)


def test_misses_follow_the_last_poll_not_the_requests_in_flight():
    # the poll saw worker 0 decoding two requests at 50 tokens/s, worker 1 idle (no throughput: 2,000 tokens/s)
    busy = LoadsReport(num_running=2, token_usage=0.1, gen_throughput=50.0)
    r = polled(busy, IDLE)
    assert r.expected_wait(0) == pytest.approx(2 * MEAN_PREFILL_TOKENS / 50.0 + 0.15 * 0.1 / 0.9)
    assert r.expected_wait(1) == 0.0
    # worker 0's requests end right after the poll; worker 1 takes every miss until the next poll all the same
    for rid in range(4):
        assert r.route(req([100 * rid + 1, 100 * rid + 2], rid), two(), 1.0 + rid).worker_id == 1
    assert r.expected_wait(1) == pytest.approx(4 * MEAN_PREFILL_TOKENS / DEFAULT_THROUGHPUT)
    # the model of before (in-flight counts only) would have sent the second miss to worker 0
    old = make_router("cache_aware_inflight", page_len=1)
    assert [old.route(req([100 * k + 1], k), two(), float(k)).worker_id for k in range(3)].count(0) >= 1


def test_the_credit_is_not_taken_back_when_a_request_ends_but_a_poll_resets_it():
    r = polled(IDLE, IDLE, seed=5)
    a = r.route(req([1, 2], 1), two(), 1.0).worker_id  # a tie: either
    r.on_finished(a, 1, 2.0)  # nothing in flight anywhere now
    assert r.expected_wait(a) == pytest.approx(MEAN_PREFILL_TOKENS / DEFAULT_THROUGHPUT)
    assert r.route(req([3, 4], 2), two(), 3.0).worker_id == 1 - a  # the credit, not the in-flight count
    r.on_finished(1 - a, 2, 4.0)
    r.on_poll((IDLE, LoadsReport(num_waiting=1)), 10.0)  # credits back to 0; worker 1 reports a queued request
    assert r.expected_wait(0) == 0.0 and r.expected_wait(1) == pytest.approx(MEAN_PREFILL_TOKENS / DEFAULT_THROUGHPUT)
    assert r.route(req([5, 6], 3), two(), 11.0).worker_id == 0


def test_uncached_tokens_reported_replace_the_per_request_guess_and_unreported_sends_count():
    r = polled(LoadsReport(num_waiting=3, waiting_uncached_tokens=500), IDLE)
    assert r.expected_wait(0) == pytest.approx(500 / DEFAULT_THROUGHPUT)
    # requests in flight beyond what the poll saw and the credit counts (sent before the poll, not reported)
    r._loads[1] = 2
    assert r.expected_wait(1) == pytest.approx(2 * MEAN_PREFILL_TOKENS / DEFAULT_THROUGHPUT)


def test_an_overloaded_holder_is_left_out_and_every_worker_overloaded_falls_back_without_learning():
    r = polled(IDLE, LoadsReport(num_waiting=1))
    assert r.route(req([1, 2, 3], 1), two(), 1.0).worker_id == 0
    r.on_finished(0, 1, 1.5)
    assert r.route(req([1, 2, 3, 4], 2), two(), 2.0).worker_id == 0  # the holder (3/4 matched)
    r.on_finished(0, 2, 2.5)
    r.on_poll((LoadsReport(num_waiting=8), IDLE), 10.0)  # worker 0 over the waiting threshold
    assert r.route(req([1, 2, 3, 5], 3), two(), 11.0).worker_id == 1
    r.on_poll((LoadsReport(token_usage=0.8), LoadsReport(num_waiting=9)), 20.0)  # both over
    lo = r._loads.index(min(r._loads))
    assert r.route(req([7, 8, 9], 4), two(), 21.0).worker_id == lo  # fewest in flight
    assert all(t.match_len((7, 8, 9)) == 0 for t in r._trees)  # no insert, no credit
    assert r._credit == [0, 0]


def test_before_any_poll_it_is_the_fewest_in_flight():
    r = make_router("cache_aware", page_len=1, seed=1)
    a = r.route(req([1], 1), two(), 0.0).worker_id
    assert r.route(req([2], 2), two(), 0.1).worker_id == 1 - a


class _Recorder(RoundRobinRouter):
    poll_period_s = 2.0
    poll_phase_s = 0.5

    def __init__(self, **kw):
        super().__init__(**kw)
        self.polls = []

    def on_poll(self, reports, now):
        self.polls.append((now, reports))


def test_the_engine_polls_at_the_phase_and_period_and_workers_report_their_loads():
    profile = load_profile("llama3.1-8b-h200")
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=20.0, seed=1,
                        max_context_len=profile.max_context_len)
    rec = _Recorder()
    eng = Engine(profile, wl, PolicyBundle("recorder", rec), EngineConfig(num_workers=3, duration_s=20.0))
    eng.run()
    times = [t for t, _ in rec.polls]
    assert times[:3] == [0.5, 2.5, 4.5] and all(b - a == pytest.approx(2.0) for a, b in zip(times, times[1:]))
    assert times[-1] <= eng.now
    reports = [r for _, rs in rec.polls for r in rs]
    assert all(len(rs) == 3 for _, rs in rec.polls) and all(isinstance(r, LoadsReport) for r in reports)
    assert all(0.0 <= r.token_usage <= 1.0 and r.num_running >= 0 and r.num_waiting >= 0 for r in reports)
    assert any(r.num_running > 0 and r.token_usage > 0.0 for r in reports)
    assert any(r.gen_throughput > 0.0 for r in reports)  # windows of 40 decode steps ended


def test_a_workers_throughput_goes_to_zero_thirty_seconds_after_its_last_window():
    profile = load_profile("llama3.1-8b-h200")
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=20.0, seed=1,
                        max_context_len=profile.max_context_len)
    eng = Engine(profile, wl, build_policy("round_robin", profile, wl.page_len, 1), EngineConfig(num_workers=2,
                                                                                                 duration_s=20.0))
    eng.run()
    w = next(w for w in eng.workers if w._gen_throughput > 0.0)
    last = w._gen_tic_s
    assert w.loads_report(last + 29.0).gen_throughput > 0.0
    assert w.loads_report(last + 31.0).gen_throughput == 0.0
    assert w.loads_report(last + 31.0).token_usage == 0.0  # everything finished: nothing locked


def test_the_simulated_smg_polls_in_a_run():
    profile = load_profile("llama3.1-8b-h200")
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=30.0, seed=1,
                        max_context_len=profile.max_context_len)
    bundle = build_policy("cache_aware", profile, wl.page_len, 1)
    seen = []
    orig = bundle.router.on_poll
    bundle.router.on_poll = lambda reports, now: (seen.append(now), orig(reports, now))
    stats = Engine(profile, wl, bundle, EngineConfig(num_workers=4, duration_s=30.0)).run().to_dict()
    assert len(seen) >= 2 and stats["num_requests"] == stats["num_arrived"] > 0
    assert "cache_aware_inflight" in ROUTERS.names()
