"""N front doors in the simulator (`PolicyBundle.doors`): the k-th request goes through door k mod N, each door's
router is fed only what it placed, and sees the shared reports merged with its own sends alone."""

import pytest

from radix_sync.policy.cost import load_profile
from radix_sync.policy.forecast import queue_wait_s
from radix_sync.policy.snapshot import Route
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import AgentWorkload, GeneratorConfig
from radix_sync.sim.policies import build_policy
from radix_sync.sim.workload import SimRequest

PROFILE = load_profile("llama3.1-8b-h200")


def agent_engine(policy: str, doors: int, duration_s: float = 200.0) -> Engine:
    wl = AgentWorkload(GeneratorConfig(), rate=2.0, duration_s=duration_s, seed=3,
                       max_context_len=PROFILE.max_context_len)
    return Engine(PROFILE, wl, build_policy(policy, PROFILE, wl.page_len, 3, front_doors=doors),
                  EngineConfig(num_workers=4, duration_s=duration_s))


def test_one_door_is_the_router_alone_and_n_doors_are_n_fresh_routers():
    one = build_policy("kvrep_route", PROFILE, 64, 0)
    assert one.doors == ()
    three = build_policy("cache_aware", PROFILE, 64, 0, front_doors=3)
    assert len(three.doors) == 3 and three.doors[0] is three.router
    assert len({id(r) for r in three.doors}) == 3
    with pytest.raises(ValueError, match="front_doors"):
        build_policy("kvrep_route", PROFILE, 64, 0, front_doors=0)


@pytest.mark.parametrize("policy", ["kvrep_route", "cache_aware"])
def test_requests_go_round_the_doors_and_each_router_hears_only_of_its_own(policy):
    eng = agent_engine(policy, 3)
    routed: list[list[int]] = [[], [], []]
    heard: list[set[int]] = [set(), set(), set()]
    for k, r in enumerate(eng.routers):
        route, first = r.route, r.on_first_token

        def spy_route(req, workers, now, k=k, route=route):
            routed[k].append(req.request_id)
            return route(req, workers, now)

        def spy_first(worker_id, request_id, now, k=k, first=first):
            heard[k].add(request_id)
            first(worker_id, request_id, now)

        r.route, r.on_first_token = spy_route, spy_first
    stats = eng.run()
    order = sorted((rid, k) for k in range(3) for rid in routed[k])
    assert stats.num_arrived == len(order) > 30 and stats.num_rejected == 0
    # the k-th arrival (in time order, whatever its id) through door k mod 3: the counts differ by at most one
    assert max(map(len, routed)) - min(map(len, routed)) <= 1
    assert [set(x) for x in routed] == heard  # every first token back to the router that placed the request
    for own in eng.loads.own:  # nothing left counted as in flight at any door
        assert own.outstanding == [0] * 4 and own.num_queued == [0] * 4 and not own._queued


def test_a_doors_view_counts_its_own_sends_not_another_doors():
    eng = agent_engine("kvrep_route", 2)
    req = SimRequest(10_000, 2000, 10, [], arrival_s=0.0)
    req.door = 1
    eng.loads.last_report_s[2] = 0.0  # (its next report not due: the request is in no report yet)
    eng._execute_route(req, Route(2), 0.0)
    cost = eng.routers[1].cost
    mine, other = eng.loads.views(0.01, 1)[2], eng.loads.views(0.01, 0)[2]
    assert queue_wait_s(cost, mine, 0.01) == pytest.approx(cost.prefill_s(2000, 0) - 0.01)
    assert queue_wait_s(cost, other, 0.01) == 0.0 and other.num_waiting == 0 and other.waiting_new_tokens == 0


def relayed_engine(relay_s):
    wl = AgentWorkload(GeneratorConfig(), rate=2.0, duration_s=10.0, seed=3, max_context_len=PROFILE.max_context_len)
    eng = Engine(PROFILE, wl, build_policy("kvrep_route", PROFILE, wl.page_len, 3, front_doors=2),
                 EngineConfig(num_workers=4, duration_s=10.0, door_sends_s=relay_s))
    eng.loads.last_report_s[2] = 0.0  # (no report due: only the routers' counts can show the request)
    req = SimRequest(10_000, 2000, 10, [], arrival_s=0.0)
    req.door = 1
    eng._execute_route(req, Route(2), 0.0)
    return eng, req


def test_a_door_learns_the_other_doors_first_outputs_and_ends_after_the_relay_delay_too():
    eng, req = relayed_engine(0.005)
    eng.loads.on_started(req, 0.02)
    queued = eng.loads.views(0.022, 0)[2]
    assert queued.num_waiting == 1 and queued.waiting_new_tokens == 2000  # (its start not relayed yet)
    started = eng.loads.views(0.03, 0)[2]
    assert started.num_waiting == 1 and started.waiting_new_tokens == 0
    eng.loads.on_done(req, 0.05)
    assert eng.loads.views(0.052, 0)[2].num_waiting == 1  # (its end not relayed yet: the worker still looks busy)
    assert eng.loads.views(0.06, 0)[2].num_waiting == 0
    assert eng.loads.views(0.06, 1)[2].num_waiting == 0  # (its own door knew at once)


def test_a_door_learns_the_other_doors_sends_only_when_relayed_and_only_after_the_relay_delay():
    def view_after(relay_s, t):
        return relayed_engine(relay_s)[0].loads.views(t, 0)[2]

    assert view_after(None, 0.01).num_waiting == 0  # (today: door 0 never hears of door 1's send)
    assert view_after(0.005, 0.001).num_waiting == 0  # not yet relayed
    relayed = view_after(0.005, 0.01)
    assert relayed.num_waiting == 1 and relayed.waiting_new_tokens == 2000
    with pytest.raises(ValueError, match="door_sends_s"):
        EngineConfig(door_sends_s=-1.0)


def test_doors_that_hear_of_each_other_draw_their_ties_and_the_others_do_not():
    # (the live routers draw while the send relay says others serve: `ExpectedTtftRouter.peers`)
    def engine(doors, relay):
        wl = AgentWorkload(GeneratorConfig(), rate=2.0, duration_s=20.0, seed=3,
                           max_context_len=PROFILE.max_context_len)
        return Engine(PROFILE, wl, build_policy("kvrep_route", PROFILE, wl.page_len, 3, front_doors=doors),
                      EngineConfig(num_workers=4, duration_s=20.0, door_sends_s=relay))

    assert [r.peers for r in engine(3, 0.003).routers] == [2, 2, 2]
    assert [r.peers for r in engine(3, None).routers] == [0, 0, 0]  # (no relay: each one believes it is alone)
    assert [r.peers for r in engine(1, 0.003).routers] == [0]
