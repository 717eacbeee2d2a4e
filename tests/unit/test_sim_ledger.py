"""The coordinator's copy ledger in the simulator (`EngineConfig.ledger_holdout`, the same `CopyLedger` object as live):
a share of the planner's prefixes held out, every finished request attributed, and the planner paused while its
copies are shown to cost."""

import pytest

from radix_sync.policy.ledger import COPIED, HELD_OUT, _unit
from radix_sync.policy.cost import load_profile
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import GeneratorConfig, SharedPrefixWorkload
from radix_sync.sim.policies import build_policy

PROFILE = load_profile("llama3.1-8b-h200")


def shared_engine(holdout: float, policy: str = "kvrep", seed: int = 1) -> Engine:
    wl = SharedPrefixWorkload(GeneratorConfig(), rate=30.0, duration_s=40.0, seed=seed,
                              max_context_len=PROFILE.max_context_len)
    return Engine(PROFILE, wl, build_policy(policy, PROFILE, wl.page_len, seed),
                  EngineConfig(num_workers=4, duration_s=40.0, ledger_holdout=holdout))


def planner_copies(eng: Engine) -> list:
    return [r for r in eng.stats.copy_records if r.kind == "replica"]


def test_no_holdout_is_no_ledger_and_the_planner_copies():
    eng = shared_engine(0.0)
    eng.run()
    assert eng.ledger is None and planner_copies(eng)


def test_a_full_holdout_makes_no_planner_copy_and_every_answer_is_heard():
    eng = shared_engine(1.0)
    stats = eng.run()
    status = eng.ledger.status(eng.now)
    assert planner_copies(eng) == [] and status["decisions"][HELD_OUT] > 0 and status["decisions"][COPIED] == 0
    # every request that finished with a first token was reported, as the routers report each answer's TTFT
    assert status["answers_timed"] == len(stats.ttft_s) > 100
    assert status["groups"][HELD_OUT]["answers"] > 0 and status["groups"][COPIED]["answers"] == 0


def test_held_out_prefixes_get_no_copy_and_the_rest_do():
    eng = shared_engine(0.5)
    eng.run()
    held = {h for h, (group, _) in eng.ledger._assigned.items() if group == HELD_OUT}
    copied = {h for h, (group, _) in eng.ledger._assigned.items() if group == COPIED}
    assert held and copied
    assert all(_unit(h) < 0.5 for h in held) and all(_unit(h) >= 0.5 for h in copied)
    assert {r.last_page for r in planner_copies(eng)} <= copied


def test_a_ledger_showing_copies_cost_pauses_the_planner():
    eng = shared_engine(0.2)
    led = eng.ledger
    # evidence as it would come: two prefixes (not the workload's pages) decided, one in each group, and many
    # answers on them, the copied group's slower: more than the run's own answers could outweigh
    hashes = [h for h in range(10**12, 10**12 + 100)]
    slow, fast = next(h for h in hashes if _unit(h) >= 0.2), next(h for h in hashes if _unit(h) < 0.2)
    for h in (slow, fast):
        led.assign(h, 0.0)
    for i in range(3000):
        assert led.finished([slow], 0.5 + 0.001 * (i % 7), 0.0) == COPIED
        assert led.finished([fast], 0.1 + 0.001 * (i % 7), 0.0) == HELD_OUT
    assert led.verdict(0.0)[0] == "costs"
    before = dict(led.num_decisions)
    eng.run()
    status = led.status(eng.now)
    assert status["verdict"] == "costs"
    # the planner decided, and every decision while the verdict held was held out: no copy made
    assert status["decisions"]["paused"] > before["paused"] and status["decisions"][COPIED] == before[COPIED]
    assert planner_copies(eng) == []


def test_the_holdout_is_checked():
    with pytest.raises(ValueError, match="ledger_holdout"):
        EngineConfig(ledger_holdout=1.5)
