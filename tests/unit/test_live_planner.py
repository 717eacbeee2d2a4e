"""The predictive planner on the live coordinator's state: snapshot building and decisions."""
import pytest

from radix_sync import protocol as p
from radix_sync.coordinator.live_planner import LivePlanner, kv_bytes_per_token
from radix_sync.coordinator.state import ClusterState
from radix_sync.hashing import page_hashes

PS = 16
FIELDS = {"kv_geometry": "(4, 64)", "num_layers": "8", "kv_store_dtype": "torch.bfloat16", "mla": "False"}


def hello(wid):
    return p.Hello(worker_id=wid, http_url="", data_endpoint="", fingerprint="f", fingerprint_fields=FIELDS,
                   page_size=PS, pool_capacity_tokens=65536, replica_budget_tokens=16384)


def load(wid, seq, waiting, waiting_tokens):
    return p.LoadReported(worker_id=wid, seq=seq, num_running_reqs=1 if waiting else 0, num_waiting_reqs=waiting,
                          num_waiting_tokens=waiting_tokens, available_tokens=60000, evictable_tokens=0,
                          replica_tokens=0)


def state_with_prefix(tokens, waiting_on_a):
    st = ClusterState()
    st.handle(b"A", hello("a"), 0.0)
    st.handle(b"B", hello("b"), 0.0)
    hashes = page_hashes(tokens, PS)
    blocks = [p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS])
              for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
    st.handle(b"A", p.PagesStored(worker_id="a", seq=1, namespace="", blocks=blocks), 0.5)
    st.handle(b"A", load("a", 2, waiting_on_a, waiting_on_a * 2048), 1.0)
    st.handle(b"B", load("b", 1, 0, 0), 1.0)
    return st


def test_kv_bytes_from_fingerprint_fields():
    assert kv_bytes_per_token(FIELDS) == 2 * 8 * 4 * 64 * 2
    assert kv_bytes_per_token({"kv_geometry": "(1, 576)", "num_layers": "4", "kv_store_dtype": "torch.uint8",
                               "mla": "True"}) == 4 * 576
    assert kv_bytes_per_token({}) is None


def test_snapshot_reflects_directory_loads_and_hints():
    tokens = list(range(100, 100 + 4096))
    st = state_with_prefix(tokens, waiting_on_a=6)
    st.record_hint({"kind": "fanout", "input_ids": tokens, "k": 8}, 1.0)
    snap, ids = LivePlanner("cpu-local").snapshot(st, 1.0)
    assert ids == ["a", "b"] and snap.page_len == PS and snap.kv_bytes_per_token == 8192
    assert [w.num_waiting for w in snap.workers] == [6, 0]
    [prefix] = snap.prefixes
    assert prefix.node_id == page_hashes(tokens, PS)[-1] and prefix.token_len == 4096 and prefix.fanout_hint == 8
    assert [(h.worker_id, h.role, h.depth_len) for h in prefix.holders] == [(0, "owner", 4096)]


def test_fanout_on_a_busy_holder_is_copied_to_the_idle_worker():
    tokens = list(range(100, 100 + 4096))
    st = state_with_prefix(tokens, waiting_on_a=6)
    st.record_hint({"kind": "fanout", "input_ids": tokens, "k": 8}, 1.0)
    decisions = LivePlanner("cpu-local").decide(st, 1.0)
    assert [(d.source, d.target, d.block_hash) for d in decisions] == [("a", "b", page_hashes(tokens, PS)[-1])]
    assert decisions[0].depth_len % PS == 0 and 0 < decisions[0].depth_len <= 4096 and decisions[0].ttl_s > 0


def test_no_demand_no_copy():
    st = state_with_prefix(list(range(100, 100 + 4096)), waiting_on_a=6)
    assert LivePlanner("cpu-local").decide(st, 1.0) == []


def test_a_request_seen_by_the_router_and_the_worker_counts_once():
    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=0)
    node = page_hashes(tokens, PS)[-1]
    # two requests, each seen as the router's arrival and the holder's prefix hit, on the same prefix
    for seq, t in ((3, 1.0), (4, 1.5)):
        st.record_arrival({"input_ids": tokens + [7] * 40, "worker": "a"}, t)
        st.handle(b"A", p.PrefixHit(worker_id="a", seq=seq, namespace="", block_hash=node, matched_len=1024,
                                    key_len=1064), t)
    # another prefix only a worker reported (no router in front of it): its hits count
    other = list(range(9000, 9000 + 512))
    st.handle(b"B", p.PagesStored(worker_id="b", seq=2, namespace="", blocks=[
        p.BlockFact(h, par, other[i * PS:(i + 1) * PS])
        for i, (h, par) in enumerate(zip(page_hashes(other, PS), [None] + page_hashes(other, PS)[:-1]))]), 1.0)
    for seq in (3, 4):
        st.handle(b"B", p.PrefixHit(worker_id="b", seq=seq, namespace="", block_hash=page_hashes(other, PS)[-1],
                                    matched_len=512, key_len=600), 1.0 + seq / 10)
    snap, _ = LivePlanner("cpu-local").snapshot(st, 2.0)
    by_node = {x.node_id: x.recent_hit_times_s for x in snap.prefixes}
    assert by_node[node] == (1.0, 1.5)
    assert by_node[page_hashes(other, PS)[-1]] == (1.3, 1.4)


def test_a_prefix_used_once_is_no_candidate():
    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=6)
    st.record_arrival({"input_ids": tokens + [7] * 40, "worker": "a"}, 1.0)
    planner = LivePlanner("cpu-local")
    assert planner.snapshot(st, 1.5)[0].prefixes == () and planner.decide(st, 1.5) == []
    st.record_arrival({"input_ids": tokens + [8] * 40, "worker": "a"}, 1.2)
    assert [x.recent_hit_times_s for x in planner.snapshot(st, 1.5)[0].prefixes] == [(1.0, 1.2)]


def test_copies_in_flight_count_against_the_target_replica_budget():
    tokens = list(range(100, 100 + 4096))
    st = state_with_prefix(tokens, waiting_on_a=6)
    st.request_replication("a", "b", tokens, "", 30.0, now_s=1.0)
    snap, ids = LivePlanner("cpu-local").snapshot(st, 1.0)
    assert [w.replica_budget_tokens for w in snap.workers] == [16384, 16384 - 4096]


def finish(st, tokens, t, stop="tool_use", cls="acme"):
    st.record_demand([], [{"page_hashes": page_hashes(tokens, PS), "page_size": PS, "worker": "a", "stop": stop,
                           "class": cls}], t)


def test_a_finished_tool_call_on_a_busy_holder_is_copied_before_the_next_turn():
    tokens = list(range(100, 100 + 4096))
    # ~14 s of queued prefill on a (cpu-local), the next turn expected ~8 s after a tool call (the prior)
    st = state_with_prefix(tokens, waiting_on_a=20)
    finish(st, tokens, 1.0)
    planner = LivePlanner("cpu-local")
    snap, _ = planner.snapshot(st, 1.2)
    [prefix] = snap.prefixes
    assert (prefix.node_id, prefix.last_finish_s, prefix.last_stop, prefix.class_key) == \
        (page_hashes(tokens, PS)[-1], 1.0, "tool_use", "acme")
    assert prefix.recent_hit_times_s == () and prefix.fanout_hint == 0
    decisions = planner.decide(st, 1.2)
    assert [(d.source, d.target, d.block_hash) for d in decisions] == [("a", "b", page_hashes(tokens, PS)[-1])]
    assert planner.session_stats()["open"] == 1
    # with ~4 s queued the holder is free again before the next turn is due: no copy
    st = state_with_prefix(tokens, waiting_on_a=6)
    finish(st, tokens, 1.0)
    assert LivePlanner("cpu-local").decide(st, 1.2) == []


def test_an_open_session_on_an_idle_holder_is_no_candidate():
    tokens = list(range(100, 100 + 4096))
    st = state_with_prefix(tokens, waiting_on_a=0)
    finish(st, tokens, 1.0)
    planner = LivePlanner("cpu-local")
    assert planner.snapshot(st, 1.2)[0].prefixes == () and planner.session_stats()["open"] == 1


def test_the_next_turn_is_recognised_and_its_gap_learned_per_class_and_stop():
    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=6)
    # the worker also cached the answer: the next turn's held prefix runs past the finished prompt
    answer = tokens + list(range(5000, 5000 + 64))
    hashes = page_hashes(answer, PS)
    st.handle(b"A", p.PagesStored(worker_id="a", seq=3, namespace="", blocks=[
        p.BlockFact(hashes[i], hashes[i - 1], answer[i * PS:(i + 1) * PS]) for i in range(64, 68)]), 1.0)
    planner = LivePlanner("cpu-local")
    finish(st, tokens, 1.0)
    planner.consume(st, 1.0)
    model = planner.planner.predictor.gap_model("acme", "tool_use")
    before = model.num_continued
    st.record_arrival({"input_ids": answer + [9] * 40, "worker": "a", "class": "acme"}, 3.5)
    snap, _ = planner.snapshot(st, 3.6)
    assert model.num_continued == before + 1 and model.counts[max(
        i for i, e in enumerate(model.edges_s[:-1]) if e <= 2.5)] > 0
    assert planner.session_stats()["followups"] == 1 and planner.session_stats()["open"] == 0
    assert snap.prefixes == ()  # the session moved on: its old prompt is no candidate any more
    # another class and another stop kind learn separately
    assert planner.planner.predictor.gap_model("acme", "end_turn").num_continued < before + 1


def test_a_fanout_hint_sent_before_its_trunk_is_due_after_the_trunk_is_computed():
    tokens = list(range(100, 100 + 2000))
    st = ClusterState()
    st.handle(b"A", hello("a"), 0.0)
    st.handle(b"B", hello("b"), 0.0)
    st.handle(b"A", load("a", 1, 0, 0), 0.0)
    st.handle(b"B", load("b", 1, 0, 0), 0.0)
    # the client sends the hint with the trunk, long before the trunk's prefill is done
    st.record_hint({"kind": "fanout", "input_ids": tokens, "k": 6, "delay_s": 0.5}, 0.0)
    planner = LivePlanner("cpu-local")
    assert planner.decide(st, 0.5) == []  # nothing held yet: nothing to copy
    hashes = page_hashes(tokens, PS)
    st.handle(b"A", p.PagesStored(worker_id="a", seq=2, namespace="", blocks=[
        p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS])
        for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]), 3.0)
    snap, _ = planner.snapshot(st, 3.0)
    [prefix] = snap.prefixes
    assert prefix.fanout_hint == 6 and prefix.hint_at_s == 3.5  # due delay_s after the pages showed up
    decisions = planner.decide(st, 3.0)  # six branches on an idle holder, one at a time: a copy pays
    assert [(d.source, d.target) for d in decisions] == [("a", "b")]
    # what the planner made of the hint, for /status: one copy, then no target left (b holds it now)
    [(when, what)] = planner.hint_outcomes[hashes[-1]]
    assert when == 3.0 and what.startswith("1 copy; then no target")
    # past the branches' time (and the grace), the hint asks for nothing more
    assert planner.snapshot(st, 5.0)[0].prefixes == () and planner.decide(st, 5.0) == []


def test_a_hinted_trunk_is_due_from_when_its_pages_arrived_not_from_the_planners_next_look():
    tokens = list(range(100, 100 + 2000))
    st = ClusterState()
    st.handle(b"A", hello("a"), 0.0)
    st.handle(b"B", hello("b"), 0.0)
    st.record_hint({"kind": "fanout", "input_ids": tokens, "k": 6, "delay_s": 0.5}, 0.0)
    hashes = page_hashes(tokens, PS)
    blocks = [p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS])
              for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
    st.handle(b"A", p.PagesStored(worker_id="a", seq=1, namespace="", blocks=blocks[:60]), 2.0)
    assert "stored_s" not in st.hint_times[hashes[-1]]  # part of the trunk is no trunk
    st.handle(b"A", p.PagesStored(worker_id="a", seq=2, namespace="", blocks=blocks[60:]), 3.0)
    assert st.hint_times[hashes[-1]] == {"hint_s": 0.0, "stored_s": 3.0}
    # the planner looks 0.4 s later (a slow tick): the branches are still due at 3.5
    [prefix] = LivePlanner("cpu-local").snapshot(st, 3.4)[0].prefixes
    assert prefix.hint_at_s == 3.5
    # a hint on a prefix already held is due delay_s after the hint itself
    st.record_hint({"kind": "fanout", "input_ids": tokens[:1600], "k": 2, "delay_s": 0.5}, 4.0)
    assert st.hint_times[hashes[99]] == {"hint_s": 4.0, "stored_s": 4.0}
    # the first copy of a hinted prefix is stamped
    st.handle(b"A", load("a", 3, 0, 0), 4.0)
    st.handle(b"B", load("b", 1, 0, 0), 4.0)
    st.request_replication("a", "b", tokens, "", 10.0, 4.1, block_hash=hashes[-1])
    assert st.hint_times[hashes[-1]]["copy_s"] == 4.1


def test_transfer_calibration_uses_the_data_planes_work_not_the_wait_for_busy_schedulers():
    tokens = list(range(100, 100 + 2000))
    st = state_with_prefix(tokens, waiting_on_a=0)
    rep, _, _ = st.request_replication("a", "b", tokens, "", 10.0, 1.0)
    # the copy took 3 s end to end, all but 0.2 s of it waiting for the two schedulers' iterations
    rep.state, rep.finished_s, rep.num_bytes = "done", 4.0, 32_000_000
    rep.timings_s.update(gather_s=0.05, send_s=0.08, receive_s=0.1, scatter_s=0.04, insert_s=0.01)
    planner = LivePlanner("cpu-local")
    predicted = planner.profile.transfer_s(32_000_000)
    planner.observe(st, 5.0)
    assert planner.cost.transfer_scale == pytest.approx(0.9 + 0.1 * 0.2 / predicted)
    planner.observe(st, 5.0)  # each replication is observed once
    assert planner.cost.transfer_scale == pytest.approx(0.9 + 0.1 * 0.2 / predicted)


def test_a_busy_workers_iteration_length_delays_it_in_the_snapshot():
    tokens = list(range(100, 100 + 2000))
    st = state_with_prefix(tokens, waiting_on_a=2)
    st.handle(b"A", p.LoadReported(worker_id="a", seq=3, num_running_reqs=1, num_waiting_reqs=2,
                                   num_waiting_tokens=4096, available_tokens=60000, evictable_tokens=0,
                                   replica_tokens=0, iteration_s=1.2), 1.0)
    snap, ids = LivePlanner("cpu-local").snapshot(st, 2.0)
    views = dict(zip(ids, snap.workers))
    assert views["a"].busy_until_s == pytest.approx(2.6)  # half an iteration to go, on average
    assert views["b"].busy_until_s == 2.0                 # idle: nothing in progress


def test_a_fanouts_branches_are_explained_by_its_hint_not_popularity():
    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=0)
    node = page_hashes(tokens, PS)[-1]
    st.record_arrival({"input_ids": tokens + [5] * 40, "worker": "a"}, 0.5)  # a reuse before the hint: popularity
    st.record_hint({"kind": "fanout", "input_ids": tokens, "k": 3, "ttl_s": 2.0}, 1.0)
    for i, t in enumerate((1.6, 1.7, 1.8, 2.5)):  # the three branches, then one more request
        st.record_arrival({"input_ids": tokens + [i] * 40, "worker": "a"}, t)
        st.handle(b"A", p.PrefixHit(worker_id="a", seq=3 + i, namespace="", block_hash=node, matched_len=1024,
                                    key_len=1064), t)
    planner = LivePlanner("cpu-local")
    [prefix] = planner.snapshot(st, 5.0)[0].prefixes  # the hint's TTL is over: only its unexplained demand stays
    assert prefix.fanout_hint == 0 and prefix.recent_hit_times_s == (0.5, 2.5)
    st2 = state_with_prefix(tokens, waiting_on_a=0)
    st2.record_hint({"kind": "fanout", "input_ids": tokens, "k": 3, "ttl_s": 2.0}, 1.0)
    for i, t in enumerate((1.6, 1.7, 1.8)):  # only the branches, seen by the worker alone (no router)
        st2.handle(b"A", p.PrefixHit(worker_id="a", seq=3 + i, namespace="", block_hash=node, matched_len=1024,
                                     key_len=1064), t)
    assert planner.snapshot(st2, 5.0)[0].prefixes == ()  # one-off tree done: no candidate, nothing re-copied


def store(st, rid, wid, seq, tokens, upto_pages, t):
    hashes = page_hashes(tokens, PS)
    st.handle(rid, p.PagesStored(worker_id=wid, seq=seq, namespace="", blocks=[
        p.BlockFact(hashes[i], hashes[i - 1] if i else None, tokens[i * PS:(i + 1) * PS])
        for i in range(upto_pages)]), t)


def next_turn_on_b(b_pages, finished=True, demote_stale=True, new_pages_stored_before_the_tick=False, gate=None,
                   planner=None):
    """A 64-page turn cached on a and (its first `b_pages`) on b; its next turn (4 more pages) is routed to b.
    Returns: (the demotions the planner decided, the follow-ups it recognised)."""
    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=6)
    store(st, b"B", "b", 2, tokens, b_pages, 0.6)
    planner = planner or LivePlanner("cpu-local")
    planner.demote_stale = demote_stale
    planner.demotion_gate = gate  # (None: the mechanism alone; the gate: tests/unit/test_demotion_gate.py)
    if finished:
        finish(st, tokens, 1.0)
        planner.consume(st, 1.0)
    nxt = tokens + list(range(7000, 7000 + 64))
    st.record_arrival({"input_ids": nxt, "worker": "b", "class": "acme"}, 2.0)
    if new_pages_stored_before_the_tick:
        store(st, b"B", "b", 3, nxt, 68, 2.1)
    planner.consume(st, 2.2)
    return planner.take_demotions(), planner.session_stats()["followups"]


def test_a_sessions_next_turn_on_another_worker_demotes_the_old_copy_only_where_it_ends_there():
    last = page_hashes(list(range(100, 100 + 1024)), PS)[-1]
    assert next_turn_on_b(64) == ([("a", "", last)], 1)
    # b holds the first 32 pages only: the next turn routed there matched less than a holds, a keeps its copy
    assert next_turn_on_b(32) == ([], 1)
    # the same prompt without a finished turn before it (plain reuse, not a session's next turn): nothing
    assert next_turn_on_b(64, finished=False) == ([], 0)
    # a planner with demotion off decides none
    assert next_turn_on_b(64, demote_stale=False) == ([], 1)
    # decided on the holdings at arrival: b's prefill may store the new pages before the planner's next look
    assert next_turn_on_b(64, new_pages_stored_before_the_tick=True) == ([("a", "", last)], 1)


def test_live_demotions_wait_for_the_gate_which_learns_from_the_sessions_next_arrivals():
    """Live, the planner's demotions go through the same gate as the simulator's: closed at first (decided, not
    sent: a control), open once moved sessions were seen staying where they went."""
    from radix_sync.policy.demotion import DemotionGate, DemotionGateConfig

    gate = DemotionGate(DemotionGateConfig(min_outcomes=1, control_every=10**9))
    planner = LivePlanner("cpu-local")
    assert next_turn_on_b(64, gate=gate, planner=planner) == ([], 1)
    status = planner.session_stats()["demotion_gate"]
    assert status["controls"] == 1 and status["sent"] == 0 and status["pending"] == 1
    gate.observe(page_hashes(list(range(100, 100 + 1024)), PS) + [1], "b", 3.0)  # its next turn stayed on b
    assert gate.is_open()
    last = page_hashes(list(range(100, 100 + 1024)), PS)[-1]
    assert next_turn_on_b(64, gate=gate, planner=LivePlanner("cpu-local")) == ([("a", "", last)], 1)


def test_demotions_are_taken_once():
    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=6)
    store(st, b"B", "b", 2, tokens, 64, 0.6)
    planner = LivePlanner("cpu-local")
    planner.demotion_gate = None
    finish(st, tokens, 1.0)
    st.record_arrival({"input_ids": tokens + [9] * 40, "worker": "b", "class": "acme"}, 2.0)
    planner.consume(st, 2.0)
    assert len(planner.take_demotions()) == 1 and planner.take_demotions() == []


def test_the_gate_fields_come_from_loads_copies_in_flight_and_recent_pulls():
    """Live, the planner's gate (`radix_sync.policy.gate`) sees what the simulator's sees: the copies coming in,
    the replica and demoted tokens each worker reported, each link's recent pull rate, and the replicas pulls
    landed a moment ago (their requests queued there: wanted)."""
    tokens = list(range(100, 100 + 4096))
    st = state_with_prefix(tokens, waiting_on_a=6)
    st.handle(b"B", p.LoadReported(worker_id="b", seq=2, num_running_reqs=0, num_waiting_reqs=0,
                                   num_waiting_tokens=0, available_tokens=50000, evictable_tokens=0,
                                   replica_tokens=3000, demoted_chains=2, demoted_tokens=700), 0.95)
    planner = LivePlanner("cpu-local")
    snap, ids = planner.snapshot(st, 1.0)
    assert ids == ["a", "b"]
    assert [(w.replica_tokens, w.demoted_tokens, w.incoming_tokens) for w in snap.workers] == [(0, 0, 0),
                                                                                                (3000, 700, 0)]
    assert [(w.egress_pull_rate_per_s, w.ingress_pull_rate_per_s) for w in snap.workers] == [(0.0, 0.0)] * 2
    assert not planner.pulls_assumed([]) and planner.planner.cfg.allow_pull is False
    # two pulls a -> b (a router's critical copies), one of them landed 2 s ago with 1024 tokens
    landed, _, _ = st.request_replication("a", "b", tokens[:1024], "", 30.0, now_s=2.0, origin="pull")
    landed.state, landed.finished_s, landed.inserted_len = "done", 3.0, 1024
    st.request_replication("a", "b", tokens, "", 30.0, now_s=4.0, origin="pull")
    snap, _ = planner.snapshot(st, 5.0)
    a, b = snap.workers
    window = LivePlanner.PULL_WINDOW_S
    assert (a.egress_pull_rate_per_s, b.ingress_pull_rate_per_s) == (2 / window, 2 / window)
    assert (a.ingress_pull_rate_per_s, b.egress_pull_rate_per_s) == (0.0, 0.0)
    assert (b.incoming_tokens, b.waited_evict_first_tokens, a.waited_evict_first_tokens) == (4096, 1024, 0)
    assert planner.planner.cfg.allow_pull is True  # a router pulls: pre-copies are valued against a pull
    # the landed pull's request has had its time; the pulls leave the window
    snap, _ = planner.snapshot(st, 4.0 + window + 1.0)
    assert snap.workers[1].waited_evict_first_tokens == 0 and planner.planner.cfg.allow_pull is False
    # told outright, the planner does not look at the pulls
    assert LivePlanner("cpu-local", router_pulls=True).pulls_assumed([]) is True
    assert LivePlanner("cpu-local", router_pulls=False).pulls_assumed([landed]) is False


def test_with_a_pulling_router_a_copy_ahead_is_worth_only_what_it_saves_over_the_pull():
    """The fan-out of `test_fanout_on_a_busy_holder_is_copied_to_the_idle_worker`, with the router pulling: without
    a copy the branches sent to the idle worker pull the trunk on their own path instead of recomputing it, so the
    same copy ahead is worth less (the simulator's `kvrep` weighs it so), and still made. The pull is gathered only
    after the holder's iteration in progress (`PlannerConfig.endpoint_wait`, the live agents: half of what the live
    router's puller takes it to be, `scoring.source_iteration_s`): the longer the holder's queue of cold prompts,
    the longer that iteration, the less a pull saves, the more the copy ahead is worth; behind six 2,048-token
    prompts (a 4,096-token chunk of ~3.7 s on `cpu-local`) a pull saves nothing over recomputing the trunk at the
    idle worker. (Before stop 54 the pull was priced at its transfer alone, ~0.05 s, whatever the holder did.)"""
    tokens = list(range(100, 100 + 4096))
    less = {}
    for waiting in (1, 3, 6):
        gains = {}
        for router_pulls in (False, True):
            st = state_with_prefix(tokens, waiting_on_a=waiting)
            st.record_hint({"kind": "fanout", "input_ids": tokens, "k": 8}, 1.0)
            planner = LivePlanner("cpu-local", router_pulls=router_pulls)
            [d] = planner.decide(st, 1.0)
            assert (d.source, d.target, d.depth_len) == ("a", "b", 4096)
            assert planner.planner.cfg.allow_pull is router_pulls and planner.planner.cfg.endpoint_wait
            gains[router_pulls] = d.gain_s
        less[waiting] = gains[False] - gains[True]
        assert 0 < gains[True] <= gains[False], gains
    assert less[1] > less[3] > less[6] == pytest.approx(0.0) and less[1] > 1.0, less


def test_the_planners_copies_are_judged_by_their_use_and_scale_its_next_bets():
    """`LivePlanner.observe`: a copy the coordinator made for a decision is handed to the use calibration with
    its kind; no hit within `judge_after_s` scales that kind's predictions down, a late hit (a promotion) back up;
    a decision never made (held out, refused) is no outcome."""
    tokens = list(range(100, 100 + 4096))
    st = state_with_prefix(tokens, waiting_on_a=20)
    finish(st, tokens, 1.0)
    planner = LivePlanner("cpu-local")
    cal = planner.planner.calibration
    [d] = planner.decide(st, 1.2)
    rep, _, _ = st.request_replication(d.source, d.target, tokens[:d.depth_len], d.namespace, d.ttl_s, 1.3,
                                       origin="kvrep", block_hash=d.block_hash)
    planner.decide(st, 1.4)
    assert (cal.status()["decided"], cal.status()["pending"]) == (1, 1)
    planner.decide(st, 40.0)  # 30 s without a hit
    assert cal.status()["unused"] == 1 and cal.factor("session") < 1.0
    assert planner.session_stats()["copy_use"]["kinds"]["session"]["used"] == 0
    rep.promoted_tokens = 1024  # a request hit it after all
    planner.decide(st, 41.0)
    assert cal.factor("session") == 1.0 and cal.status()["late_used"] == 1
    # decisions the coordinator did not carry out are forgotten, never judged
    st = state_with_prefix(tokens, waiting_on_a=20)
    finish(st, tokens, 1.0)
    held_out = LivePlanner("cpu-local")
    assert len(held_out.decide(st, 1.2)) == 1
    assert held_out._decided
    st.handle(b"A", load("a", 3, 20, 20 * 2048), 1.2 + LivePlanner.DECIDED_KEPT_S)  # (the holder still as busy)
    held_out.decide(st, 1.2 + LivePlanner.DECIDED_KEPT_S + 1.0)
    # (the entry of 1.2 is gone; the planner decided the same copy again, not made either)
    assert [v[2] for v in held_out._decided.values()] == [1.2 + LivePlanner.DECIDED_KEPT_S + 1.0]
    assert held_out.planner.calibration.status()["decided"] == 0
    # a record older than a decision (an earlier planner's copy of the same prefix to the same worker) is not it
    st = state_with_prefix(tokens, waiting_on_a=20)
    finish(st, tokens, 1.0)
    old, _, _ = st.request_replication("a", "b", tokens[:1024], "", 30.0, 1.1, origin="kvrep",
                                       block_hash=page_hashes(tokens, PS)[-1])
    old.state, old.promoted_tokens = "failed", 1024
    later = LivePlanner("cpu-local")
    assert len(later.decide(st, 1.2)) == 1
    later.decide(st, 1.4)
    assert later.planner.calibration.status()["decided"] == 0 and len(later._decided) == 1
    # without the calibration every prediction is taken as it is
    planner.planner.calibration = None
    assert planner.session_stats()["copy_use"] is None


def test_a_copy_whose_pages_left_the_target_unused_is_not_made_again_until_it_is_judged():
    """Live, the copy is known by its target's worker id (`ClusterSnapshot.worker_keys`): once the coordinator made
    it and its pages are gone from the target without a hit (evicted), the planner does not copy that prefix there
    again while the bet is pending (the demo's agent sessions: one prefix copied to one worker 5 times in 19 s)."""
    from radix_sync.coordinator.replications import DONE

    tokens = list(range(100, 100 + 4096))

    def made(planner):
        st = state_with_prefix(tokens, waiting_on_a=20)
        finish(st, tokens, 1.0)
        [d] = planner.decide(st, 1.2)
        rep, _, _ = st.request_replication(d.source, d.target, tokens[:d.depth_len], d.namespace, d.ttl_s, 1.3,
                                           origin="kvrep", block_hash=d.block_hash)
        rep.state = DONE  # it landed and was evicted before any request came: the directory has no page of it at b
        return st, d

    planner = LivePlanner("cpu-local")
    st, d = made(planner)
    assert planner.decide(st, 1.6) == []
    assert planner.planner.calibration.betting(d.block_hash, "b")
    assert "still a bet" in planner.planner.outcomes[d.block_hash]
    control = LivePlanner("cpu-local")
    control.planner.calibration = None  # (no bets kept: the same copy is made again)
    st, d = made(control)
    assert [(x.source, x.target) for x in control.decide(st, 1.6)] == [("a", "b")]


def test_a_load_reports_queued_work_is_taken_as_done_for_its_age():
    """The agent reports between scheduler iterations: through a long prefill its last report (taken before it, the
    prefill's request still waiting) stands, and the heartbeat repeats it with its age (`LoadReported.age_s`). The
    coordinator dates the report by it (`WorkerRecord.load_s`) and the planner takes the work it shows as done for
    that long (before: the whole prefill still to do until the next report; the live agent sessions' holders
    looked busy 0.4 s longer than the simulated ones, and the planner copied sessions that did not pay)."""
    import msgspec

    from radix_sync.policy.forecast import queue_wait_s
    st = ClusterState()
    st.handle(b"A", hello("a"), 0.0)
    st.handle(b"B", hello("b"), 0.0)
    st.handle(b"A", load("a", 1, 2, 1024), 1.0)
    planner = LivePlanner("cpu-local")

    def wait(t):
        return queue_wait_s(planner.cost, planner._worker_views(st, ["a", "b"], [], {}, t)[0], t)

    whole = wait(1.0)
    assert whole > 0.3
    assert wait(1.2) == pytest.approx(whole - 0.2)
    st.handle(b"A", msgspec.structs.replace(load("a", 2, 2, 1024), age_s=0.3), 1.3)  # a heartbeat's repeat
    assert st.workers["a"].load_s == pytest.approx(1.0) and wait(1.3) == pytest.approx(whole - 0.3)
    assert wait(1.0 + whole + 0.5) == 0.0
    st.handle(b"A", load("a", 3, 2, 1024), 5.0)  # a new report: its work from the whole again
    assert wait(5.0) == pytest.approx(whole)
