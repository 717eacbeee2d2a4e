"""The planner's use calibration (`radix_sync.policy.calibration`): copies' outcomes by kind of demand, the factor
the planner scales that kind's expected counts by, and its wiring into the planner and the simulator."""

import pytest

from radix_sync.policy.calibration import UseCalibration, UseCalibrationConfig
from tests.unit.test_policy_planner import planner, snapshot


def test_no_outcomes_no_scaling_and_unused_copies_scale_their_kind_only():
    """Every copy is judged `judge_after_s` after it was decided, used or not; only `kinds` are scaled."""
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=10.0, prior=2.0))
    assert cal.factor("session") == 1.0
    for i in range(6):
        cal.decided(("s", i), "session", 0.75, now=float(i))
    cal.decided("h", "hint", 4.0, now=0.0)  # (a count above 1 predicts one use: the copy is hit or not)
    cal.used("h", now=1.0)
    cal.tick(9.0)  # nothing is 10 s old yet (the hint's use waits for its judgement too)
    assert cal.factor("session") == 1.0 and cal.status()["pending"] == 7 and cal.status()["used"] == 0
    cal.tick(20.0)
    # 6 copies predicted 0.75 uses each, none used: (0 + 2) / (4.5 + 2)
    assert cal.factor("session") == pytest.approx(2.0 / 6.5)
    assert cal.factor("hint") == 1.0  # not a scaled kind
    assert cal.factors() == {"session": pytest.approx(2.0 / 6.5)}
    st = cal.status()
    assert (st["decided"], st["used"], st["unused"], st["pending"]) == (7, 1, 6, 0)
    assert st["kinds"]["session"] == {"outcomes": 6, "used": 0, "predicted": 4.5, "factor": round(2.0 / 6.5, 4),
                                      "scaled": True}
    assert st["kinds"]["hint"]["used"] == 1 and not st["kinds"]["hint"]["scaled"]


def test_the_factor_is_never_above_one():
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=1.0))
    for i in range(5):
        cal.decided(i, "session", 0.2, now=0.0)
        cal.used(i, now=0.5)
    cal.tick(2.0)
    assert cal.factor("session") == 1.0


def test_a_use_after_the_judgement_flips_it_and_a_dropped_copy_is_no_outcome():
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=5.0, prior=1.0))
    cal.decided("a", "session", 1.0, now=0.0)
    cal.decided("b", "session", 1.0, now=0.0)
    cal.decided("c", "session", 1.0, now=0.0)
    cal.dropped("c")  # never landed: neither used nor unused
    cal.tick(6.0)
    assert cal.factor("session") == pytest.approx(1.0 / 3.0)  # (0 + 1) / (2 + 1)
    cal.used("a", now=7.0)
    assert cal.factor("session") == pytest.approx(2.0 / 3.0)
    cal.used("a", now=8.0)  # a second hit changes nothing
    assert cal.factor("session") == pytest.approx(2.0 / 3.0)
    assert cal.status()["late_used"] == 1 and cal.status()["dropped"] == 1


def test_the_window_keeps_the_latest_outcomes_and_old_ones_age_out():
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=1.0, window=4, prior=1.0, outcome_window_s=100.0,
                                              kinds=("popularity",)))
    for i in range(4):  # 4 unused at t=0..3
        cal.decided(i, "popularity", 1.0, now=float(i))
    for i in range(4, 6):  # then 2 used at t=4, 5
        cal.decided(i, "popularity", 1.0, now=float(i))
        cal.used(i, now=float(i) + 0.5)
    cal.tick(10.0)
    # the window holds the last 4 (2 unused, 2 used): (2 + 1) / (4 + 1)
    assert cal.factor("popularity") == pytest.approx(3.0 / 5.0)
    cal.used(0, now=11.0)  # its outcome left the window: no late flip of anything kept
    assert cal.factor("popularity") == pytest.approx(3.0 / 5.0)
    cal.tick(104.5)  # outcomes of t=2, 3, 4 are older than 100 s
    assert cal.status()["kinds"]["popularity"]["outcomes"] == 1
    cal.tick(200.0)
    assert cal.factor("popularity") == 1.0  # all forgotten: the kind is probed again


def test_pending_copies_are_bounded():
    cal = UseCalibration(UseCalibrationConfig(max_pending=2, prior=1.0))
    for i in range(3):
        cal.decided(i, "session", 1.0, now=0.0)
    assert cal.status()["pending"] == 2 and cal.status()["unused"] == 1  # the oldest judged unused


@pytest.mark.parametrize("kw", [dict(judge_after_s=0), dict(prior=0), dict(window=0), dict(outcome_window_s=-1),
                                dict(max_pending=0)])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        UseCalibrationConfig(**kw)


def test_the_planner_scales_a_kinds_expected_count_by_its_factor():
    # test_policy_planner's hinted case without pulls: gain = count x (1.1 - 0.1) - 0.005 s of link cost
    default = UseCalibration(UseCalibrationConfig(judge_after_s=1.0))
    for i in range(30):
        default.decided(i, "hint", 1.0, now=0.0)
    default.tick(5.0)
    p = planner(allow_pull=False)
    p.calibration = default
    (d,) = p.plan(snapshot(), 0.0)  # hints are not scaled by default
    assert (d.kind, d.expected_count, d.gain_s) == ("hint", 1.0, pytest.approx(0.995))
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=1.0, prior=2.0, kinds=("session", "hint")))
    p = planner(allow_pull=False)
    p.calibration = cal
    (d,) = p.plan(snapshot(), 0.0)
    assert (d.kind, d.expected_count, d.gain_s) == ("hint", 1.0, pytest.approx(0.995))
    for i in range(30):
        cal.decided(i, "session", 1.0, now=0.0)
    cal.tick(5.0)
    (d,) = p.plan(snapshot(), 0.0)  # another kind's outcomes do not touch hints
    assert d.gain_s == pytest.approx(0.995)
    for i in range(30, 60):
        cal.decided(i, "hint", 1.0, now=0.0)
    cal.tick(5.0)
    f = 2.0 / 32.0
    (d,) = p.plan(snapshot(), 0.0)
    assert (d.expected_count, d.gain_s) == (1.0, pytest.approx(f * 1.0 - 0.005))  # the raw count, the scaled gain
    # with pulls the copy saves only the pull's 0.1 s: f x 0.1 - 0.005 is below min_gain_s, so nothing is copied
    p_pull = planner(allow_pull=True)
    p_pull.calibration = cal
    assert p_pull.plan(snapshot(), 0.0) == []
    assert len(planner(allow_pull=True).plan(snapshot(), 0.0)) == 1


def test_a_sessions_copies_are_judged_when_its_next_turn_arrives():
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=30.0, prior=1.0))
    cal.decided("a", "session", 0.8, 0.0, prefix=7, target="w1")
    cal.decided("b", "session", 0.8, 0.0, prefix=7, target="w2")
    cal.decided("c", "session", 0.8, 0.0, prefix=8, target="w1")
    cal.decided("h", "hint", 1.0, 0.0, prefix=7, target="w3")  # many requests: not judged by one arrival
    cal.arrived(7, "w1", 2.0)  # the turn went to a's worker, not b's
    st = cal.status()
    assert (st["used"], st["unused"], st["pending"]) == (1, 1, 2)
    assert cal.factor("session") == pytest.approx((1 + 1.0) / (1.6 + 1.0))
    cal.arrived(7, "w2", 3.0)  # nothing of 7 is pending any more
    assert cal.status()["pending"] == 2
    cal.used("b", 4.0)  # a later request used b after all
    assert cal.status()["late_used"] == 1 and cal.factor("session") == 1.0
    cal.dropped("c")
    cal.tick(31.0)
    assert cal.status()["kinds"]["hint"]["outcomes"] == 1 and cal.status()["pending"] == 0
    # a copy judged used at its turn's arrival that then never lands takes its outcome back
    cal.dropped("a")
    st = cal.status()
    assert st["kinds"]["session"]["outcomes"] == 1 and (st["used"], st["dropped"]) == (0, 2)
    cal.dropped("a")  # (once)
    assert cal.status()["dropped"] == 2


def test_by_default_sessions_and_popular_prefixes_are_scaled_hints_are_not():
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=1.0, prior=1.0))
    for kind in ("session", "popularity", "hint"):
        for i in range(3):
            cal.decided((kind, i), kind, 1.0, now=0.0)
    cal.tick(2.0)
    assert cal.factors() == {"session": pytest.approx(0.25), "popularity": pytest.approx(0.25)}
    assert cal.factor("hint") == 1.0


def test_what_was_judged_outlives_a_planner_restart_its_pending_bets_and_counts_do_not():
    """`learned()`: the outcomes in the windows go to the next planner (so it does not bet cold again); the bets
    still pending were the old planner's (nobody would report their use) and its counts are its own."""
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=5.0, prior=2.0, outcome_window_s=100.0))
    for i in range(6):
        cal.decided(("p", i), "popularity", 1.0, now=0.0)
    cal.used(("p", 0), now=1.0)
    cal.tick(6.0)  # judged: 1 of 6 used
    cal.decided("late", "popularity", 1.0, now=6.0)  # pending when the planner goes
    before = cal.factor("popularity")
    assert before == pytest.approx(3.0 / 8.0)
    new = cal.learned()
    assert new.factor("popularity") == pytest.approx(before)
    st = new.status()
    assert st["pending"] == 0 and st["decided"] == 0 and st["kinds"]["popularity"]["outcomes"] == 6
    new.tick(200.0)  # the carried outcomes age out as their own would
    assert new.factor("popularity") == 1.0
    assert cal.factor("popularity") == pytest.approx(before)  # (the old one is not changed by the new one)


def test_the_coordinator_hands_what_its_planner_learned_to_the_next_one(tmp_path):
    """A benchmark's arms switch `kvrep` -> `none` -> `kvrep` with `reset_demand`: demand is forgotten, the use
    calibration is not (a planner left running would keep it)."""
    from radix_sync.coordinator.server import Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", admin_port=0, policy="kvrep", mode="active",
                                          state_dir=str(tmp_path)))
    try:
        cal = coord.policy.planner.calibration
        for i in range(8):
            cal.decided(i, "popularity", 1.0, now=0.0)
        cal.tick(31.0)
        learned = cal.factor("popularity")
        assert learned < 0.5
        with coord.lock:
            coord.set_policy("none", "active", reset_demand=True)
            assert not hasattr(coord.policy, "planner")
            coord.set_policy("kvrep", "active", reset_demand=True)
        carried = coord.policy.planner.calibration
        assert carried is not cal and carried.factor("popularity") == pytest.approx(learned)
        with coord.lock:
            coord.set_policy("kvrep", "shadow", reset_demand=True)  # a restart of the same policy too
        assert coord.policy.planner.calibration.factor("popularity") == pytest.approx(learned)
    finally:
        coord._sock.close(0)
        coord._ctx.term()


def test_a_popular_prefixs_predicted_requests_are_judged_against_the_requests_that_reuse_it():
    """The use factor says whether a copy was used at all; a popular prefix's count (20 requests from a burst of
    two) is judged by the requests that reused the prefix, anywhere, within `judge_after_s` of the decision."""
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=30.0, prior=2.0))
    cal.decided("p", "popularity", 20.0, now=0.0, prefix=5, target="w1")
    cal.decided("s", "session", 0.5, now=0.0, prefix=5, target="w1")  # a session: one turn, not counted this way
    cal.decided("q", "popularity", 4.0, now=0.0)  # no prefix named: no demand outcome
    cal.requested([3, 4, 5, 6], 4, now=1.0)  # reuses pages 3..6: prefix 5 is one of them
    cal.requested([3, 4, 5], 2, now=2.0)  # held only 3, 4: not a request on 5
    cal.arrival([3, 4, 5], 3, None, now=3.0)  # a request, no session's turn
    st = cal.status()
    assert st["pending"] == 3 and st["used"] == 0  # (requests are not uses of the copy)
    cal.tick(31.0)
    cal.requested([3, 4, 5], 3, now=32.0)  # after the judgement: not counted
    st = cal.status()["kinds"]["popularity"]
    assert (st["requests_predicted"], st["requests_seen"], st["used"]) == (20.0, 2, 0)
    use = (0 + 2.0) / (2.0 + 2.0)  # two copies, each predicted one use (min(1, count)), none used
    demand = (2 + 2.0) / (20.0 + 2.0)
    assert cal.factor("popularity") == pytest.approx(use * demand)
    assert cal.factor("session") == pytest.approx((0 + 2.0) / (0.5 + 2.0))  # the use factor alone
    assert cal.learned().factor("popularity") == pytest.approx(use * demand)
    # requests beyond the prediction never raise the factor above the use factor
    more = UseCalibration(UseCalibrationConfig(judge_after_s=1.0, prior=2.0))
    more.decided("p", "popularity", 1.0, now=0.0, prefix=9, target="w1")
    more.used("p", now=0.5)
    for t in range(5):
        more.requested([9], 1, now=0.1 * t)
    more.tick(2.0)
    assert more.factor("popularity") == 1.0



def test_pending_popular_copies_correct_the_count_before_their_judgement():
    """Given `now`, the demand factor takes each pending copy's requests so far against the share of its
    prediction due by then (a rate over `judge_after_s`); the judged outcomes alone without `now`."""
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=30.0, prior=2.0, half_life_s=1e12))  # (no fading)
    cal.decided("a", "popularity", 20.0, now=0.0, prefix=5, target="w1")
    cal.decided("b", "popularity", 20.0, now=6.0, prefix=6, target="w1")
    cal.requested([5], 1, now=7.0)
    # at 12 s: a is 12/30 due (8 requests), b 6/30 (4); one request seen
    assert cal.factor("popularity", 12.0) == pytest.approx((1 + 2.0) / (8.0 + 4.0 + 2.0))
    assert cal.factors(12.0) == {"popularity": pytest.approx(3.0 / 14.0)}
    assert cal.factor("popularity") == 1.0 and cal.factors() == {}  # nothing judged yet
    assert cal.factor("popularity", 0.0) == 1.0  # nothing due yet (b's elapsed time is taken as 0)
    cal.tick(31.0)  # a judged (20 predicted, 1 seen, unused), b pending at 25/30
    use = (0 + 2.0) / (1.0 + 2.0)
    assert cal.factor("popularity", 31.0) == pytest.approx(use * (1 + 2.0) / (20.0 + 25.0 / 30.0 * 20.0 + 2.0))
    assert cal.factor("popularity") == pytest.approx(use * (1 + 2.0) / (20.0 + 2.0))
    assert cal.factor("session", 31.0) == 1.0


def test_outcomes_fade_with_their_age_given_now():
    """Given `now`, each judged outcome weighs 0.5 ** (age / half_life_s): the factor drifts back towards 1 as the
    evidence ages (a gradual re-probe), instead of jumping back when the outcomes leave the window."""
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=10.0, prior=2.0, half_life_s=100.0))
    for i in range(4):
        cal.decided(i, "session", 1.0, now=0.0)
    cal.tick(10.0)
    assert cal.factor("session") == pytest.approx(2.0 / 6.0)  # unweighted
    assert cal.factor("session", 100.0) == pytest.approx(2.0 / (4 * 0.5 + 2.0))  # one half-life: weight 1/2
    assert cal.factor("session", 300.0) == pytest.approx(2.0 / (4 * 0.125 + 2.0))
    cal.decided("p", "popularity", 10.0, now=0.0, prefix=3, target="w")
    cal.requested([3], 1, now=1.0)
    cal.tick(20.0)
    use, demand = (0 + 2.0) / (0.5 + 2.0), (0.5 + 2.0) / (5.0 + 2.0)  # weight 1/2 at 100 s
    assert cal.factor("popularity", 100.0) == pytest.approx(use * demand)


def test_one_bet_per_prefix_and_target_until_it_is_judged():
    """A copy decided and not used is still a bet until its judgement: the planner makes no second copy of that
    prefix to that target meanwhile (its pages gone from the target before any request came are no evidence a
    second would be used); a use, a failure (dropped) or the judgement lets it copy again."""
    cal = UseCalibration(UseCalibrationConfig(judge_after_s=30.0))
    p = planner(allow_pull=False)
    p.calibration = cal
    snap = snapshot()
    (d,) = p.plan(snap, 0.0)
    assert not cal.betting(d.node_id, d.target)
    cal.decided("c1", d.kind, d.expected_count, 0.0, prefix=d.node_id, target=d.target)
    assert cal.betting(d.node_id, d.target) and not cal.betting(d.node_id, d.target + 1)
    assert not cal.betting(d.node_id + 1, d.target)
    assert p.plan(snap, 1.0) == [] and "still a bet" in p.outcomes[d.node_id]  # the same copy again: not made
    cal.used("c1", 2.0)  # it paid: another copy of it may
    assert not cal.betting(d.node_id, d.target) and len(p.plan(snap, 2.0)) == 1
    cal.decided("c2", d.kind, d.expected_count, 3.0, prefix=d.node_id, target=d.target)
    assert p.plan(snap, 4.0) == []
    cal.dropped("c2")  # it never landed: no bet stands
    assert len(p.plan(snap, 4.0)) == 1
    cal.decided("c3", d.kind, d.expected_count, 5.0, prefix=d.node_id, target=d.target)
    assert p.plan(snap, 6.0) == []
    cal.tick(35.0)  # judged (unused): the bet is over, its outcome now weighs on the kind's factor instead
    assert not cal.betting(d.node_id, d.target) and cal.stats["unused"] == 1


def test_a_bet_leaves_only_its_target_out_of_the_pass():
    """The bet is per prefix and target: the same pass scores the prefix's other targets (the target is left out of
    `best_candidate`'s scoring, not the pass's copy dropped after it), and a bet on another prefix changes nothing."""
    from dataclasses import replace

    from radix_sync.policy.snapshot import WorkerView

    cal = UseCalibration(UseCalibrationConfig(judge_after_s=30.0))
    p = planner(allow_pull=False)
    p.calibration = cal
    snap = snapshot()
    snap = replace(snap, workers=snap.workers + (WorkerView(2, free_tokens=10_000, replica_budget_tokens=10_000,
                                                                   nic_bandwidth_bytes_per_s=1000.0),))
    (d,) = p.plan(snap, 0.0)
    assert d.target == 1  # (two idle targets alike: the first wins)
    cal.decided("c1", d.kind, d.expected_count, 0.0, prefix=d.node_id, target=d.target)
    assert cal.bets() == {d.node_id: {1}}
    (again,) = p.plan(snap, 0.0)  # (the same pass again: the other target, the same copy and gain)
    assert (again.node_id, again.target, again.depth_len) == (d.node_id, 2, d.depth_len)
    assert again.gain_s == pytest.approx(d.gain_s)
    cal.decided("c2", d.kind, d.expected_count, 1.0, prefix=d.node_id, target=2)
    assert p.plan(snap, 2.0) == [] and "still a bet x2" in p.outcomes[d.node_id]
    other = UseCalibration(UseCalibrationConfig(judge_after_s=30.0))
    other.decided("c3", d.kind, d.expected_count, 0.0, prefix=d.node_id + 1, target=1)
    p.calibration = other
    assert [x.target for x in p.plan(snap, 1.0)] == [1]


def test_live_the_bet_is_known_by_the_workers_id():
    """The live planner records its copies by worker id (`ClusterSnapshot.worker_keys`): the same rule."""
    import dataclasses

    cal = UseCalibration(UseCalibrationConfig(judge_after_s=30.0))
    p = planner(allow_pull=False)
    p.calibration = cal
    snap = snapshot()
    ids = tuple(f"w{i}" for i in range(len(snap.workers)))
    live = dataclasses.replace(snap, worker_keys=ids)
    (d,) = p.plan(live, 0.0)
    cal.decided("r1", d.kind, d.expected_count, 0.0, prefix=d.node_id, target=ids[d.target])
    assert p.plan(live, 1.0) == [] and len(planner(allow_pull=False).plan(live, 1.0)) == 1
    assert len(p.plan(snap, 1.0)) == 1  # (known by index, the bet would be another worker's)
