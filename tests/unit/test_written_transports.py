"""The registered-memory transports (`WrittenTransport`: `NixlTransport`, `--kvrep-transport nixl`, and
`MooncakeTransport`, `--kvrep-transport mooncake`) against the same contract as the ZeroMQ one, each with its real
engine (NIXL's UCX backend on this host's shared memory / loopback; Mooncake Transfer Engine's TCP transport on
loopback): a transfer lands bit-exact in the target's registered staging buffer with no staging copy; a chunk whose
written bytes do not match its announced checksum, a wrong token and a silent source end as `TransferFailed`, and
the staging buffer comes back to the pool (after the quarantine that keeps a failed transfer's late writes out of
the next one); a ZeroMQ source can still send to either target, and their sources are refused, with a clear
error, by a ZeroMQ-only target and fall back to ZeroMQ; the agent's I/O side on top replicates through each.
Another process as the target: `scripts/bench_transport.py --transports nixl,mooncake`
(tests/component/test_bench_transport.py)."""
import pytest
import torch
import zmq

from radix_sync import protocol as p
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.config import KvrepConfig
from sglang_kvrep.dataplane.mooncake_transport import MooncakeTransport, mooncake_missing
from sglang_kvrep.dataplane.nixl_transport import NixlTransport, nixl_missing
from sglang_kvrep.dataplane.registry import check_transport_name, known_transports
from sglang_kvrep.dataplane.transport import ChunkSent, TransferFailed, TransferReceived, TransferSent
from sglang_kvrep.dataplane.wire import send_transfer
from tests.unit.test_transport import (OWN_CONTEXTS, FakeCoordinator, Side, StubAgent, chunk, ctx,  # noqa: F401
                                      header, keydir, payload_of, pump, send_whole)


MISSING = {NixlTransport: nixl_missing, MooncakeTransport: mooncake_missing}


@pytest.fixture(params=[NixlTransport, MooncakeTransport], ids=["nixl", "mooncake"])
def kind(request):
    return request.param


def test_each_engine_is_installed_and_selectable(kind):
    assert MISSING[kind]() is None  # pinned in requirements-pins.txt: a host without it fails here, not skips
    assert kind.name in known_transports()
    check_transport_name(kind.name)
    assert KvrepConfig(transport=kind.name).transport == kind.name


def test_transfer_lands_bit_exact_in_the_registered_staging_without_a_copy(ctx, kind):
    src, dst = Side(ctx, kind=kind), Side(ctx, kind=kind)
    h = header(num_pages=5, pages_per_chunk=2)
    payload = payload_of(h)
    src.t.send(h, dst.t.endpoint)
    src.t.push_chunk(h.transfer_id, 0, chunk(h, payload, 0), 0.25)
    pump([src, dst], lambda: src.of(ChunkSent))
    assert not src.of(TransferSent)
    for i in (1, 2):
        src.t.push_chunk(h.transfer_id, i, chunk(h, payload, i), 0.25)
    pump([src, dst], lambda: dst.of(TransferReceived))
    assert src.of(ChunkSent) == [ChunkSent("t1", 1), ChunkSent("t1", 2), ChunkSent("t1", 3)]
    [sent] = src.of(TransferSent)
    assert sent.header.transport == kind.name and sent.gather_s == 0.75
    inc = dst.of(TransferReceived)[0].incoming
    assert inc.header.transport == kind.name and inc.chunks == {0, 1, 2} and inc.received_bytes == h.num_bytes
    assert torch.equal(inc.buffer, payload)  # every byte, written in place in the buffer layout
    assert inc.storage.data_ptr() in dst.t._registered  # the buffer the engine wrote into is the one handed over
    dst.t.answer(inc, inserted_len=20)
    pump([src, dst], lambda: not src.t.outgoing)
    assert not src.t.writes.get("t1") and not src.t.orphans and not src.t.ready  # every WRITE released
    assert dst.t.staging.cached_bytes() == h.num_bytes
    # the next transfer reuses the registered buffer (a NIXL source adds the target's metadata once)
    h2 = header(tid="t2", num_pages=2)
    src.t.send(h2, dst.t.endpoint)
    src.t.push_chunk("t2", 0, chunk(h2, payload_of(h2, 1), 0), 0.0)
    pump([src, dst], lambda: len(dst.of(TransferReceived)) == 2)
    inc2 = dst.of(TransferReceived)[1].incoming
    assert inc2.storage.data_ptr() == inc.storage.data_ptr() and torch.equal(inc2.buffer, payload_of(h2, 1))
    if kind is NixlTransport:
        assert list(src.t.remote) == [dst.t.agent_name]
    assert not src.of(TransferFailed) and not dst.of(TransferFailed)
    src.t.close()
    dst.t.close()


def test_written_bytes_that_do_not_match_their_checksum_are_refused_and_quarantined(ctx, kind):
    src, dst = Side(ctx, kind=kind), Side(ctx, kind=kind, clock=True, transfer_timeout_s=5.0)
    h = header()
    payload = payload_of(h)
    src.t.send(h, dst.t.endpoint)
    pump([src, dst], lambda: "t1" in src.t.ready)
    src.t.push_chunk("t1", 0, chunk(h, payload, 0), 0.0)
    # written and announced; the target's engine progresses (as its I/O loop drives it) but it has not read the
    # announcement yet
    pump([src], lambda: (dst.t._engine_progress(True), src.of(ChunkSent))[1])
    staged = dst.t.incoming["t1"].storage
    staged[7] ^= 0xFF  # what a forged write on the fabric would do
    pump([src, dst], lambda: dst.of(TransferFailed))
    [failed] = dst.of(TransferFailed)
    assert failed.role == "target" and failed.error.startswith("checksum mismatch in chunk 0: written")
    pump([src, dst], lambda: src.of(TransferFailed))  # the source stops: the target refused it
    assert not dst.t.incoming and dst.t.staging.cached_bytes() == 0 and len(dst.t.quarantine) == 1
    dst.now = 5.01  # the source may write late for as long as its own stall timeout: then the buffer is reused
    dst.step(0)
    assert not dst.t.quarantine and dst.t.staging.cached_bytes() == h.num_bytes
    src.t.close()
    dst.t.close()


def test_wrong_token_is_refused_before_any_registration_is_offered(ctx, kind):
    src, dst = Side(ctx, kind=kind), Side(ctx, kind=kind)
    src.t.send(header(token="forged"), dst.t.endpoint)
    pump([src, dst], lambda: src.of(TransferFailed))
    assert dst.of(TransferFailed) == [TransferFailed("t1", "r1", "target", "bad token", tell_coordinator=False)]
    assert not src.t.ready and not getattr(src.t, "remote", None)  # no TransferReady: no address given out
    assert not dst.t.incoming and dst.t.staging.cached_bytes() == 0 and not dst.t._registered
    src.t.close()
    dst.t.close()


def test_silent_source_times_out_and_its_staging_comes_back_after_the_quarantine(ctx, kind):
    src, dst = Side(ctx, kind=kind), Side(ctx, kind=kind, clock=True, transfer_timeout_s=5.0)
    h = header()
    src.t.send(h, dst.t.endpoint)
    pump([src, dst], lambda: "t1" in src.t.ready)  # then the source never gathers a chunk
    dst.now = 5.01
    dst.step(0)
    [failed] = dst.of(TransferFailed)
    assert failed.error.startswith("transfer timed out: no data for 5s (0/")
    assert dst.t.staging.cached_bytes() == 0
    dst.now = 10.03
    dst.step(0)
    assert dst.t.staging.cached_bytes() == h.num_bytes
    src.t.close()
    dst.t.close()


def test_mixed_fleets_a_zmq_source_sends_to_a_written_target_and_a_written_source_falls_back_to_zmq(ctx, kind):
    dst = Side(ctx, kind=kind)
    h = header()
    payload = payload_of(h)
    import threading

    replies = []
    sender = threading.Thread(target=lambda: replies.append(send_transfer(dst.t.endpoint, h,
                                                                          payload.numpy().tobytes())))
    sender.start()
    pump([dst], lambda: dst.of(TransferReceived))
    inc = dst.of(TransferReceived)[0].incoming
    assert inc.header.transport == "zmq" and torch.equal(inc.buffer, payload)
    dst.t.answer(inc, inserted_len=12)
    sender.join(20)
    assert isinstance(replies[0], p.TransferAccepted)
    src, zdst = Side(ctx, kind=kind), Side(ctx)
    h2 = header(tid="t2")
    src.t.send(h2, zdst.t.endpoint)
    src.t.push_chunk("t2", 0, chunk(h2, payload, 0), 0.0)  # queued while the target answers the header
    pump([src, zdst], lambda: zdst.t.endpoint in src.t.zmq_targets)
    # refused as a negotiation, not as a failure: nothing admitted on the target, no one told, nothing lost
    assert not zdst.events and not src.of(TransferFailed)
    src.t.push_chunk("t2", 1, chunk(h2, payload, 1), 0.0)
    pump([src, zdst], lambda: zdst.of(TransferReceived))
    inc2 = zdst.of(TransferReceived)[0].incoming
    assert inc2.header.transport == "zmq" and torch.equal(inc2.buffer, payload)
    zdst.t.answer(inc2, inserted_len=12)
    pump([src, zdst], lambda: not src.t.outgoing)
    h3 = header(tid="t3")  # the next one to that worker goes over ZMQ at once
    src.t.send(h3, zdst.t.endpoint)
    assert src.t.outgoing["t3"].header.transport == "zmq"
    assert not src.of(TransferFailed) and not zdst.of(TransferFailed)
    for t in (src.t, zdst.t, dst.t):
        t.close()


def test_io_sides_replicate_through_each_engine(kind):
    ctx = zmq.Context()
    coord = FakeCoordinator(ctx)
    a = StubAgent("a", coord.endpoint, transport=kind.name)
    b = StubAgent("b", coord.endpoint, transport=kind.name)
    try:
        coord.wait_for(p.Hello, 2)
        h = header()
        payload = payload_of(h)
        coord.grant("b", h)
        coord.wait_for(p.ReplicaExpected)
        a.to_io(m.StartSend(h, b.data_endpoint))
        for i in range(h.num_chunks):
            a.to_io(m.ChunkGathered(h.transfer_id, i, chunk(h, payload, i), 0.0))
        [install] = b.wait_for(m.Install)
        assert install.incoming.header.transport == kind.name and torch.equal(install.incoming.buffer, payload)
        b.to_io(m.Installed(install.incoming, install.block_hashes, inserted_len=12, scatter_s=0.0, insert_s=0.0))
        [stored] = coord.wait_for(p.ReplicaStored)
        [sent] = coord.wait_for(p.SourceSent)
        assert (stored.worker_id, stored.inserted_len, sent.num_bytes) == ("b", 12, h.num_bytes)
    finally:
        a.close()
        b.close()
        coord.sock.close()
        ctx.destroy(linger=0)


def test_a_target_that_registers_a_new_buffer_mid_flight_is_still_written_correctly(ctx, kind):
    src, dst = Side(ctx, kind=kind), Side(ctx, kind=kind)
    small, big = header(tid="s", num_pages=2), header(tid="b", num_pages=6, pages_per_chunk=2)
    src.t.send(small, dst.t.endpoint)
    src.t.push_chunk("s", 0, chunk(small, payload_of(small), 0), 0.0)
    pump([src, dst], lambda: "s" in src.t.ready)
    src.t.send(big, dst.t.endpoint)  # a second staging buffer registered while the first transfer is open
    pump([src, dst], lambda: "b" in src.t.ready)
    for i in range(big.num_chunks):
        src.t.push_chunk("b", i, chunk(big, payload_of(big, 2), i), 0.0)
    pump([src, dst], lambda: len(dst.of(TransferReceived)) == 2)
    got = {r.incoming.header.transfer_id: r.incoming for r in dst.of(TransferReceived)}
    assert torch.equal(got["s"].buffer, payload_of(small)) and torch.equal(got["b"].buffer, payload_of(big, 2))
    assert len(dst.t._registered) == 2 and not src.of(TransferFailed)
    src.t.close()
    dst.t.close()


def test_garbage_in_a_targets_transfer_ready_fails_that_transfer_only(ctx, kind):
    src = Side(ctx, kind=kind)
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    h = header()
    src.t.send(h, endpoint)
    pump([src], lambda: fake.poll(0))
    peer, raw = fake.recv_multipart()
    assert p.decode_data_plane(raw).transport == kind.name
    fake.send_multipart([peer, p.encode(p.TransferReady(transfer_id="t1", agent_name="x", agent_metadata=b"\x00junk",
                                                        address=4096, num_bytes=h.num_bytes))])
    pump([src], lambda: src.of(TransferFailed))
    [failed] = src.of(TransferFailed)
    assert failed.role == "source" and failed.error.startswith({
        NixlTransport: "nixl: target's agent metadata refused",
        MooncakeTransport: "mooncake: target's session 'x' is not an engine on its own host"}[kind]), failed
    assert not src.t.outgoing and not getattr(src.t, "remote", None)
    # a TransferReady for a transfer this source never sent is ignored
    fake.send_multipart([peer, p.encode(p.TransferReady(transfer_id="nope", agent_name="x", agent_metadata=b"",
                                                        address=0, num_bytes=1))])
    for _ in range(5):
        src.step()
    assert len(src.of(TransferFailed)) == 1 and not src.t.ready
    fake.close(0)
    src.t.close()


def test_with_keys_the_address_goes_only_to_the_allow_listed_source_and_no_one_speaks_for_another(keydir, kind):
    def keyed(i):
        own = zmq.Context()
        OWN_CONTEXTS.append(own)
        return Side(own, kind=kind, keys=str(keydir.path), key_name=f"worker-{i}")

    try:
        src, dst, other = keyed(0), keyed(1), keyed(2)
        h = header(source_id="worker-0")
        payload = payload_of(h)
        src.t.send(h, dst.t.endpoint, "worker-1")
        for i in range(h.num_chunks):
            src.t.push_chunk(h.transfer_id, i, chunk(h, payload, i), 0.0)
        pump([src, dst], lambda: dst.of(TransferReceived))
        assert torch.equal(dst.of(TransferReceived)[0].incoming.buffer, payload)
        # an allow-listed worker that claims another's transfer gets no TransferReady (no address, no metadata)
        other.t.send(header(tid="t2", source_id="worker-0"), dst.t.endpoint, "worker-1")
        pump([other, dst], lambda: other.of(TransferFailed))
        assert "is not the worker of this connection's key" in other.of(TransferFailed)[0].error
        assert not other.t.ready and not getattr(other.t, "remote", None)
        for side in (src, dst, other):
            side.t.close()
    finally:
        while OWN_CONTEXTS:
            OWN_CONTEXTS.pop().destroy(linger=0)


def test_a_gpu_workers_arena_leaves_the_registered_staging_alone(ctx, kind):
    """`make_transport(..., arena=)` gives a GPU worker's pinned arena to a transport that can receive into it; the
    engines write into staging they registered, so they keep their own (an arena view would be advertised
    unregistered): the transfer still lands bit-exact, not marked pinned."""
    from sglang_kvrep.dataplane.registry import make_transport

    src, dst = Side(ctx, kind=kind), Side(ctx, kind=kind)
    dst.t.close()
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    dst.t = make_transport(kind.name, KvrepConfig(), dst.t.admit, dst.events.append, ctx, dst.poller, arena=arena)
    assert dst.t.staging.arena is None
    h = header(num_pages=3, pages_per_chunk=2)
    payload = payload_of(h)
    inc = send_whole(src, dst, h, payload)
    assert not inc.pinned and torch.equal(inc.buffer, payload)
    src.t.close()
    dst.t.close()


# ------------------------------------------------------------------------------------------ Mooncake's own
def test_mooncake_a_write_outside_the_targets_registered_memory_fails_that_transfer(ctx):
    """A target that names a real engine on its own host but an address outside what that engine registered: the
    engine refuses the WRITE, the transfer fails on the source (reported once), and the source keeps serving."""
    src, other = Side(ctx, kind=MooncakeTransport), Side(ctx, kind=MooncakeTransport)
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    h = header()
    payload = payload_of(h)
    src.t.send(h, endpoint)
    pump([src], lambda: fake.poll(0))
    peer, _ = fake.recv_multipart()
    fake.send_multipart([peer, p.encode(p.TransferReady(transfer_id="t1", agent_name=other.t.session,
                                                        agent_metadata=b"", address=4096, num_bytes=h.num_bytes))])
    pump([src], lambda: "t1" in src.t.ready)
    src.t.push_chunk("t1", 0, chunk(h, payload, 0), 0.0)
    pump([src, other], lambda: src.of(TransferFailed))
    [failed] = src.of(TransferFailed)
    assert failed.role == "source" and failed.error == "mooncake: WRITE of chunk 0 failed"
    pump([src], lambda: not src.t.writes and not src.t.orphans)  # every WRITE ended and released
    assert not src.t.outgoing and not src.of(ChunkSent)
    inc = send_whole(src, other, header(tid="t2"), payload)  # and the next transfer lands
    assert torch.equal(inc.buffer, payload)
    fake.close(0)
    src.t.close()
    other.t.close()


def test_mooncake_loads_the_libraries_the_host_lacks_from_next_to_the_package():
    """scripts/env.sh unpacks libibverbs and libnl (requirements-native.txt) next to the `mooncake` package; the
    transport loads them by path only where the host has none, so the engine imports without `LD_LIBRARY_PATH`."""
    from sglang_kvrep.dataplane import mooncake_transport as mt

    folder = mt.native_dirs()[-1]
    assert folder.name == "kvrep_native_libs"
    assert all((folder / soname).exists() for soname in mt.NATIVE_LIBS), sorted(folder.iterdir())
    assert mt.load_mooncake().TransferEngine is not None and mt.host_memory_only()
    assert mt._preload() == []  # every one loadable now, from the host or from the folder


def test_mooncakes_cpu_build_refuses_device_memory_clearly(ctx):
    side = Side(ctx, kind=MooncakeTransport)
    with pytest.raises(ValueError, match="CPU build of Mooncake cannot read meta memory"):
        side.t._engine_register(torch.empty(16, dtype=torch.uint8, device="meta"))
    side.t.close()


def test_a_staging_buffer_the_engine_will_not_register_refuses_that_transfer_and_holds_nothing(ctx, kind):
    """The target admitted the header (its replica budget reserved) and then its engine refused the new staging
    buffer (e.g. a low RLIMIT_MEMLOCK over RDMA): the transfer is refused and reported, so the reservation is
    released, and the next transfer lands."""
    src, dst = Side(ctx, kind=kind), Side(ctx, kind=kind)
    register = dst.t._engine_register

    def refuse(buf):
        raise RuntimeError("register_memory returned -1")

    dst.t._engine_register = refuse
    h = header()
    src.t.send(h, dst.t.endpoint)
    pump([src, dst], lambda: dst.of(TransferFailed) and src.of(TransferFailed))
    [failed] = dst.of(TransferFailed)
    assert failed.role == "target" and failed.error == "no staging buffer: register_memory returned -1"
    assert failed.tell_coordinator and not dst.t.incoming and not dst.t._registered
    dst.t._engine_register = register
    payload = payload_of(h)
    inc = send_whole(src, dst, header(tid="t2"), payload)
    assert torch.equal(inc.buffer, payload)
    src.t.close()
    dst.t.close()


class _FakeEngine:
    """`transfer_check_status` answers from a script per batch id; every call recorded."""

    def __init__(self, answers: dict) -> None:
        self.answers = {k: list(v) for k, v in answers.items()}
        self.calls: list[int] = []

    def transfer_check_status(self, bid: int) -> int:
        self.calls.append(bid)
        return self.answers[bid].pop(0)


def test_mooncake_a_timed_out_write_fails_its_transfer_and_is_watched_until_the_engine_lets_go(ctx):
    """-2 (timed out) fails the transfer at once (LOST) but the engine keeps that batch and may still read the
    chunk: it stays watched (and its memory registered) until 1 or -1; an id that answered 1 or -1 is never asked
    again (the binding freed it)."""
    from sglang_kvrep.dataplane.mooncake_transport import _Writes
    from sglang_kvrep.dataplane.written import DONE, ERR, LOST, PROC, Write

    side = Side(ctx, kind=MooncakeTransport)
    engine, side.t.engine = side.t.engine, _FakeEngine({5: [0, -2, -2, 1], 6: [1], 7: [0, 1], 8: [-1]})
    try:
        w = _Writes()
        w.ids, w.ends = [5, 6], [0, 0]
        write = Write("t1", 0, torch.zeros(4, dtype=torch.uint8), b"", None, w)
        assert side.t._engine_state(write) == PROC  # 5 in flight, 6 done
        assert side.t._engine_state(write) == LOST  # 5 timed out: the transfer fails, the write is still watched
        assert side.t._engine_state(write) == LOST
        assert side.t._engine_state(write) == ERR  # 5 ended: released now; a timed-out write never counts as DONE
        assert side.t._engine_state(write) == ERR and side.t.engine.calls == [5, 6, 5, 5, 5]
        ok = _Writes()
        ok.ids, ok.ends = [7, 8], [0, 0]
        other = Write("t2", 0, torch.zeros(4, dtype=torch.uint8), b"", None, ok)
        assert side.t._engine_state(other) == PROC and side.t._engine_state(other) == ERR
        done = _Writes()
        done.ids, done.ends = [9], [1]
        assert side.t._engine_state(Write("t3", 0, torch.zeros(1), b"", None, done)) == DONE
        assert side.t.engine.calls[5:] == [7, 8, 7]
    finally:
        side.t.engine = engine
        side.t.close()


def test_mooncake_names_its_engine_by_the_host_peers_reach_it_at():
    """The session is the advertised host (a wildcard data host is no address: the one that routes to the
    coordinator, as the data endpoint has), and a source compares hosts without IPv6 brackets."""
    from types import SimpleNamespace

    from sglang_kvrep.dataplane.mooncake_transport import session_host

    cfg = SimpleNamespace(advertise_host="", data_host="0.0.0.0", coordinator="tcp://127.0.0.1:5600")
    assert session_host(cfg) == "127.0.0.1"
    assert session_host(SimpleNamespace(advertise_host="10.1.2.3", data_host="0.0.0.0", coordinator="")) == "10.1.2.3"
    assert session_host(SimpleNamespace(advertise_host="", data_host="[::1]", coordinator="")) == "::1"
    accept = MooncakeTransport._accept_peer
    out = SimpleNamespace(endpoint="tcp://[::1]:5555")
    ready = p.TransferReady(transfer_id="t", agent_name="::1:16000", agent_metadata=b"", address=0, num_bytes=1)
    assert accept(None, ready, out) is None
    for name in ("::2:16000", "::1:0", "::1:x", "::1:70000"):
        assert "is not an engine on its own host" in accept(None, msgspec_replace(ready, agent_name=name), out)


def msgspec_replace(msg, **kw):
    import msgspec

    return msgspec.structs.replace(msg, **kw)
