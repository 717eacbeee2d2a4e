"""The worker agent's resync after a coordinator restart, over a real ZMQ socket pair: it says its vocabulary in
the hello, re-reports a live replica with the time it has left (never its first TTL again), and an expired or
evicted replica not at all."""
import time
from types import SimpleNamespace

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
    io.next_hello_s, io.awaiting_ack_since, io.coordinator_id = 0.0, None, ""
    io.stats = {"hellos": 0, "dropped_facts": 0, "coordinator_restarts": 0, "stale_resync_requests": 0}
    now = time.monotonic()
    io.replica_facts = {"live": (fact("live", 60.0), now + 30.0), "expired": (fact("expired", 60.0), now - 1.0),
                        "evicted": (fact("evicted", 60.0), now + 30.0)}
    io.replica_blocks = {"evicted": ("", [1, 2], False)}
    io.mailbox = SimpleNamespace(post_to_scheduler=lambda msg: None)
    # the scheduler side evicted one: its ReplicaExpired passes through the I/O side, which forgets the fact
    io.on_message(m.ToCoordinator(p.ReplicaExpired(worker_id="w", seq=0, replication_id="evicted",
                                                   num_evicted_tokens=8)))
    assert "evicted" not in io.replica_facts and "evicted" not in io.replica_blocks
    io.hello()
    got = []
    while router.poll(200):
        got.append(p.decode_for_coordinator(router.recv_multipart()[1]))
    assert isinstance(got[0], p.ReplicaExpired)  # (told to the coordinator as it passed)
    hello, *rest = got[1:]
    assert isinstance(hello, p.Hello) and hello.vocab_size == 32000
    replicas = [msg for msg in rest if isinstance(msg, p.ReplicaStored)]
    # re-reported with what is left: 0 for the one past its TTL but still held; the evicted one not at all
    assert [r.replication_id for r in replicas] == ["live", "expired"] and 29.0 < replicas[0].expires_in_s <= 30.0
    assert replicas[1].expires_in_s == 0.0
    # one past its TTL stays known until its ReplicaExpired (a queued request may be keeping it)
    assert set(io.replica_facts) == {"live", "expired"}
    io.coord.close(0)
    router.close(0)
    ctx.term()
