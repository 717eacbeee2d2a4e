"""The demotion gate (`radix_sync.policy.demotion`): demote a moved session's old copies only while moved sessions
seldom come back, learned from decisions it did not act on (controls)."""
from __future__ import annotations

import pytest

from radix_sync.policy.demotion import DemotionGate, DemotionGateConfig

CFG = DemotionGateConfig(max_return_rate=0.5, min_outcomes=4, window=8, control_every=4, outcome_window_s=100.0)


def history(i: int) -> list[int]:
    """A session's page hashes (the last one is what a demotion names); hashes 4k+1.. are never controls while
    the gate is open (control_every=4)."""
    return [1000 * i + j for j in range(1, 5)] + [4 * i + 1]


def move(gate: DemotionGate, i: int, now: float) -> bool:
    """Session i's turn moved from worker "a" to "b": the gate's decision on a's copy."""
    h = history(i)
    gate.observe(h, "b", now)
    return gate.decide(h[-1], ["a"], now)


def follow_up(gate: DemotionGate, i: int, worker: str, now: float) -> None:
    gate.observe(history(i) + [7, 8], worker, now)


def test_closed_until_enough_controls_then_open_where_sessions_move_on():
    gate = DemotionGate(CFG)
    assert [move(gate, i, 1.0) for i in range(4)] == [False] * 4  # closed: every decision a control, none sent
    assert not gate.is_open() and gate.stats["controls"] == 4
    for i in range(4):
        follow_up(gate, i, "b", 2.0)  # each session stayed where it went
    assert gate.stats["moved_on"] == 4 and gate.is_open() and gate.return_rate() == pytest.approx(1 / 6)
    assert move(gate, 10, 3.0) is True and gate.stats["sent"] == 1
    # open: one decision in `control_every` (by its hash) is still a control
    h = [5, 6, 4 * 11]
    gate.observe(h, "b", 3.0)
    assert gate.decide(h[-1], ["a"], 3.0) is False and gate.stats["controls"] == 5


def test_sessions_that_come_back_keep_it_closed_and_close_it_again():
    gate = DemotionGate(CFG)
    for i in range(4):
        move(gate, i, 1.0)
        follow_up(gate, i, "a", 2.0)  # back on the worker it left
    assert gate.stats["returned"] == 4 and not gate.is_open()
    assert move(gate, 9, 3.0) is False
    # sessions that move on open it; then coming back again closes it (the window holds the last 8)
    gate = DemotionGate(CFG)
    for i in range(4):
        move(gate, i, 1.0)
        follow_up(gate, i, "b", 2.0)
    assert gate.is_open()
    for i in range(20, 28, 1):
        h = [3, 4 * i]  # controls (hash a multiple of 4)
        gate.observe(h, "b", 5.0)
        assert gate.decide(h[-1], ["a"], 5.0) is False
        gate.observe(h + [9], "a", 6.0)
    assert gate.stats["returned"] == 8 and not gate.is_open() and move(gate, 40, 7.0) is False


def test_only_controls_count_a_sent_demotions_outcome_is_kept_apart():
    """A sent demotion biases its own outcome (its copy evicted, a cache-aware router stops sending the session
    back): it is counted apart and never moves the estimate."""
    gate = DemotionGate(CFG)
    for i in range(4):
        move(gate, i, 1.0)
        follow_up(gate, i, "b", 2.0)
    rate = gate.return_rate()
    assert move(gate, 50, 3.0) is True
    follow_up(gate, 50, "a", 4.0)
    assert gate.stats["sent_returned"] == 1 and gate.return_rate() == rate


def test_an_unanswered_decision_counts_as_moved_on_after_its_window_and_the_pending_set_is_bounded():
    gate = DemotionGate(CFG)
    for i in range(4):
        move(gate, i, 1.0)
    assert gate.status()["pending"] == 4 and not gate.is_open()
    gate.observe([12345], "b", 1.0 + CFG.outcome_window_s)  # nobody carried those histories since: sessions over
    assert gate.stats["expired"] == 4 and gate.stats["moved_on"] == 4 and gate.is_open()
    small = DemotionGate(DemotionGateConfig(max_pending=3, min_outcomes=1))
    for i in range(5):
        small.decide(4 * i + 1, ["a"], 1.0)
    assert small.status()["pending"] == 3 and small.stats["expired"] == 2


def test_an_arrival_resolves_earlier_decisions_before_its_own_and_only_histories_it_carries():
    gate = DemotionGate(CFG)
    move(gate, 0, 1.0)
    follow_up(gate, 1, "a", 2.0)  # another session's arrival on a: says nothing of session 0
    assert gate.stats["returned"] == gate.stats["moved_on"] == 0 and gate.status()["pending"] == 1
    # session 0's next turn moves again (to c): resolves the first decision (moved on), then records its own
    h = history(0) + [77, 4 * 30 + 1]
    gate.observe(h, "c", 3.0)
    gate.decide(h[-1], ["b"], 3.0)
    assert gate.stats["moved_on"] == 1 and gate.status()["pending"] == 1


@pytest.mark.parametrize("field,value", [("max_return_rate", 1.5), ("max_return_rate", -0.1), ("min_outcomes", 0),
                                         ("window", 0), ("control_every", 0), ("outcome_window_s", 0.0),
                                         ("max_pending", 0)])
def test_a_bad_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        DemotionGateConfig(**{field: value})


def test_the_sweep_script_runs_the_gate_off_and_at_each_setting(capsys):
    """scripts/demotion_gate_sweep.py (the numbers behind the defaults) on a short agent run: one line per setting,
    the gated ones with the gate's end state, the ungated one without."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "demotion_gate_sweep.py"
    spec = importlib.util.spec_from_file_location("demotion_gate_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.gate_of("0.3/8") == DemotionGateConfig(max_return_rate=0.3, control_every=8)
    assert mod.gate_of("none") is None
    assert mod.main(["--gates", "none,0.4/16", "--seeds", "1", "--", "--generator", "agent", "--rate", "20",
                     "--duration-s", "20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [x.split(":")[0] for x in lines] == ["kvrep gate none", "kvrep gate 0.4/16"]
    assert "sent" not in lines[0] and " sent " in lines[1] and "P99" in lines[1]
