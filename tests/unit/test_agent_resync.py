"""The worker agent's resync after a coordinator restart, over a real ZMQ socket pair: it says its vocabulary in
the hello, re-reports a live replica with the time it has left (never its first TTL again), and an expired or
evicted replica, or one a later request extended (ordinary cache now), not at all."""
import time
from types import SimpleNamespace

import msgspec
import zmq

from radix_sync import protocol as p
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.agent.io_side import IoSide


def fact(rid: str, ttl_s: float) -> p.ReplicaStored:
    return p.ReplicaStored(worker_id="w", seq=0, replication_id=rid, namespace="", block_hashes=[1, 2],
                           inserted_len=8, expires_in_s=ttl_s, num_bytes=64, receive_s=0.1, scatter_s=0.1,
                           insert_s=0.1)


def test_a_resync_reports_held_replicas_with_what_is_left_and_never_evicted_ones():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://coord")
    io = IoSide.__new__(IoSide)
    io.cfg = SimpleNamespace(worker_id="w", http_url="http://w")
    io.info = SimpleNamespace(fingerprint="f", fingerprint_fields={}, page_size=4, pool_capacity_tokens=100,
                              replica_budget_tokens=25, vocab_size=32000)
    io.transport = SimpleNamespace(endpoint="tcp://127.0.0.1:1")
    io.data_endpoint = io.transport.endpoint
    io.coord = ctx.socket(zmq.DEALER)
    io.coord.connect("inproc://coord")
    io.seq, io.need_resync, io.mirror, io.last_load, io.last_sent_s = 0, False, {}, None, 0.0
    io.host_mirror = {}
    io.next_hello_s, io.awaiting_ack_since, io.coordinator_id = 0.0, None, ""
    io.stats = {"hellos": 0, "dropped_facts": 0, "coordinator_restarts": 0, "stale_resync_requests": 0}
    now = time.monotonic()
    io.replica_facts = {"live": (fact("live", 60.0), now + 30.0), "expired": (fact("expired", 60.0), now - 1.0),
                        "evicted": (fact("evicted", 60.0), now + 30.0), "extended": (fact("extended", 60.0), now - 1.0)}
    io.replica_blocks = {"evicted": ("", [1, 2]), "extended": ("", [1, 2])}
    io.mailbox = SimpleNamespace(post_to_scheduler=lambda msg: None)
    # the scheduler side evicted one: its ReplicaExpired passes through the I/O side, which forgets the fact
    io.on_message(m.ToCoordinator(p.ReplicaExpired(worker_id="w", seq=0, replication_id="evicted",
                                                   num_evicted_tokens=8)))
    assert "evicted" not in io.replica_facts and "evicted" not in io.replica_blocks
    # one its expiry found extended by a later request: told as promoted with no tokens (no use counted)
    io.on_message(m.ToCoordinator(p.ReplicaPromoted(worker_id="w", seq=0, replication_id="extended",
                                                    num_promoted_tokens=0)))
    assert "extended" not in io.replica_facts and "extended" not in io.replica_blocks
    io.hello()
    got = []
    while router.poll(200):
        got.append(p.decode_for_coordinator(router.recv_multipart()[1]))
    assert isinstance(got[0], p.ReplicaExpired)  # (told to the coordinator as they passed)
    assert isinstance(got[1], p.ReplicaPromoted) and got[1].replication_id == "extended"
    hello, *rest = got[2:]
    assert isinstance(hello, p.Hello) and hello.vocab_size == 32000
    replicas = [msg for msg in rest if isinstance(msg, p.ReplicaStored)]
    # re-reported with what is left: 0 for the one past its TTL but still held; the evicted and extended ones not
    assert [r.replication_id for r in replicas] == ["live", "expired"] and 29.0 < replicas[0].expires_in_s <= 30.0
    assert replicas[1].expires_in_s == 0.0
    # one past its TTL stays known until its ReplicaExpired (a queued request may be keeping it)
    assert set(io.replica_facts) == {"live", "expired"}
    io.coord.close(0)
    router.close(0)
    ctx.term()


def test_a_hit_on_a_replica_promotes_it_once_and_the_io_side_forgets_it():
    """A request's hit on a replica's first page promotes it (told to the scheduler and the coordinator, with the
    pages the hit covered); the I/O side then forgets it: before, it kept every promoted replica's page list for
    the worker's life."""
    from array import array

    from radix_sync.hashing import page_hashes
    io = IoSide.__new__(IoSide)
    io.cfg = SimpleNamespace(worker_id="w")
    io.info = SimpleNamespace(page_size=4)
    sent, to_sched = [], []
    io.send_coord, io.to_sched = sent.append, to_sched.append
    toks = list(range(16))
    blocks = page_hashes(toks, 4, "t")
    io.replica_blocks = {"r1": ("t", blocks[2:]), "r2": ("", page_hashes(toks, 4, "")[2:])}
    io.replica_facts = {"r1": (fact("r1", 60.0), 0.0), "r2": (fact("r2", 60.0), 0.0)}
    hit = m.PrefixMatched(namespace="t", token_ids=array("q", toks[:12]), matched_len=12, key_len=12)
    io.on_hit(hit)
    promoted = [x for x in sent if isinstance(x, p.ReplicaPromoted)]
    assert [(x.replication_id, x.num_promoted_tokens) for x in promoted] == [("r1", 4)]
    assert [x.replication_id for x in to_sched if isinstance(x, m.Promote)] == ["r1"]
    assert set(io.replica_blocks) == {"r2"} and set(io.replica_facts) == {"r2"}  # r2: another tenant's
    io.on_hit(hit)  # the same prefix again: nothing left to promote
    assert len([x for x in sent if isinstance(x, p.ReplicaPromoted)]) == 1


def test_a_drop_the_coordinator_made_room_with_counts_at_once_until_the_scheduler_tells_the_true_room():
    """The coordinator drops a speculative replica to make room for a pull (`pull.room_for_critical`) and sends the
    pull's grant right after; the pull's bytes may reach the I/O side before the scheduler has dropped it (a CPU
    prefill iteration lasts seconds), so the I/O side counts the drop at once; the scheduler's answer (sent after
    every drop, done or not) sets the true room."""
    io = IoSide.__new__(IoSide)
    to_sched = []
    io.to_sched = to_sched.append
    io.free_replica_tokens = 4
    io.replica_facts = {"spec": (fact("spec", 60.0), time.monotonic() + 30.0)}
    io.on_coord(p.encode(p.DropReplica(replication_id="spec")))
    io.on_coord(p.encode(p.DropReplica(replication_id="unknown")))  # nothing known of it: nothing counted
    assert io.free_replica_tokens == 4 + 8 and to_sched == [m.Drop("spec"), m.Drop("unknown")]
    io.on_message(m.ReplicaRoom(6))  # the scheduler could not drop it (a queued request wants it)
    assert io.free_replica_tokens == 6


def test_a_replica_sglang_evicted_or_flushed_leaves_the_budget_at_once():
    """Replicas sort first in SGLang's eviction: under memory pressure SGLang evicts them long before their TTL,
    and a cache flush takes them all. The I/O side sees their pages go (the KV events) and tells the scheduler,
    which forgets them (before, they held the replica budget until their TTL, refusing pulls)."""
    from sglang_kvrep import events

    io = IoSide.__new__(IoSide)
    io.cfg = SimpleNamespace(worker_id="w")
    sent, to_sched = [], []
    io.send_coord, io.to_sched = sent.append, to_sched.append
    io.mirror, io.host_mirror = {}, {}
    now = time.monotonic()
    io.replica_facts = {r: (fact(r, 60.0), now + 30.0) for r in ("a", "b", "c")}
    io.replica_blocks = {"a": ("", [1, 2]), "b": ("", [3, 4]), "c": ("", [5, 6])}
    events.SINK.append(events.KvRemoved(block_hashes=[2, 3], medium="GPU"))  # a's last page; only b's first
    io.drain_events()
    assert to_sched == [m.ReplicaGone("a")] and set(io.replica_blocks) == {"b", "c"} and "a" not in io.replica_facts
    events.SINK.append(events.KvCleared())
    io.drain_events()
    assert to_sched == [m.ReplicaGone(r) for r in "abc"] and not io.replica_blocks and not io.replica_facts
    assert [type(x).__name__ for x in sent] == ["PagesRemoved", "AllPagesCleared"]


def test_a_copy_a_request_waits_for_lands_or_is_raised_as_ordinary_cache():
    """`WantReplica` (a router holds a request until this copy lands): a grant not yet received is made ordinary (the
    install lands it at `PULLED_PRIORITY`, as a pull's); one the I/O side no longer holds (installing, landed or
    gone) goes to the scheduler, which raises it."""
    io = IoSide.__new__(IoSide)
    to_sched = []
    io.to_sched = to_sched.append
    grant = p.ExpectReplica(replication_id="r1", source_id="w0", namespace="", page_size=4, block_hashes=[1, 2],
                            auth_token="t", expires_in_s=30.0)
    io.expected = {"r1": (grant, 123.0)}
    io.on_coord(p.encode(p.WantReplica(replication_id="r1")))
    assert io.expected["r1"] == (msgspec.structs.replace(grant, ordinary=True), 123.0) and to_sched == []
    io.on_coord(p.encode(p.WantReplica(replication_id="r2")))
    assert to_sched == [m.Want("r2")] and set(io.expected) == {"r1"}


def test_the_heartbeat_repeats_the_last_load_report_with_its_age():
    """Through a long prefill the scheduler side sends no report (it reports between iterations); after a second of
    silence the I/O side repeats the last one, saying how old it is (the coordinator dates it by that)."""
    import pytest

    io = IoSide.__new__(IoSide)
    io.cfg = SimpleNamespace(worker_id="w")
    sent = []
    io.send_coord = sent.append
    io.need_resync, io.awaiting_ack_since, io.last_load = False, None, None
    io.replica_facts, io.replica_blocks = {}, {}
    load = p.LoadReported(worker_id="w", seq=0, num_running_reqs=0, num_waiting_reqs=1, num_waiting_tokens=2000,
                          available_tokens=1000, evictable_tokens=0, replica_tokens=0)
    io.on_message(m.ToCoordinator(load))
    t = io.last_load_s
    assert sent == [load] and load.age_s == 0.0
    io.last_sent_s = t
    io.keep_link(t + 0.5)
    assert len(sent) == 1  # (not a second of silence yet)
    io.keep_link(t + 1.5)
    assert sent[1].age_s == pytest.approx(1.5) and msgspec.structs.replace(sent[1], age_s=0.0) == load
