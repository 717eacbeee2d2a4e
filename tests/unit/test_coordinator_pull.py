"""The coordinator's side of a router's pull (`radix_sync.coordinator.pull`): which critical copies it refuses, and
the long poll the router waits on, on a real `ClusterState` fed worker facts (no sockets)."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from radix_sync import api
from radix_sync import protocol as p
from radix_sync.api import AdminError
from radix_sync.coordinator.pull import check_critical, room_for_critical, wait_replication
from radix_sync.coordinator.state import ClusterState, StateConfig
from radix_sync.hashing import page_hashes
from tests.unit.test_state import hello, stored


@pytest.fixture
def st():
    s = ClusterState(StateConfig(worker_timeout_s=5.0, replication_timeout_s=10.0))
    s.handle(b"A", hello("a"), 0.0)  # replica budget 250 tokens each
    s.handle(b"B", hello("b"), 0.0)
    s.handle(b"A", stored("a", 1, list(range(40))), 1.0)  # a holds 40 tokens (10 pages of 4)
    return s


def critical(tokens, source="a", target="b", ns=None):
    return api.ReplicateRequest(source=source, target=target, input_ids=tokens, cache_salt=ns, critical=True)


def test_a_copy_the_source_holds_with_room_at_the_target_passes(st):
    check_critical(st, critical(list(range(40)) + [7, 7]), "active")  # 40 page-aligned tokens, all held
    check_critical(st, critical(list(range(12))), "active")


@pytest.mark.parametrize("req, mode, needle", [
    (critical(list(range(40))), "shadow", "shadow mode"),
    (critical(list(range(36)) + [99, 98, 97, 96]), "active", "holds 36 of the 40"),  # the prompt diverges
    (critical(list(range(40)), ns="other"), "active", "holds 0 of the 40"),  # another tenant's pages
    (critical(list(range(40)), source="b", target="a"), "active", "holds 0 of the 40"),
])
def test_a_copy_that_cannot_help_is_refused_with_409(st, req, mode, needle):
    with pytest.raises(AdminError, match=needle) as exc:
        check_critical(st, req, mode)
    assert exc.value.status == 409


def seq(st, wid):
    """The worker's next fact number (a gap would ask it to resync, dropping the fact)."""
    return st.workers[wid].last_seq + 1


def load(st, wid, replica_tokens, now_s):
    st.handle(wid.upper().encode(), p.LoadReported(worker_id=wid, seq=seq(st, wid), num_running_reqs=0,
                                                   num_waiting_reqs=0, num_waiting_tokens=0, available_tokens=900,
                                                   evictable_tokens=0, replica_tokens=replica_tokens), now_s)


def landed(st, tokens, origin, now_s, ttl_s=30.0):
    """A copy of `tokens` from a to b by `origin`, landed at `now_s` as a replica on b. Returns: its id."""
    st.handle(b"A", stored("a", seq(st, "a"), tokens), now_s)
    rep, _, _ = st.request_replication("a", "b", tokens, "", ttl_s, now_s, origin=origin)
    st.handle(b"B", p.ReplicaExpected(worker_id="b", seq=seq(st, "b"), replication_id=rep.id), now_s)
    st.handle(b"B", p.ReplicaStored(worker_id="b", seq=seq(st, "b"), replication_id=rep.id, namespace="",
                                    block_hashes=page_hashes(tokens, 4), inserted_len=len(tokens),
                                    expires_in_s=ttl_s, num_bytes=64, receive_s=0.1, scatter_s=0.1, insert_s=0.1),
              now_s)
    assert rep.state == "done"
    return rep.id


def test_the_target_budget_counts_live_replicas_and_copies_in_flight(st):
    toks = list(range(40))
    load(st, "b", 200, 2.0)
    assert room_for_critical(st, critical(toks), {}) == []  # 250 - 200 = 50 >= 40
    st.request_replication("a", "b", toks[:12], "", 30.0, 2.0)  # 12 tokens headed for b
    with pytest.raises(AdminError, match=r"room for 38 replica tokens, the copy needs 40 \(budget 250, live 200, "
                                         r"in flight 12; speculative replicas there: 0 tokens\)") as exc:
        room_for_critical(st, critical(toks), {})  # the 200 are no replica the directory knows: nothing can go
    assert exc.value.status == 409
    assert room_for_critical(st, critical(toks[:36]), {}) == []


def test_speculative_replicas_make_way_for_a_pull_soonest_to_expire_first_pulled_ones_never(st):
    toks = list(range(40))
    late = landed(st, list(range(100, 180)), "kvrep", 2.0, ttl_s=60.0)  # 80 tokens, expires at 62
    soon = landed(st, list(range(200, 280)), "kvrep", 2.0, ttl_s=20.0)  # 80 tokens, expires at 22
    landed(st, list(range(300, 380)), "pull", 2.0, ttl_s=5.0)  # a pull's: its request may be queued for it
    load(st, "b", 240, 3.0)
    dropping = {}
    assert room_for_critical(st, critical(toks), dropping) == [soon]  # 10 free + 80: as few as needed
    assert dropping == {"b": {soon: 80}}
    # until b confirms, what was asked to go counts as gone: a second pull takes the next one, not the same
    assert room_for_critical(st, critical(list(range(40)) + list(range(40, 80))), dropping) == []  # 90 free
    with pytest.raises(AdminError, match="speculative replicas there: 80 tokens"):
        room_for_critical(st, critical(toks * 5), dropping)  # 200 tokens: 90 + the last speculative 80 < 200
    assert dropping == {"b": {soon: 80}}  # a refusal drops nothing
    # b confirms (its report no longer counts it, the directory forgets it): forgotten here too
    st.handle(b"B", p.ReplicaExpired(worker_id="b", seq=seq(st, "b"), replication_id=soon, num_evicted_tokens=80), 4.0)
    load(st, "b", 160, 4.1)
    assert room_for_critical(st, critical(toks * 3), dropping) == [late] and dropping == {"b": {late: 80}}


def test_a_pulled_replica_whose_request_went_elsewhere_makes_way_first(st):
    spec = landed(st, list(range(100, 180)), "kvrep", 2.0, ttl_s=20.0)
    pulled = landed(st, list(range(200, 280)), "pull", 2.0, ttl_s=30.0)
    load(st, "b", 160, 3.0)
    st.replications[pulled].num_waiting = 1  # its router still waits (it landed in time): not it
    assert room_for_critical(st, critical(list(range(40)) * 3), {}) == [spec]
    st.replications[pulled].num_waiting, st.replications[pulled].num_abandoned = 0, 1  # it fell back at its deadline
    assert room_for_critical(st, critical(list(range(40)) * 3), {}) == [pulled]  # before the speculative one


def test_the_admin_replicate_drops_the_replicas_it_made_room_with_before_granting_the_pull(tmp_path):
    import time

    from radix_sync.coordinator.server import Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", admin_port=0, policy="none", mode="active",
                                          state_dir=str(tmp_path)))
    try:
        now = time.monotonic()
        for wid in ("a", "b"):
            coord.state.handle(wid.upper().encode(), hello(wid), now)
        spec = landed(coord.state, list(range(100, 320)), "kvrep", now)  # 220 of b's 250
        load(coord.state, "b", 220, now)
        coord.state.handle(b"A", stored("a", seq(coord.state, "a"), list(range(40))), now)
        sent = []
        coord.send = lambda rid, msg: sent.append((rid, msg))
        info = coord.admin_replicate(critical(list(range(40))))
        assert [(rid, type(msg).__name__) for rid, msg in sent] == [(b"B", "DropReplica"), (b"B", "ExpectReplica")]
        assert sent[0][1].replication_id == spec and info.origin == "pull" and coord.num_critical_preempted == 1
    finally:
        coord._sock.close(0)
        coord._ctx.term()


def test_unknown_workers_are_left_to_request_replication(st):
    check_critical(st, critical(list(range(40)), source="zz"), "active")  # no refusal here ...
    with pytest.raises(AdminError) as exc:  # ... the usual 404
        st.request_replication("zz", "b", list(range(40)), "", 30.0, 2.0)
    assert exc.value.status == 404


def _coord(st):
    sent = []
    return SimpleNamespace(lock=threading.Lock(), state=st, sent=sent, send=lambda rid, msg: sent.append((rid, msg)))


def test_the_wait_answers_when_the_copy_is_done_and_at_the_deadline_else(st):
    coord = _coord(st)
    rep, _, _ = st.request_replication("a", "b", list(range(40)), "", 30.0, 2.0)

    async def land_then_wait():
        async def land():
            await asyncio.sleep(0.05)
            with coord.lock:  # the target expects it, then the copy lands with the granted pages
                st.handle(b"B", p.ReplicaExpected(worker_id="b", seq=1, replication_id=rep.id), 2.5)
                st.handle(b"B", p.ReplicaStored(worker_id="b", seq=2, replication_id=rep.id, namespace="",
                                                block_hashes=page_hashes(list(range(40)), 4), inserted_len=40,
                                                expires_in_s=30.0, num_bytes=40, receive_s=0.0, scatter_s=0.0,
                                                insert_s=0.0), 3.0)
        task = asyncio.create_task(land())
        info = await wait_replication(coord, api.ReplicationWaitRequest(id=rep.id, wait_s=10.0))
        await task
        return info
    info = asyncio.run(land_then_wait())
    assert (info.id, info.state, info.inserted_len) == (rep.id, "done", 40)

    other, _, _ = st.request_replication("a", "b", list(range(8)), "", 30.0, 2.0)
    info = asyncio.run(wait_replication(coord, api.ReplicationWaitRequest(id=other.id, wait_s=0.0)))
    assert info.state == "pending"  # the deadline came first: the answer says so
    assert (other.num_abandoned, other.num_waiting) == (1, 0) and (rep.num_abandoned, rep.num_waiting) == (0, 0)
    with pytest.raises(AdminError, match="unknown replication") as exc:
        asyncio.run(wait_replication(coord, api.ReplicationWaitRequest(id="r0-nope", wait_s=0.0)))
    assert exc.value.status == 404


def test_the_wait_request_is_bounded():
    with pytest.raises(AdminError, match="wait_s"):
        api.convert({"id": "r1", "wait_s": 31}, api.ReplicationWaitRequest)
    with pytest.raises(AdminError, match="id"):
        api.convert({"id": "x" * 65}, api.ReplicationWaitRequest)


def test_a_pull_of_a_prefix_already_headed_for_its_target_joins_that_copy(st):
    """Two routers (or two sibling requests) pull the same prefix to the same target: the second waits for the
    first copy; another prefix, another target, another tenant or a finished copy: a copy of its own."""
    from radix_sync.coordinator.pull import critical_prefix_hash, join_critical

    toks = list(range(40))
    h = critical_prefix_hash(st, critical(toks + [7, 7]))
    assert h == page_hashes(toks, 4)[-1]  # page-aligned, at the source's page size
    assert join_critical(st, critical(toks), h) is None  # nothing in flight yet
    rep, _, _ = st.request_replication("a", "b", toks, "", 30.0, 2.0, origin="pull", block_hash=h)
    assert join_critical(st, critical(toks + [5]), critical_prefix_hash(st, critical(toks + [5]))) is rep
    shorter = critical(toks[:36])
    assert join_critical(st, shorter, critical_prefix_hash(st, shorter)) is None  # another prefix
    st.handle(b"C", hello("c"), 2.0)
    assert join_critical(st, critical(toks, target="c"), h) is None
    assert join_critical(st, critical(toks, ns="t2"), critical_prefix_hash(st, critical(toks, ns="t2"))) is None
    rep.state = "done"
    assert join_critical(st, critical(toks), h) is None
    assert critical_prefix_hash(st, critical([1, 2])) is None and critical_prefix_hash(st, critical(toks, "zz")) is None


def test_the_admin_replicate_of_two_routers_pulls_makes_one_copy(tmp_path):
    import time

    from radix_sync.coordinator.server import Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", admin_port=0, policy="none", mode="active",
                                          state_dir=str(tmp_path)))
    try:
        now = time.monotonic()
        coord.state.handle(b"A", hello("a"), now)
        coord.state.handle(b"B", hello("b"), now)
        coord.state.handle(b"A", stored("a", 1, list(range(40))), now)
        first = coord.admin_replicate(critical(list(range(40)) + [1]))
        second = coord.admin_replicate(critical(list(range(40)) + [2]))
        assert second.id == first.id and coord.num_critical_joined == 1
        assert [r.origin for r in coord.state.replications.values()] == ["pull"]
        third = coord.admin_replicate(critical(list(range(40)), target="b", ns=None))
        assert third.id == first.id
        plain = coord.admin_replicate(api.ReplicateRequest(source="a", target="b", input_ids=list(range(40))))
        assert plain.id != first.id  # an admin's copy is its own (not a pull)
    finally:
        coord._sock.close(0)
        coord._ctx.term()


def test_pulls_are_a_bet_the_pull_ledger_holds_some_out_and_pauses_them_all_when_they_cost(st):
    """Inert unless it pays, for reactive copies too: a share of the prefixes pulls are asked for is held out
    (409: the router routes by its ranking instead); answers on pulled prefixes and on held-out ones are compared;
    once pulls are shown to cost, every new pull is held out (inert: routing only) until the evidence ages out."""
    from radix_sync.policy.ledger import COPIED, HELD_OUT
    from radix_sync.coordinator.pull import ledger_allows_pull

    groups = {COPIED: [], HELD_OUT: []}
    for i in range(400):  # distinct prefixes (one each, as sessions'), drawn into the two groups by their hash
        h = 10_000 + i
        try:
            ledger_allows_pull(st, h, 5.0)
            groups[COPIED].append(h)
        except AdminError as exc:
            assert exc.status == 409 and "not made, to measure" in str(exc)
            groups[HELD_OUT].append(h)
    assert 0.1 < len(groups[HELD_OUT]) / 400 < 0.3  # the default holdout, 0.2
    ledger_allows_pull(st, groups[COPIED][0], 6.0)  # a prefix keeps its group
    # answers: pulled prefixes answer in 2 s, held-out ones in 1 s: pulls cost
    for group, ttft in ((COPIED, 2.0), (HELD_OUT, 1.0)):
        for j, h in enumerate(groups[group][:40]):
            assert st.pull_ledger.finished([h], ttft + 0.01 * (j % 5), 7.0) == group
    assert st.pull_ledger.verdict(7.0)[0] == "costs"
    with pytest.raises(AdminError, match="pulls are paused") as exc:
        ledger_allows_pull(st, 99_999, 8.0)  # a new prefix: held out while paused
    assert exc.value.status == 409
    assert st.ledger.verdict(8.0)[0] == "not shown"  # the planner's ledger is another one
    ledger_allows_pull(st, None, 8.0)  # no prefix (shorter than a page): nothing to draw


def test_a_routers_finish_report_is_evidence_for_the_pull_ledger(st):
    from radix_sync.coordinator.pull import ledger_allows_pull

    tokens = list(range(40))
    try:  # whichever group the prefix draws, its answers count there
        ledger_allows_pull(st, page_hashes(tokens, 4)[-1], 5.0)
    except AdminError:
        pass
    st.record_demand([], [{"input_ids": tokens + [1, 2, 3, 4], "worker": "b", "ttft_s": 0.5}], 6.0)
    groups = st.pull_ledger.status(6.0)["groups"]
    assert sum(g["answers"] for g in groups.values()) == 1


def test_a_wait_on_a_speculative_copy_tells_its_target_once_that_a_request_wants_it(st):
    """A router holding a request for a planner's copy waits on it (`want`): the coordinator tells the copy's target
    once (`WantReplica`: land it, or raise it, as ordinary cache, as a pull: evict-first, the next allocation would
    take it before the request is admitted); a pull's own copy lands so already, and a failed one is not there to
    want."""
    coord = _coord(st)
    rep, _, _ = st.request_replication("a", "b", list(range(40)), "", 30.0, 2.0, origin="kvrep")  # the planner
    asyncio.run(wait_replication(coord, api.ReplicationWaitRequest(id=rep.id, wait_s=0.0)))
    assert coord.sent == [] and not rep.wanted  # an admin's wait (no request waits): the copy stays as it is
    for _ in range(2):
        info = asyncio.run(wait_replication(coord, api.ReplicationWaitRequest(id=rep.id, wait_s=0.0, want=True)))
        assert info.state == "pending"
    assert [(rid, msg) for rid, msg in coord.sent] == [(b"B", p.WantReplica(replication_id=rep.id))] and rep.wanted
    pulled, _, _ = st.request_replication("a", "b", list(range(8)), "", 30.0, 2.0, origin="pull")
    asyncio.run(wait_replication(coord, api.ReplicationWaitRequest(id=pulled.id, wait_s=0.0, want=True)))
    failed, _, _ = st.request_replication("a", "b", list(range(12)), "", 30.0, 2.0)
    failed.state = "failed"
    asyncio.run(wait_replication(coord, api.ReplicationWaitRequest(id=failed.id, wait_s=0.0, want=True)))
    assert len(coord.sent) == 1 and not pulled.wanted and not failed.wanted
