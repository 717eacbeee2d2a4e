"""Pins the planner's decisions (what, where, how deep, how long) on hand-computed cases."""

from dataclasses import replace

import pytest

from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
from radix_sync.policy.predictor import DemandPredictor
from radix_sync.policy.snapshot import ClusterSnapshot, HolderView, PrefixView, WorkerView

# 10 ms per prompt token, no attention term or overheads, 1000 B/s links, 1 byte of KV per token.
PROFILE = CostProfile(name="t", kv_bytes_per_token=1, kv_capacity_tokens=10_000, max_context_len=10_000,
                      chunked_prefill_len=10_000, max_running_requests=64, prefill_overhead_s=0.0,
                      prefill_s_per_token=0.01, prefill_s_per_token_pair=0.0, decode_step_s=0.01,
                      decode_s_per_request=0.0, decode_s_per_ctx_token=0.0, nic_bandwidth_bytes_per_s=1000.0,
                      transfer_latency_s=0.0)


def snapshot(holder_waiting_tokens=2000, budget=10_000, hint_at=1.0, fanout=1):
    ws = tuple(WorkerView(i, free_tokens=10_000, replica_budget_tokens=budget, nic_bandwidth_bytes_per_s=1000.0)
               for i in range(2))
    ws = (ws[0]._replace(num_waiting=1, waiting_new_tokens=holder_waiting_tokens),) + ws[1:]
    node = PrefixView(node_id=7, token_len=100, holders=(HolderView(0, depth_len=100),), expected_new_len=10,
                      fanout_hint=fanout, hint_at_s=hint_at)
    return ClusterSnapshot(ws, (node,), (), page_len=1, kv_bytes_per_token=1)


def planner(**kw):
    return KvrepPlanner(CostModel(PROFILE), DemandPredictor(), PlannerConfig(**kw))


def test_copies_a_hinted_prefix_off_a_busy_holder():
    # Holder w0: 20 s of queue. Request expected at t=1. Without a copy the best option is pulling at route time
    # on w1: max(0, 100 B / 1000 B/s) + pf(10) = 0.1 + 0.1 = 0.2 s. With a replica landing at 0.1 s: 0.1 s.
    # gain = 1 x (0.2 - 0.1) - 0.05 x 0.1 s link = 0.095 s. Half depth (50) would give max(..) + pf(60) = 0.6: worse.
    # TTL: hint -> until max(1.0, 0) + hint_ttl 15 = 16.0, minus landing 0.1 = 15.9 s.
    out = planner(allow_pull=True).plan(snapshot(), 0.0)
    assert len(out) == 1
    d = out[0]
    assert (d.node_id, d.source, d.target, d.depth_len) == (7, 0, 1, 100)
    assert d.ttl_s == pytest.approx(15.9)
    assert d.gain_s == pytest.approx(0.095)


def test_without_pull_the_copy_saves_the_recompute():
    # Without pulling, w1 must recompute 110 tokens: 1.1 s; gain = 1.1 - 0.1 - 0.005 = 0.995 s.
    out = planner(allow_pull=False).plan(snapshot(), 0.0)
    assert out[0].gain_s == pytest.approx(0.995)


@pytest.mark.parametrize("allow_pull", [False, True])
def test_inert_when_the_holder_is_idle(allow_pull):
    assert planner(allow_pull=allow_pull).plan(snapshot(holder_waiting_tokens=0), 0.0) == []


@pytest.mark.parametrize("allow_pull", [False, True])
def test_inert_when_the_backlog_drains_before_the_request(allow_pull):
    # 20 s backlog, hinted request at t=25: the holder is idle again by then.
    assert planner(allow_pull=allow_pull).plan(snapshot(hint_at=25.0), 0.0) == []


def test_respects_the_replica_budget():
    assert planner().plan(snapshot(budget=99), 0.0) == []


def test_fanout_spreads_over_more_holders_by_marginal_gain():
    # 8 branches, 3 workers: each extra replica takes a share of the branches off the busy holder.
    snap = snapshot(fanout=8)
    ws = snap.workers + (WorkerView(2, free_tokens=10_000, replica_budget_tokens=10_000,
                                    nic_bandwidth_bytes_per_s=1000.0),)
    snap = replace(snap, workers=ws)
    out = planner().plan(snap, 0.0)
    assert sorted(d.target for d in out) == [1, 2]
    assert all(d.source == 0 and d.depth_len == 100 for d in out)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="horizon_s"):
        PlannerConfig(horizon_s=0)
    with pytest.raises(ValueError, match="depth_fractions"):
        PlannerConfig(depth_fractions=(1.5,))


def idle_workers(n, **kw):
    return tuple(WorkerView(i, free_tokens=10_000, replica_budget_tokens=10_000, nic_bandwidth_bytes_per_s=1000.0,
                            **kw) for i in range(n))


def test_chained_copy_from_a_replica_in_flight_beats_the_busy_first_holder():
    # w0 holds the prefix but its link is booked until 0.5 s; a replica to w1 lands at 0.1 s. Two hinted requests
    # at t=1: with holders w0 (20 s queue) and w1, they run one after the other on w1 (0.1 and 0.2 s, mean
    # 0.15 s); a copy to w2 lets both start at once (mean 0.1 s). From w1 it lands at 0.1 + 0.1 = 0.2 s, from
    # w0 at 0.5 + 0.1 = 0.6 s: w1 is the source. gain = 2 x 0.05 - 0.05 x 0.1 s link = 0.095 s.
    ws = idle_workers(3)
    ws = (ws[0]._replace(num_waiting=1, waiting_new_tokens=2000, egress_busy_until_s=0.5),) + ws[1:]
    node = PrefixView(7, 100, holders=(HolderView(0, depth_len=100), HolderView(1, "replica", 100, None, 0.1)),
                      expected_new_len=10, fanout_hint=2, hint_at_s=1.0)
    out = planner(chain_sources=True).plan(ClusterSnapshot(ws, (node,), (), 1, 1), 0.0)
    assert [(d.source, d.target, d.depth_len) for d in out] == [(1, 2, 100)]
    assert out[0].gain_s == pytest.approx(0.095)
    # Without chaining (an executor that cannot defer a copy), only w0 may be the source.
    assert all(d.source == 0 for d in planner().plan(ClusterSnapshot(ws, (node,), (), 1, 1), 0.0))


def test_fanout_from_a_prefill_in_flight_spreads_as_a_tree():
    # The prompt is still being prefilled on w0 (ready at 2.0 s); 8 branches are hinted at t=3 over 4 idle
    # workers. Copies start when the source has the pages: 0 -> 1 lands at 2.1; then w0 (link free at 2.1)
    # and w1 (holds it from 2.1) both land their next copy at 2.2: 0 -> 2 (the first source on a tie), 1 -> 3.
    node = PrefixView(7, 100, holders=(HolderView(0, depth_len=100, eta_s=2.0),), expected_new_len=10,
                      fanout_hint=8, hint_at_s=3.0)
    out = planner(chain_sources=True).plan(ClusterSnapshot(idle_workers(4), (node,), (), 1, 1), 0.0)
    assert sorted((d.source, d.target) for d in out) == [(0, 1), (0, 2), (1, 3)]
    assert planner().plan(ClusterSnapshot(idle_workers(4), (node,), (), 1, 1), 0.0) == []  # no holder has it yet


def test_endpoint_wait_prices_the_iterations_in_progress_at_both_ends():
    # As test_without_pull_the_copy_saves_the_recompute (copy lands at 0.1 s, gain 0.995 s), with the source's
    # iteration in progress ending at 0.3 s and the target's at 0.5 s: with endpoint_wait the copy is gathered
    # at 0.3, on the wire until 0.4, installed when the target's iteration ends at 0.5: the request (at 1.0)
    # still finds it, same gain. A source busy until 2.0 s gathers too late: the copy lands at 2.1, the request
    # would wait 1.1 s for it + 0.1 s > recomputing on w1 (1.1 s): no copy. The simulator's executor does not
    # wait for the schedulers (endpoint_wait off): the copy lands at 0.1 s either way.
    def snap(src_busy, dst_busy):
        s = snapshot()
        ws = (s.workers[0]._replace(busy_until_s=src_busy), s.workers[1]._replace(busy_until_s=dst_busy))
        return replace(s, workers=ws)
    [d] = planner(allow_pull=False, endpoint_wait=True).plan(snap(0.3, 0.5), 0.0)
    assert d.gain_s == pytest.approx(0.995)
    assert planner(allow_pull=False, endpoint_wait=True).plan(snap(2.0, 0.5), 0.0) == []
    [d] = planner(allow_pull=False, endpoint_wait=False).plan(snap(2.0, 0.5), 0.0)
    assert d.gain_s == pytest.approx(0.995)


def three_hinted(**kw):
    """Three hinted prefixes (ids 7, 8, 9; due at 1, 2, 3 s) each held by the busy w0 only."""
    snap = snapshot(**kw)
    node = snap.prefixes[0]
    nodes = tuple(replace(node, node_id=7 + i, hint_at_s=1.0 + i) for i in range(3))
    return replace(snap, prefixes=nodes)


def test_a_scoring_budget_defers_the_rest_and_the_next_pass_takes_the_longest_waiting_first():
    # each prefix past the cheap bounds costs one pair per worker (2 here) per copy it looks for; 3 pairs: the most
    # urgent (7) is scored (its copy and the look for a second one: 4 pairs), 8 and 9 wait
    p = planner(allow_pull=False, max_scored_per_tick=3, urgent_s=0.5)  # none due within 0.5 s: round robin
    out = p.plan(three_hinted(), 0.0)
    assert [d.node_id for d in out] == [7]
    assert p.deferred == {8: 1, 9: 1} and p.num_scored == 4
    assert p.outcomes[8].startswith("deferred")
    # carried over: 8 first (waited as long as 9, due sooner), then 7 waits with 9
    out = p.plan(replace(three_hinted(), carried=p.deferred), 0.0)
    assert [d.node_id for d in out] == [8]
    assert p.deferred == {7: 1, 9: 2}
    out = p.plan(replace(three_hinted(), carried=p.deferred), 0.0)
    assert [d.node_id for d in out] == [9] and p.deferred == {7: 2, 8: 1}


def test_a_prefix_due_soon_is_scored_before_those_carried_over():
    # 8 and 9 were carried over (budget spent); 7 and 8 are due within urgent_s (1 and 2 s <= 2 s), 9 is not (3 s):
    # the due ones first by when they are due, so 7 although it waited least
    p = planner(allow_pull=False, max_scored_per_tick=3, urgent_s=2.0)
    out = p.plan(replace(three_hinted(), carried={8: 3, 9: 5}), 0.0)
    assert [d.node_id for d in out] == [7] and p.deferred == {8: 4, 9: 6}
    # none due within urgent_s: the longest waiting first
    p = planner(allow_pull=False, max_scored_per_tick=3, urgent_s=0.5)
    out = p.plan(replace(three_hinted(), carried={8: 3, 9: 5}), 0.0)
    assert [d.node_id for d in out] == [9] and p.deferred == {7: 1, 8: 4}


def test_no_budget_scores_every_prefix():
    p = planner(allow_pull=False)
    out = p.plan(three_hinted(), 0.0)
    assert sorted(d.node_id for d in out) == [7, 8, 9] and p.deferred == {}
    with pytest.raises(ValueError):
        PlannerConfig(max_scored_per_tick=-1)


def test_a_pull_waits_for_the_holders_iteration_so_a_copy_ahead_keeps_its_value():
    """With `endpoint_wait` (the live agents gather and install between scheduler iterations) a copy on the
    request's path is gathered only once the holder's iteration in progress is over: half of it left on average,
    the iteration being the holder's queued work up to one chunk (`scoring.source_iteration_s`). Holder w0: 20 s of
    queue, one iteration (chunks of 10,000 tokens); request at t=1: the pull waits 0.5 x 19 = 9.5 s + 0.1 s on the
    wire, worse than recomputing the 110 tokens at w1 (1.1 s): the copy ahead (landing at 0.1 s) saves the whole
    recompute, as without pulls (`test_without_pull_the_copy_saves_the_recompute`: 0.995 s), not just the wire
    (`test_copies_a_hinted_prefix_off_a_busy_holder`: 0.095 s)."""
    [d] = planner(allow_pull=True, endpoint_wait=True).plan(snapshot(), 0.0)
    assert (d.source, d.target, d.depth_len) == (0, 1, 100) and d.gain_s == pytest.approx(0.995)
    [d] = planner(allow_pull=True, endpoint_wait=False).plan(snapshot(), 0.0)
    assert d.gain_s == pytest.approx(0.095)


def test_the_pull_is_as_good_shortcut_bounds_the_pull_with_the_holders_iteration():
    """A copy whose wire time per request is under the minimum gain (20 tokens: 0.02 s x 1 request < 0.05 s) is
    skipped as no better than the pull on the request's path, unless that pull also waits for the holder's
    iteration (`endpoint_wait`: up to one chunk, 100 s here): then the copy is weighed; it lands at 0.02 s, where
    recomputing the 30 tokens at w1 takes 0.3 s and the pull ~9.5 s: gain 0.3 - 0.1 - 0.05 x 0.02 = 0.199 s."""
    s = snapshot()
    node = replace(s.prefixes[0], token_len=20, holders=(HolderView(0, depth_len=20),))
    s = replace(s, prefixes=(node,))
    p = planner(allow_pull=True, endpoint_wait=False)
    assert p.plan(s, 0.0) == [] and p.outcomes[7] == "a copy on the request's path is as good"
    [d] = planner(allow_pull=True, endpoint_wait=True).plan(s, 0.0)
    assert (d.target, d.depth_len) == (1, 20) and d.gain_s == pytest.approx(0.199)
