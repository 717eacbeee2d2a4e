"""Pins the session-continuation model: survival-based follow-up probability, censored (open) sessions, early
abandonment, late follow-ups, and the tracker's use of hints."""

import pytest

from radix_sync.policy.predictor import DemandPredictor, GapModel, PredictorConfig
from radix_sync.policy.snapshot import PrefixView
from radix_sync.policy.tracker import NodeTracker

# A negligible prior: the learned histogram is what the tests put in it.
CFG = PredictorConfig(prior_weight=1e-9)


def learned(gaps=(1.0,) * 10 + (100.0,) * 10, ends=5):
    m = GapModel(CFG, prior_median_s=10.0, prior_continue=0.5)
    for g in gaps:
        m.observe_gap(g)
    for _ in range(ends):
        m.observe_end()
    return m


def test_follow_up_probability_decays_with_elapsed_time():
    # 20 follow-ups (half at 1 s, half at 100 s), 5 abandoned: c = 20/25 = 0.8.
    m = learned()
    assert m.p_continue == pytest.approx(0.8)
    # Nothing yet: within 2 s -> c x F(2) = 0.8 x 0.5 = 0.4.
    assert m.p_within(0.0, 2.0) == pytest.approx(0.4)
    # Silent for 5 s: alive = c S / (1 - c + c S) = 0.4 / 0.6; due within 200 s with the same probability.
    assert m.p_alive(5.0) == pytest.approx(2 / 3)
    assert m.p_within(5.0, 200.0) == pytest.approx(2 / 3)
    assert m.p_within(5.0, 10.0) == pytest.approx(0.0, abs=1e-9)
    # Silent past every learned gap: nothing more is expected (up to the negligible prior).
    assert m.p_alive(200.0) == pytest.approx(0.0, abs=1e-9)


def test_abandonment_is_inferred_from_the_survival_function():
    m = learned()
    # p_alive < 0.02 once S(e) < 0.02 x 0.2 / (0.8 x 0.98) = 0.0051: past the 100 s bin.
    after = m.abandon_after_s(0.02)
    assert 90.0 < after <= 130.0
    assert m.p_alive(after * 1.01) < 0.02 <= m.p_alive(50.0)
    p = DemandPredictor(CFG)
    p._gaps[("c", False)] = m
    assert not p.is_abandoned("c", "end_turn", 50.0) and p.is_abandoned("c", "end_turn", 150.0)


def test_open_sessions_enter_the_continue_estimate_as_censored_data():
    m = learned(gaps=(1.0,) * 4, ends=4)  # c = 0.5
    # 4 sessions silent for 10 s (past every learned gap: p_alive = 0): (4 + 0) / (4 + 4 + 4) = 1/3.
    m.observe_open(4, sum(m.p_alive(10.0) for _ in range(4)))
    assert m.p_continue == pytest.approx(1 / 3)
    # 4 sessions that just finished (p_alive = c) leave it where it was: (4 + 4 x 0.5) / (4 + 4 + 4) = 0.5.
    m.observe_open(0, 0.0)
    m.observe_open(4, 4 * m.p_alive(0.0))
    assert m.p_continue == pytest.approx(0.5)


def test_late_follow_up_takes_the_abandonment_back():
    m = learned(gaps=(1.0,) * 4, ends=1)  # c = 0.8
    m.observe_late_followup(300.0)
    assert m.p_continue == pytest.approx(1.0)
    assert m.cdf(200.0) == pytest.approx(0.8)


def test_predict_uses_the_survival_posterior():
    p = DemandPredictor(CFG)
    p._gaps[("c", True)] = learned()
    node = PrefixView(1, 64, class_key="c", holders=(), last_finish_s=100.0, last_stop="tool_use")
    d = p.predict(node, now=105.0, horizon_s=200.0)
    assert d.source == "session" and d.expected_count == pytest.approx(2 / 3)
    assert p.predict(node, now=400.0, horizon_s=30.0).expected_count < 1e-9


def test_tracker_abandons_early_and_counts_a_late_follow_up():
    p = DemandPredictor(CFG)
    p._gaps[("c", False)] = learned()
    t = NodeTracker(p)
    t.on_finish([1, 2], "c", 0, "end_turn", 0.0)
    t.prune(50.0)
    assert t.nodes[2].last_finish_s == 0.0  # still alive at 50 s
    t.prune(150.0)
    assert 2 not in t.nodes and 2 in t.abandoned  # abandoned at 150 s, long before the 1,800 s cap
    ends = p._gaps[("c", False)].num_ended
    t.on_arrival([1, 2, 3], 2, "c", 0, 192, 64, 160.0)
    assert p._gaps[("c", False)].num_ended == pytest.approx(ends - 1)


def test_hinted_arrivals_are_not_counted_as_popularity():
    t = NodeTracker(DemandPredictor(CFG))
    t.on_hint([1, 2], "f", 0, fanout=2, hint_at_s=5.0, owner=3, owner_eta_s=1.0, now=0.0)
    for k in range(2):
        t.on_arrival([1, 2, 10 + k], 2, "f", 0, 192, 64, 5.0)
    n = t.nodes[2]
    assert n.hit_times_s == [] and n.fanout_hint == 0 and n.owner == -1
    t.on_arrival([1, 2, 20], 2, "f", 0, 192, 64, 6.0)  # unexplained: counts
    assert n.hit_times_s == [6.0]


def test_tracker_reports_a_silent_session_for_demotion_once_per_finish():
    # learned(): c = 0.8, gaps half at 1 s, half at 100 s. Silent for 5 s: p_alive = 2/3, and the next turn
    # within 50 s has probability 0 (the remaining gaps are all at 100 s).
    p = DemandPredictor(CFG)
    p._gaps[("c", False)] = learned()
    t = NodeTracker(p)
    t.on_finish([1, 2], "c", 0, "end_turn", 0.0)
    assert t.prune(5.0) == []  # demotion off (the default)
    assert t.prune(5.0, demote_p=0.5) == []  # alive (2/3) and no horizon: kept
    assert [n.node_id for n in t.prune(5.0, demote_p=0.5, demote_horizon_s=50.0)] == [2]
    assert t.prune(6.0, demote_p=0.5, demote_horizon_s=50.0) == []  # once per finish
    t.on_finish([1, 2], "c", 0, "end_turn", 10.0)  # a new finish of the same prompt: reported again
    assert [n.node_id for n in t.prune(15.0, demote_p=0.5, demote_horizon_s=50.0)] == [2]


def test_a_popularity_rate_needs_three_hits_in_its_window():
    """Two hits within 3 s once predicted 20 requests in a 30 s horizon (2 / 3 s x 30 s); live, 19 of 342 such
    predicted requests came, and two hits within 30 s made most of the live planner's first bets, none used. Now a
    window's rate counts from 3 hits in it."""
    def demand(hits, cfg=PredictorConfig()):
        node = PrefixView(node_id=1, token_len=64, holders=(), recent_hit_times_s=tuple(hits))
        one = DemandPredictor(cfg).predict(node, 100.0, 30.0)
        assert DemandPredictor(cfg).predict_all([node], 100.0, 30.0) == [one]  # (the inline copy agrees)
        return one.expected_count
    assert demand([98.5, 99.5]) == 0.0  # 2 hits: not popular
    assert demand([75.0, 98.5, 99.5]) == pytest.approx(3 / 30 * 30)  # 3 in 30 s (2 in 3 s): the long window's
    assert demand([98.0, 99.0, 99.5]) == pytest.approx(3 / 3 * 30)  # 3 in 3 s: a burst, 1 / s
    assert demand([98.5, 99.5], PredictorConfig(min_hits=1)) == pytest.approx(2 / 3 * 30)  # the rule before
    assert demand([80.0 + i for i in range(10)]) == pytest.approx(10 / 30 * 30)  # old hits: the long window
    with pytest.raises(ValueError, match="min_hits"):
        PredictorConfig(min_hits=0)
