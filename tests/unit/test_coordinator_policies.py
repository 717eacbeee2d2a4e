"""The coordinator's live policies: built by name through one registry, called through one interface."""
import pytest

from radix_sync import protocol as p
from radix_sync.coordinator.live_planner import LiveDecision, LivePlanner
from radix_sync.coordinator.policies import LIVE_POLICIES, DemotePolicy, NoPolicy, RulesPolicy
from radix_sync.coordinator.server import POLICIES, CoordinatorConfig
from radix_sync.coordinator.state import ClusterState
from radix_sync.hashing import page_hashes
from radix_sync.policy.rules import RuleBasedPolicy, RuleConfig

PS = 16
RULES = RuleConfig(min_prefix_len=64, min_hits=3, window_s=10.0, max_queue=1, ttl_s=30.0)


def make(name):
    return LIVE_POLICIES.create(name, rules=RULES, profile="cpu-local")


def hot_state():
    """Worker a holds a 256-token prefix hit 3 times and has 2 requests waiting; b is idle."""
    st = ClusterState()
    for rid, wid in ((b"A", "a"), (b"B", "b")):
        st.handle(rid, p.Hello(worker_id=wid, http_url="", data_endpoint="", fingerprint="f", fingerprint_fields={},
                               page_size=PS, pool_capacity_tokens=65536, replica_budget_tokens=16384), 0.0)
    tokens = list(range(100, 356))
    hashes = page_hashes(tokens, PS)
    blocks = [p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS])
              for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
    st.handle(b"A", p.PagesStored(worker_id="a", seq=1, namespace="", blocks=blocks), 0.1)
    for seq in (2, 3, 4):
        st.handle(b"A", p.PrefixHit(worker_id="a", seq=seq, namespace="", block_hash=hashes[-1], matched_len=256,
                                    key_len=300), 0.1 * seq)
    st.handle(b"A", p.LoadReported(worker_id="a", seq=5, num_running_reqs=1, num_waiting_reqs=2,
                                   num_waiting_tokens=600, available_tokens=60000, evictable_tokens=0,
                                   replica_tokens=0), 0.5)
    return st, hashes[-1]


def test_the_registry_names_every_live_policy_in_the_order_errors_list_them():
    assert LIVE_POLICIES.names() == ["kvrep", "kvrep_lru", "kvrep_fixed", "demote", "rules", "none"]
    assert POLICIES == ("kvrep", "kvrep_lru", "kvrep_fixed", "demote", "rules", "none")
    assert [type(make(n)) for n in POLICIES] == [LivePlanner, LivePlanner, LivePlanner, DemotePolicy, RulesPolicy,
                                                 NoPolicy]
    assert [make(n).name for n in POLICIES] == list(POLICIES)
    # only `kvrep_lru`'s copies land as ordinary cache (`ExpectReplica.ordinary`); the class keeps evict-first
    assert [make(n).replicas_ordinary for n in POLICIES] == [False, True, False, False, False, False]
    # only `kvrep_fixed` prices prefills at its profile's times, not the speed the routers measure
    assert [getattr(make(n), "speed_calibrated", None) for n in POLICIES[:3]] == [True, True, False]
    assert not LivePlanner.replicas_ordinary
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        make("lru")
    with pytest.raises(ValueError, match="choose one of kvrep, kvrep_lru, kvrep_fixed, demote, rules, none"):
        CoordinatorConfig(policy="lru")


@pytest.mark.parametrize("name", POLICIES)
def test_every_live_policy_answers_the_one_interface(name):
    st, _ = hot_state()
    policy = make(name)
    assert isinstance(policy.decide(st, 1.0), list)
    assert policy.take_demotions() == [] and isinstance(policy.hint_outcomes, dict)
    assert (policy.session_stats() is None) == (name not in ("kvrep", "kvrep_lru", "kvrep_fixed", "demote"))


def test_the_rules_policy_decides_on_the_states_rule_snapshot():
    st, block_hash = hot_state()
    expected = RuleBasedPolicy(RULES).decide(st.rule_snapshot(1.0), 1.0)
    assert [(d.source, d.target, d.block_hash, d.prefix_len) for d in expected] == [("a", "b", block_hash, 256)]
    assert make("rules").decide(st, 1.0) == [LiveDecision("a", "b", "", block_hash, 256, 30.0, 0.0)]
    assert make("none").decide(st, 1.0) == []


def test_the_demote_policy_demotes_a_moved_sessions_copy_and_copies_nothing():
    """`demote` is `kvrep` without its planner: the same session tracking and demotion (a finished turn's next turn
    routed to b, which holds all of it, demotes a's copy), and never a copy, even where `kvrep` makes one."""
    def run(name):
        st, _ = hot_state()
        tokens = list(range(100, 356))
        hashes = page_hashes(tokens, PS)
        st.handle(b"B", p.PagesStored(worker_id="b", seq=1, namespace="", blocks=[
            p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS])
            for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]), 0.6)
        policy = make(name)
        policy.demotion_gate = None  # (sent whatever moved sessions did: tests/unit/test_demotion_gate.py)
        st.record_demand([], [{"input_ids": tokens, "worker": "a", "stop": "tool_use", "class": "acme"}], 1.0)
        policy.decide(st, 1.0)
        st.record_arrival({"input_ids": tokens + [7] * 40, "worker": "b", "class": "acme"}, 2.0)
        return policy.decide(st, 2.2), policy.take_demotions(), policy.session_stats()["followups"]

    copies, demotions, followups = run("demote")
    assert copies == [] and demotions == [("a", "", page_hashes(list(range(100, 356)), PS)[-1])] and followups == 1
    assert run("kvrep")[1:] == (demotions, 1)  # the same demotion as the whole planner's
    st, block_hash = hot_state()  # a's prefix hot and a busy: `kvrep` copies it, `demote` does not
    assert [d.block_hash for d in make("kvrep").decide(st, 1.0)] == [block_hash] and make("demote").decide(st, 1.0) == []
