"""The routers' sends relayed to one another: the coordinator's board (`radix_sync.coordinator.relay.SendRelay`), a
router's count of the others' sends (`radix_sync.router.peers.PeerSends`) merged into its loads, and the events a
router's requests emit (`WorkerPool.dispatch`)."""
import msgspec
import pytest

from radix_sync import api
from radix_sync.api import AdminError
from radix_sync.coordinator.relay import SendRelay, parse_feed_query
from radix_sync.router.peers import PeerSends
from radix_sync.router.policy import WorkerState, queued_work
from radix_sync.router.pool import WorkerPool


def sent(rid, worker="w0", new=100, cached=0, at=0.0):
    return api.SendEvent(kind="sent", rid=rid, worker=worker, new_tokens=new, cached_tokens=cached, at=at)


def batch(router, *events):
    return api.SendBatch(router=router, events=list(events))


# ------------------------------------------------------------------------------------------ the coordinator's board
def test_a_router_gets_the_others_events_in_order_and_never_its_own():
    board = SendRelay()
    first = board.feed("r1", "", 0, now=0.0)
    assert first.reset and first.seq == 0 and first.events == []  # (another epoch: start from the head)
    board.feed("r2", "", 0, now=0.0)
    board.post(batch("r2", sent(1), api.SendEvent(kind="started", rid=1, worker="w0")), now=0.1)
    board.post(batch("r1", sent(7, "w1")), now=0.1)
    board.post(batch("r2", api.SendEvent(kind="done", rid=1, worker="w0")), now=0.2)
    out = board.feed("r1", first.epoch, first.seq, now=0.3)
    assert not out.reset and out.seq == out.head == 4 and out.routers == 2
    assert [(e.kind, e.rid, e.router) for e in out.events] == [("sent", 1, "r2"), ("started", 1, "r2"),
                                                               ("done", 1, "r2")]
    mine = board.feed("r2", first.epoch, first.seq, now=0.3)
    assert [(e.kind, e.rid, e.router) for e in mine.events] == [("sent", 7, "r1")]
    assert board.feed("r1", out.epoch, out.seq, now=0.4).events == []


def test_the_poster_names_its_events_a_router_cannot_speak_for_another():
    board = SendRelay()
    start = board.feed("r1", "", 0, now=0.0)
    forged = msgspec.structs.replace(sent(1), router="r1")
    board.post(batch("evil", forged, api.SendEvent(kind="gone", router="r1")), now=0.0)
    out = board.feed("r1", start.epoch, start.seq, now=0.0)
    assert [(e.kind, e.router) for e in out.events] == [("sent", "evil")]  # its own name; no `gone` of another


def test_a_caller_too_far_behind_or_of_another_epoch_is_told_to_reset():
    board = SendRelay(capacity=4)
    start = board.feed("r1", "", 0, now=0.0)
    for rid in range(6):
        board.post(batch("r2", sent(rid)), now=0.0)
    behind = board.feed("r1", start.epoch, start.seq, now=0.0)
    assert behind.reset and behind.events == [] and behind.seq == board.head == 6
    assert board.feed("r1", "another", 6, now=0.0).reset
    assert board.feed("r1", start.epoch, 99, now=0.0).reset  # (ahead of the head: a restarted coordinator)
    within = board.feed("r1", start.epoch, 3, now=0.0)  # events 4-6 are still kept
    assert not within.reset and [e.rid for e in within.events] == [3, 4, 5]


def test_answers_are_bounded_and_the_caller_comes_back_for_the_rest():
    board = SendRelay()
    start = board.feed("r1", "", 0, now=0.0)
    board.post(batch("r2", *[sent(i) for i in range(10)]), now=0.0)
    part = board.feed("r1", start.epoch, start.seq, now=0.0, max_events=4)
    assert [e.rid for e in part.events] == [0, 1, 2, 3] and part.seq == 4 < part.head == 10
    rest = board.feed("r1", part.epoch, part.seq, now=0.0, max_events=100)
    assert [e.rid for e in rest.events] == list(range(4, 10)) and rest.seq == rest.head


def test_a_router_that_stops_polling_is_announced_gone_once():
    board = SendRelay(router_gone_s=5.0)
    start = board.feed("r1", "", 0, now=0.0)
    board.feed("r2", "", 0, now=0.0)
    board.post(batch("r2", sent(1)), now=1.0)
    assert board.routers(now=4.0) == 2
    out = board.feed("r1", start.epoch, start.seq, now=7.0)  # r2 silent since 1.0
    assert [(e.kind, e.router) for e in out.events] == [("sent", "r2"), ("gone", "r2")]
    assert out.routers == 1
    again = board.feed("r1", out.epoch, out.seq, now=8.0)
    assert again.events == []


def test_only_routers_that_serve_count_an_idle_one_listens():
    board = SendRelay(router_gone_s=5.0)
    start = board.feed("r1", "", 0, now=0.0)
    spare = board.feed("spare", "", 0, now=0.0, serving=False)
    assert board.routers(now=0.0) == 1  # (r1 alone serves: it has nobody to tell)
    board.post(batch("r2", sent(1)), now=1.0)  # (posting is serving)
    assert board.routers(now=1.0) == 2
    assert [e.rid for e in board.feed("spare", spare.epoch, spare.seq, now=1.0, serving=False).events] == [1]
    assert board.routers(now=6.5) == 0  # (r1 polled at 0, r2 posted at 1: neither served since)
    board.feed("r1", start.epoch, start.seq, now=6.6)
    assert board.routers(now=6.6) == 1


def test_the_board_refuses_routers_past_its_bound_and_malformed_queries():
    board = SendRelay(max_routers=2)
    board.feed("r1", "", 0, now=0.0)
    board.post(batch("r2"), now=0.0)
    with pytest.raises(AdminError) as err:
        board.feed("r3", "", 0, now=0.0)
    assert err.value.status == 429
    for query in ({}, {"router": "x" * 129}, {"router": "r", "since": "a"}, {"router": "r", "wait_s": "x"}):
        with pytest.raises(AdminError):
            parse_feed_query(query)
    assert parse_feed_query({"router": "r", "since": "3", "wait_s": "99"}) == ("r", "", 3, 30.0, True)
    assert parse_feed_query({"router": "r", "serving": "0"})[4] is False


def test_bad_batches_are_refused_by_the_schema():
    ok = api.encode(batch("r", sent(1)))
    assert api.decode(ok, api.SendBatch).events[0].rid == 1
    too_many = {"router": "r", "events": [{"kind": "sent"}] * (api.MAX_SEND_EVENTS + 1)}
    for body in ({"events": []}, {"router": ""}, {"router": "r", "events": [{"kind": "pushed"}]},
                 {"router": "r", "events": [{"kind": "sent", "rid": -1}]},
                 {"router": "r", "events": [{"kind": "sent", "new_tokens": api.MAX_LIST + 1}]}, too_many):
        with pytest.raises(AdminError):
            api.decode(msgspec.json.encode(body), api.SendBatch)


# ------------------------------------------------------------------------------------- a router's count of its peers
def test_peer_sends_count_until_started_and_done():
    peers = PeerSends()
    lags = []
    peers.on_lag = lags.append
    e = sent(1, new=120, cached=40, at=100.0)
    peers.apply([msgspec.structs.replace(e, router="r2")], now=0.0, wall_now=100.004)
    w = queued_work(120, 40)
    assert peers.counts("w0") == (1, w.num_tokens, w.attn_pairs, w.cached_pairs)
    assert lags == [pytest.approx(0.004)]
    peers.apply([api.SendEvent(kind="started", rid=1, worker="w0", router="r2")], now=0.1, wall_now=0.0)
    assert peers.counts("w0") == (1, 0, 0.0, 0.0)
    peers.apply([api.SendEvent(kind="done", rid=1, worker="w0", router="r2")], now=0.2, wall_now=0.0)
    assert peers.counts("w0") == (0, 0, 0.0, 0.0) and peers.status()["open"] == 0


def test_peer_sends_of_another_router_same_rid_are_apart_and_unknown_ends_are_ignored():
    peers = PeerSends()
    peers.apply([msgspec.structs.replace(sent(1), router="r2"), msgspec.structs.replace(sent(1), router="r3"),
                 msgspec.structs.replace(sent(1), router="r3"),  # (a repeat)
                 api.SendEvent(kind="done", rid=9, worker="w0", router="r2")], now=0.0, wall_now=0.0)
    assert peers.counts("w0")[0] == 2
    peers.apply([api.SendEvent(kind="done", rid=1, worker="w0", router="r3")], now=0.0, wall_now=0.0)
    assert peers.counts("w0")[0] == 1


def test_a_gone_router_expired_requests_and_a_reset_are_forgotten():
    peers = PeerSends(ttl_s=10.0)
    peers.apply([msgspec.structs.replace(sent(1, "w0"), router="r2"),
                 msgspec.structs.replace(sent(2, "w1"), router="r2"),
                 msgspec.structs.replace(sent(1, "w1"), router="r3")], now=0.0, wall_now=0.0)
    peers.apply([api.SendEvent(kind="gone", router="r2")], now=1.0, wall_now=0.0)
    assert peers.counts("w0")[0] == 0 and peers.counts("w1")[0] == 1
    peers.apply([msgspec.structs.replace(sent(5, "w0"), router="r3")], now=5.0, wall_now=0.0)
    peers.expire(now=10.5)  # r3's first (sent at 0) expired, its second (at 5) not
    assert peers.counts("w1")[0] == 0 and peers.counts("w0")[0] == 1
    peers.reset()
    assert peers.counts("w0")[0] == 0 and peers.status()["resets"] == 1


# ------------------------------------------------------------------------------------------------ in the router
A, B = "http://a", "http://b"


def pool_with_ids():
    pool = WorkerPool([A, B], 16, 5.0)
    pool.sync([{"url": A, "id": "wA"}, {"url": B, "id": "wB"}])
    return pool


def test_a_routers_requests_emit_sent_started_done_with_the_coordinators_worker_ids():
    pool = pool_with_ids()
    events = []
    pool.relay = lambda *event: events.append(event)
    first = pool.dispatch(A, 100, 20)
    second = pool.dispatch(B, 50, 0)
    assert pool.outstanding[A] == 1 and pool.outstanding[B] == 1
    first.started()
    first.started()
    first.done()
    second.done()  # (ended without a first output: failed)
    second.done()
    assert [e[:3] for e in events] == [
        ("sent", "wA", first.rid), ("sent", "wB", second.rid), ("started", "wA", first.rid),
        ("done", "wA", first.rid), ("done", "wB", second.rid)]
    assert events[0][3:] == (100, 20)
    assert pool.outstanding[A] == pool.outstanding[B] == 0 and pool._queued[A].count == 0


def test_the_other_routers_sends_load_a_worker_in_this_routers_view():
    pool = pool_with_ids()
    idle = WorkerState(A, 16)
    assert pool.with_local_load(idle, True, now=0.0).num_waiting == 0
    pool.peers.apply([msgspec.structs.replace(sent(1, "wA", new=300), router="r2")], now=0.0, wall_now=0.0)
    seen = pool.with_local_load(idle, True, now=0.0)
    assert seen.num_waiting == 1 and seen.num_waiting_tokens == 300
    assert pool.with_local_load(WorkerState(B, 16), True, now=0.0).num_waiting == 0
    own = pool.dispatch(A, 100, 0)
    both = pool.with_local_load(idle, True, now=0.0)
    assert both.num_waiting == 2 and both.num_waiting_tokens == 400
    own.done()


def test_the_link_relays_only_while_another_router_serves_and_dates_each_event():
    import asyncio

    import aiohttp

    from radix_sync.router.coordinator_link import CoordinatorLink, LinkConfig

    async def run():
        async with aiohttp.ClientSession() as session:
            link = CoordinatorLink(LinkConfig("http://127.0.0.1:9"), session)
            link.num_routers = 1  # (alone: nothing is built or queued)
            link.relay("sent", "wA", 1, 100, 20)
            assert link.outbox.pending == []
            link.num_routers = 2
            link.relay("sent", "wA", 2, 100, -5)
            [event] = link.outbox.pending
            assert (event.kind, event.worker, event.rid, event.new_tokens, event.cached_tokens) == (
                "sent", "wA", 2, 100, 0) and event.at > 0
            await link._posting  # (nothing answers on port 9: the event is dropped and counted, not kept)
            assert link.outbox.pending == [] and link.outbox.num_dropped == 1

    asyncio.run(run())
