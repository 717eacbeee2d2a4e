"""The router's decisions on hand-computed cases: expected TTFT from the directory, and the fallback rule."""
from dataclasses import replace

import pytest

from radix_sync.policy.routers import ExpectedTtftRouter
from radix_sync.policy.snapshot import RequestView, WorkerView
from radix_sync.router.policy import (ApproxPrefixIndex, CopyInFlight, RouterCosts, WorkerState, cost_model,
                                      rank_by_ttft)

# 10 ms per uncached token, no per-request overhead, no decode step; KV 1 byte/token over a 200 B/s link.
COSTS = RouterCosts(prefill_s_per_token=0.01, queue_s_per_request=0.0, decode_step_s=0.0, kv_bytes_per_token=1,
                    link_bytes_per_s=200.0, transfer_latency_s=0.0)


def w(wid, running=0, waiting=0, waiting_tokens=0, page_size=16):
    return WorkerState(wid, page_size, running, waiting, waiting_tokens)


def rank(workers, matched, copies=(), prompt_len=100, ns="", costs=COSTS):
    return rank_by_ttft(workers, matched, copies, prompt_len, ns, 0.0, cost_model(costs))


def test_idle_workers_holder_wins_by_uncached_prefill():
    d = rank([w("b"), w("a")], {"a": 80})
    assert d.ranked == ("a", "b")
    assert d.expected_ttft_s == pytest.approx((0.2, 1.0))  # 20 and 100 uncached tokens
    assert (d.mode, d.cached_tokens, d.wait_inflight) == ("directory", 80, False)


def test_a_full_tie_goes_to_the_worker_after_the_last_one_that_took_one():
    model = cost_model(COSTS)
    ws = [w("a"), w("b"), w("c")]
    d = rank_by_ttft(ws, {}, (), 100, "", 0.0, model)
    assert d.ranked[0] == "a" and d.tie_taken == "a"  # nothing held anywhere: a tie, the first in id order
    d = rank_by_ttft(ws, {}, (), 100, "", 0.0, model, tie_after=d.tie_taken)
    assert d.ranked == ("b", "c", "a") and d.tie_taken == "b"
    d = rank_by_ttft(ws, {}, (), 100, "", 0.0, model, tie_after="c")
    assert d.ranked[0] == "a"  # wraps around
    # a holder is no tie: it wins whatever the turn, and says so (the router keeps its turn)
    d = rank_by_ttft(ws, {"a": 80}, (), 100, "", 0.0, model, tie_after="a")
    assert d.ranked[0] == "a" and d.tie_taken is None
    # equal time, one busier: the less loaded wins, no full tie
    d = rank_by_ttft([w("a"), w("b", running=1)], {}, (), 100, "", 0.0, cost_model(COSTS), tie_after="a")
    assert d.ranked[0] == "a" and d.tie_taken is None


def test_a_router_that_is_not_alone_breaks_ties_by_its_draw_and_takes_no_turn():
    model = cost_model(COSTS)
    ws = [w("a"), w("b", running=1), w("c")]
    # alone: equal time, the less loaded first, the turn taken
    d = rank_by_ttft(ws, {}, (), 100, "", 0.0, model)
    assert d.ranked[0] == "a" and d.tie_taken == "a" and not d.tie_drawn
    # with a draw (other routers serve too): the two lowest draws (b, a), the less loaded of them first (a); no turn
    d = rank_by_ttft(ws, {}, (), 100, "", 0.0, model, tie_after="a", tie_draw=(0.5, 0.1, 0.9))
    assert d.ranked == ("a", "b", "c") and d.tie_taken is None and d.tie_drawn
    # b and c drawn, equally loaded: the draw's order
    d = rank_by_ttft([w("a", running=1), w("b"), w("c")], {}, (), 100, "", 0.0, model, tie_draw=(0.9, 0.5, 0.1))
    assert d.ranked == ("c", "b", "a")
    # a holder is no tie: it wins whatever the draw
    d = rank_by_ttft(ws, {"c": 80}, (), 100, "", 0.0, model, tie_draw=(0.5, 0.1, 0.9))
    assert d.ranked[0] == "c"


def test_queue_at_the_holder_sends_the_request_elsewhere():
    # a: wait 100 queued tokens (1.0 s) + 0.2 s; b: recompute 100 tokens = 1.0 s
    d = rank([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80})
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((1.0, 1.2))


def test_per_request_queue_cost_and_decode_step():
    costs = RouterCosts(prefill_s_per_token=0.01, queue_s_per_request=0.5, decode_step_s=0.05,
                        kv_bytes_per_token=1, link_bytes_per_s=200.0, transfer_latency_s=0.0)
    # a: 2 queued requests x 0.5 + 0 tokens... plus its own overhead 0.5 + 0.2 = 1.7 s
    # b: 1 running -> 0.05 s, then 0.5 + 1.0 = 1.55 s
    d = rank([w("a", waiting=2), w("b", running=1)], {"a": 80}, costs=costs)
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((1.55, 1.7))


def test_replica_in_flight_is_counted_with_its_arrival_time():
    # a holds 80 but has 1.0 s queued (1.2 s); a copy of 80 tokens a -> b lands in 80 B / 200 B/s = 0.4 s,
    # then b prefills 20 tokens: 0.6 s (b recomputing all: 1.0 s)
    copy = CopyInFlight("a", "b", "", 80)
    d = rank([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, [copy])
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((0.6, 1.2))
    assert d.wait_inflight and d.cached_tokens == 0


@pytest.mark.parametrize("copy", [CopyInFlight("a", "b", "other-tenant", 80),  # another namespace
                                  CopyInFlight("a", "b", "", 96),  # longer than what a holds of this prompt
                                  CopyInFlight("a", "zz", "", 80)])  # unknown target
def test_copies_that_do_not_cover_this_prompt_are_ignored(copy):
    d = rank([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, [copy])
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((1.0, 1.2)) and not d.wait_inflight


def test_ties_go_to_fewer_outstanding_then_lower_id():
    assert rank([w("a", running=1), w("b")], {}).ranked == ("b", "a")
    assert rank([w("c"), w("b"), w("a")], {}).ranked == ("a", "b", "c")


def test_matches_are_capped_at_the_prompt_length():
    d = rank([w("a"), w("b")], {"a": 500}, prompt_len=100)
    assert d.cached_tokens == 100 and d.expected_ttft_s[0] == pytest.approx(0.0)


def test_first_choice_is_exactly_the_policy_engine_router():
    workers = [w("a", waiting=3, waiting_tokens=40), w("b", running=2), w("c", waiting=1, waiting_tokens=7)]
    matched = {"a": 64, "b": 16, "c": 48}
    model = cost_model(COSTS)
    d = rank_by_ttft(workers, matched, (), 70, "", 0.0, model)
    views = tuple(WorkerView(i, num_running=x.num_running, num_waiting=x.num_waiting,
                             waiting_new_tokens=x.num_waiting_tokens) for i, x in enumerate(workers))
    route = ExpectedTtftRouter(model, 1, allow_pull=False).route(RequestView(0, 70, cached_len=(64, 16, 48)),
                                                                 views, 0.0)
    assert d.ranked[0] == workers[route.worker_id].worker_id == "c"  # a: 0.4+0.06, b: 0.54, c: 0.07+0.22


def test_costs_are_validated():
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        RouterCosts(prefill_s_per_token=-1.0)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        RouterCosts(kv_bytes_per_token=0)


# ------------------------------------------------------------------ fallback: sgl-model-gateway cache_aware
def test_fallback_longest_match_then_smallest_tree():
    idx = ApproxPrefixIndex()
    ws = [w("a", page_size=1), w("b", page_size=1)]
    d = idx.rank(ws, [1, 2, 3, 4], 4)
    assert d.ranked == ("a", "b") and d.mode == "fallback"  # no match: smallest tree, tie -> lower id
    idx.observe("a", [1, 2, 3, 4], 1, 0.0)
    assert idx.rank(ws, [1, 2, 5, 6], 4).ranked[0] == "a"  # 2/4 = 0.5 > 0.3
    assert idx.rank(ws, [1, 2, 5, 6], 4).cached_tokens == 2
    assert idx.rank(ws, [7, 8, 9, 10], 4).ranked[0] == "b"  # no match: b's tree is empty
    assert idx.rank(ws, [1, 11, 12, 13], 4).ranked[0] == "b"  # 1/4 = 0.25 <= 0.3: smallest tree


def test_fallback_match_ratio_counts_tokens_with_the_page_size():
    idx = ApproxPrefixIndex()
    idx.observe("b", [7], 16, 0.0)
    # one 16-token page of a 40-token prompt: 0.4 > 0.3
    assert idx.rank([w("a"), w("b")], [7, 8], 40).ranked == ("b", "a")


def test_fallback_imbalance_needs_both_thresholds():
    idx = ApproxPrefixIndex()
    idx.observe("a", [1, 2, 3, 4], 1, 0.0)
    imbalanced = [w("a", running=100, page_size=1), w("b", running=10, page_size=1)]  # 90 > 64 and 100 > 15
    assert idx.rank(imbalanced, [1, 2, 3, 9], 4).ranked == ("b", "a")
    abs_small = [w("a", running=100, page_size=1), w("b", running=40, page_size=1)]  # 60 <= 64
    assert idx.rank(abs_small, [1, 2, 3, 9], 4).ranked == ("a", "b")


def test_fallback_others_follow_by_load():
    idx = ApproxPrefixIndex()
    idx.observe("c", [5, 6], 1, 0.0)
    ws = [w("a", running=3, page_size=1), w("b", running=1, page_size=1), w("c", running=2, page_size=1)]
    assert idx.rank(ws, [5, 6], 2).ranked == ("c", "b", "a")


def test_a_backend_that_recomputes_the_cached_prefix_prices_hits_and_queued_hits():
    from dataclasses import replace

    from radix_sync.policy.cost import CostModel

    # 10 ms per new token, and 1 ms per 1,000 cached x cached pairs (torch_native-like)
    prof = replace(COSTS.profile(), prefill_s_per_cached_pair=1e-6)
    model = CostModel(prof)
    assert prof.prefill_piece_s(0, 1000) == 0.0
    assert prof.prefill_piece_s(20, 1000) == pytest.approx(0.2 + 1000 * 1001 / 2 * 1e-6)
    # a: holds 80 of 100 tokens: 20 new (0.2 s) + 80*81/2 pairs (3.24 ms); b: cold 100 tokens (1.0 s)
    d = rank_by_ttft([w("a"), w("b")], {"a": 80}, (), 100, "", 0.0, model)
    assert d.ranked == ("a", "b") and d.expected_ttft_s == pytest.approx((0.2 + 3240e-6, 1.0))
    # two hits queued at a, each recomputing attention over 1,000 cached tokens (0.5 s each): b wins now
    busy = WorkerState("a", 16, 0, 2, 40, num_waiting_pairs=0.0, num_waiting_cached_pairs=2 * 500500)
    d = rank_by_ttft([busy, w("b")], {"a": 80}, (), 100, "", 0.0, model)
    assert d.ranked == ("b", "a")
    assert d.expected_ttft_s[1] == pytest.approx(0.4 + 2 * 0.5005 + 0.2 + 3240e-6)


def test_a_request_waits_for_the_copy_that_covers_it_not_for_every_copy_to_that_worker():
    """Three copies to b: one of this prompt's prefix (80 tokens a holds), a shallower one of the same prefix, and one
    of another tenant's. The decision names the deepest copy covering the prompt; the router holds the request until
    that one is done, while the other copies to b are still in flight."""
    import asyncio

    from radix_sync.router.config import RouterConfig
    from radix_sync.router.service import Router

    covering, shallow, other = (CopyInFlight("a", "b", "", 80), CopyInFlight("a", "b", "", 48),
                                CopyInFlight("a", "b", "other-tenant", 80))
    d = rank([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, [other, shallow, covering])
    assert d.ranked[0] == "b" and d.wait_inflight and d.wait_copy == covering
    assert rank([w("a"), w("b")], {"a": 80}, [covering]).wait_copy is None  # not waiting: a holds it, idle

    class Link:
        """The coordinator's view: the copies in flight (coordinator ids), the covering one done after 3 looks."""
        def __init__(self):
            self.looks = 0

        async def cluster_state(self):
            self.looks += 1
            done = self.looks > 3
            copies = [CopyInFlight("ca", "cb", "other-tenant", 80), CopyInFlight("ca", "cb", "", 48)]
            return type("State", (), {"copies": copies + ([] if done else [CopyInFlight("ca", "cb", "", 80)])})()

    r = Router.__new__(Router)
    r.cfg = RouterConfig(worker_urls=("http://a",), max_wait_inflight_s=5.0)
    r.pool = type("Pool", (), {"coordinator_ids": {"a": "ca", "b": "cb"}})()
    r.puller = type("Puller", (), {"in_flight": {}})()
    r.link = Link()
    asyncio.run(asyncio.wait_for(r._wait_for_copy("b", d.wait_copy), 2.0))
    assert r.link.looks == 4  # returned once the covering copy was done; two others to b still in flight
    r.link = Link()
    with pytest.raises(asyncio.TimeoutError):  # without the copy named: every copy to b holds it (the bound: 5 s)
        asyncio.run(asyncio.wait_for(r._wait_for_copy("b"), 0.5))


def test_a_request_held_for_a_copy_with_an_id_goes_when_the_coordinators_long_poll_answers():
    """A copy the coordinator listed carries its replication id through the ranking (`copies_by_url` keeps it; the id is
    not part of a copy's equality). The router holds the request on the coordinator's long poll for that id, and
    sends it when the poll answers, without reading the cached cluster view (released 13-143 ms late before); a long
    poll that gets no answer falls back to that view, as does a copy whose id is not known yet (a pull being asked
    for) until this router's own pull of it has one."""
    import asyncio

    from radix_sync.router.config import RouterConfig
    from radix_sync.router.pool import WorkerPool
    from radix_sync.router.service import Router

    listed = CopyInFlight("a", "b", "", 80, "r7-abc")
    assert listed == CopyInFlight("a", "b", "", 80) and hash(listed) == hash(CopyInFlight("a", "b", "", 80))
    d = rank([w("a", waiting=1, waiting_tokens=100), w("b")], {"a": 80}, [listed])
    assert d.wait_inflight and d.wait_copy.id == "r7-abc"
    pool = WorkerPool.__new__(WorkerPool)
    pool._url_of = {"ca": "a", "cb": "b"}
    assert [c.id for c in pool.copies_by_url([CopyInFlight("ca", "cb", "", 80, "r7-abc")])] == ["r7-abc"]

    class Link:
        def __init__(self, answer):
            self.answer, self.waited, self.looks = answer, [], 0

        async def wait_replication(self, rid, wait_s):
            self.waited.append((rid, wait_s))
            await asyncio.sleep(0.05)  # the copy lands 50 ms later
            return (self.answer, "") if self.answer is not None else (None, "unreachable: down")

        async def cluster_state(self):
            self.looks += 1
            return type("State", (), {"copies": [CopyInFlight("ca", "cb", "", 80)] if self.looks < 3 else []})()

    r = Router.__new__(Router)
    r.cfg = RouterConfig(worker_urls=("http://a",), max_wait_inflight_s=5.0)
    r.pool = type("Pool", (), {"coordinator_ids": {"a": "ca", "b": "cb"}})()
    r.puller = type("Puller", (), {"in_flight": {}})()
    r.link = Link(answer=object())
    asyncio.run(asyncio.wait_for(r._wait_for_copy("b", d.wait_copy), 2.0))
    assert r.link.waited == [("r7-abc", pytest.approx(5.0, abs=0.1))] and r.link.looks == 0
    r.link = Link(answer=None)  # the long poll failed: the cached view, until the copy is gone from it
    asyncio.run(asyncio.wait_for(r._wait_for_copy("b", d.wait_copy), 2.0))
    assert len(r.link.waited) == 1 and r.link.looks == 3
    r.link = Link(answer=object())  # a copy without an id (a pull being asked for): the view only
    asyncio.run(asyncio.wait_for(r._wait_for_copy("b", CopyInFlight("a", "b", "", 80)), 2.0))
    assert r.link.waited == [] and r.link.looks == 3
    # ... until this router's own pull of it has its id from the coordinator: then its long poll
    r.link = Link(answer=object())
    r.puller.in_flight = {"r9-def": CopyInFlight("ca", "cb", "", 80, "r9-def"),
                          "r8-xyz": CopyInFlight("ca", "cb", "other-tenant", 80, "r8-xyz")}
    asyncio.run(asyncio.wait_for(r._wait_for_copy("b", CopyInFlight("a", "b", "", 80)), 2.0))
    assert r.link.waited == [("r9-def", pytest.approx(5.0, abs=0.1))] and r.link.looks == 0


def test_a_prefix_the_router_sent_to_a_worker_and_not_started_counts_as_cached_there():
    # a: 50 queued tokens (0.5 s): the first request with prefix pages 1..5 (page 10 tokens), not started;
    # b: 20 queued tokens (0.2 s), holds nothing. A 60-token prompt on the same 5 pages + 1 new page:
    # without the router's own count a computes it cold (0.5 + 0.6 = 1.1 s) and b wins (0.2 + 0.6 = 0.8 s);
    # with it, a will hold 50 tokens when it starts: 0.5 + 0.1 = 0.6 s, and a wins.
    model = cost_model(COSTS)
    ws = [w("a", waiting=1, waiting_tokens=50, page_size=10), w("b", waiting=1, waiting_tokens=20, page_size=10)]
    pages = [1, 2, 3, 4, 5, 61]
    sent = {"a": {h: 1 for h in (1, 2, 3, 4, 5)}}
    d = rank_by_ttft(ws, {}, (), 60, "", 0.0, model, page_hashes=pages, page_len=10)
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((0.8, 1.1)) and d.cached_tokens == 0
    d = rank_by_ttft(ws, {}, (), 60, "", 0.0, model, page_hashes=pages, page_len=10, sent_pages=sent)
    assert d.ranked == ("a", "b") and d.expected_ttft_s == pytest.approx((0.6, 0.8))
    assert d.cached_tokens == 50  # what the proxy counts the request's queued work with
    # a prompt that shares no page with it: as before
    d = rank_by_ttft(ws, {}, (), 60, "", 0.0, model, page_hashes=[7, 8, 9, 10, 11, 12], page_len=10,
                     sent_pages=sent)
    assert d.ranked == ("b", "a") and d.cached_tokens == 0
    # and the caller's counts are read, never changed (a pull-capable decision routes a second instance too)
    rank_by_ttft(ws, {}, (), 60, "", 0.0, model, allow_pull=True, page_hashes=pages, page_len=10, sent_pages=sent)
    assert sent == {"a": {h: 1 for h in (1, 2, 3, 4, 5)}}


def test_the_live_rank_prices_sent_prefixes_as_the_simulated_router_does():
    """The simulated router keeps its own count of what it sent (`ExpectedTtftRouter.route`); the live one passes
    the pool's: on the same state both choose the same worker with the same expected TTFT."""
    model = cost_model(COSTS)
    sim = ExpectedTtftRouter(model, COSTS.kv_bytes_per_token, allow_pull=False, page_len=10)
    views = (WorkerView(0), WorkerView(1, num_waiting=1, waiting_new_tokens=20))
    first = sim.route(RequestView(1, 50, page_hashes=(1, 2, 3, 4, 5), cached_len=(0, 0)), views, 0.0)
    assert first.worker_id == 0  # the idle worker computes the first one
    views = (WorkerView(0, num_waiting=1, waiting_new_tokens=50), views[1])
    second = sim.route(RequestView(2, 60, page_hashes=(1, 2, 3, 4, 5, 61), cached_len=(0, 0)), views, 0.0)
    live = rank_by_ttft([w("a", waiting=1, waiting_tokens=50, page_size=10),
                         w("b", waiting=1, waiting_tokens=20, page_size=10)], {}, (), 60, "", 0.0, model,
                        page_hashes=[1, 2, 3, 4, 5, 61], page_len=10, sent_pages={"a": {h: 1 for h in range(1, 6)}})
    assert (second.worker_id, live.ranked[0]) == (0, "a")
    assert live.expected_ttft_s[0] == pytest.approx(second.expected_ttft_s)


def test_a_workers_own_work_that_has_been_computing_counts_only_what_is_left():
    # a: this router's first request (100 tokens, 1.0 s) went to it idle 0.6 s ago: 0.4 s are left. A 110-token
    # prompt on its 10 pages + 1: 0.4 + 0.1 s there, against 1.1 s cold at the idle b.
    model = cost_model(COSTS)
    pages = [*range(1, 11), 99]
    sent = {"a": {h: 1 for h in range(1, 11)}}
    a = WorkerState("a", 10, 0, 1, 100, own_waiting_tokens=100, own_elapsed_s=0.6)
    d = rank_by_ttft([a, w("b", page_size=10)], {}, (), 110, "", 0.0, model, page_hashes=pages, page_len=10,
                     sent_pages=sent)
    assert d.ranked == ("a", "b") and d.expected_ttft_s == pytest.approx((0.5, 1.1))
    # not known to have started: the whole 1.0 s, a tie on time, and the less loaded b wins
    d = rank_by_ttft([replace(a, own_elapsed_s=0.0), w("b", page_size=10)], {}, (), 110, "", 0.0, model,
                     page_hashes=pages, page_len=10, sent_pages=sent)
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((1.1, 1.1))
    # longer than the work: nothing left (never negative)
    d = rank_by_ttft([replace(a, own_elapsed_s=5.0), w("b", page_size=10)], {}, (), 110, "", 0.0, model,
                     page_hashes=pages, page_len=10, sent_pages=sent)
    assert d.expected_ttft_s[0] == pytest.approx(0.1)
    # the ablation (--no-sent-pages): neither the pages nor the elapsed time
    d = rank_by_ttft([a, w("b", page_size=10)], {}, (), 110, "", 0.0, model, page_hashes=pages, page_len=10)
    assert d.ranked == ("b", "a") and d.expected_ttft_s == pytest.approx((1.1, 2.1))


def test_the_pool_knows_since_when_an_idle_worker_computes_its_requests():
    from radix_sync.router.pool import WorkerPool
    pool = WorkerPool(["http://a:1"], 16, 5.0)
    url = "http://a:1"
    pool.started_alone(url, 10.0)
    assert pool.alone_since == {}  # nothing of this router's is queued there
    first = pool.queue(url, 100, 0)
    pool.started_alone(url, 10.0)
    second = pool.queue(url, 10, 100)
    pool.started_alone(url, 11.0)  # (the first start stands)
    assert pool.with_local_load(pool.known[url], False, now=10.5).own_elapsed_s == pytest.approx(0.5)
    first()
    assert pool.alone_since == {url: 10.0}
    second()
    assert pool.alone_since == {} and pool.with_local_load(pool.known[url], False, now=12.0).own_elapsed_s == 0.0


def test_a_request_sent_to_a_busy_worker_does_not_count_as_computing_its_prefix_first():
    """SGLang batches the requests waiting together and none of a batch reuses another's prefix: two cold
    branches of a tree sent to a busy worker are one batch of two cold prefills. Only a request that starts at once
    (an idle worker) computes its prefix before the next ones there start."""
    model = cost_model(COSTS)
    sim = ExpectedTtftRouter(model, COSTS.kv_bytes_per_token, allow_pull=False, page_len=10)
    busy = (WorkerView(0, num_running=1, num_waiting=1, waiting_new_tokens=30),
            WorkerView(1, num_running=1, num_waiting=1, waiting_new_tokens=90))
    first = sim.route(RequestView(1, 50, page_hashes=(1, 2, 3, 4, 5), cached_len=(0, 0)), busy, 0.0)
    assert first.worker_id == 0
    busy = (busy[0]._replace(num_waiting=2, waiting_new_tokens=80), busy[1])
    second = sim.route(RequestView(2, 60, page_hashes=(1, 2, 3, 4, 5, 61), cached_len=(0, 0)), busy, 0.0)
    # not priced as a hit behind the first at 0 (0.8 + 0.1 s): cold at either, 0.8 + 0.6 or 0.9 + 0.6 s
    assert second.worker_id == 0 and second.expected_ttft_s == pytest.approx(1.4)
