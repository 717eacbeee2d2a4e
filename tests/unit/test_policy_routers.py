"""Pins every router's decision on small hand-computed cases."""

import pytest

from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.routers import make_router
from radix_sync.policy.snapshot import REPLICA, HolderView, RequestView, Route, WorkerView

# 10 ms per prompt token, no attention term, no overheads; 2000 B/s links; 1 byte of KV per token.
PROFILE = CostProfile(name="t", kv_bytes_per_token=1, kv_capacity_tokens=10_000, max_context_len=10_000,
                      chunked_prefill_len=10_000, max_running_requests=64, prefill_overhead_s=0.0,
                      prefill_s_per_token=0.01, prefill_s_per_token_pair=0.0, decode_step_s=0.01,
                      decode_s_per_request=0.0, decode_s_per_ctx_token=0.0, nic_bandwidth_bytes_per_s=2000.0,
                      transfer_latency_s=0.0)


def workers(n, **overrides):
    out = [WorkerView(i, nic_bandwidth_bytes_per_s=2000.0, free_tokens=10_000) for i in range(n)]
    for i, kw in overrides.items():
        out[int(i[1:])] = out[int(i[1:])]._replace(**kw)
    return tuple(out)


def req(prompt_len, pages=(), cached=(), inflight=(), output_len=1, rid=0):
    return RequestView(rid, prompt_len, output_len, 0, list(pages), tuple(cached), tuple(inflight))


def router(name, **kw):
    return make_router(name, cost=CostModel(PROFILE), page_len=1, kv_bytes_per_token=1, **kw)


def test_round_robin_cycles():
    r = router("round_robin")
    assert [r.route(req(1), (None,) * 3, 0.0).worker_id for _ in range(4)] == [0, 1, 2, 0]


def test_least_load_takes_fewest_outstanding_lowest_id_on_ties():
    ws = workers(3, w0=dict(num_running=2), w1=dict(num_waiting=1), w2=dict(num_running=1))
    assert router("least_load").route(req(1), ws, 0.0) == Route(1)


def test_cache_aware_match_then_smallest_tree():
    r, ws = router("cache_aware"), workers(2)
    assert r.route(req(4, [1, 2, 3, 4]), ws, 0.0).worker_id == 0  # no match: smallest tree (tie -> 0)
    assert r.route(req(4, [1, 2, 5, 6]), ws, 1.0).worker_id == 0  # match 2/4 = 0.5 > 0.3
    assert r.route(req(4, [7, 8, 9, 10]), ws, 2.0).worker_id == 1  # no match: worker 1's tree is empty
    assert r.route(req(10, [1, 11, 12, 13, 14, 15, 16, 17, 18, 19]), ws, 3.0).worker_id == 1  # 1/10 <= 0.3


def test_cache_aware_imbalance_needs_both_thresholds():
    r = router("cache_aware")
    r.route(req(4, [1, 2, 3, 4]), workers(2), 0.0)  # worker 0 now holds the prefix (approximately)
    imbalanced = workers(2, w0=dict(num_running=100), w1=dict(num_running=10))  # 90 > 64 and 100 > 15
    assert r.route(req(4, [1, 2, 3, 9]), imbalanced, 1.0).worker_id == 1
    abs_small = workers(2, w0=dict(num_running=100), w1=dict(num_running=40))  # 60 <= 64
    assert r.route(req(4, [1, 2, 3, 8]), abs_small, 2.0).worker_id == 0


def test_dynamo_cost_overlap_plus_decode_blocks():
    r = router("cost")
    # cost0 = (10-8) + (20+10) = 32, cost1 = 10 + (5+10) = 25
    ws = workers(2, w0=dict(running_ctx_tokens=20), w1=dict(running_ctx_tokens=5))
    assert r.cost(req(10, cached=(8, 0)), ws[0]) == 32.0
    assert r.route(req(10, cached=(8, 0)), ws, 0.0).worker_id == 1
    ws = workers(2, w0=dict(running_ctx_tokens=20), w1=dict(running_ctx_tokens=15))  # cost1 = 35
    assert r.route(req(10, cached=(8, 0)), ws, 0.0).worker_id == 0


def test_pull_copies_from_the_holder_when_it_beats_waiting_and_recomputing():
    # holder w0 has 10 s of queued prefill; w1 idle. w0: 10 + 0.1 = 10.1 s; w1 recompute 110 tokens = 1.1 s;
    # w1 pulling 100 tokens (100 B at 2000 B/s = 0.05 s) then 10 tokens: max(0, 0.05) + 0.1 = 0.15 s.
    ws = workers(2, w0=dict(num_waiting=1, waiting_new_tokens=1000))
    route = router("pull").route(req(110, cached=(100, 0)), ws, 0.0)
    assert (route.worker_id, route.pull_from, route.pull_len) == (1, 0, 100)
    assert route.expected_ttft_s == pytest.approx(0.15)
    # an idle holder wins: 0.1 s
    assert router("pull").route(req(110, cached=(100, 0)), workers(2), 0.0) == Route(0, expected_ttft_s=pytest.approx(0.1))


def test_e2_exploits_then_replicates_by_recompute_then_explores():
    r = router("e2")
    ws = workers(2)
    assert r.route(req(100, cached=(80, 0), output_len=1), ws, 0.0).worker_id == 0  # 80 > 20: exploit
    # worker 0 now carries 0.2 s of load (20 missed tokens), worker 1 none: 0.2 > 2 x 0 -> lightest (recompute)
    assert r.route(req(100, cached=(80, 0), output_len=1), ws, 1.0).worker_id == 1
    # explore (10 <= 90): w0 = 0.2 + pf(90) = 1.1, w1 = 1.0 + pf(100) = 2.0
    assert r.route(req(100, cached=(10, 0), output_len=1), ws, 2.0).worker_id == 0


def test_expected_ttft_counts_a_copy_in_flight():
    ws = workers(2, w0=dict(num_waiting=1, waiting_new_tokens=1000))
    inflight = (HolderView(1, REPLICA, 100, None, 0.02),)
    route = router("expected_ttft", allow_pull=False).route(req(110, cached=(100, 0), inflight=inflight), ws, 0.0)
    assert (route.worker_id, route.wait_inflight) == (1, True)
    assert route.expected_ttft_s == pytest.approx(0.02 + 0.1)
    # without the copy in flight and without pulling, recomputing on w1 (1.1 s) beats waiting at w0 (10.1 s)
    route = router("expected_ttft", allow_pull=False).route(req(110, cached=(100, 0)), ws, 0.0)
    assert route == Route(1, expected_ttft_s=pytest.approx(1.1))


def test_ttft_rank_key_orders_by_rounded_ttft_then_load_then_id():
    from radix_sync.policy.routers import ttft_rank_key

    ws = workers(3, w0=dict(num_running=2), w1=dict(num_waiting=1))
    # within 1 ns the TTFTs tie: fewer outstanding first (w2: 0, w1: 1, w0: 2); a slower one last
    keys = {i: ttft_rank_key(t, i, ws) for i, t in ((0, 1.0), (1, 1.0 + 1e-10), (2, 1.0 - 1e-10))}
    assert sorted(keys, key=keys.get) == [2, 1, 0]
    assert ttft_rank_key(0.5, 0, ws) < ttft_rank_key(0.6, 2, ws)
    assert ttft_rank_key(1.0, 0, ws) == (1.0, 2, 0)
    # the router picks the lowest key among its options
    r = router("expected_ttft", allow_pull=False)
    q = req(10, cached=(0, 0, 0))  # nothing cached: every worker 0.1 s plus its queue
    opts = r.options(q, ws, 0.0)
    best = min(opts, key=lambda o: ttft_rank_key(o.expected_ttft_s, o.worker_id, ws))
    assert r.route(q, ws, 0.0) == best and best.worker_id == 2
