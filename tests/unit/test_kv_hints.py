"""SGLang's `kv_hints` envelope read for kvrep's actions (`radix_sync.kv_hints`), and the `end` hint it can carry
(the coordinator drops the prefix's live hints and closes its open session)."""
import pytest

from radix_sync import kv_hints as kh
from radix_sync import protocol as p
from radix_sync.coordinator.live_planner import LivePlanner
from radix_sync.hashing import page_hashes
from tests.unit.test_live_planner import PS, finish, hello, state_with_prefix


def action(kind, payload, version="1", aid="a"):
    return {"action_id": aid, "action_type": kind, "action_version": version, "payload": payload}


def env(*actions, **extra):
    return {"protocol_version": "1", "message_id": "m", "actions": list(actions), **extra}


def test_our_actions_become_hints_in_order_and_other_consumers_actions_are_left_alone():
    value = env(action("kvrep.fanout", {"k": 8, "delay_s": 0.2}), action("acme.prefetch", {"anything": [1, 2]}),
                action("kvrep.keepalive", {"ttl_s": 30}), action("kvrep.session_end", {}), unknown_key=1)
    assert kh.parse(value) == [{"kind": "fanout", "k": 8, "delay_s": 0.2, "hint_id": "m/a"},
                               {"kind": "keepalive", "ttl_s": 30.0, "hint_id": "m/a"}, {"kind": "end", "hint_id": "m/a"}]
    assert kh.parse(env(action("kvrep.fanout", {"k": 2}, aid="b7"))) == [{"kind": "fanout", "k": 2, "delay_s": 0.5,
                                                                         "hint_id": "m/b7"}]
    assert kh.parse(None) == [] and kh.parse(env()) == [] and kh.parse(env(action("x.y", {}, version="9"))) == []
    assert kh.parse(kh.envelope(("kvrep.fanout", {"k": 3}))) == [{"kind": "fanout", "k": 3, "delay_s": 0.5,
                                                                  "hint_id": "m-1/a-0"}]


@pytest.mark.parametrize("value,what", [
    ({"message_id": "m"}, "protocol_version"),                                   # SGLang's shape rule
    ({"protocol_version": "1"}, "message_id"),
    (env(actions=None), "actions"),
    (env({"action_id": "a", "action_type": "kvrep.fanout"}), "action_version"),
    (7, "must be an object"),
    ("x", "must be an object"),
    (env(action("kvrep.fanout", {"k": 8}, version="2")), "version '2' is not supported"),   # ours
    (env(action("kvrep.fanout", {"k": 0})), ">= 1"),
    (env(action("kvrep.fanout", {})), "missing required field `k`"),
    (env(action("kvrep.fanout", {"k": 2, "delay_s": 61})), "<= 60"),
    (env(action("kvrep.keepalive", {"ttl_s": 0})), "> 0"),
    (env(action("kvrep.keepalive", {"ttl_s": 1e9})), "<="),
    (env(action("kvrep.keepalive", {"ttl_s": 5, "k": 2})), "unknown field `k`"),
    (env(action("kvrep.session_end", {"now": True})), "unknown field"),
    (env(action("kvrep.fanout", [8])), "payload"),
    (env(*[action("x.y", {}, aid=str(i)) for i in range(kh.MAX_ACTIONS + 1)]), "length"),  # bounds
    (env(action("x" * (kh.MAX_ID_CHARS + 1), {})), "length"),
    ({**env(), "message_id": "m" * (kh.MAX_ID_CHARS + 1)}, "length"),
])
def test_a_malformed_envelope_or_action_is_refused_with_what_is_wrong(value, what):
    with pytest.raises(kh.KvHintsError, match="kv_hints") as err:
        kh.parse(value)
    assert what in str(err.value), err.value


def test_a_batch_takes_one_envelope_per_prompt_and_acts_on_the_first():
    first, second = env(action("kvrep.fanout", {"k": 4})), env(action("kvrep.session_end", {}))
    assert kh.parse([first, second], num_prompts=2) == [{"kind": "fanout", "k": 4, "delay_s": 0.5, "hint_id": "m/a"}]
    assert kh.parse([None, second], num_prompts=2) == []
    with pytest.raises(kh.KvHintsError, match="2 envelopes for 3 prompt"):
        kh.parse([first, second], num_prompts=3)
    with pytest.raises(kh.KvHintsError, match=r"kv_hints\[1\]"):  # every envelope is validated
        kh.parse([first, {"message_id": "m"}], num_prompts=2)
    with pytest.raises(kh.KvHintsError, match="version"):
        kh.parse([None, env(action("kvrep.fanout", {"k": 1}, version="0"))], num_prompts=2)


def test_what_we_accept_sglang_accepts_and_what_its_shape_rule_refuses_we_refuse():
    """Our router forwards the body unchanged: an envelope we pass must not be one SGLang then refuses, and one
    SGLang refuses is refused at the router already (same message, earlier)."""
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    good = env(action("kvrep.fanout", {"k": 8}), action("acme.other", {"z": [1]}), extra_key=3)
    assert decode_kv_hints_envelope(good).actions[0].action_type == "kvrep.fanout" and kh.parse(good)
    for bad in ({"message_id": "m"}, {"protocol_version": "1"}, env({"action_id": "a", "action_type": "t"})):
        with pytest.raises(ValueError):
            decode_kv_hints_envelope(bad)
        with pytest.raises(kh.KvHintsError):
            kh.parse(bad)


def test_an_end_hint_drops_the_prefix_live_hints_and_closes_its_open_session():
    tokens = list(range(100, 100 + 4096))
    node = page_hashes(tokens, PS)[-1]
    st = state_with_prefix(tokens, waiting_on_a=20)
    finish(st, tokens, 1.0)
    st.record_hint({"kind": "keepalive", "input_ids": tokens, "ttl_s": 60}, 1.05)
    other = list(range(9000, 9000 + 1024))
    st.record_hint({"kind": "keepalive", "input_ids": other, "ttl_s": 60}, 1.05)
    planner = LivePlanner("cpu-local")
    assert [x.node_id for x in planner.snapshot(st, 1.1)[0].prefixes] == [node]
    assert planner.session_stats()["open"] == 1 and len(st.hints) == 2
    ended_before = planner.planner.predictor.gap_model("acme", "tool_use").num_ended
    rec = st.record_hint({"kind": "end", "input_ids": tokens}, 1.2)
    assert rec.kind == "end" and rec.block_hash == node
    assert [h.prefix_len for h in st.hints] == [1024]  # the other prefix's hint stays
    st.demand.check_integrity()
    snap, _ = planner.snapshot(st, 1.3)
    assert snap.prefixes == () and planner.decide(st, 1.3) == []
    stats = planner.session_stats()
    assert (stats["open"], stats["ended_by_hint"]) == (0, 1)
    # the gap model counted the session as ended
    assert planner.planner.predictor.gap_model("acme", "tool_use").num_ended == pytest.approx(ended_before + 1)
    # an end on a prefix with no session and no hint changes nothing, and is no live hint
    st.record_hint({"kind": "end", "input_ids": other[:512]}, 1.4)
    assert len(st.hints) == 1 and planner.snapshot(st, 1.5)[0].prefixes == ()
    assert planner.session_stats()["ended_by_hint"] == 1


def test_end_hints_are_not_capped_as_live_hints_but_are_rate_limited():
    from radix_sync.api import AdminError
    from radix_sync.coordinator.config import StateConfig
    from radix_sync.coordinator.state import ClusterState

    st = ClusterState(StateConfig(max_hints_per_namespace=1, hint_rate_per_s=0.001, hint_burst=2))
    st.handle(b"A", hello("a"), 0.0)
    st.record_hint({"kind": "keepalive", "input_ids": list(range(64)), "ttl_s": 60}, 0.1)
    with pytest.raises(AdminError, match="too many live hints"):
        st.record_hint({"kind": "keepalive", "input_ids": list(range(1, 65)), "ttl_s": 60}, 0.2)
    st.record_hint({"kind": "end", "input_ids": list(range(1, 65))}, 0.3)  # the cap does not apply
    with pytest.raises(AdminError, match="rate limit"):
        st.record_hint({"kind": "end", "input_ids": list(range(2, 66))}, 0.4)


def test_a_hint_sent_by_the_router_and_again_by_the_worker_is_recorded_once():
    """The router acts on the envelope and forwards it; the worker's plugin reports the same actions: the hint id
    (message id / action id) makes the second a no-op, in the same namespace, for the hit window."""
    from radix_sync.api import HintRequest

    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=0)
    first = st.record_hint(HintRequest(kind="fanout", input_ids=tokens, k=4, hint_id="m-1/a-0"), 1.0)
    # the worker's report of the same action, over the wire
    out = st.handle(b"A", p.HintReported(worker_id="a", seq=3, namespace="", token_ids=tokens, kind="fanout", k=4,
                                         hint_id="m-1/a-0"), 1.1)
    assert out == [] and len(st.hints) == 1
    assert st.record_hint(HintRequest(kind="fanout", input_ids=tokens, k=4, hint_id="m-1/a-0"), 1.2) is first
    # another action, another namespace, or no id: each its own hint
    st.handle(b"A", p.HintReported(worker_id="a", seq=4, namespace="", token_ids=tokens, kind="keepalive",
                                   ttl_s=5, hint_id="m-1/a-1"), 1.3)
    st.record_hint(HintRequest(kind="fanout", input_ids=tokens, k=4, cache_salt="t9", hint_id="m-1/a-0"), 1.4)
    st.record_hint(HintRequest(kind="fanout", input_ids=tokens, k=4), 1.5)
    assert [h.kind for h in st.hints] == ["fanout", "keepalive", "fanout", "fanout"]
    # a client reusing a message id for another kind of action: not taken for a repeat
    st.record_hint(HintRequest(kind="keepalive", input_ids=tokens, ttl_s=3, hint_id="m-1/a-0"), 1.6)
    assert [h.kind for h in st.hints][-1] == "keepalive" and len(st.hints) == 5
    st.demand.check_integrity()
    # past the hit window the id is forgotten with the rest of the demand
    st.tick(1.5 + st.config.hit_window_s + 1.0)
    assert st.demand.hint_ids == {} or all(r.time_s > 1.5 for r in st.demand.hint_ids.values())


def test_a_worker_hint_out_of_bounds_is_refused_and_answered_with_an_error():
    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=0)
    too_long = [1] * (st.config.max_prompt_tokens + 1)
    out = st.handle(b"A", p.HintReported(worker_id="a", seq=3, namespace="", token_ids=too_long, kind="fanout",
                                         k=2), 1.0)
    assert len(out) == 1 and isinstance(out[0][1], p.Error) and out[0][1].in_reply_to == "HintReported"
    assert len(st.hints) == 0 and st.num_refused_facts == {"HintReported": 1}
