"""The copy on the critical path (`radix_sync.policy.pull`) on hand-computed cases: the pure rule the simulator's
`kvrep_pull` runs, and the live router's decision built on it (`rank_by_ttft(allow_pull=True)`).

Costs (the router's, as in test_router_policy): 10 ms per uncached token, no per-request overhead, no decode step;
KV 1 byte/token over a 200 B/s link, no fixed copy cost; prefill in chunks of 30 tokens (0.3 s), so a worker with
prefill queued is 0.3 s from the end of its iteration in progress. A 100-token prompt, of which worker a holds 80.
"""
from dataclasses import replace

import pytest

from radix_sync.policy.cost import CostModel
from radix_sync.policy.forecast import queue_wait_s, split_iteration
from radix_sync.policy.pull import PullConfig, PullPlan, best_holder, plan_pull, pull_eta_s, pull_ttft_s
from radix_sync.policy.routers import ExpectedTtftRouter
from radix_sync.policy.snapshot import RequestView, Route, WorkerView
from radix_sync.router.policy import CopyInFlight, RouterCosts, WorkerState, cost_model, rank_by_ttft
from radix_sync.sim.policies import build_policy

COSTS = RouterCosts(prefill_s_per_token=0.01, queue_s_per_request=0.0, decode_step_s=0.0, kv_bytes_per_token=1,
                    link_bytes_per_s=200.0, transfer_latency_s=0.0)
UNCHUNKED = cost_model(COSTS)


def chunked(costs, tokens=30):
    return CostModel(replace(costs.profile(), chunked_prefill_len=tokens))


MODEL = chunked(COSTS)


def w(wid, running=0, waiting=0, waiting_tokens=0, own=True):
    """`own`: the queued requests are this router's, not seen start (else only the worker's reported waiting queue)."""
    return WorkerState(wid, 16, running, waiting, waiting_tokens, own_waiting_tokens=waiting_tokens if own else 0)


def decide(workers, matched, copies=(), prompt_len=100, ns="", model=MODEL, cfg=PullConfig()):
    return rank_by_ttft(workers, matched, copies, prompt_len, ns, 0.0, model, allow_pull=True, pull_cfg=cfg)


# ------------------------------------------------------------------------------------------- the pure pieces
def test_best_holder_and_the_copy_time():
    assert best_holder((0, 80, 80)) == (1, 80)  # ties to the lower id
    a, b = WorkerView(0, nic_bandwidth_bytes_per_s=200.0), WorkerView(1, nic_bandwidth_bytes_per_s=100.0)
    assert pull_eta_s(a, b, 80, MODEL, 0.0) == pytest.approx(0.8)  # the slower end's bandwidth
    busy = a._replace(egress_busy_until_s=0.5)
    assert pull_eta_s(busy, b, 80, MODEL, 0.0) == pytest.approx(1.3)  # behind the copy already on the link
    iterating = b._replace(busy_until_s=0.2)
    assert pull_eta_s(a, iterating, 80, MODEL, 0.0) == pytest.approx(0.8)  # the simulator: no endpoint wait
    assert pull_eta_s(a, iterating, 80, MODEL, 0.0, endpoint_wait=True) == pytest.approx(1.0)


def test_no_pull_from_itself_or_without_a_link_or_when_the_target_holds_as_much():
    ws = (WorkerView(0, nic_bandwidth_bytes_per_s=200.0), WorkerView(1, nic_bandwidth_bytes_per_s=200.0),
          WorkerView(2))
    assert pull_ttft_s(MODEL, 1, ws, 0, 0, 80, 80, 0.0, 0.2, 0.0) is None
    assert pull_ttft_s(MODEL, 1, ws, 2, 0, 80, 0, 0.0, 0.2, 0.0) is None  # no bandwidth
    assert pull_ttft_s(MODEL, 1, ws, 1, 0, 80, 80, 0.0, 0.2, 0.0) is None
    # only the missing 40 tokens are priced: 0.2 s, then 0.2 s of prefill; the queue (0.3 s) overlaps the copy
    assert pull_ttft_s(MODEL, 1, ws, 1, 0, 80, 40, 0.3, 0.2, 0.0) == pytest.approx((0.5, 0.2))


def test_the_deadline_is_the_break_even_bounded():
    pull = Route(1, pull_from=0, pull_len=80, expected_ttft_s=0.6, pull_eta_s=0.4)
    # the copy may land until 1.0 - 0.2 = 0.8 s and the pull still beats the fallback's 1.0 s
    assert plan_pull(pull, Route(1, expected_ttft_s=1.0), 0.2, 10.0) == PullPlan(0, 1, 80, 0.4, 0.6, 1.0, 10.8)
    assert plan_pull(pull, Route(1, expected_ttft_s=1.0), 0.2, 10.0, PullConfig(1.0, 2.0)).deadline_s == 11.0
    assert plan_pull(pull, Route(1, expected_ttft_s=9.0), 0.2, 10.0, PullConfig(0.1, 0.5)).deadline_s == 10.5
    assert plan_pull(Route(0, expected_ttft_s=0.2), Route(0, expected_ttft_s=0.2), 0.2, 0.0) is None
    with pytest.raises(ValueError, match="min_wait_s"):
        PullConfig(min_wait_s=3.0, max_wait_s=2.0)
    with pytest.raises(ValueError, match="ttl_s"):
        PullConfig(ttl_s=0.0)


# ------------------------------------------------------------------------------- the live router's decision
def test_pull_wins_when_the_holder_is_busy():
    # a: 1.0 s queued + 0.2 s (20 uncached) = 1.2 s; b cold: 1.0 s; b pulling 80 tokens: the copy starts when a's
    # iteration in progress ends (its first chunk, 0.3 s) and takes 0.4 s, then 0.2 s of prefill = 0.9 s
    d = decide([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80})
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((1.0, 1.2))  # the fallback: no copy
    assert d.pull == PullPlan("a", "b", 80, pytest.approx(0.7), pytest.approx(0.9), pytest.approx(1.0),
                              pytest.approx(0.8))


def test_no_pull_from_a_holder_whose_queue_is_all_in_its_iteration_in_progress():
    # unchunked, a's whole 1.0 s of queued prefill is one iteration: the copy would start at 1.0 s (1.6 s TTFT),
    # later than a itself serves the request (1.2 s); before the split the live router priced it at 0.6 s and
    # half its pulls were still pending at the source at their deadline
    d = decide([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, model=UNCHUNKED)
    assert d.ranked == ("b", "a") and d.pull is None
    # a queue the worker reports (another router's requests, or SGLang's own waiting queue) is not running: the
    # copy starts at once (0.4 s, 0.6 s TTFT)
    d = decide([w("a", waiting=1, waiting_tokens=100, own=False), w("b")], {"a": 80}, model=UNCHUNKED)
    assert d.pull.copy_eta_s == pytest.approx(0.4) and d.pull.expected_ttft_s == pytest.approx(0.6)


def test_split_iteration_moves_the_first_chunk_into_the_iteration_and_keeps_the_queue_wait():
    v = WorkerView(0, num_running=1, num_waiting=2, waiting_new_tokens=100, waiting_attn_pairs=40.0,
                   waiting_cached_pairs=8.0, busy_until_s=10.05)
    costs = RouterCosts(prefill_s_per_token=0.01, queue_s_per_request=0.0, decode_step_s=0.05,
                        kv_bytes_per_token=1, link_bytes_per_s=200.0, transfer_latency_s=0.0)
    for model, in_progress, iteration in ((chunked(costs), None, 0.3), (cost_model(costs), None, 1.0),
                                          (cost_model(costs), 0.25, 0.25), (chunked(costs), 0.5, 0.3)):
        s = split_iteration(model, v, 10.0, in_progress)
        assert s.busy_until_s == pytest.approx(10.05 + iteration)
        assert queue_wait_s(model, s, 10.0) == pytest.approx(queue_wait_s(model, v, 10.0)) == pytest.approx(1.05)
        assert s.waiting_new_tokens == pytest.approx(100 * (1 - iteration))
        assert s.num_waiting == pytest.approx(2 * (1 - iteration))
    idle = WorkerView(1, busy_until_s=3.0)
    assert split_iteration(MODEL, idle, 10.0) is idle  # nothing queued: as it was
    assert split_iteration(MODEL, v, 10.0, 0.0) is v  # nothing of it in progress: as it was


def test_pull_loses_to_a_short_queue_at_the_holder():
    # a: 0.3 s queued + 0.2 s = 0.5 s beats b pulling (0.6 s) and b cold (1.0 s)
    d = decide([w("a", waiting=1, waiting_tokens=30), w("b")], {"a": 80})
    assert d.ranked == ("a", "b") and d.pull is None
    # and without --pull the decision is the same ranking, never a pull
    d = rank_by_ttft([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, (), 100, "", 0.0, MODEL)
    assert d.ranked == ("b", "a") and d.pull is None


def test_a_busy_link_makes_the_pull_lose():
    # another tenant's 200-token copy a -> b holds a's egress and b's ingress for 1.0 s: the pull would land at
    # 1.4 s (1.6 s TTFT), so b computes cold (1.0 s); the other tenant's copy is no copy of this prompt
    d = decide([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, [CopyInFlight("a", "b", "other", 200)])
    assert d.ranked == ("b", "a") and d.pull is None and not d.wait_inflight
    # a 70-token one (0.35 s, past the end of a's iteration at 0.3 s): the pull still wins, landing 0.05 s later
    # than on an idle link
    d = decide([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, [CopyInFlight("a", "b", "other", 70)])
    assert d.pull.copy_eta_s == pytest.approx(0.75) and d.pull.expected_ttft_s == pytest.approx(0.95)


def test_a_copy_in_flight_of_this_prefix_is_waited_for_not_pulled_again():
    # the 80 tokens are already on their way a -> b (0.4 s): b waits for them (0.6 s); a second copy would queue
    # behind the first on both links (0.8 s + 0.2 s)
    d = decide([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, [CopyInFlight("a", "b", "", 80)])
    assert d.ranked == ("b", "a") and d.wait_inflight and d.pull is None
    assert d.expected_ttft_s == pytest.approx((0.6, 1.2))


def test_the_live_pull_waits_for_the_iteration_at_both_ends():
    # a's iteration in progress ends at 0.3 s (a chunk of its queued prefill); b decodes (a 0.05 s step) and has
    # 40 tokens queued, its iteration ends at 0.05 + 0.3 = 0.35 s: the copy starts then, lands at 0.75 s, and b's
    # queue (0.45 s) is over by then: 0.95 s. The fallback is a (1.0 s queued + 0.2 s), b cold would be 1.45 s
    costs = RouterCosts(prefill_s_per_token=0.01, queue_s_per_request=0.0, decode_step_s=0.05,
                        kv_bytes_per_token=1, link_bytes_per_s=200.0, transfer_latency_s=0.0)
    d = decide([w("a", waiting=1, waiting_tokens=100), w("b", running=1, waiting=1, waiting_tokens=40)], {"a": 80},
               model=chunked(costs))
    assert d.pull.copy_eta_s == pytest.approx(0.75) and d.pull.expected_ttft_s == pytest.approx(0.95)
    assert d.pull.fallback_ttft_s == pytest.approx(1.2) and d.pull.deadline_s == pytest.approx(1.0)


def test_the_live_decision_is_the_simulators_kvrep_pull_rule():
    # the same object and method: the simulator's `kvrep_pull` bundle routes the same view to the same pull; live,
    # with the iterations in progress split out of the queues and waited for at both ends (the simulator's
    # executor starts a copy at once)
    d = decide([w("a", waiting=1, waiting_tokens=100), w("b"), w("c", running=0)], {"a": 80})
    profile = MODEL.profile
    sim = build_policy("kvrep_pull", profile, 1, 0).router
    assert isinstance(sim, ExpectedTtftRouter) and sim.allow_pull and not sim.endpoint_wait
    live_rule = ExpectedTtftRouter(CostModel(profile), profile.kv_bytes_per_token, allow_pull=True,
                                   endpoint_wait=True)
    views = tuple(split_iteration(MODEL, WorkerView(i, num_waiting=n, waiting_new_tokens=t,
                                                    nic_bandwidth_bytes_per_s=200.0), 0.0)
                  for i, (n, t) in enumerate(((1, 100), (0, 0), (0, 0))))
    route = live_rule.route(RequestView(0, 100, cached_len=(80, 0, 0)), views, 0.0)
    assert (route.worker_id, route.pull_from, route.pull_len) == (1, 0, 80)
    assert (d.pull.target, d.pull.source, d.pull.pull_len) == ("b", "a", 80)
    assert d.pull.expected_ttft_s == pytest.approx(route.expected_ttft_s)
    assert d.pull.copy_eta_s == pytest.approx(route.pull_eta_s)
    assert CostModel(COSTS.profile()).transfer_s(80) == pytest.approx(0.4)


def test_a_pull_counts_as_in_flight_from_its_decision_so_a_sibling_waits_for_it_instead_of_pulling_again():
    """The branches of a fan-out arrive together: a branch decided while the first branch's `/replicate` call is
    still out must see that copy (live, before the fix: 2-3 copies of one trunk to one target within 60 ms)."""
    import asyncio

    from radix_sync import api
    from radix_sync.router.metrics import RouterMetrics
    from radix_sync.router.pool import WorkerPool
    from radix_sync.router.pull import PullRunner

    workers = [w("a", waiting=1, waiting_tokens=100), w("b")]
    first = decide(workers, {"a": 80})
    assert first.pull is not None and (first.pull.source, first.pull.target) == ("a", "b")

    pool = WorkerPool(["a", "b"], 16, 1.0)
    pool.coordinator_ids.update({"a": "wa", "b": "wb"})
    pool._url_of = {"wa": "a", "wb": "b"}
    answered = asyncio.Event()
    seen = []

    class Link:
        async def replicate(self, req):
            seen.append(dict(runner.in_flight))  # what a sibling deciding now sees
            await answered.wait()
            return api.ReplicationInfo(id="r1", source="wa", target="wb", namespace="", num_tokens=80,
                                       ttl_s=30.0, origin="pull", state="done", error=None, num_bytes=80), ""

    runner = PullRunner(PullConfig(), pool, RouterMetrics())
    runner.link = Link()

    async def scenario():
        task = asyncio.create_task(runner.run(first, list(range(100)), ""))
        while not seen:
            await asyncio.sleep(0)
        copies = pool.copies_by_url(runner.in_flight.values())
        sibling = decide(workers, {"a": 80}, copies)
        answered.set()
        decision, record = await task
        return copies, sibling, decision, record

    copies, sibling, decision, record = asyncio.run(scenario())
    assert seen == [{"asked-1": CopyInFlight("wa", "wb", "", 80)}]
    assert copies == [CopyInFlight("a", "b", "", 80)]
    assert sibling.pull is None and sibling.ranked[0] == "b" and sibling.wait_inflight  # waits for the copy
    assert record["outcome"] == "done" and decision.ranked[0] == "b" and runner.in_flight == {}


def test_a_pull_to_one_of_two_tied_workers_is_not_taken_for_the_tie():
    # a holds 80 tokens behind a long queue; b and c tie cold (1.0 s each, both idle): without --pull b takes the
    # tie (the turn moves on), with it a pull a -> b wins and decides the request, so the turn stays
    ws = [w("a", waiting=1, waiting_tokens=100), w("b"), w("c")]
    plain = rank_by_ttft(ws, {"a": 80}, (), 100, "", 0.0, MODEL)
    assert plain.ranked[:2] == ("b", "c") and plain.pull is None and plain.tie_taken == "b"
    pulled = decide(ws, {"a": 80})
    assert pulled.pull is not None and pulled.tie_taken is None
