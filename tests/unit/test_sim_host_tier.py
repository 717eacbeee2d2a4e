"""The simulator's host-memory tier (SGLang's hierarchical cache, `EngineConfig.host_tier_ratio`): what the device
evicts is kept in host memory and loaded back when a prompt continues there, at the tier's load rate; the
expected-TTFT router prices it; conservation and the directory hold."""

import dataclasses

import pytest

from radix_sync.integrity import IntegrityError
from radix_sync.policy.cost import CostModel, load_profile
from radix_sync.policy.routers import make_router
from radix_sync.policy.snapshot import RequestView, WorkerView
from radix_sync.sim.cache import Directory, HostTier, WorkerCache
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import AgentWorkload, GeneratorConfig
from radix_sync.sim.policies import build_policy
from radix_sync.sim.workload import SimRequest, Workload
# 10 ms per prompt token, no attention term, no overhead, 1 byte of KV per token; links 1000 and 2000 B/s
from tests.unit.test_policy_planner import PROFILE as PLANNER_PROFILE
from tests.unit.test_policy_routers import PROFILE as ROUTER_PROFILE

H200 = load_profile("llama3.1-8b-h200")


def test_host_tier_keeps_what_the_device_evicts_lru_within_capacity_but_no_replica():
    d, hd = Directory(), Directory()
    c = WorkerCache(0, capacity_tokens=40, page_len=10, directory=d, radix_nodes=False,
                    host=HostTier(0, capacity_pages=2, directory=hd))
    c.insert([1, 2, 3], 3, 0.0)
    c.insert([9], 1, 0.5, replica=True)
    assert c.make_room(40)  # the replica goes first, then 3, 2, 1 (leaves, LRU)
    assert list(c.host.pages) == [2, 1]  # no replica; 3 pushed out by the capacity of 2 pages
    assert c.host.num_dropped == 1
    assert hd.holders == {1: 1, 2: 1} and d.holders == {}
    assert c.host.match_from([1, 2, 3], 0) == 2 and c.host.match_from([1, 2, 3], 1) == 1
    assert c.host.match_from([5, 1, 2], 0) == 0  # a match runs from its first page
    c.insert([1], 1, 1.0)  # on the device again: out of the host tier
    assert list(c.host.pages) == [2] and hd.holders == {2: 1}
    c.host.take([2])
    assert len(c.host) == 0 and hd.holders == {}
    c.check_integrity()


def test_host_tier_integrity_names_a_page_on_both_tiers():
    d, hd = Directory(), Directory()
    c = WorkerCache(0, capacity_tokens=40, page_len=10, directory=d, host=HostTier(0, 4, hd))
    c.insert([1, 2], 2, 0.0)
    c.host.add(2)
    with pytest.raises(IntegrityError, match="both on the device and in the host tier"):
        c.check_integrity()
    with pytest.raises(ValueError, match="capacity_pages"):
        HostTier(0, 0, hd)


class ThreeRequests(Workload):
    """A long prompt, another that fills the pool (so the first is evicted), then the first again with more."""

    def __init__(self, pages_a: int, pages_b: int) -> None:
        super().__init__()
        a = list(range(1, pages_a + 1))
        b = list(range(1000, 1000 + pages_b))
        self.open_requests = [SimRequest(self.new_rid(), len(a) * 64, 1, a, arrival_s=0.0),
                              SimRequest(self.new_rid(), len(b) * 64, 1, b, arrival_s=10.0),
                              SimRequest(self.new_rid(), len(a) * 64 + 64, 1, a + [7777], arrival_s=20.0)]


def run_three(host_tier_ratio: float, policy: str = "round_robin"):
    profile = dataclasses.replace(H200, kv_capacity_tokens=64 * 100)
    wl = ThreeRequests(pages_a=40, pages_b=80)
    cfg = EngineConfig(num_workers=1, duration_s=30.0, host_tier_ratio=host_tier_ratio, view_staleness_s=0.0)
    eng = Engine(profile, wl, build_policy(policy, profile, wl.page_len, 1), cfg)
    stats = eng.run()
    eng.workers[0].cache.check_integrity()
    return wl.open_requests, stats.to_dict(), profile


def test_a_prompt_the_device_evicted_is_loaded_back_from_the_host_tier_at_the_tiers_rate():
    (_, _, c), rec, p = run_three(2.0)
    assert c.cached_len == 40 * 64 and c.host_len == 40 * 64
    load = 40 * 64 * p.kv_bytes_per_token / EngineConfig.host_load_bytes_per_s
    expected = p.prefill_overhead_s + load + p.prefill_piece_s(64, 40 * 64)  # idle worker, one output token
    assert c.first_token_s - c.arrival_s == pytest.approx(expected)
    assert rec["host_hit_rate"] == pytest.approx(40 * 64 / (40 * 64 + 80 * 64 + 41 * 64))
    (_, _, c0), rec0, _ = run_three(0.0)  # no host tier: recomputed
    assert c0.cached_len == 0 and c0.host_len == 0 and rec0["host_hit_rate"] == 0.0
    assert c0.first_token_s - c0.arrival_s == pytest.approx(p.prefill_s(41 * 64, 0))


def test_the_host_tier_needs_a_ratio_above_one_and_a_positive_rate():
    with pytest.raises(ValueError, match="host_tier_ratio"):
        EngineConfig(host_tier_ratio=0.5)
    with pytest.raises(ValueError, match="host_load_bytes_per_s"):
        EngineConfig(host_load_bytes_per_s=0.0)


def test_agent_sessions_on_a_small_pool_load_back_and_keep_every_invariant():
    profile = dataclasses.replace(H200, kv_capacity_tokens=40_000)
    out = {}
    for ratio in (0.0, 2.0):
        wl = AgentWorkload(GeneratorConfig(), 30.0, 30.0, 1, profile.max_context_len, "poisson")
        cfg = EngineConfig(num_workers=2, duration_s=30.0, host_tier_ratio=ratio)
        eng = Engine(profile, wl, build_policy("kvrep", profile, wl.page_len, 1), cfg)
        rec = eng.run().to_dict()
        for w in eng.workers:
            w.cache.check_integrity()
            assert w.cache.reserved_tokens == 0 and not w.waiting and not w.running
        assert rec["num_requests"] == rec["num_arrived"] - rec["num_rejected"]
        out[ratio] = rec
    assert out[0.0]["host_hit_rate"] == 0.0 and out[2.0]["host_hit_rate"] > 0.0
    assert out[2.0]["prefix_hit_rate"] > out[0.0]["prefix_hit_rate"]


def test_the_expected_ttft_router_prices_a_host_tier_hit_at_its_load_rate():
    ws = tuple(WorkerView(i, nic_bandwidth_bytes_per_s=2000.0, free_tokens=10_000) for i in range(2))
    view = RequestView(0, 100, 1, 0, list(range(100)), (0, 0), (), "", (80, 0))
    priced = make_router("expected_ttft", cost=CostModel(ROUTER_PROFILE), page_len=1, kv_bytes_per_token=1,
                         host_load_bytes_per_s=100.0)
    opts = priced.options(view, ws, 0.0)
    assert opts[0].expected_ttft_s == pytest.approx(80 / 100.0 + 20 * 0.01)  # load 80 tokens, compute 20
    assert opts[1].expected_ttft_s == pytest.approx(100 * 0.01)
    assert priced.route(view, ws, 0.0).worker_id == 0
    slow = make_router("expected_ttft", cost=CostModel(ROUTER_PROFILE), page_len=1, kv_bytes_per_token=1,
                       host_load_bytes_per_s=10.0)  # loading 80 tokens (8 s) costs more than computing them
    assert slow.options(view, ws, 0.0)[0].expected_ttft_s == pytest.approx(8.0 + 0.2)
    unpriced = make_router("expected_ttft", cost=CostModel(ROUTER_PROFILE), page_len=1, kv_bytes_per_token=1)
    assert [o.expected_ttft_s for o in unpriced.options(view, ws, 0.0)] == pytest.approx([1.0, 1.0])


# ---- the planner's tier: the device pool, the host tier, or nothing ----

def hinted_snapshot(budget: int):
    """test_policy_planner's case: holder w0 20 s busy, one request hinted at t=1 on a 100-token prefix (+10)."""
    from radix_sync.policy.snapshot import ClusterSnapshot, HolderView, PrefixView
    ws = tuple(WorkerView(i, free_tokens=10_000, replica_budget_tokens=budget, nic_bandwidth_bytes_per_s=1000.0)
               for i in range(2))
    ws = (ws[0]._replace(num_waiting=1, waiting_new_tokens=2000),) + ws[1:]
    node = PrefixView(node_id=7, token_len=100, holders=(HolderView(0, depth_len=100),), expected_new_len=10,
                      fanout_hint=1, hint_at_s=1.0)
    return ClusterSnapshot(ws, (node,), (), page_len=1, kv_bytes_per_token=1)


def tier_planner(host_rate: float, **kw):
    from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
    from radix_sync.policy.predictor import DemandPredictor
    p = KvrepPlanner(CostModel(PLANNER_PROFILE), DemandPredictor(), PlannerConfig(allow_pull=False, **kw))
    p.host_load_bytes_per_s = host_rate
    return p


def test_the_planner_copies_into_the_host_tier_where_the_device_budget_refuses():
    # Without a copy w1 recomputes 110 tokens: 1.1 s. A copy lands at 0.1 s (100 B at 1000 B/s). Into the device
    # pool the hit prefills 10 tokens: 0.1 s, gain 1.1 - 0.1 - 0.05 x 0.1 link = 0.995 s; into the host tier it
    # also loads 100 tokens at 1000 B/s first: 0.2 s, gain 0.895 s (half depth: load 0.05 + pf(60) 0.6, less).
    device = tier_planner(1000.0).plan(hinted_snapshot(budget=10_000), 0.0)
    assert [(d.target, d.depth_len, d.tier) for d in device] == [(1, 100, "device")]
    assert device[0].gain_s == pytest.approx(0.995)
    # a device budget of 99 tokens takes only the half depth: pf(60) = 0.6 s, gain 1.1 - 0.6 - 0.0025 = 0.4975 s;
    # the whole prefix into the host tier gains more
    host = tier_planner(1000.0).plan(hinted_snapshot(budget=99), 0.0)
    assert [(d.target, d.depth_len, d.tier) for d in host] == [(1, 100, "host")]
    assert host[0].gain_s == pytest.approx(0.895)
    for half in (tier_planner(0.0), tier_planner(1000.0, host_copies=False),  # no host tier, the ablation
                 tier_planner(50.0)):  # a load slower than recomputing (100 tokens at 50 B/s: 2 s)
        out = half.plan(hinted_snapshot(budget=99), 0.0)
        assert [(d.depth_len, d.tier) for d in out] == [(50, "device")] and out[0].gain_s == pytest.approx(0.4975)
    assert tier_planner(0.0).plan(hinted_snapshot(budget=49), 0.0) == []  # neither depth fits: nothing
    assert [d.tier for d in tier_planner(1000.0).plan(hinted_snapshot(budget=49), 0.0)] == ["host"]


def test_host_tier_copies_land_in_the_targets_host_memory_and_are_loaded_back_on_a_hit():
    from radix_sync.sim.generators import FanoutWorkload
    from radix_sync.policy.planner import PlannerConfig
    out = {}
    for copies in (True, False):
        wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=20.0, seed=1,
                            max_context_len=H200.max_context_len)
        cfg = EngineConfig(num_workers=4, duration_s=20.0, host_tier_ratio=2.0, replica_budget_frac=0.0)
        eng = Engine(H200, wl, build_policy("kvrep", H200, wl.page_len, 1, PlannerConfig(host_copies=copies)), cfg)
        rec = eng.run().to_dict()
        for w in eng.workers:
            w.cache.check_integrity()
            assert w.cache.reserved_tokens == 0 and not w.waiting and not w.running
        out[copies] = rec
    kinds = out[True]["replication"]["by_kind"]
    assert "replica" not in kinds  # no device budget: no device replica
    assert kinds["host"]["landed"] > 0 and kinds["host"]["useful_bytes"] > 0
    assert out[True]["host_hit_rate"] > 0.0
    assert "host" not in out[False]["replication"]["by_kind"] and out[False]["host_hit_rate"] == 0.0


def test_unpriced_the_policies_see_no_host_tier_but_the_workers_still_use_it():
    profile = dataclasses.replace(H200, kv_capacity_tokens=40_000)
    wl = AgentWorkload(GeneratorConfig(), 30.0, 30.0, 1, profile.max_context_len, "poisson")
    cfg = EngineConfig(num_workers=2, duration_s=30.0, host_tier_ratio=2.0, host_tier_priced=False)
    policy = build_policy("kvrep", profile, wl.page_len, 1)
    eng = Engine(profile, wl, policy, cfg)
    assert policy.router.host_load_bytes_per_s == 0.0 and policy.planner.host_load_bytes_per_s == 0.0
    rec = eng.run().to_dict()
    assert rec["host_hit_rate"] > 0.0
    priced = build_policy("kvrep", profile, wl.page_len, 1)
    Engine(profile, wl, priced, dataclasses.replace(cfg, host_tier_priced=True))
    assert priced.router.host_load_bytes_per_s == cfg.host_load_bytes_per_s == priced.planner.host_load_bytes_per_s
