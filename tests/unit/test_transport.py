"""The `Transport` interface through its ZeroMQ implementation, over real loopback sockets: transfers land
bit-exact; corruption, a wrong token and silence end as `TransferFailed` with the staging buffer back in its pool;
the rate cap holds; the registry refuses unknown names. Then the agent's I/O side driving two transports end to end
against a fake coordinator, through the mailbox. Stall timeouts and the rate cap run on an injected clock."""
import select
import threading
import time

import msgspec
import pytest
import torch
import zmq

from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.agent.io_side import IoSide
from sglang_kvrep.config import KvrepConfig
from sglang_kvrep.dataplane.checks import LocalGeometry
from sglang_kvrep.dataplane.registry import known_transports, make_transport
from sglang_kvrep.dataplane.transport import (ChunkSent, Refusal, TransferFailed, TransferReceived, TransferSent,
                                              Transport)
from sglang_kvrep.dataplane.wire import send_transfer, split_pages
from sglang_kvrep.dataplane.zmq_transport import ZmqTransport
from tests.util import wait_until

GEO = LocalGeometry("fp", 4, "torch.bfloat16", "NHD", (2, 4, 2, 8), num_layers=3, itemsize=2)  # 768 B per page


def header(tid="t1", token="good", num_pages=3, pages_per_chunk=2, rid="r1", **kw) -> p.TransferHeader:
    fields = dict(transfer_id=tid, replication_id=rid, auth_token=token, source_id="a", fingerprint="fp",
                  namespace="", token_ids=list(range(num_pages * 4)), page_size=4, num_pages=num_pages,
                  dtype="torch.bfloat16", layout="NHD", buffer_shape=GEO.buffer_shape(num_pages),
                  num_bytes=GEO.num_bytes(num_pages), pages_per_chunk=pages_per_chunk,
                  num_chunks=-(-num_pages // pages_per_chunk), checksum_kind="xxh3", ttl_s=5.0)
    fields.update(kw)
    return p.TransferHeader(**fields)


def payload_of(h: p.TransferHeader, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (h.num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def chunk(h: p.TransferHeader, payload: torch.Tensor, index: int) -> torch.Tensor:
    return split_pages(h, payload.numpy().tobytes(), index)


def admit_token(h: p.TransferHeader):
    return None if h.auth_token == "good" else Refusal("bad token", tell_coordinator=False)


class Side:
    """One transport with its own poller, the events it reported, and an optional injected clock."""

    def __init__(self, ctx, clock=None, kind=ZmqTransport, **cfg) -> None:
        self.poller = zmq.Poller()
        self.events: list = []
        self.now = 0.0
        extra = {} if clock is None else {"clock": lambda: self.now}
        self.t = kind(KvrepConfig(**cfg), admit_token, self.events.append, ctx, self.poller, **extra)

    def step(self, timeout_ms: int = 5) -> float:
        return self.t.progress(dict(self.poller.poll(timeout_ms)))

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def pump(sides, until, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "condition not reached"
        for s in sides:
            s.step()


def send_whole(src: Side, dst: Side, h: p.TransferHeader, payload: torch.Tensor):
    """`src` sends every chunk of `payload` to `dst`; returns the `Incoming` of the transfer `dst` receives."""
    received = len(dst.of(TransferReceived))
    src.t.send(h, dst.t.endpoint)
    for i in range(h.num_chunks):
        src.t.push_chunk(h.transfer_id, i, chunk(h, payload, i), 0.0)
    pump([src, dst], lambda: len(dst.of(TransferReceived)) > received)
    return dst.of(TransferReceived)[received].incoming


OWN_CONTEXTS: list = []


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    while OWN_CONTEXTS:
        OWN_CONTEXTS.pop().destroy(linger=0)
    c.destroy(linger=0)


def test_registry_knows_zmq_and_rejects_unknown_names(ctx):
    assert "zmq" in known_transports()
    with pytest.raises(ValueError, match=r"unknown transport 'carrier-pigeon' \(known: .*zmq"):
        make_transport("carrier-pigeon", KvrepConfig(), admit_token, print, ctx, zmq.Poller())
    with pytest.raises(ValueError, match=r"--kvrep-transport: unknown transport 'tcp' \(known: .*zmq"):
        KvrepConfig(transport="tcp")
    t = make_transport("zmq", KvrepConfig(), admit_token, print, ctx, zmq.Poller())
    assert isinstance(t, Transport) and t.name == "zmq" and t.endpoint.startswith("tcp://127.0.0.1:")
    t.close()


def test_transfer_lands_bit_exact_and_staging_is_reused(ctx):
    src, dst = Side(ctx), Side(ctx)
    h = header()
    payload = payload_of(h)
    src.t.send(h, dst.t.endpoint)
    src.t.push_chunk(h.transfer_id, 0, chunk(h, payload, 0), 0.25)  # chunk 1 is still being "gathered"
    pump([src, dst], lambda: src.of(ChunkSent))
    assert not src.of(TransferSent)
    src.t.push_chunk(h.transfer_id, 1, chunk(h, payload, 1), 0.5)
    pump([src, dst], lambda: dst.of(TransferReceived))
    assert src.of(ChunkSent) == [ChunkSent("t1", 1), ChunkSent("t1", 2)]
    [sent] = src.of(TransferSent)
    assert sent.header == h and sent.gather_s == 0.75 and sent.send_s >= 0
    [received] = dst.of(TransferReceived)
    inc = received.incoming
    assert inc.header == h and inc.chunks == {0, 1} and inc.received_bytes == h.num_bytes
    assert torch.equal(inc.buffer, payload)  # every byte, in the buffer layout
    assert dst.t.staging.cached_bytes() == 0  # lent to the owner until it answers
    dst.t.answer(inc, inserted_len=12)
    pump([src, dst], lambda: not src.t.outgoing)  # the source consumed the TransferAccepted
    assert dst.t.staging.cached_bytes() == h.num_bytes and not dst.t.incoming
    assert not src.of(TransferFailed) and not dst.of(TransferFailed)
    # the next transfer reuses the staging buffer
    h2 = header(tid="t2", num_pages=1)
    src.t.send(h2, dst.t.endpoint)
    src.t.push_chunk("t2", 0, chunk(h2, payload_of(h2, 1), 0), 0.0)
    pump([src, dst], lambda: len(dst.of(TransferReceived)) == 2)
    assert dst.of(TransferReceived)[1].incoming.storage.data_ptr() == inc.storage.data_ptr()
    src.t.close()
    dst.t.close()


def test_corrupted_chunk_is_refused_and_staging_freed(ctx):
    dst = Side(ctx)
    h = header()
    payload = payload_of(h)
    replies = []
    sender = threading.Thread(target=lambda: replies.append(
        send_transfer(dst.t.endpoint, h, payload.numpy().tobytes(), timeout_s=20, corrupt_chunk=1)))
    sender.start()
    pump([dst], lambda: dst.of(TransferFailed))
    sender.join(20)
    [failed] = dst.of(TransferFailed)
    assert (failed.transfer_id, failed.replication_id, failed.role, failed.tell_coordinator) == ("t1", "r1", "target",
                                                                                                 True)
    assert failed.error.startswith("checksum mismatch in chunk 1")
    assert isinstance(replies[0], p.TransferRefused) and replies[0].error == failed.error
    assert not dst.of(TransferReceived) and not dst.t.incoming
    assert dst.t.staging.cached_bytes() == h.num_bytes  # the slot went back to the pool
    dst.t.close()


def test_wrong_token_is_refused_before_staging_and_the_source_stops(ctx):
    src, dst = Side(ctx), Side(ctx)
    h = header(token="forged")
    src.t.send(h, dst.t.endpoint)
    pump([src, dst], lambda: src.of(TransferFailed))
    assert dst.of(TransferFailed) == [TransferFailed("t1", "r1", "target", "bad token", tell_coordinator=False)]
    assert src.of(TransferFailed) == [TransferFailed("t1", "r1", "source", "bad token", tell_coordinator=False)]
    assert not dst.t.incoming and dst.t.staging.cached_bytes() == 0  # nothing was ever staged
    src.t.push_chunk("t1", 0, chunk(h, payload_of(h), 0), 0.0)  # a late chunk of the ended transfer
    assert not src.t.outgoing and src.step() == 0.5
    src.t.close()
    dst.t.close()


def test_silent_source_times_out_on_the_target(ctx):
    dst = Side(ctx, clock=True, transfer_timeout_s=5.0)
    h = header()
    payload = payload_of(h).numpy().tobytes()
    assert send_transfer(dst.t.endpoint, h, payload, stop_after_chunks=1) is None  # dies after chunk 0
    pump([dst], lambda: "t1" in dst.t.incoming and dst.t.incoming["t1"].chunks == {0})
    dst.now = 5.0
    dst.step(0)
    assert not dst.of(TransferFailed)  # exactly the limit: not yet
    dst.now = 5.01
    dst.step(0)
    [failed] = dst.of(TransferFailed)
    assert failed.role == "target" and failed.tell_coordinator
    assert failed.error == f"transfer timed out: no data for 5s ({h.num_bytes // 3 * 2}/{h.num_bytes} bytes " \
                           "received; source dead?)"
    assert not dst.t.incoming and dst.t.staging.cached_bytes() == h.num_bytes
    dst.t.close()


def test_stalled_send_fails_on_the_source(ctx):
    src = Side(ctx, clock=True, transfer_timeout_s=5.0)
    h = header()
    src.t.send(h, "tcp://127.0.0.1:9")  # nobody there: libzmq queues, the header never gets an answer
    src.step(0)
    src.now = 5.01
    src.step(0)
    assert src.of(TransferFailed) == [TransferFailed("t1", "r1", "source", "send stalled for 5s (0/2 chunks sent)")]
    assert not src.t.outgoing
    src.t.close()


def test_rate_cap_spaces_chunks(ctx):
    # 1000 B/s, burst 4096 B; chunks of 4 pages = 3072 B: the first goes, the second waits for 2048 more tokens
    src, dst = Side(ctx, clock=True, send_rate_mbps=0.001, chunk_bytes=4096), Side(ctx)
    h = header(num_pages=12, pages_per_chunk=4)
    payload = payload_of(h)
    src.t.send(h, dst.t.endpoint)
    for i in range(3):
        src.t.push_chunk("t1", i, chunk(h, payload, i), 0.0)
    pump([src, dst], lambda: src.of(ChunkSent))
    for _ in range(3):
        src.step(0)
    assert src.of(ChunkSent) == [ChunkSent("t1", 1)]
    src.now = 2.0
    src.step(0)
    assert len(src.of(ChunkSent)) == 1
    src.now = 2.05
    src.step(0)
    assert src.of(ChunkSent)[-1] == ChunkSent("t1", 2)
    src.now = 5.2
    pump([src, dst], lambda: dst.of(TransferReceived))
    assert torch.equal(dst.of(TransferReceived)[0].incoming.buffer, payload)
    src.t.close()
    dst.t.close()


# ----------------------------------------------------------------------------- the agent's I/O side on top
class StubAgent:
    """The scheduler side's end of the mailbox, without SGLang: an `IoSide` on its own thread, with what a
    `WorkerAgent` would tell it (`WorkerInfo`) and the messages it posts back kept in `got`."""

    def __init__(self, worker_id: str, coordinator: str, free_tokens: int = 100, transport: str = "zmq",
                 **cfg) -> None:
        self.config = KvrepConfig(coordinator=coordinator, worker_id=worker_id, transport=transport, **cfg)
        info = m.WorkerInfo(fingerprint="fp", fingerprint_fields={}, page_size=4, pool_capacity_tokens=1000,
                            replica_budget_tokens=free_tokens, free_replica_tokens=free_tokens, geometry=GEO)
        self.mailbox = m.Mailbox()
        self.got: list = []
        self.loop: IoSide = None
        built = threading.Event()

        def main() -> None:
            self.loop = IoSide(self.config, info, self.mailbox)
            built.set()
            self.loop.run()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert built.wait(10)
        [started] = self.wait_for(m.IoStarted)
        self.data_endpoint = started.data_endpoint

    def to_io(self, msg: m.ToIo) -> None:
        self.mailbox.post_to_io(msg)

    def wait_for(self, kind, n: int = 1, timeout_s: float = 20.0) -> list:
        """The messages of `kind` the I/O side posted to the scheduler side, once there are `n`."""
        deadline = time.monotonic() + timeout_s
        while len([x for x in self.got if isinstance(x, kind)]) < n:
            assert time.monotonic() < deadline, f"no {kind.__name__} from the I/O side"
            msg = self.mailbox.take_for_scheduler()
            if msg is None:
                select.select([self.mailbox.scheduler_bell_fd], [], [], 0.05)  # rung when it posts
                self.mailbox.clear_bell()
            else:
                self.got.append(msg)
        return [x for x in self.got if isinstance(x, kind)]

    def close(self) -> None:
        self.to_io(m.Stop())
        self.thread.join(10)
        self.loop.coord.close(linger=0)
        self.loop.ctx.term()
        self.mailbox.close()


class FakeCoordinator:
    def __init__(self, ctx, keydir=None) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = None
        if keydir is not None:  # as the real one: CURVE server, allow-listed workers only
            from radix_sync.keys import curve_server, start_authenticator

            self.auth = start_authenticator(ctx, keydir.allow_list())
            curve_server(self.sock, keydir.pair("coordinator"))
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.ids: dict[str, bytes] = {}
        self.got: list = []

    def wait_for(self, kind, n: int = 1, timeout_s: float = 20.0) -> list:
        deadline = time.monotonic() + timeout_s
        while len([m for m in self.got if isinstance(m, kind)]) < n:
            assert time.monotonic() < deadline, f"no {kind.__name__} from the workers"
            if self.sock.poll(50):
                ident, data = self.sock.recv_multipart()
                msg = p.decode_for_coordinator(data)
                self.got.append(msg)
                if isinstance(msg, p.Hello):
                    self.ids[msg.worker_id] = ident
        return [m for m in self.got if isinstance(m, kind)]

    def grant(self, worker_id: str, h: p.TransferHeader) -> None:
        self.sock.send_multipart([self.ids[worker_id], p.encode(p.ExpectReplica(
            replication_id=h.replication_id, source_id=h.source_id, namespace="", page_size=4,
            block_hashes=page_hashes(h.token_ids, 4, ""), auth_token="good", expires_in_s=60.0))])


def test_io_side_replicates_through_the_transport_and_reports_failures(ctx):
    coord = FakeCoordinator(ctx)
    a, b = StubAgent("a", coord.endpoint), StubAgent("b", coord.endpoint)
    try:
        coord.wait_for(p.Hello, 2)
        assert coord.ids.keys() == {"a", "b"}
        h = header()
        payload = payload_of(h)
        coord.grant("b", h)
        coord.wait_for(p.ReplicaExpected)
        # a wrong token is refused without consuming the grant or telling the coordinator
        a.to_io(m.StartSend(header(tid="x", token="forged"), b.data_endpoint))
        # the source's I/O side tells its scheduler side to stop gathering when it learns of the refusal
        assert a.wait_for(m.SendCancelled) == [m.SendCancelled("x")]
        # the real transfer: chunks arrive as the "scheduler" gathers them
        a.to_io(m.StartSend(h, b.data_endpoint))
        for i in range(h.num_chunks):
            a.to_io(m.ChunkGathered(h.transfer_id, i, chunk(h, payload, i), 0.125))
        [install] = b.wait_for(m.Install)
        inc, hashes = install.incoming, install.block_hashes
        assert hashes == page_hashes(h.token_ids, 4, "")
        assert torch.equal(inc.buffer, payload)
        b.to_io(m.Installed(inc, hashes, inserted_len=12, scatter_s=0.0, insert_s=0.0))
        [stored] = coord.wait_for(p.ReplicaStored)
        [sent] = coord.wait_for(p.SourceSent)
        assert (stored.worker_id, stored.replication_id, stored.inserted_len) == ("b", "r1", 12)
        assert (sent.worker_id, sent.num_tokens, sent.num_bytes, sent.gather_s) == ("a", 12, h.num_bytes, 0.25)
        # the scheduler side heard of every chunk on the wire, in order, and of no failure of this one
        assert [x.num_sent for x in a.wait_for(m.ChunksSent, 2) if x.transfer_id == "t1"] == [1, 2]
        assert [x.transfer_id for x in a.got if isinstance(x, m.SendCancelled)] == ["x"]
        # a corrupted chunk of a granted transfer: refused, the grant consumed, the coordinator told
        h2 = header(tid="t2", rid="r2")
        coord.grant("b", h2)
        coord.wait_for(p.ReplicaExpected, 2)
        reply = send_transfer(b.data_endpoint, h2, payload_of(h2).numpy().tobytes(), corrupt_chunk=0)
        assert isinstance(reply, p.TransferRefused) and "checksum mismatch in chunk 0" in reply.error
        [failed] = coord.wait_for(p.ReplicationFailed)
        assert (failed.worker_id, failed.replication_id, failed.role) == ("b", "r2", "target")
        assert not any(isinstance(m, p.ReplicationFailed) and m.replication_id == "r1" for m in coord.got)
    finally:
        a.close()
        b.close()
        coord.sock.close()
    assert not b.loop.expected and b.loop.transport.staging.cached_bytes() == h.num_bytes  # one buffer, reused


# ------------------------------------------------------------------------------------- with keys (CurveZMQ)
@pytest.fixture(scope="module")
def keydir(tmp_path_factory):
    from radix_sync.keys import create_dir

    return create_dir(tmp_path_factory.mktemp("keys") / "k", 3, 0)


def keyed_side(ctx, keydir, i: int, **cfg) -> Side:
    """Worker i's transport, in a context of its own (as each worker has: one ZAP handler per context)."""
    own = zmq.Context()
    OWN_CONTEXTS.append(own)
    return Side(own, keys=str(keydir.path), key_name=f"worker-{i}", **cfg)


HANDSHAKE_OUTCOMES = (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                      zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def handshake_outcome(sock, mon, sides) -> int:
    """The first handshake outcome `mon` (a monitor set up on `sock` before it connected) reports, pumping
    `sides` meanwhile; the monitor is then closed."""
    from zmq.utils.monitor import recv_monitor_message

    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for side in sides:
                side.step(1)
            if mon.poll(10):
                ev = recv_monitor_message(mon)["event"]
                if ev in HANDSHAKE_OUTCOMES:
                    return ev
        raise AssertionError("no handshake outcome")
    finally:
        sock.disable_monitor()
        mon.close(0)


def test_keyed_transfer_lands_between_allow_listed_workers(ctx, keydir):
    src, dst = keyed_side(ctx, keydir, 0), keyed_side(ctx, keydir, 1)
    h = header(source_id="worker-0")
    payload = payload_of(h)
    src.t.send(h, dst.t.endpoint, "worker-1")
    for i in range(h.num_chunks):
        src.t.push_chunk(h.transfer_id, i, chunk(h, payload, i), 0.0)
    pump([src, dst], lambda: dst.of(TransferReceived))
    assert torch.equal(dst.of(TransferReceived)[0].incoming.buffer, payload)
    src.t.close()
    dst.t.close()


def test_keyed_data_port_admits_no_stranger_and_no_impersonation(ctx, keydir):
    from radix_sync.keys import KeyPair, curve_client

    dst = keyed_side(ctx, keydir, 1)
    server_key = keydir.workers["worker-1"].public
    # no CURVE, or a key outside the allow-list: the handshake fails, admit is never even asked
    for curve in (None, (KeyPair("stranger", *zmq.curve_keypair()), server_key)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve:
            curve_client(sock, *curve)
        mon = sock.get_monitor_socket()
        sock.connect(dst.t.endpoint)
        sock.send(p.encode(header(source_id="worker-0")))
        assert handshake_outcome(sock, mon, [dst]) != zmq.EVENT_HANDSHAKE_SUCCEEDED
        sock.close(0)
    assert not dst.events and not dst.t.incoming
    # worker-2's genuine key, speaking for worker-0: refused before admit, not reported (it would fail worker-0's)
    replies = []
    sender = threading.Thread(target=lambda: replies.append(send_transfer(
        dst.t.endpoint, header(source_id="worker-0"), payload_of(header()).numpy().tobytes(),
        curve=(keydir.pair("worker-2"), server_key))))
    sender.start()
    pump([dst], lambda: dst.of(TransferFailed))
    sender.join(20)
    err = "source_id 'worker-0' is not the worker of this connection's key ('worker-2')"
    assert dst.of(TransferFailed) == [TransferFailed("t1", "r1", "target", err, tell_coordinator=False)]
    assert isinstance(replies[0], p.TransferRefused) and replies[0].error == err
    assert not dst.t.incoming and dst.t.staging.cached_bytes() == 0
    dst.t.close()


def test_keyed_source_sends_only_to_the_targets_own_key(ctx, keydir):
    src, dst = keyed_side(ctx, keydir, 0), keyed_side(ctx, keydir, 1)
    # a target id with no allow-listed key: failed at once, nothing connected
    src.t.send(header(), dst.t.endpoint, "worker-9")
    assert src.of(TransferFailed) == [TransferFailed(
        "t1", "r1", "source", "target 'worker-9' has no key in the allow-list: not sending it anything")]
    assert not src.t.peers and not src.t.outgoing
    # worker-1's endpoint named as worker-2's: worker-1 cannot prove it holds worker-2's key, no handshake
    src.t.send(header(tid="t2", source_id="worker-0"), dst.t.endpoint, "worker-2")
    sock = src.t.peers[dst.t.endpoint]
    result = [handshake_outcome(sock, sock.get_monitor_socket(), [src, dst])]
    assert result[0] != zmq.EVENT_HANDSHAKE_SUCCEEDED and not dst.events and not dst.t.incoming
    src.t.close()
    dst.t.close()


def test_chunks_count_only_from_the_connection_that_opened_the_transfer(ctx):
    dst = Side(ctx)
    h = header()
    payload = payload_of(h)
    owner, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (owner, other):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(dst.t.endpoint)
    from sglang_kvrep.dataplane.wire import chunk_frames

    owner.send(p.encode(h))
    pump([dst], lambda: "t1" in dst.t.incoming)
    other.send_multipart(chunk_frames(h, 0, chunk(h, torch.zeros_like(payload), 0)))
    other.send(p.encode(p.TransferEnd(transfer_id="t1")))
    for i in range(h.num_chunks):
        owner.send_multipart(chunk_frames(h, i, chunk(h, payload, i)))
    owner.send(p.encode(p.TransferEnd(transfer_id="t1")))
    pump([dst], lambda: dst.of(TransferReceived))
    assert torch.equal(dst.of(TransferReceived)[0].incoming.buffer, payload) and not dst.of(TransferFailed)
    for s in (owner, other):
        s.close(0)
    dst.t.close()


def test_one_resync_however_many_facts_a_restarted_coordinator_turns_down(ctx):
    """A coordinator that restarted answers every fact sent before the worker noticed with `ResyncRequested`;
    the worker resyncs once (the requests that answer facts from before its new hello are stale)."""
    coord = FakeCoordinator(ctx)
    agent = StubAgent("a", coord.endpoint)
    try:
        [first] = coord.wait_for(p.Hello)
        coord.sock.send_multipart([coord.ids["a"], p.encode(p.HelloAck(coordinator_id="one"))])
        load = p.LoadReported(worker_id="a", seq=0, num_running_reqs=0, num_waiting_reqs=0, num_waiting_tokens=0,
                              available_tokens=1, evictable_tokens=0, replica_tokens=0)
        for _ in range(20):
            agent.to_io(m.ToCoordinator(msgspec.structs.replace(load)))
        facts = coord.wait_for(p.LoadReported, 20)
        # the restarted coordinator turns down all 20, then acks the one hello that comes
        for _ in facts:
            coord.sock.send_multipart([coord.ids["a"], p.encode(p.ResyncRequested(reason="unknown worker"))])
        coord.wait_for(p.Hello, 2)
        coord.sock.send_multipart([coord.ids["a"], p.encode(p.HelloAck(coordinator_id="two"))])
        agent.to_io(m.ToCoordinator(msgspec.structs.replace(load)))
        coord.wait_for(p.LoadReported, 22)  # the resync's load, then this one: the link is live again
        stats = agent.loop.stats
        # the ack and the load reach the I/O loop on two sockets: the ack may be read after the load went out
        wait_until(lambda: stats["coordinator_restarts"] == 1, 10, what="the second HelloAck read")
        assert (stats["hellos"], stats["stale_resync_requests"], stats["coordinator_restarts"]) == (2, 19, 1)
        assert len([x for x in coord.got if isinstance(x, p.Hello)]) == 2
    finally:
        agent.close()
        coord.sock.close()


def test_keyed_io_sides_replicate_through_curve_planes(keydir):
    """The whole worker side with keys: both I/O sides reach a CURVE coordinator with their own keys, the source
    learns the target's id from `ReplicatePages` and sends only to that worker's key, and the pages land."""
    ctx = zmq.Context()
    coord = FakeCoordinator(ctx, keydir)
    kw = {"keys": str(keydir.path)}
    a = StubAgent("worker-0", coord.endpoint, key_name="worker-0", **kw)
    b = StubAgent("worker-1", coord.endpoint, key_name="worker-1", **kw)
    try:
        coord.wait_for(p.Hello, 2)
        h = header(source_id="worker-0")
        payload = payload_of(h)
        coord.grant("worker-1", h)
        coord.wait_for(p.ReplicaExpected)
        coord.sock.send_multipart([coord.ids["worker-0"], p.encode(p.ReplicatePages(
            replication_id="r1", auth_token="good", token_ids=h.token_ids, namespace="", target_id="worker-1",
            target_endpoint=b.data_endpoint, target_fingerprint="fp", ttl_s=5.0))])
        a.wait_for(m.Replicate)  # what the scheduler side gets; it gathers and starts the send
        a.to_io(m.StartSend(h, b.data_endpoint))
        for i in range(h.num_chunks):
            a.to_io(m.ChunkGathered(h.transfer_id, i, chunk(h, payload, i), 0.0))
        [install] = b.wait_for(m.Install)
        assert torch.equal(install.incoming.buffer, payload)
        assert not a.loop.send_targets  # consumed by the send
    finally:
        a.close()
        b.close()
        coord.sock.close()
        coord.auth.stop()
        ctx.destroy(linger=0)


def test_a_resync_announces_held_replicas_with_the_ttl_left_and_never_an_expired_one(ctx):
    coord = FakeCoordinator(ctx)
    info = m.WorkerInfo(fingerprint="fp", fingerprint_fields={}, page_size=4, pool_capacity_tokens=1000,
                        replica_budget_tokens=100, free_replica_tokens=100, geometry=GEO)
    io = IoSide(KvrepConfig(coordinator=coord.endpoint, worker_id="w"), info, m.Mailbox())
    try:
        now = time.monotonic()
        for rid, left_s in (("gone", 50.0), ("live", 20.0), ("overdue", -3.0)):
            fact = p.ReplicaStored(worker_id="w", seq=0, replication_id=rid, namespace="", block_hashes=[1],
                                   inserted_len=4, expires_in_s=60.0, num_bytes=1, receive_s=0.0, scatter_s=0.0,
                                   insert_s=0.0)
            io.replica_facts[rid] = (fact, now + left_s)
        io.on_message(m.ToCoordinator(p.ReplicaExpired(worker_id="w", seq=0, replication_id="gone",
                                                        num_evicted_tokens=4)))
        deadline = time.monotonic() + 20
        while io.need_resync:  # the first hello goes once the link is up (IMMEDIATE: no queue before that)
            assert time.monotonic() < deadline
            io.keep_link(time.monotonic())
            time.sleep(0.01)
        stored = {f.replication_id: f.expires_in_s for f in coord.wait_for(p.ReplicaStored, 2)}
        assert stored.keys() == {"live", "overdue"}  # "overdue": past its TTL but still held (a queued request)
        assert 0 < stored["live"] <= 20.0 and stored["overdue"] == 0.0
    finally:
        io.transport.close()
        io.coord.close(0)
        io.ctx.term()
        coord.sock.close()


def test_a_cancelled_send_is_reported_failed_once_and_sends_nothing_more(ctx):
    src = Side(ctx)
    h = header()
    src.t.send(h, "tcp://127.0.0.1:1")  # nobody listens: nothing leaves, the transfer stays open
    src.t.push_chunk(h.transfer_id, 0, chunk(h, payload_of(h), 0), 0.0)
    src.t.cancel(h.transfer_id, "gather of chunk 1 failed")
    [failed] = src.of(TransferFailed)
    assert (failed.transfer_id, failed.replication_id, failed.role, failed.error, failed.tell_coordinator) == (
        h.transfer_id, "r1", "source", "gather of chunk 1 failed", True)
    assert not src.t.outgoing
    src.t.cancel(h.transfer_id, "again")  # ended: not reported twice
    src.t.push_chunk(h.transfer_id, 1, chunk(h, payload_of(h), 1), 0.0)  # ignored
    src.step()
    assert len(src.of(TransferFailed)) == 1 and not src.t.outgoing and not src.t.send_queue
    src.t.close()


def test_io_side_reports_a_failed_gather_to_the_coordinator(ctx):
    coord = FakeCoordinator(ctx)
    a = StubAgent("a", coord.endpoint)
    try:
        coord.wait_for(p.Hello)
        h = header()
        a.to_io(m.StartSend(h, "tcp://127.0.0.1:1"))
        a.to_io(m.ChunkGathered(h.transfer_id, 0, chunk(h, payload_of(h), 0), 0.0))
        a.to_io(m.GatherFailed(h.transfer_id, "gather of chunk 1 failed: injected"))
        [failed] = coord.wait_for(p.ReplicationFailed)
        assert (failed.worker_id, failed.replication_id, failed.role) == ("a", "r1", "source")
        assert "gather of chunk 1 failed" in failed.error
        assert a.wait_for(m.SendCancelled) == [m.SendCancelled(h.transfer_id)]
    finally:
        a.close()


def test_a_transfer_to_a_gpu_worker_lands_in_its_pinned_arena_and_the_arena_is_reused(ctx):
    """With an arena (a GPU worker's pinned receive memory, `make_transport(..., arena=)`), a transfer is received
    into a view of it, marked `pinned` (it uploads in one asynchronous copy), bit-exact; answered, the view goes
    back to the arena, and the next transfer lands at the same place. A transfer that does not fit gets pageable
    memory as before."""
    from sglang_kvrep.dataplane.staging import ARENA_ALIGN

    arena = torch.zeros(2 * ARENA_ALIGN, dtype=torch.uint8)
    src = Side(ctx)
    dst = Side(ctx)
    dst.t.close()
    dst.t = make_transport("zmq", KvrepConfig(), admit_token, dst.events.append, ctx, dst.poller, arena=arena)
    h = header()
    payload = payload_of(h)
    inc = send_whole(src, dst, h, payload)
    assert inc.pinned and inc.storage.data_ptr() == arena.data_ptr() and torch.equal(inc.buffer, payload)
    dst.t.answer(inc, inserted_len=12)
    pump([src, dst], lambda: not src.t.outgoing)
    assert dst.t.staging.arena_free_bytes() == 2 * ARENA_ALIGN and dst.t.staging.cached_bytes() == 0
    big = header(tid="t2", rid="r2", num_pages=12, pages_per_chunk=4)  # 9 KiB: more than the arena
    inc2 = send_whole(src, dst, big, payload_of(big, 2))
    assert not inc2.pinned and torch.equal(inc2.buffer, payload_of(big, 2))
    src.t.close()
    dst.t.close()
