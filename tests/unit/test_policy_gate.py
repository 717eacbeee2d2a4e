"""The planner's gate (`radix_sync.policy.gate`), each term hand-computed, and each term refusing or shrinking a copy
in the planner (issue 16, item 7: a copy's gain is net of the harm it does to the others)."""

import pytest

from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.gate import UNLIMITED, landing_room_tokens, link_free_s, pull_delay_s
from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
from radix_sync.policy.predictor import DemandPredictor
from radix_sync.policy.snapshot import REPLICA, ClusterSnapshot, HolderView, PrefixView, WorkerView

# as tests/unit/test_policy_planner.py: 10 ms per prompt token, 1000 B/s links, 1 byte of KV per token
PROFILE = CostProfile(name="t", kv_bytes_per_token=1, kv_capacity_tokens=10_000, max_context_len=10_000,
                      chunked_prefill_len=10_000, max_running_requests=64, prefill_overhead_s=0.0,
                      prefill_s_per_token=0.01, prefill_s_per_token_pair=0.0, decode_step_s=0.01,
                      decode_s_per_request=0.0, decode_s_per_ctx_token=0.0, nic_bandwidth_bytes_per_s=1000.0,
                      transfer_latency_s=0.0)


def snapshot():
    """Holder w0 has 20 s of queue; node 7 (100 tokens) has one hinted request at t=1 adding 10 tokens."""
    ws = tuple(WorkerView(i, free_tokens=10_000, replica_budget_tokens=10_000, nic_bandwidth_bytes_per_s=1000.0)
               for i in range(2))
    ws = (ws[0]._replace(num_waiting=1, waiting_new_tokens=2000),) + ws[1:]
    node = PrefixView(node_id=7, token_len=100, holders=(HolderView(0, depth_len=100),), expected_new_len=10,
                      fanout_hint=1, hint_at_s=1.0)
    return ClusterSnapshot(ws, (node,), (), page_len=1, kv_bytes_per_token=1)


def planner(**kw):
    return KvrepPlanner(CostModel(PROFILE), DemandPredictor(), PlannerConfig(**kw))


def refused(snap, reason):
    """Plans without pull; returns whether nothing was copied and node 7's outcome names `reason`."""
    p = planner(allow_pull=False)
    return p.plan(snap, 0.0) == [] and reason in p.outcomes[7]


def test_a_link_is_free_after_what_is_booked_and_what_is_decided():
    # booked until 2.0; 500 B decided but not booked at 1000 B/s: 0.5 s more
    assert link_free_s(2.0, 500, 1000.0, 1.0) == pytest.approx(2.5)
    # booked in the past: from now
    assert link_free_s(0.5, 500, 1000.0, 1.0) == pytest.approx(1.5)
    # no bandwidth: nothing can be booked; pending bytes do not count
    assert link_free_s(0.5, 500, 0.0, 1.0) == pytest.approx(1.0)


def test_pull_delay_is_rate_times_hold_times_wait():
    # 0.5 pulls/s; the copy starts at 3 (now 1) and holds the link 2 s: pulls arriving in [1, 3) wait 2 s each
    # (0.5 x 2 x 2 = 2), those in [3, 5) wait 1 s on average (0.5 x 2 x 1 = 1)
    assert pull_delay_s(0.5, 3.0, 2.0, 1.0) == pytest.approx(3.0)
    assert pull_delay_s(0.5, 0.5, 2.0, 1.0) == pytest.approx(1.0)  # started already: only the hold counts
    assert pull_delay_s(0.0, 3.0, 2.0, 1.0) == 0.0


def test_landing_room_ends_where_wanted_pages_would_be_evicted():
    w = WorkerView(0, free_tokens=100, waiting_new_tokens=30, incoming_tokens=20, demoted_tokens=10,
                   replica_tokens=200, waited_evict_first_tokens=50)
    # free at landing 100 - 30 - 20 = 50; evict-first 10 + 200 = 210, of which 50 + 40 wanted: 120 unwanted
    assert landing_room_tokens(w, 40) == 170
    # more wanted than evict-first: only what is free at landing
    assert landing_room_tokens(w, 400) == 50
    # the queue and the copies coming in fill more than is free: nothing
    assert landing_room_tokens(w._replace(waiting_new_tokens=500), 400) == 0


def test_landing_room_stops_at_the_evict_first_pages_when_ordinary_pages_are_wanted():
    # full, 200 replica tokens none wanted: past them a copy takes ordinary pages in LRU order; 100 ordinary tokens
    # there have predicted demand (their LRU place unknown): the room is the 200 evict-first tokens, not unlimited
    w = WorkerView(0, free_tokens=0, replica_tokens=200)
    assert landing_room_tokens(w, 0, 100) == 200
    assert landing_room_tokens(w, 0, 0) == UNLIMITED
    # with 50 of the replica tokens wanted as well: 150
    assert landing_room_tokens(w, 50, 100) == 150


def test_landing_room_is_unlimited_when_nothing_wanted_can_go():
    w = WorkerView(0, free_tokens=0, replica_tokens=500)
    assert landing_room_tokens(w) == UNLIMITED  # only unwanted replicas and ordinary pages are evicted
    assert landing_room_tokens(w._replace(replica_tokens=-1, waited_evict_first_tokens=9)) == UNLIMITED  # unreported


WANTED = "would evict a wanted page"


# ---- each term in the planner (the base case: tests/unit/test_policy_planner.py, without pull the copy saves the
# 1.1 s recompute: gain 1.1 - 0.1 (landing) - 0.005 (link) = 0.995 s) ----

def with_worker(snap, i, **fields):
    ws = list(snap.workers)
    ws[i] = ws[i]._replace(**fields)
    return snap.__class__(tuple(ws), snap.prefixes, snap.links, snap.page_len, snap.kv_bytes_per_token)


def test_bytes_decided_for_the_sources_link_delay_the_landing():
    # 1000 B pending on w0's egress: the copy starts at 1.0, lands at 1.1; the request (t=1) waits 0.1 s for it:
    # 0.1 + 0.1 prefill = 0.2 s instead of 0.1: gain 1.1 - 0.2 - 0.005 = 0.895
    # (the link cap raised to 2 s: by default a link promised 1 s ahead takes no speculative copy at all)
    out = planner(allow_pull=False, max_link_backlog_s=2.0).plan(with_worker(snapshot(), 0, egress_pending_bytes=1000),
                                                                 0.0)
    assert out[0].gain_s == pytest.approx(0.895)
    # with a pull on the request's path available (0.2 s), a copy landing then saves nothing: none
    assert planner(allow_pull=True, max_link_backlog_s=2.0).plan(
        with_worker(snapshot(), 0, egress_pending_bytes=1000), 0.0) == []
    # the default cap (0.5 s): the source's link is promised too far ahead
    p = planner(allow_pull=False)
    assert p.plan(with_worker(snapshot(), 0, egress_pending_bytes=1000), 0.0) == []
    assert "every source's link is booked" in p.outcomes[7]


def test_bytes_decided_for_the_targets_link_count_too():
    out = planner(allow_pull=False, max_link_backlog_s=2.0).plan(
        with_worker(snapshot(), 1, ingress_pending_bytes=1000), 0.0)
    assert out[0].gain_s == pytest.approx(0.895)
    p = planner(allow_pull=False)
    assert p.plan(with_worker(snapshot(), 1, ingress_pending_bytes=1000), 0.0) == []
    assert "target link booked" in p.outcomes[7]


def test_the_delay_imposed_on_pulls_behind_the_copy_is_charged():
    # 2 pulls/s out of w0 and 1/s into w1; the copy holds both links 0.1 s from 0: 2 x 0.1 x 0.05 + 1 x 0.1 x 0.05
    snap = with_worker(with_worker(snapshot(), 0, egress_pull_rate_per_s=2.0), 1, ingress_pull_rate_per_s=1.0)
    out = planner(allow_pull=False).plan(snap, 0.0)
    assert out[0].gain_s == pytest.approx(0.995 - 0.015)


def test_no_copy_that_would_evict_a_replica_requests_wait_for():
    # w1 is full: 500 replica tokens, 460 of them waited for by requests routed there; the 100-token copy (or the
    # 50-token half) would need 100 (50) evicted, only 40 are unwanted: refused
    full = dict(free_tokens=0, replica_tokens=500, demoted_tokens=0)
    assert refused(with_worker(snapshot(), 1, waited_evict_first_tokens=460, **full), WANTED)
    # 400 waited for: 100 unwanted, the copy fits; it still pays for the ordinary memory it displaces:
    # 0.3 x prefill(100) = 0.3 s -> 0.995 - 0.3
    out = planner(allow_pull=False).plan(with_worker(snapshot(), 1, waited_evict_first_tokens=400, **full), 0.0)
    assert out[0].gain_s == pytest.approx(0.695)


def test_no_copy_that_would_evict_a_replica_the_planner_predicts_demand_for():
    # node 8's replica on w1 (460 tokens) has a hinted request coming; w1 is full with 500 replica tokens
    snap = with_worker(snapshot(), 1, free_tokens=0, replica_tokens=500, demoted_tokens=0)
    other = PrefixView(node_id=8, token_len=460, holders=(HolderView(1, REPLICA, 460),), fanout_hint=1, hint_at_s=1.0)
    snap = snap.__class__(snap.workers, snap.prefixes + (other,), (), 1, 1)
    assert refused(snap, WANTED)


def test_copies_still_coming_in_and_the_queue_take_the_room_first():
    # w1: 150 free; 10 demoted tokens a queued request will use (so something there is wanted)
    base = dict(free_tokens=150, replica_tokens=0, demoted_tokens=10, waited_evict_first_tokens=10)
    assert len(planner(allow_pull=False).plan(with_worker(snapshot(), 1, **base), 0.0)) == 1
    # 100 tokens of another copy still landing: 50 left: only the half-depth copy fits (it lands at 0.05 s, the
    # request prefills 60 tokens: 0.6 s; gain 1.1 - 0.6 - 0.05 x 0.05)
    p = planner(allow_pull=False)
    out = p.plan(with_worker(snapshot(), 1, incoming_tokens=100, **base), 0.0)
    assert [(d.depth_len, round(d.gain_s, 6)) for d in out] == [(50, 0.4975)] and WANTED in p.outcomes[7]
    # 110 still landing: 40 left, nothing fits
    assert refused(with_worker(snapshot(), 1, incoming_tokens=110, **base), WANTED)
    # the same with 110 queued prompt tokens (admitted before it lands)
    assert refused(with_worker(snapshot(), 1, waiting_new_tokens=110, **base), WANTED)


# ---- the whole pass: no copy when none pays, a copy when one clearly does (issue 16, item 7: "when copies do not
# pay it must copy nothing"). Three workers, w0 holds node 7 (100 tokens) with 20 s of queue, one request hinted at
# t=1 adding 10 tokens; min_gain_s=0, so what refuses a copy is its negative gain, not the threshold. ----

def cluster(link_bps=(1000.0, 1000.0, 1000.0, 1000.0), waiting=(2000, 0, 0, 0)):
    ws = tuple(WorkerView(i, num_waiting=int(q > 0), waiting_new_tokens=q, free_tokens=10_000,
                          replica_budget_tokens=10_000, nic_bandwidth_bytes_per_s=bw)
               for i, (bw, q) in enumerate(zip(link_bps, waiting)))
    node = PrefixView(node_id=7, token_len=100, holders=(HolderView(0, depth_len=100),), expected_new_len=10,
                      fanout_hint=1, hint_at_s=1.0)
    return ClusterSnapshot(ws, (node,), (), page_len=1, kv_bytes_per_token=1)


@pytest.mark.parametrize("allow_pull", [False, True])
def test_a_clearly_paying_copy_is_made(allow_pull):
    # idle targets, 1000 B/s: the full copy lands at 0.1 s; the request (t=1) prefills 10 tokens (0.1 s) instead of
    # recomputing 110 (1.1 s; with pull: pulling 0.1 s + 0.1 s); link cost 0.05 x 0.1. One copy: a second replica
    # saves the single request nothing more.
    out = planner(allow_pull=allow_pull, min_gain_s=0.0).plan(cluster(), 0.0)
    assert [(d.node_id, d.source, d.target, d.depth_len) for d in out] == [(7, 0, 1, 100)]
    assert out[0].gain_s == pytest.approx(0.095 if allow_pull else 0.995)


@pytest.mark.parametrize("allow_pull", [False, True])
def test_nothing_is_copied_when_every_link_is_too_slow(allow_pull):
    # 4 B/s everywhere: the full copy lands at 25 s (the request would wait 24 s, then 0.1 s), the half (50 tokens)
    # at 12.5 s (11.5 + 0.6 s); recomputing at an idle worker takes 1.1 s (a pull at route time 25.1 s): no copy is
    # faster than that, at any depth, to any target
    p = planner(allow_pull=allow_pull, min_gain_s=0.0)
    assert p.plan(cluster(link_bps=(4.0,) * 4), 0.0) == []
    assert "no faster there" in p.outcomes[7]
    # only the targets' links slow (the holder's is fast): the same, the slower end sets the copy's speed
    assert planner(allow_pull=allow_pull, min_gain_s=0.0).plan(cluster(link_bps=(1000.0, 4.0, 4.0, 4.0)), 0.0) == []


@pytest.mark.parametrize("allow_pull", [False, True])
def test_nothing_is_copied_when_every_target_is_busier_than_the_holder(allow_pull):
    # w1..w3 have 30 s of queue, the holder 20 s: the request is best served waiting at the holder (19 + 0.1 s); a
    # replica on w1 would serve it at 29 + 0.1 s: the best option stays the holder's, gain 0 - 0.05 x 0.1 < 0
    p = planner(allow_pull=allow_pull, min_gain_s=0.0)
    assert p.plan(cluster(waiting=(2000, 3000, 3000, 3000)), 0.0) == []
    # (with pull, a replica on w1 is no faster than pulling there at route time, 29 + 0.1 s, either)
    assert ("no faster there" if allow_pull else "gain below minimum") in p.outcomes[7]
    # one target only a little less busy than the holder (w1: 19.5 s of queue, 18.5 s at the request's arrival)
    # makes the copy pay there: 19.1 (wait at the holder; recomputing on w1: 18.5 + 1.1) -> 18.5 + 0.1 s, gain
    # 0.5 - 0.005. (Refused before 2026-12-03: the planner's cheap bound took the least wait at `now`, 19.5 s, not
    # at the arrival, and saw no saving.) With pull, pulling to w1 at route time (max(18.5, 0.1) + 0.1) does as
    # well as the replica: no copy.
    out = planner(allow_pull=allow_pull, min_gain_s=0.0).plan(cluster(waiting=(2000, 1950, 3000, 3000)), 0.0)
    if allow_pull:
        assert out == []
    else:
        assert [(d.target, d.depth_len) for d in out] == [(1, 100)]
        assert out[0].gain_s == pytest.approx(0.495)


def test_the_copy_goes_only_where_it_pays():
    # w1 busier than the holder, w2's link 4 B/s, w3 idle and fast: one copy, to w3, gain 1.1 - 0.1 - 0.005
    out = planner(allow_pull=False, min_gain_s=0.0).plan(
        cluster(link_bps=(1000.0, 1000.0, 4.0, 1000.0), waiting=(2000, 3000, 0, 0)), 0.0)
    assert [(d.target, d.depth_len) for d in out] == [(3, 100)]
    assert out[0].gain_s == pytest.approx(0.995)


def test_demoted_pages_a_later_prefill_extended_are_no_room_for_a_copy():
    """Issue 16 item 7, round 5 (fan-out rates 60-150: `kvrep` P99 up to 1.30x `kvrep_pull`): the simulator
    reported every page marked demoted as evict-first room, including the demoted chains a later prefill had
    extended. Such a page is no leaf while its (live) child is there, so the eviction takes the replicas before it:
    the gate saw room where a landing copy evicts a replica that requests routed there wait for.

    Worker 1's cache, pages of 64 tokens (the fan-out workload's), full (capacity = what it holds):
    - chain A, 4 pages (256 tokens), demoted, then extended by one page (a prefill on top of it: 64 live tokens);
    - replica R, 2 pages (128 tokens), which a queued request will use (waited for: 128 tokens).
    The view: replica 128, demoted evict-first 0 (256 before: all 4 pages were counted), free 0.
    Landing room (`gate.landing_room_tokens`) = free at landing 0 + unwanted evict-first
    max(0, demoted + replica - waited): with 256 demoted, 0 + (256 + 128 - 128) = 256 tokens, and the 100-token copy of
    node 7 was made (gain 0.995 - 0.3 x prefill(100) = 0.695 s, as in
    `test_no_copy_that_would_evict_a_replica_requests_wait_for`); with 0 demoted, 0 + (0 + 128 - 128) = 0: refused,
    at either depth (100 or 50 tokens). The truth: making room for 100 tokens there evicts 2 pages, both R's (the
    wanted replica), and none of A's demoted pages.
    """
    from radix_sync.policy.cost import load_profile
    from radix_sync.sim.config import EngineConfig
    from radix_sync.sim.engine import Engine
    from radix_sync.sim.generators import FanoutWorkload, GeneratorConfig
    from radix_sync.sim.policies import build_policy

    profile = load_profile("llama3.1-8b-h200")
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=1.0, duration_s=1.0, seed=1,
                        max_context_len=profile.max_context_len)
    eng = Engine(profile, wl, build_policy("kvrep", profile, wl.page_len, 1),
                 EngineConfig(num_workers=2, duration_s=1.0))
    assert wl.page_len == 64
    cache = eng.workers[1].cache
    a, r = [101, 102, 103, 104, 105], [201, 202]
    cache.insert(a, 4, 0.0)
    assert cache.tree.demote(104) == 4
    cache.insert(a, 5, 1.0)  # a later prefill extends the demoted chain
    cache.insert(r, 2, 1.0, replica=True)
    cache.capacity_tokens = 7 * 64
    v = eng.loads.exact(eng.workers[1], 1.0, *eng.loads._consts())
    assert (v.free_tokens, v.replica_tokens, v.demoted_tokens) == (0, 128, 0)
    assert cache.tree.num_stale_pages == 4  # still marked, but not evict-first
    snap = with_worker(snapshot(), 1, free_tokens=0, replica_tokens=v.replica_tokens, demoted_tokens=v.demoted_tokens,
                       waited_evict_first_tokens=128)
    assert refused(snap, WANTED)
    # what the old count (256) let through
    out = planner(allow_pull=False).plan(with_worker(snap, 1, demoted_tokens=256), 0.0)
    assert [(d.target, d.depth_len, round(d.gain_s, 6)) for d in out] == [(1, 100, 0.695)]
    # the truth: room for a 100-token copy takes R's two pages, not A's
    assert cache.make_room(100)
    assert cache.match_len(r) == 0 and cache.match_len(a) == 5


def test_no_copy_that_would_evict_an_ordinary_prefix_the_planner_predicts_demand_for():
    """Issue 16 item 7, round 5 (fan-out 24 GB/s, seed 1: a copy planned at 40.0 s, when nothing was queued at its
    target, landed at 40.139 s and evicted 22,400 ordinary tokens: the trunk of a hinted tree held there, whose
    branches had been routed to it at 40.110 s; one recomputed it, six queued behind: TTFT 2.0 s). The gate counted
    only evict-first pages as wanted, and with none wanted the room was unlimited.

    Worker 1 is full (free 0) with 40 replica tokens, none wanted, and holds node 8 (300 tokens) as ordinary cache,
    with a hinted request at t=5 (predicted demand; after node 7's request at t=1, so it adds nothing to the wait
    node 7's request sees there). Node 7's copy (100 tokens, or 50 at half depth) would take the 40 evict-first
    tokens and then ordinary pages in LRU order, node 8's among them maybe: room 0 + 40 = 40 < 50: refused. Before:
    room unlimited, the 100-token copy made with gain 1.1 - 0.1 - 0.005 - 0.3 x prefill(100) = 0.695 s. With 120
    replica tokens (room 120) the full copy fits and is made, same gain.
    """
    def with_trunk(replica_tokens):
        snap = with_worker(snapshot(), 1, free_tokens=0, replica_tokens=replica_tokens, demoted_tokens=0)
        trunk = PrefixView(node_id=8, token_len=300, holders=(HolderView(1, depth_len=300),), expected_new_len=10,
                           fanout_hint=1, hint_at_s=5.0)
        return snap.__class__(snap.workers, snap.prefixes + (trunk,), (), 1, 1)

    assert refused(with_trunk(40), WANTED)
    out = planner(allow_pull=False).plan(with_trunk(120), 0.0)
    assert [(d.node_id, d.source, d.target, d.depth_len, round(d.gain_s, 6)) for d in out] == [(7, 0, 1, 100, 0.695)]
