"""Pins every router's decision on small hand-computed cases (the baselines' rules: `radix_sync.policy.baselines`,
each class citing its source)."""

import hashlib

import pytest

from radix_sync.policy import baselines  # noqa: F401 (registers the baseline routers)
from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.pagetree import PageTree
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


def test_cache_aware_v03_match_then_smallest_tree():
    r, ws = router("cache_aware_v03"), workers(2)
    assert r.route(req(4, [1, 2, 3, 4]), ws, 0.0).worker_id == 0  # no match: smallest tree (tie -> 0)
    assert r.route(req(4, [1, 2, 5, 6]), ws, 1.0).worker_id == 0  # match 2/4 = 0.5 > 0.3
    assert r.route(req(4, [7, 8, 9, 10]), ws, 2.0).worker_id == 1  # no match: worker 1's tree is empty
    assert r.route(req(10, [1, 11, 12, 13, 14, 15, 16, 17, 18, 19]), ws, 3.0).worker_id == 1  # 1/10 <= 0.3


def test_cache_aware_v03_imbalance_needs_both_thresholds():
    r = router("cache_aware_v03")
    r.route(req(4, [1, 2, 3, 4]), workers(2), 0.0)  # worker 0 now holds the prefix (approximately)
    imbalanced = workers(2, w0=dict(num_running=100), w1=dict(num_running=10))  # 90 > 64 and 100 > 15
    assert r.route(req(4, [1, 2, 3, 9]), imbalanced, 1.0).worker_id == 1
    abs_small = workers(2, w0=dict(num_running=100), w1=dict(num_running=40))  # 60 <= 64
    assert r.route(req(4, [1, 2, 3, 8]), abs_small, 2.0).worker_id == 0


# ---------------------------------------------------------------- smg 1.13 cache_aware
def test_smg_cache_aware_affinity_then_least_in_flight_on_a_miss():
    r, ws = router("cache_aware"), workers(2)
    a = r.route(req(4, [1, 2, 3, 4], rid=1), ws, 0.0).worker_id  # miss, both idle: a random one
    b = 1 - a
    assert r.route(req(4, [1, 2, 5, 6], rid=2), ws, 1.0).worker_id == a  # 2/4 > 0.3: the holder, not spilled
    assert r.route(req(4, [7, 8, 9, 10], rid=3), ws, 2.0).worker_id == b  # miss: fewest in flight (2 vs 0)
    assert r.route(req(10, [1, *range(11, 20)], rid=4), ws, 3.0).worker_id == b  # 1/10 <= 0.3: miss, 2 vs 1
    r.on_finished(a, 1, 4.0)
    r.on_finished(a, 2, 4.0)  # a: 0 in flight, b: 2
    assert r.route(req(4, [7, 8, 9, 11], rid=5), ws, 5.0).worker_id == b  # 3/4: b holds it and does not spill


def test_smg_cache_aware_ties_are_random():
    picks = {make_router("cache_aware", page_len=1, seed=s).route(req(4, [1, 2, 3, 4]), workers(3), 0.0).worker_id
             for s in range(30)}
    assert picks == {0, 1, 2}


def test_smg_cache_aware_spill_gate_has_an_adaptive_absolute_margin():
    r = router("cache_aware")
    # mean 16: margin min(64, max(ceil(2 x 4), 4)) = 8: spills above max(1.5 x 16, 16 + 8) = 24
    assert not r._spills(24, 16.0) and r._spills(25, 16.0)
    # mean 1: margin 4 (the floor): spills above 5; mean 1000: margin 64 (the cap): above 1500 (relative)
    assert not r._spills(5, 1.0) and r._spills(6, 1.0)
    assert not r._spills(1500, 1000.0) and r._spills(1501, 1000.0)


def test_smg_cache_aware_a_spilled_holder_sends_to_a_worker_that_does_not_spill():
    r, ws = router("cache_aware"), workers(2)
    a = r.route(req(4, [1, 2, 3, 4], rid=0), ws, 0.0).worker_id
    for k in range(1, 11):  # 11 requests on the prefix: a holds it and does not spill (10 > 5 + 5 fails)
        assert r.route(req(4, [1, 2, 3, 100 + k], rid=k), ws, k).worker_id == a
    # a: 11 in flight, mean 5.5, margin ceil(2 sqrt 5.5) = 5: 11 > 8.25 and 11 > 10.5: every holder spills
    assert r.route(req(4, [1, 2, 3, 200], rid=11), ws, 11.0).worker_id == 1 - a
    # now both hold [1, 2, 3]; mean 6, margin 5: 11 > 11 fails, nobody spills: fewest in flight
    assert r.route(req(4, [1, 2, 3, 201], rid=12), ws, 12.0).worker_id == 1 - a


def test_smg_cache_aware_trims_the_trees_to_one_shared_budget_oldest_first():
    from radix_sync.policy.routers import CacheAwareConfig

    r = make_router("cache_aware", page_len=1, cfg=CacheAwareConfig(max_tree_tokens=4))
    r._trees = [PageTree(), PageTree()]
    r._trees[0].insert([1, 2, 3], 3, 0.0)
    r._trees[1].insert([4, 5], 2, 1.0)
    r._trees[0].insert([1, 2, 3, 6], 4, 2.0)  # worker 0: 1-2-3-6, the leaf touched at 2.0; worker 1: 4-5 at 1.0
    r._trim()  # 6 pages, budget 4: worker 1's chain is the least recently used
    assert len(r._trees[0]) == 4 and len(r._trees[1]) == 0


# ---------------------------------------------------------------- smg prefix_hash (sticky)
def _h(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def test_sticky_ring_maps_a_key_clockwise_to_the_next_virtual_node():
    from radix_sync.policy.baselines.smg import PrefixHashConfig

    r = make_router("sticky", page_len=1, cfg=PrefixHashConfig(virtual_nodes=2))
    r.route(req(1, [1]), workers(3), 0.0)
    ring = sorted((_h(f"worker-{i}#{v}"), i) for i in range(3) for v in range(2))
    for key in ("p1", "p2", "w7:100", "r5"):
        after = [w for pos, w in ring if pos >= _h(key)]
        assert r.ring_worker(key) == (after[0] if after else ring[0][1])


def test_sticky_key_is_the_first_256_tokens():
    r = make_router("sticky", page_len=64)
    pages = [11, 12, 13, 14, 15]
    assert r.key(req(320, pages)) == "p14"  # 256 tokens = 4 pages of 64: the hash of the 4th names them
    assert r.key(req(320, [11, 12, 13, 14, 99])) == "p14"  # same first 256 tokens, same key
    assert r.key(req(200, [11, 12, 13])) == "w13:200"  # shorter: the whole prompt
    assert r.key(req(50, [], rid=7)) == "r7"


def test_sticky_bounded_load_falls_back_to_the_least_loaded_worker():
    r, ws = router("sticky"), workers(3)
    got = [r.route(req(4, [1, 2, 3, 4], rid=k), ws, 0.0).worker_id for k in range(16)]
    home = got[0]
    assert got == [home] * 16  # load 15 <= max(1.25 x 16/3, 16/3 + 10) = 15.33: still the ring's worker
    other = min(i for i in range(3) if i != home)
    # load 16 > 17/3 + 10 = 15.67: the least-loaded worker within bounds, lowest id
    assert r.route(req(4, [1, 2, 3, 4], rid=16), ws, 0.0).worker_id == other
    assert r.route(req(4, [1, 2, 3, 4], rid=17), ws, 0.0).worker_id == home  # 16 <= 18/3 + 10 = 16
    r.on_finished(home, 0, 1.0)
    assert r._loads[home] == 16 and r.ring_worker(r.key(req(4, [1, 2, 3, 4]))) == home


# ---------------------------------------------------------------- Dynamo KV router (cost)
def test_dynamo_cost_counts_pending_prefill_and_shared_blocks_once():
    r, ws = router("cost"), workers(2)
    # cost = (active prefill + prompt - cached) / bs + active blocks + new blocks; bs = 1 here
    assert r.cost(req(8, range(1, 9), cached=(8, 0)), 0) == 0 + 0 + 8
    assert r.route(req(8, range(1, 9), cached=(8, 0), rid=1), ws, 0.0).worker_id == 0  # 8 vs 16
    b = req(10, [*range(1, 9), 9, 10], cached=(8, 0), rid=2)
    assert r.cost(b, 0) == 2 + 8 + 2  # blocks 1-8 are already active on 0: only 9, 10 are new
    assert r.route(b, ws, 0.0).worker_id == 0  # 12 vs 20
    c = req(10, range(11, 21), rid=3, cached=(0, 0))
    assert r.cost(c, 0) == (2 + 10) + 10 + 10  # B's 2 tokens still to prefill; 10 unique active blocks
    assert r.route(c, ws, 0.0).worker_id == 1  # 32 vs 20
    r.on_first_token(0, 2, 1.0)  # B's prefill is done
    d = req(10, [*range(1, 9), 21, 22], cached=(8, 0), rid=4)
    assert r.cost(d, 0) == 2 + 10 + 2 and r.cost(d, 1) == (10 + 10) + 10 + 10
    assert r.route(d, ws, 1.0).worker_id == 0
    r.on_finished(0, 1, 2.0)
    r.on_finished(0, 2, 2.0)  # D alone on 0: its 10 blocks, its 2 tokens of prefill
    assert r.cost(req(10, [*range(1, 9), 9, 10], cached=(8, 0)), 0) == (2 + 2) + 10 + 2


def test_dynamo_cost_block_size_and_random_ties():
    r = make_router("cost", page_len=4)
    assert r.cost(req(10, [1, 2], cached=(8, 0)), 0) == 2 / 4 + 0 + 2
    picks = {make_router("cost", page_len=1, seed=s).route(req(4, [1, 2, 3, 4], cached=(0, 0, 0)), workers(3),
                                                           0.0).worker_id for s in range(30)}
    assert picks == {0, 1, 2}


# ---------------------------------------------------------------- Mooncake Algorithm 1 (pull)
def test_pull_copies_from_the_holder_when_it_beats_waiting_and_recomputing():
    # holder w0 has 10 s of queued prefill; w1 idle. w0 (local): 10 + 0.1 = 10.1 s; w1 (best 100 > local 0):
    # T_transfer 100 B at 2000 B/s = 0.05 s + T_queue 0 + prefill of 10 tokens 0.1 s = 0.15 s
    ws = workers(2, w0=dict(num_waiting=1, waiting_new_tokens=1000))
    route = router("pull").route(req(110, cached=(100, 0)), ws, 0.0)
    assert (route.worker_id, route.pull_from, route.pull_len) == (1, 0, 100)
    assert route.expected_ttft_s == pytest.approx(0.15)
    # an idle holder wins: 0.1 s
    assert router("pull").route(req(110, cached=(100, 0)), workers(2), 0.0) == Route(0, expected_ttft_s=pytest.approx(0.1))


def test_pull_adds_transfer_and_queue_times():
    # w1 queues 0.04 s: 0.05 + 0.04 + 0.1 = 0.19 s; idle w2: 0.15 s (max(queue, transfer) would tie them at 0.15)
    ws = workers(3, w0=dict(num_waiting=1, waiting_new_tokens=1000), w1=dict(num_waiting=1, waiting_new_tokens=4))
    route = router("pull").route(req(110, cached=(100, 0, 0)), ws, 0.0)
    assert (route.worker_id, route.pull_from) == (2, 0) and route.expected_ttft_s == pytest.approx(0.15)


def test_pull_ties_go_to_fewer_outstanding_requests_then_lower_id():
    ws = workers(3, w0=dict(num_running=2), w1=dict(num_running=1), w2=dict(num_running=1))
    assert router("pull").route(req(110, cached=(0, 0, 0)), ws, 0.0).worker_id == 1  # all 1.1 s
    ws = workers(3, w0=dict(num_waiting=1, waiting_new_tokens=1000), w1=dict(num_running=3))
    assert router("pull").route(req(110, cached=(100, 0, 0)), ws, 0.0).worker_id == 2  # 0.15 s each: 3 vs 0


def test_pull_balancing_threshold_decides_the_branch():
    # w0 holds 100 (10 s queued), w1 60, w2 nothing. Threshold 1: w1 pulls the 40 missing: 0.02 + 0.1 = 0.12 s
    ws = workers(3, w0=dict(num_waiting=1, waiting_new_tokens=1000))
    route = router("pull").route(req(110, cached=(100, 60, 0)), ws, 0.0)
    assert (route.worker_id, route.pull_from, route.pull_len) == (1, 0, 100)
    assert route.expected_ttft_s == pytest.approx(0.12)
    # threshold 2: 100 <= 2 x 60, w1 recomputes 50 tokens (0.5 s); w2 (100 > 0) pulls all: 0.05 + 0.1 = 0.15 s
    route = router("pull", balancing_threshold=2.0).route(req(110, cached=(100, 60, 0)), ws, 0.0)
    assert (route.worker_id, route.pull_from) == (2, 0) and route.expected_ttft_s == pytest.approx(0.15)


# ---------------------------------------------------------------- llm-d precise
def test_precise_weighted_sum_of_prefix_queue_and_kv_scores():
    r = router("precise")  # 2 x prefix + 1 x (1 - kv usage) + 1 x queue; KV pool 10,000 tokens
    ws = workers(3, w0=dict(num_waiting=2, running_ctx_tokens=5000))
    # prefix (min-max over hits 8, 4): 1, 0, 0; queue (max 2): 0, 1, 1; kv: 0.5, 1, 1 -> 2.5, 2, 2
    assert r.scores(req(10, range(10), cached=(8, 4, 0)), ws) == pytest.approx([2.5, 2.0, 2.0])
    assert r.route(req(10, range(10), cached=(8, 4, 0)), ws, 0.0).worker_id == 0


def test_precise_min_max_quirk_and_random_ties():
    # w1's 4-block hit scores 0, like w2's miss; w0: 2 + 0 + 0, w1: 0 + 1 + 2/3, w2: 0 + 1 + 1: w0 and w2 tie
    ws = workers(3, w0=dict(num_waiting=3, running_ctx_tokens=10_000), w1=dict(num_waiting=1))
    q = req(10, range(10), cached=(8, 4, 0))
    assert router("precise").scores(q, ws) == pytest.approx([2.0, 5 / 3, 2.0])
    picks = {make_router("precise", cost=CostModel(PROFILE), page_len=1, seed=s).route(q, ws, 0.0).worker_id
             for s in range(30)}
    assert picks == {0, 2}
    # one hit: 1.0; HEAD's absolute normalisation: hits / prompt blocks
    assert router("precise").prefix_scores(req(10, range(10), cached=(0, 4, 0)), 3) == [0.0, 1.0, 0.0]
    absolute = router("precise", normalisation="absolute")
    assert absolute.prefix_scores(req(10, range(10), cached=(8, 4, 0)), 3) == pytest.approx([0.8, 0.4, 0.0])


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


def test_full_ties_rotate_over_the_workers_and_other_choices_leave_the_turn_alone():
    from radix_sync.policy.routers import full_tie, next_tie_start, ttft_rank_key

    # idle, equal workers: prompts nobody holds tie on time and load; they go 0, 1, 2, 0, ... (not always to 0)
    r = router("expected_ttft", allow_pull=False)
    ws = workers(3)
    picks = [r.route(req(10, cached=(0, 0, 0), rid=k), ws, 0.0).worker_id for k in range(4)]
    assert picks == [0, 1, 2, 0]
    # a prompt w2 holds is no tie: it goes there and the turn (w1 next) stays
    assert r.route(req(10, cached=(0, 0, 8), rid=9), ws, 0.0).worker_id == 2
    assert r.route(req(10, cached=(0, 0, 0), rid=10), ws, 0.0).worker_id == 1
    # equal time, unequal load: fewer outstanding wins, and that is no full tie either
    busy = workers(2, w0=dict(num_running=1))
    assert not full_tie([(0.1, 1), (0.1, 0)], busy) and full_tie([(0.1, 0), (0.1, 1)], ws)
    assert next_tie_start([(0.1, 1), (0.1, 0)], busy, 0) == 0
    assert next_tie_start([(0.1, 1), (0.1, 2)], ws, 0) == 2 and next_tie_start([(0.1, 2), (0.1, 0)], ws, 0) == 0
    # the key puts the worker at the turn first among tied ones
    assert sorted(range(3), key=lambda i: ttft_rank_key(0.1, i, ws, 2)) == [2, 0, 1]


def test_a_router_with_peers_breaks_ties_on_the_expected_ttft_by_its_own_draw():
    from radix_sync.policy.routers import make_router, ttft_rank_key

    # equal time, unequal load: alone, the less loaded worker takes every tie (the load is its own to read);
    # with other routers serving, that load is shared and every router would pick the same worker: each router
    # draws two of the tied workers and takes the less loaded of them (power of two choices), so the least loaded
    # takes most, the middle one some (when drawn with the most loaded), the most loaded none
    ws = workers(3, w0=dict(num_running=2), w2=dict(num_running=1))
    alone = router("expected_ttft", allow_pull=False)
    assert {alone.route(req(10, cached=(0, 0, 0), rid=k), ws, 0.0).worker_id for k in range(30)} == {1}
    picks = [[], []]
    for seed, out in zip((5, 6), picks):
        r = make_router("expected_ttft", cost=alone.cost, kv_bytes_per_token=1, allow_pull=False, seed=seed)
        r.peers = 3
        out.extend(r.route(req(10, cached=(0, 0, 0), rid=k), ws, 0.0).worker_id for k in range(90))
        assert set(out) == {1, 2} and out.count(1) > out.count(2) and r.tie_start == 0  # (no turn: drawn)
    assert picks[0] != picks[1]  # two routers, two draws
    # equal load too: the draw alone
    even = workers(3)
    assert {r.route(req(10, cached=(0, 0, 0), rid=100 + k), even, 0.0).worker_id for k in range(40)} == {0, 1, 2}
    # a strictly faster option is never drawn against: a holder wins every time
    r.peers = 3
    assert {r.route(req(10, cached=(0, 8, 0), rid=k), ws, 0.0).worker_id for k in range(20)} == {1}
    # a caller's draw (the live router's) decides instead of the router's own: w2 and w1 drawn, w1 less loaded
    r.tie_draw = (0.9, 0.8, 0.1)
    assert r.route(req(10, cached=(0, 0, 0)), ws, 0.0).worker_id == 1
    r.tie_draw = (0.1, 0.9, 0.2)  # w0 and w2 drawn: w2, less loaded than w0 (w1, the least, not drawn)
    assert r.route(req(10, cached=(0, 0, 0)), ws, 0.0).worker_id == 2
    assert ttft_rank_key(0.1, 2, ws, 0, (0.9, 0.8, 0.1)) == (0.1, 0, 0.1)


def test_expected_ttft_queues_behind_its_own_requests_waiting_for_the_same_copy():
    # a replica lands on w1 at 0.5 s; w0 (the holder) has 10 s of queue. The first request waits for it: 0.5 + 0.1
    r = router("expected_ttft", allow_pull=False)
    ws = workers(2, w0=dict(num_waiting=1, waiting_new_tokens=1000))
    inflight = (HolderView(1, REPLICA, 100, None, 0.5),)
    first = r.route(req(110, cached=(100, 0), inflight=inflight, rid=1), ws, 0.0)
    assert (first.worker_id, first.wait_inflight, first.expected_ttft_s) == (1, True, pytest.approx(0.6))
    # the second sees w1's queue raised by the first (0.1 s of prefill), which cannot run before the copy lands
    # either: it starts at max(0.1 - 0.1, 0.5) + 0.1 = 0.6 and is served at 0.7 (not max(0.1, 0.5) + 0.1 = 0.6)
    ws = workers(2, w0=dict(num_waiting=1, waiting_new_tokens=1000), w1=dict(num_waiting=1, waiting_new_tokens=10))
    second = r.route(req(110, cached=(100, 0), inflight=inflight, rid=2), ws, 0.0)
    assert second.expected_ttft_s == pytest.approx(0.7)
    # once the first has its first token it gates nothing; a router that sent nothing sees the plain max
    r.on_first_token(1, 1, 0.6)
    r.on_first_token(1, 2, 0.7)
    assert r.route(req(110, cached=(100, 0), inflight=inflight, rid=3), ws, 0.0).expected_ttft_s == pytest.approx(0.6)
    fresh = router("expected_ttft", allow_pull=False)
    assert fresh.route(req(110, cached=(100, 0), inflight=inflight), ws, 0.0).expected_ttft_s == pytest.approx(0.6)


def test_expected_ttft_counts_the_prefix_its_own_earlier_requests_compute_first():
    # K candidates of one 100-token prompt (pages 1..100) arrive together; nothing is cached anywhere yet.
    # The caller's views count what this router sent and has not seen start (as the live `with_local_load` and the
    # simulator's views): a prompt's tokens less what the directory says is cached there.
    r = router("expected_ttft", allow_pull=False)
    pages = range(1, 101)
    # A: w0 idle (1.0 s), w1 has 5 queued tokens (1.05 s): w0
    a = r.route(req(100, pages, cached=(0, 0), rid=1), workers(2, w1=dict(num_waiting=1, waiting_new_tokens=5)), 0.0)
    assert (a.worker_id, a.expected_ttft_s) == (0, pytest.approx(1.0))
    # B: w0's view now has A queued (1.0 s); A computes the 100 tokens first, so B prefills 1 token there (the
    # last token is never cached): 1.0 + 0.01 = 1.01 < w1's 1.05. (Before: 1.0 + 1.0 = 2.0, so B went to w1 and
    # recomputed the whole prompt: every candidate of a job on its own worker.)
    ws = workers(2, w0=dict(num_waiting=1, waiting_new_tokens=100), w1=dict(num_waiting=1, waiting_new_tokens=5))
    b = r.route(req(100, pages, cached=(0, 0), rid=2), ws, 0.0)
    assert (b.worker_id, b.expected_ttft_s) == (0, pytest.approx(1.01))
    # C: w0's view counts B as 100 tokens too (2.0 s), but B will prefill 1: the router takes off the 0.99 s it
    # knows is over-counted: 1.01 + 0.01 = 1.02
    ws = workers(2, w0=dict(num_waiting=2, waiting_new_tokens=200), w1=dict(num_waiting=1, waiting_new_tokens=5))
    c = r.route(req(100, pages, cached=(0, 0), rid=3), ws, 0.0)
    assert (c.worker_id, c.expected_ttft_s) == (0, pytest.approx(1.02))
    # another prompt (pages 201..300) gets no credit for them: w0 (A, B, C queued: 3.0 - 0.99 - 0.99 s) + 1.0 =
    # 2.02 vs w1's 1.05
    ws = workers(2, w0=dict(num_waiting=3, waiting_new_tokens=300), w1=dict(num_waiting=1, waiting_new_tokens=5))
    d = r.route(req(100, range(201, 301), cached=(0, 0), rid=4), ws, 0.0)
    assert (d.worker_id, d.expected_ttft_s) == (1, pytest.approx(1.05))
    assert r.options(req(100, range(201, 301), cached=(0, 0)), ws, 0.0)[0].expected_ttft_s == pytest.approx(2.02)
    # once they have started, their pages and their over-count are forgotten: a copy of the prompt that finds it
    # evicted (cached 0) on an idle w0 costs the full 1.0 s again
    for rid in (1, 2, 3):
        r.on_first_token(0, rid, 1.0)
    r.on_finished(1, 4, 1.0)
    assert r.route(req(100, pages, cached=(0, 0), rid=5), workers(2, w1=dict(num_waiting=1, waiting_new_tokens=5)),
                   1.0).expected_ttft_s == pytest.approx(1.0)
