"""A target's staging is bounded across concurrent grants by its replica budget: five granted transfers that each
fit the budget but not together are admitted while they fit and refused after with a clear reason the
coordinator hears (the scheduler thread never sees them: no KV slot is taken); what an ended transfer held is
free again. Timings a worker reports are finite. A weight update re-announces the worker with its new
fingerprint and transfers of the old one are refused. Real sockets over loopback, a fake coordinator."""
import math
import time

import msgspec
import pytest
import torch
import zmq

from radix_sync import protocol as p
from sglang_kvrep import compat
from sglang_kvrep.agent import WorkerAgent
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.config import KvrepConfig
from sglang_kvrep.dataplane.checks import finite_s
from sglang_kvrep.dataplane.staging import StagingLedger
from sglang_kvrep.dataplane.wire import send_transfer
from tests.unit.test_agent_reports import FakeView
from tests.unit.test_transport import GEO, FakeCoordinator, StubAgent, chunk, header, payload_of


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def wait(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_ledger_holds_each_admission_against_the_others():
    led = StagingLedger()
    assert led.reserve("t1", 12, 30) is None and led.reserve("t2", 12, 30) is None
    err = led.reserve("t3", 12, 30)
    assert err.startswith("replica budget exceeded: 12 tokens > 6 free") and "held by 2 transfer(s)" in err
    assert led.reserve("t1", 1, 30) == "duplicate transfer id t1"
    led.release("t1")
    led.release("unknown")
    assert led.held_tokens() == 12 and led.reserve("t3", 12, 30) is None


def test_concurrent_grants_never_stage_more_than_the_replica_budget(ctx):
    coord = FakeCoordinator(ctx)
    # 30 tokens of budget; each transfer is 12 tokens (3 pages of 4): two fit at once, not five
    b = StubAgent("b", coord.endpoint, free_tokens=30, transfer_timeout_s=2.0)
    try:
        coord.wait_for(p.Hello)
        heads = [header(tid=f"t{i}", rid=f"r{i}") for i in range(5)]
        for h in heads:
            coord.grant("b", h)
        coord.wait_for(p.ReplicaExpected, 5)
        for h in heads:  # each source sends its header and a first chunk, then goes quiet (still staging)
            assert send_transfer(b.data_endpoint, h, payload_of(h).numpy().tobytes(), stop_after_chunks=1) is None
        failed = coord.wait_for(p.ReplicationFailed, 3)
        assert len({f.replication_id for f in failed}) == 3
        for f in failed:
            assert f.role == "target" and f.error.startswith("replica budget exceeded: 12 tokens > 6 free")
        assert b.loop.staged.held_tokens() == 24  # at most the budget, staged at once
        assert not [x for x in b.got if isinstance(x, m.Install)]  # nothing reached the pool
        # the two staged ones stall and fail: what they held is free again, the coordinator is told
        failed = coord.wait_for(p.ReplicationFailed, 5)
        assert sum("timed out" in f.error for f in failed) == 2
        wait(lambda: b.loop.staged.held_tokens() == 0, "the stalled transfers to release their hold")
        # a full transfer now lands; it holds its tokens while the scheduler thread installs it
        h = header(tid="t9", rid="r9")
        coord.grant("b", h)
        coord.wait_for(p.ReplicaExpected, 6)
        src = StubAgent("a", coord.endpoint)
        try:
            # its link to the coordinator is up before it sends (a fact sent before is dropped for the resync)
            coord.wait_for(p.Hello, 2)
            src.to_io(m.StartSend(h, b.data_endpoint))
            for i in range(h.num_chunks):  # a broken clock: NaN seconds of gathering
                src.to_io(m.ChunkGathered(h.transfer_id, i, chunk(h, payload_of(h), i), math.nan))
            [install] = b.wait_for(m.Install)
            assert b.loop.staged.held_tokens() == 12
            b.to_io(m.Installed(install.incoming, install.block_hashes, inserted_len=12, scatter_s=math.inf,
                                insert_s=-1.0))
            [stored] = coord.wait_for(p.ReplicaStored)
            [sent] = coord.wait_for(p.SourceSent)
        finally:
            src.close()
        # non-finite and negative timings are never sent
        assert (sent.gather_s, stored.scatter_s, stored.insert_s) == (0.0, 0.0, 0.0)
        assert math.isfinite(sent.send_s) and math.isfinite(stored.receive_s)
        wait(lambda: b.loop.staged.held_tokens() == 0, "the installed transfer to release its hold")
    finally:
        b.close()
        coord.sock.close()


def test_finite_s():
    assert [finite_s(x) for x in (0.25, 0, math.inf, -math.inf, math.nan, -0.5, "x", None)] == \
        [0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_a_reannounce_says_hello_again_and_refuses_the_old_fingerprint(ctx):
    coord = FakeCoordinator(ctx)
    b = StubAgent("b", coord.endpoint)
    try:
        coord.wait_for(p.Hello)
        info = b.loop.info
        new = msgspec.structs.replace(info, fingerprint="fp2", fingerprint_fields={"weights": "new"},
                                      geometry=type(GEO)(**{**GEO.__dict__, "fingerprint": "fp2"}))
        b.to_io(m.Reannounce(new))
        hellos = coord.wait_for(p.Hello, 2)
        assert (hellos[1].worker_id, hellos[1].fingerprint, hellos[1].fingerprint_fields) == \
            ("b", "fp2", {"weights": "new"})
        h = header(tid="old", rid="r-old")  # a source still on the old weights
        coord.grant("b", h)
        coord.wait_for(p.ReplicaExpected)
        reply = send_transfer(b.data_endpoint, h, payload_of(h).numpy().tobytes(), timeout_s=10)
        assert isinstance(reply, p.TransferRefused) and "fingerprint mismatch: source fp != target fp2" in reply.error
    finally:
        b.close()
        coord.sock.close()


class WeightsView(FakeView):
    """A stand-in scheduler whose weights' content is named by the folder they were loaded from."""

    def __init__(self):
        super().__init__()
        self.loaded = "/models/base"

    def fingerprint_fields(self, model_path=None):
        self.loaded = model_path or self.loaded
        return {"weights": self.loaded, "tp_size": "1"}

    def unlock(self, lock):
        raise RuntimeError("the flush reset the tree")  # what unlocking after a flush may do


def reannounced(agent) -> list:
    out = []
    while (msg := agent.mailbox.take_for_io()) is not None:
        if isinstance(msg, m.Reannounce):
            out.append(msg.info)
    return out


def test_weight_updates_change_the_fingerprint_and_reannounce():
    view = WeightsView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w"))
    base = agent.fingerprint
    agent.gathers["t"] = object.__new__(type("Job", (), {"lock": None}))  # a gather running over the update

    def update(kind, **kw):
        agent.on_weights_updated_safe(compat.WeightUpdate(scheduler=None, kind=kind, **{
            "model_path": None, "weight_version": None, "succeeded": True, **kw}))
        [info] = reannounced(agent)
        assert info.fingerprint == agent.fingerprint == agent.geometry.fingerprint
        return agent.fingerprint

    tuned = update("disk", model_path="/models/tuned")
    assert tuned != base and not agent.gathers and not agent.disabled  # the gather stopped, nothing raised
    assert update("disk", model_path="/models/base") == base  # back on the base's content: compatible again
    v2 = update("tensor", weight_version="v2")
    assert v2 != base and update("disk", model_path="/models/base") == base
    assert update("tensor", weight_version="v2") == v2  # deterministic: peers given the same update match
    unversioned = update("tensor")
    assert unversioned not in (base, v2)
    # a failed update may or may not have changed the weights: this worker matches nobody after it
    failed = update("disk", model_path="/models/base", succeeded=False)
    assert failed not in (base, v2, unversioned)


def test_a_gpu_workers_receive_buffers_are_carved_from_its_pinned_arena_first_and_given_back_merged():
    """The scheduler thread allocates the arena (pinned on a GPU); the I/O thread only lends views of it: page
    aligned, best effort first fit, merged when given back; what does not fit gets pageable memory as before."""
    from sglang_kvrep.dataplane.staging import ARENA_ALIGN, StagingPool

    arena = torch.zeros(8 * ARENA_ALIGN, dtype=torch.uint8)
    pool = StagingPool(1 << 20, arena=arena)
    a = pool.acquire(100)
    b = pool.acquire(2 * ARENA_ALIGN)
    assert pool.in_arena(a) and pool.in_arena(b)
    assert a.data_ptr() == arena.data_ptr() and b.data_ptr() == arena.data_ptr() + ARENA_ALIGN
    assert a.numel() == ARENA_ALIGN and pool.arena_free_bytes() == 5 * ARENA_ALIGN
    big = pool.acquire(6 * ARENA_ALIGN)  # does not fit what is left: pageable
    assert not pool.in_arena(big) and big.numel() == 6 * ARENA_ALIGN
    pool.release(a)
    pool.release(b)
    assert pool.arena_free_bytes() == 8 * ARENA_ALIGN and pool._holes == [(0, 8 * ARENA_ALIGN)]
    whole = pool.acquire(8 * ARENA_ALIGN)  # the holes merged: the whole arena in one piece
    assert pool.in_arena(whole) and whole.data_ptr() == arena.data_ptr()
    pool.release(big)
    assert pool.cached_bytes() == 6 * ARENA_ALIGN  # the pageable one is kept for reuse as before
