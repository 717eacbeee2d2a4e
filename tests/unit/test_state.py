import dataclasses
import json

import msgspec
import pytest

from radix_sync import api
from radix_sync import protocol as p
from radix_sync.coordinator.state import AdminError, ClusterState, StateConfig
from radix_sync.integrity import IntegrityError
from radix_sync.hashing import page_hashes
from tests.util import integrity_errors_under_python_O

PS = 4


def arrival(**fields) -> api.ArrivalReport:
    """An arrival report as the admin API decodes it from the router's JSON."""
    return api.convert(fields, api.ArrivalReport)


def record_batch(st, body: dict, now_s: float):
    """`POST /arrivals` without HTTP: the body decoded as the admin API does (each report on its own), then
    recorded. Returns: (arrivals recorded, finishes recorded, errors)."""
    batch = api.decode(json.dumps(body).encode(), api.DemandItems)
    return st.record_demand([] if batch.arrivals is api.UNSET else batch.arrivals,
                            [] if batch.finishes is api.UNSET else batch.finishes, now_s)


def hello(wid, fp="f", ps=PS):
    return p.Hello(worker_id=wid, http_url=f"http://{wid}", data_endpoint=f"tcp://{wid}:1", fingerprint=fp,
                   fingerprint_fields={"fp": fp, "page_size": str(ps)}, page_size=ps, pool_capacity_tokens=1000,
                   replica_budget_tokens=250)


def stored(wid, seq, tokens, ns=""):
    hashes = page_hashes(tokens, PS, ns)
    blocks = [p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS])
              for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
    return p.PagesStored(worker_id=wid, seq=seq, namespace=ns, blocks=blocks)


@pytest.fixture
def st():
    s = ClusterState(StateConfig(worker_timeout_s=5.0, replication_timeout_s=10.0))
    assert isinstance(s.handle(b"A", hello("a"), 0.0)[0][1], p.HelloAck)
    assert isinstance(s.handle(b"B", hello("b"), 0.0)[0][1], p.HelloAck)
    return s


def test_facts_build_the_directory(st):
    toks = list(range(12))
    assert st.handle(b"A", stored("a", 1, toks), 1.0) == []
    assert st.lookup(toks + [99], "") == {"a": 12, "b": 0}
    st.handle(b"A", p.PagesRemoved(worker_id="a", seq=2, block_hashes=page_hashes(toks, PS)[1:]), 2.0)
    assert st.lookup(toks, "") == {"a": 4, "b": 0}
    st.check_integrity()


def test_unknown_sender_and_sequence_gap_ask_for_resync(st):
    toks = list(range(8))
    reply = st.handle(b"X", stored("x", 1, toks), 1.0)
    assert isinstance(reply[0][1], p.ResyncRequested)
    st.handle(b"A", stored("a", 1, toks), 1.0)
    reply = st.handle(b"A", stored("a", 5, toks), 1.0)   # seq 2..4 lost
    assert isinstance(reply[0][1], p.ResyncRequested) and "gap" in reply[0][1].reason
    assert st.lookup(toks, "") == {"a": 0, "b": 0}       # forgotten until the resync
    st.check_integrity()


def test_replication_lifecycle(st):
    toks = list(range(10))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    rep, rid, expect = st.request_replication("a", "b", toks, "", 30.0, now_s=2.0)
    # the target is told first, with the page hashes it may accept and a one-time token
    assert rid == b"B" and isinstance(expect, p.ExpectReplica) and rep.num_tokens == 8 and rep.state == "pending"
    assert expect.block_hashes == page_hashes(toks[:8], PS) and expect.source_id == "a" and len(expect.auth_token) == 32
    assert not expect.critical  # a speculative copy: the target inserts it below every ordinary entry
    _, _, pulled = st.request_replication("a", "b", toks, "", 30.0, now_s=2.0, origin="pull")
    assert pulled.critical  # a router's pull: the target inserts it as ordinary cache (a request waits for it)
    assert not expect.ordinary and not pulled.ordinary
    _, _, kept = st.request_replication("a", "b", toks, "", 30.0, now_s=2.0, origin="kvrep_lru", ordinary=True)
    assert kept.ordinary and not kept.critical  # a policy's copy landed as ordinary cache (`kvrep_lru`)
    # only once it says it expects the transfer does the source get the command, with the same token
    [(src_rid, cmd)] = st.handle(b"B", p.ReplicaExpected(worker_id="b", seq=1, replication_id=rep.id), 2.05)
    assert src_rid == b"A" and isinstance(cmd, p.ReplicatePages) and cmd.token_ids == toks[:8]
    assert cmd.auth_token == expect.auth_token
    assert st.handle(b"B", p.ReplicaExpected(worker_id="b", seq=2, replication_id=rep.id), 2.06) == []  # once
    st.handle(b"A", p.SourceSent(worker_id="a", seq=2, replication_id=rep.id, num_tokens=8, num_bytes=64,
                                 gather_s=0.1, send_s=0.2), 2.1)
    assert rep.state == "running"
    st.handle(b"B", p.ReplicaStored(worker_id="b", seq=3, replication_id=rep.id, namespace="",
                                    block_hashes=page_hashes(toks, PS), inserted_len=8, expires_in_s=30.0,
                                    num_bytes=64, receive_s=0.1, scatter_s=0.1, insert_s=0.1), 2.5)
    assert rep.state == "done" and rep.to_json()["total_s"] == pytest.approx(0.5)
    assert st.lookup(toks, "") == {"a": 8, "b": 8}
    assert st.directory.replicas() == {("b", rep.id): {"num_pages": 2, "expires_at_s": 32.5}}
    # the expiry evicted its tail only (its head is under a running request, or SGLang took the tail earlier): the
    # pages leave the directory by the worker's PagesRemoved, what it kept stays, as ordinary cache
    st.handle(b"B", p.PagesRemoved(worker_id="b", seq=4, block_hashes=page_hashes(toks, PS)[1:]), 40.0)
    st.handle(b"B", p.ReplicaExpired(worker_id="b", seq=5, replication_id=rep.id, num_evicted_tokens=4), 40.0)
    assert st.lookup(toks, "") == {"a": 8, "b": 4} and st.directory.replicas() == {}
    assert st.directory.holders(page_hashes(toks, PS)[0])["b"].expires_at_s is None
    st.check_integrity()


def test_a_replica_held_past_its_ttl_is_re_reported_due_never_extended(st):
    toks = list(range(8))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    rep, _, _ = st.request_replication("a", "b", toks, "", 30.0, now_s=2.0)
    st.handle(b"B", p.ReplicaExpected(worker_id="b", seq=1, replication_id=rep.id), 2.05)
    landed = p.ReplicaStored(worker_id="b", seq=2, replication_id=rep.id, namespace="",
                             block_hashes=page_hashes(toks, PS), inserted_len=8, expires_in_s=30.0,
                             num_bytes=64, receive_s=0.1, scatter_s=0.1, insert_s=0.1)
    st.handle(b"B", landed, 2.5)
    # at 40 s (past 32.5) the worker still holds it for a queued request, and a resync re-reports it, 0 s left
    assert st.handle(b"B", msgspec.structs.replace(landed, seq=3, expires_in_s=0.0), 40.0) == []
    assert st.directory.replicas() == {("b", rep.id): {"num_pages": 2, "expires_at_s": 32.5}}  # not extended
    # a re-report claiming time left after the expiry is a resurrection: refused
    [(_, err)] = st.handle(b"B", msgspec.structs.replace(landed, seq=4, expires_in_s=30.0), 41.0)
    assert isinstance(err, p.Error) and "expired" in err.error
    assert st.directory.replicas() == {("b", rep.id): {"num_pages": 2, "expires_at_s": 32.5}}
    st.check_integrity()



def test_a_replica_extended_by_a_later_request_becomes_ordinary_cache_with_no_use_counted(st):
    """At its expiry the worker found the replica extended by a later request (`ReplicaTable.take_extended`): it
    says so with a promotion of no tokens. The directory keeps the pages as the worker's own cache (no replica
    role, no expiry); the replication's record counts no use (the request may have computed them itself)."""
    toks = list(range(8))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    rep, _, _ = st.request_replication("a", "b", toks, "", 30.0, now_s=2.0)
    st.handle(b"B", p.ReplicaExpected(worker_id="b", seq=1, replication_id=rep.id), 2.05)
    st.handle(b"B", p.ReplicaStored(worker_id="b", seq=2, replication_id=rep.id, namespace="",
                                    block_hashes=page_hashes(toks, PS), inserted_len=8, expires_in_s=30.0,
                                    num_bytes=64, receive_s=0.1, scatter_s=0.1, insert_s=0.1), 2.5)
    assert st.directory.replicas() == {("b", rep.id): {"num_pages": 2, "expires_at_s": 32.5}}
    assert st.handle(b"B", p.ReplicaPromoted(worker_id="b", seq=3, replication_id=rep.id,
                                             num_promoted_tokens=0), 33.0) == []
    assert st.directory.replicas() == {} and st.lookup(toks, "") == {"a": 8, "b": 8}
    assert rep.promoted_tokens == 0
    st.check_integrity()

def test_admin_refusals(st):
    st.handle(b"C", hello("c", fp="other"), 0.0)
    st.handle(b"A", stored("a", 1, list(range(8))), 0.0)
    with pytest.raises(AdminError, match="fingerprint mismatch"):
        st.request_replication("a", "c", list(range(8)), "", 1.0, 0.0)
    # a source that does not hold the prefix is never handed the transfer token
    with pytest.raises(AdminError, match="'b' holds no page of this prefix"):
        st.request_replication("b", "a", list(range(8)), "", 1.0, 0.0)
    with pytest.raises(AdminError, match="'a' holds no page of this prefix"):
        st.request_replication("a", "b", list(range(100, 108)), "", 1.0, 0.0)
    with pytest.raises(AdminError, match="unknown worker"):
        st.request_replication("a", "zz", list(range(8)), "", 1.0, 0.0)
    with pytest.raises(AdminError, match="same worker"):
        st.request_replication("a", "a", list(range(8)), "", 1.0, 0.0)
    with pytest.raises(AdminError, match="shorter than one page"):
        st.request_replication("a", "b", [1, 2], "", 1.0, 0.0)
    for bad in ([1, -2, 3, 4], [1, 2, 2 ** 64, 4], [1, True, 3, 4], [1, 2, 2 ** 31, 4], [1, 2 ** 40, 3, 4]):
        with pytest.raises(AdminError, match=r"integers in \[0, 2147483648\)"):
            st.request_replication("a", "b", bad, "", 1.0, 0.0)
    assert st.replications == {}
    # what the source holds is what is copied (the rest of a longer prompt is not)
    rep, _, expect = st.request_replication("a", "b", list(range(8)) + [50] * 8, "", 1.0, 0.0)
    assert rep.num_tokens == 8 and expect.block_hashes == page_hashes(list(range(8)), PS)


def test_silent_worker_is_dropped_and_its_replications_fail(st):
    toks = list(range(8))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    rep, _, _ = st.request_replication("a", "b", toks, "", 30.0, now_s=1.0)
    st.handle(b"B", p.LoadReported(worker_id="b", seq=1, num_running_reqs=0, num_waiting_reqs=0,
                                   num_waiting_tokens=0, available_tokens=10, evictable_tokens=0,
                                   replica_tokens=0), 5.5)
    st.tick(7.0)   # a silent since 1.0
    assert set(st.workers) == {"b"} and rep.state == "failed" and "silent" in rep.error
    assert st.lookup(toks, "") == {"b": 0}
    st.check_integrity()


def test_replication_timeout(st):
    toks = list(range(8))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    rep, _, _ = st.request_replication("a", "b", toks, "", 30.0, now_s=1.0)
    for t in (2.0, 4.0, 6.0, 8.0, 10.0):
        for wid, rid in (("a", b"A"), ("b", b"B")):
            st.handle(rid, p.LoadReported(worker_id=wid, seq=st.workers[wid].last_seq + 1, num_running_reqs=0,
                                          num_waiting_reqs=0, num_waiting_tokens=0, available_tokens=0,
                                          evictable_tokens=0, replica_tokens=0), t)
    st.tick(11.5)
    assert rep.state == "failed" and "timed out" in rep.error


def test_protocol_version_and_rehello(st):
    bad = hello("z")
    bad.protocol_version = 99
    assert isinstance(st.handle(b"Z", bad, 0.0)[0][1], p.Error)
    toks = list(range(8))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    st.handle(b"A2", hello("a"), 2.0)  # restarted worker, new socket identity
    assert st.lookup(toks, "") == {"a": 0, "b": 0}
    assert st.handle(b"A2", stored("a", 1, toks), 2.0) == []
    st.check_integrity()


def test_a_rehello_with_new_weights_fails_its_copies_in_flight_at_once(st):
    toks = list(range(8))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    same, _, _ = st.request_replication("a", "b", toks, "", 30.0, now_s=1.0)
    st.handle(b"B", hello("b"), 1.5)  # a reconnect, same weights: the copy goes on
    assert same.in_flight
    st.handle(b"B", hello("b", fp="g"), 2.0)  # a weight update re-announced
    assert same.state == "failed" and "fingerprint" in same.error and same.finished_s == 2.0
    st.check_integrity()


def test_demand_events_nobody_reads_are_forgotten_after_the_hit_window(st):
    """The rules and none policies never drain the planner's demand events: they must not pile up."""
    toks = list(range(40))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    for i in range(50):
        st.record_arrival(arrival(input_ids=toks + [100 + i] * 8, worker="a"), 2.0 + i)
    assert len(st.demand_events) == 50
    st.tick(2.0 + 49 + st.config.hit_window_s - 10)  # the first ~10 are older than the window now
    assert 8 <= len(st.demand_events) < 50
    st.tick(2.0 + 49 + st.config.hit_window_s + 1)
    assert len(st.demand_events) == 0
    st.check_integrity()


def test_an_arrival_counts_for_the_prefix_it_reuses(st):
    trunk = list(range(12))
    # nothing holds it yet: the arrival shows no reuse (a one-off prompt must not look popular)
    first = st.record_arrival(arrival(input_ids=trunk, worker="a"), 1.0)
    assert first.block_hash is None and first.prompt_len == 12
    st.handle(b"A", stored("a", 1, trunk), 1.5)
    # a branch (trunk + 8 new tokens) counts for the trunk, which a worker holds, not for its own new pages
    branch = st.record_arrival(arrival(input_ids=trunk + [50, 51, 52, 53, 54, 55, 56, 57], worker="b"), 2.0)
    assert branch.block_hash == page_hashes(trunk, PS)[-1] and branch.prompt_len == 20
    # a prompt sharing only the first page counts for that page
    other = st.record_arrival(arrival(input_ids=trunk[:4] + [90] * 8), 3.0)
    assert other.block_hash == page_hashes(trunk, PS)[0]
    assert st.record_arrival(arrival(input_ids=[1, 2]), 4.0).block_hash is None


def test_a_router_batch_replays_in_report_order_and_drops_only_its_bad_items(st):
    toks = list(range(12))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    hashes = page_hashes(toks, PS)
    # the finish was reported before the arrival (seq), though it sits in the other list
    record_batch(st, {"arrivals": [{"input_ids": toks + [50] * 4, "worker": "a", "class": "acme", "seq": 2}],
                      "finishes": [{"page_hashes": hashes, "page_size": PS, "worker": "a", "stop": "tool_use",
                                    "class": "acme", "seq": 1}]}, 2.0)
    assert [kind for kind, *_ in st.demand_events] == ["finish", "arrival"]
    fin = st.finishes[-1]
    assert (fin.block_hash, fin.num_pages, fin.stop, fin.class_key) == (hashes[-1], 3, "tool_use", "acme")
    assert st.arrivals[-1].block_hash == hashes[-1] and st.arrivals[-1].class_key == "acme"
    # an arrival given as the router's page hashes is the same arrival, not rehashed
    record_batch(st, {"arrivals": [{"page_hashes": hashes + [123], "page_size": PS, "prompt_len": 17,
                                    "worker": "a"}]}, 2.2)
    assert (st.arrivals[-1].block_hash, st.arrivals[-1].prompt_len) == (hashes[-1], 17)
    # a finish given as token ids hashes them at the worker's page size
    record_batch(st, {"finishes": [{"input_ids": toks, "worker": "a"}]}, 2.5)
    assert st.finishes[-1].block_hash == hashes[-1] and st.finishes[-1].stop is None
    # a bad item is dropped and named; the good items of its batch (other tenants' signals) are recorded
    bad = [
        ([], [{"page_hashes": hashes, "page_size": 8, "worker": "a"}], "finishes[0]: page_size 8 is not worker a's (4)"),
        ([], [{"page_hashes": [2 ** 63], "page_size": PS}],
         "finishes[0]: Expected `int` <= 9223372036854775807 - at `$.page_hashes[0]`"),
        ([], [{"input_ids": toks, "stop": 3}], "finishes[0]: Expected `str | null`, got `int` - at `$.stop`"),
        ([], [{"input_ids": toks, "stop": "x" * 65}], "finishes[0]: Expected `str` of length <= 64 - at `$.stop`"),
        ([{"input_ids": "x"}], [], "arrivals[1]: Expected `array`, got `str` - at `$.input_ids`"),
        ([{"input_ids": [1, -2]}], [], "arrivals[1]: Expected `int` >= 0 - at `$.input_ids[1]`"),
        ([{"input_ids": [1, 2 ** 31]}], [], "arrivals[1]: Expected `int` <= 2147483647 - at `$.input_ids[1]`"),
        ([{"input_ids": [1, True]}], [], "arrivals[1]: Expected `int`, got `bool` - at `$.input_ids[1]`"),
        ([{"input_ids": toks, "class": ["x"]}], [], "arrivals[1]: Expected `str | null`, got `array` - at `$.class`"),
        ([{"input_ids": toks, "session_id": "s" * 257}], [], "arrivals[1]: Expected `str` of length <= 256"),
        ([{"input_ids": toks, "seq": "1"}], [], "arrivals[1]: Expected `int | float`, got `str` - at `$.seq`"),
        ([{"page_hashes": hashes, "page_size": PS}], [], "arrivals[1]: prompt_len must be"),
        ([{"worker": "a"}], [], "arrivals[1]: input_ids must be a list of integers"),
        ([], ["nope"], "finishes[0]: Expected `object`, got `str`"),
    ]
    for arrivals, finishes, msg in bad:
        before = (len(st.arrivals), len(st.finishes))
        num_a, num_f, errors = record_batch(st, {"arrivals": [{"input_ids": toks, "class": "other-tenant"}, *arrivals],
                                                 "finishes": finishes}, 3.0)
        assert (num_a, num_f) == (1, 0) and len(errors) == 1 and msg in errors[0], (msg, errors)
        assert (len(st.arrivals), len(st.finishes)) == (before[0] + 1, before[1])
        assert st.arrivals[-1].class_key == "other-tenant"
    # a prompt longer than max_prompt_tokens is refused before it is hashed
    small = ClusterState(StateConfig(max_prompt_tokens=8))
    assert "more than max_prompt_tokens=8" in record_batch(small, {"arrivals": [{"input_ids": list(range(9))}]},
                                                           0.0)[2][0]


def test_demand_events_are_bounded_when_no_policy_drains_them():
    s = ClusterState(StateConfig(max_demand_events=3))
    s.handle(b"A", hello("a"), 0.0)
    for i in range(5):
        s.record_arrival(arrival(input_ids=list(range(8)), worker="a"), float(i))
    assert len(s.demand_events) == 3 and s.demand_events[0][1].time_s == 2.0
    with pytest.raises(ValueError, match="max_demand_events"):
        StateConfig(max_demand_events=0)


def corruptions():
    """(what is broken, how to break a healthy state), one per owner and one across owners."""
    def routing(s):
        s._workers._by_routing[b"ZZ"] = "a"

    def worker_key(s):
        s._workers.records["z"] = dataclasses.replace(s._workers.records["a"], routing_id=b"Z")
        s._workers._by_routing[b"Z"] = "z"

    def replication_state(s):
        next(iter(s.replications.values())).state = "lost"

    def replication_finish(s):
        next(iter(s.replications.values())).finished_s = 3.0

    def event(s):
        kind, rec, hashes, held, copies = s.demand_events[-1]
        s.demand_events[-1] = (kind, rec, hashes, len(hashes) + 1, copies)

    def hint_times(s):
        del next(iter(s.hint_times.values()))["hint_s"]

    def directory(s):
        s.directory._by_worker["a"].add(12345)

    def unknown_holder(s):
        s._workers.remove("b")

    return [("socket", routing), ("holds the record", worker_key), ("unknown state", replication_state),
            ("finished_s", replication_finish), ("arrival event holds", event), ("no hint time", hint_times),
            ("unknown page 12345", directory), ("pages of unknown worker b", unknown_holder)]


def corruptible(st):
    toks = list(range(12))
    st.handle(b"A", stored("a", 1, toks), 1.0)
    st.handle(b"B", stored("b", 1, toks[:8]), 1.0)
    st.request_replication("a", "b", toks, "", 30.0, now_s=1.5)
    st.record_arrival(arrival(input_ids=toks, worker="a"), 2.0)
    st.record_hint({"kind": "fanout", "input_ids": toks, "k": 2}, 2.0)
    st.check_integrity()
    return st


@pytest.mark.parametrize("needle,corrupt", corruptions(), ids=[n for n, _ in corruptions()])
def test_check_integrity_raises_on_a_corrupted_state(st, needle, corrupt):
    corruptible(st)
    corrupt(st)
    with pytest.raises(IntegrityError, match=needle):
        st.check_integrity()


def consistent_state():
    """Two workers and one of every record the corruptions break, every invariant holding."""
    s = ClusterState(StateConfig())
    s.handle(b"A", hello("a"), 0.0)
    s.handle(b"B", hello("b"), 0.0)
    return corruptible(s)


def test_check_integrity_is_not_an_assert_it_holds_under_python_O():
    """The same corruptions raise with assertions compiled out (the coordinator's /status relies on it)."""
    assert integrity_errors_under_python_O("tests.unit.test_state", "consistent_state") == (1, len(corruptions()))
