"""How the agent orders its copies against SGLang's device work (issue 18 items 1 and 6), on the CPU through an
injected asynchronous device (`FakeDevice`): what a GPU's streams do, with the hazards made observable.

The fake keeps two queues, as a GPU keeps two streams: SGLang's forward stream (`forward`: writes a forward has
queued and not yet made) and the agent's copy stream (host<->device copies: made only when the test says the device
ran, `run()`). A kernel the agent launches (the gather or scatter itself) runs when launched, so it sees the pool as
it is then: a `fence()` runs the forward work queued so far first, exactly the ordering `wait_stream` gives. An
event is done only after `run()`. So here:
- a source that gathers without its fence misses the token a forward was still writing; with it, it does not;
- a target that scatters into just-freed slots without its fence is overwritten by a late forward write; with it,
  its pages hold the transfer;
- nothing reaches the I/O side, the tree or the budget's release before the copy's event is done, and a job that
  ends early keeps its prefix locked until its copies are.
"""
import contextlib

import pytest
import torch

from radix_sync import protocol as p
from sglang_kvrep.agent import WorkerAgent
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.config import KvrepConfig
from sglang_kvrep.dataplane.staging import Incoming
from sglang_kvrep.device import SyncOps

PS = 16
ROWS = 512  # 32 pages of 16 tokens; page 0 is the pool's padding page


class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class FakeDevice:
    is_async = True
    device = torch.device("cpu")

    def __init__(self, fenced=True):
        self.fenced = fenced
        self.forward = []   # writes queued on the forward stream, not made yet
        self.copies = []    # host<->device copies queued on the copy stream
        self.events = []
        self.fences = 0

    def fence(self):
        self.fences += 1
        if self.fenced:  # the copy stream waits for the forward work queued so far
            self._run_forward()

    def stream(self):
        return contextlib.nullcontext()

    def record(self):
        ev = FakeEvent()
        self.events.append(ev)
        return ev

    def host_buffer(self, num_bytes):
        return torch.zeros(num_bytes, dtype=torch.uint8)

    def to_host(self, src, dst):
        src = src.reshape(-1).view(torch.uint8)
        self.copies.append(lambda: dst.reshape(-1).view(torch.uint8).copy_(src))

    def to_device(self, src, out=None):
        out = torch.zeros_like(src) if out is None else out
        self.copies.append(lambda: out.copy_(src))
        return out

    def _run_forward(self):
        for f in self.forward:
            f()
        self.forward.clear()

    def run(self):
        """The copy stream catches up: queued copies are made, every event of it is done (the forward stream is
        not waited for: its writes land at `finish_forward`, or at a fence)."""
        for c in self.copies:
            c()
        self.copies.clear()
        for ev in self.events:
            ev.done = True

    def finish_forward(self):
        self._run_forward()


class PoolView:
    """A stand-in scheduler view over one real (CPU) pool: 2 layers, K and V, 2 heads x 8; a 256-token prefix cached
    at pages 1-16; an allocator handing out pages 20 on; a tree that records inserts."""

    page_size = PS

    def __init__(self):
        self.k = [torch.arange(ROWS * 16, dtype=torch.float32).view(ROWS, 2, 8) + 1000 * i for i in range(2)]
        self.v = [x + 0.5 for x in self.k]
        self.locked, self.unlocked, self.inserted, self.freed = [], [], [], []
        self.next_slot = 20 * PS
        self.cached = {}

    def fingerprint_fields(self):
        return {"model": "fake"}

    def kv_buffers(self):
        return self.k, self.v, "NHD"

    def pool_capacity_tokens(self):
        return ROWS

    def load(self):
        return {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_waiting_tokens": 0, "available_tokens": 10,
                "evictable_tokens": 0}

    def is_idle(self):
        return False

    def touch_waiting_prefixes(self):
        return 0

    def waiting_wanting(self, prefixes):
        return set()  # nothing queued: no replica is raised

    def flush_kv_events(self):
        pass

    def match(self, token_ids, namespace):
        if namespace == "src":
            return min(len(token_ids), 256), "node"
        return self.cached.get(tuple(token_ids), 0), None

    def lock(self, node):
        self.locked.append(node)
        return f"lock{len(self.locked)}"

    def unlock(self, lock):
        self.unlocked.append(lock)

    def path_slots(self, node):
        return torch.arange(PS, PS + 256)

    def alloc_slots(self, n):
        slots = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        return slots

    def free_slots(self, slots):
        self.freed.append(slots)

    def insert(self, token_ids, namespace, slots, priority):
        self.inserted.append((list(token_ids), slots.clone()))
        self.cached[tuple(token_ids)] = len(token_ids)
        return 0

    def expected_chunk(self, first_page, num_pages):
        """What a gather of pool pages [first_page, +num_pages) gives, layer-major (L, P, 2, ps, H, D)."""
        rows = slice(first_page * PS, (first_page + num_pages) * PS)
        return torch.stack([torch.stack([k[rows].view(num_pages, PS, 2, 8), v[rows].view(num_pages, PS, 2, 8)], 1)
                            for k, v in zip(self.k, self.v)])


def posted(agent, kind):
    out = []
    while (msg := agent.mailbox.take_for_io()) is not None:
        if isinstance(msg, kind):
            out.append(msg)
    return out


def source(dev, monkeypatch, chunk_pages=4, batch=False):
    monkeypatch.setattr("sglang_kvrep.agent.source_side.GATHER_SLICE_S", 3600.0)
    if not batch:  # one gather per chunk (the batched gather has its own test)
        monkeypatch.setattr("sglang_kvrep.agent.source_side.GATHER_BATCH_BYTES", 1)
    view = PoolView()
    page_bytes = 2 * 2 * PS * 16 * 4  # layers x (K, V) x tokens x (heads x dim) x fp32
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", chunk_bytes=chunk_pages * page_bytes,
                                          load_interval_s=3600.0), ops=dev)
    cmd = p.ReplicatePages(replication_id="r1", auth_token="t", token_ids=list(range(256)), namespace="src",
                           target_id="x", target_endpoint="tcp://127.0.0.1:1", target_fingerprint=agent.fingerprint,
                           ttl_s=5.0)
    return view, agent, cmd


@pytest.mark.parametrize("fenced", [True, False])
def test_a_source_gathers_after_the_forward_that_writes_the_prefix_and_hands_over_only_finished_host_memory(
        monkeypatch, fenced):
    dev = FakeDevice(fenced=fenced)
    view, agent, cmd = source(dev, monkeypatch)
    # overlap scheduling: the forward in flight still writes the cached prefix's last token (page 16, row 255)
    dev.forward.append(lambda: [k[PS + 255].fill_(-7.0) for k in view.k])
    agent._on_message(m.Replicate(cmd))
    [start] = posted(agent, m.StartSend)
    tid = start.header.transfer_id
    agent.on_iteration()  # the slots are on their way to the host: nothing gathered yet
    assert posted(agent, m.ChunkGathered) == [] and dev.fences == 0
    dev.run()
    agent.on_iteration()  # slots on the host: all four chunks issued, none done: the prefix stays locked
    assert posted(agent, m.ChunkGathered) == [] and dev.fences == 4 and view.unlocked == []
    dev.run()
    agent.on_iteration()
    chunks = posted(agent, m.ChunkGathered)
    assert [c.index for c in chunks] == [0, 1, 2, 3]  # in order, once their copies are done
    last = chunks[3].buffer
    assert last.shape == (2, 4, 2, PS, 2, 8)
    assert torch.equal(chunks[0].buffer, view.expected_chunk(1, 4))  # the host bytes are the pages' bytes
    dev.finish_forward()
    saw_last_token = bool((last[:, 3, 0, PS - 1] == -7.0).all())
    assert saw_last_token == fenced  # unfenced, the gather ran before the forward's write: the hazard
    assert view.unlocked == ["lock1"] and tid not in agent.gathers  # every copy done: the job is over


def test_a_cancelled_source_keeps_its_prefix_locked_until_its_copies_are_done(monkeypatch):
    dev = FakeDevice()
    view, agent, cmd = source(dev, monkeypatch)
    agent._on_message(m.Replicate(cmd))
    [start] = posted(agent, m.StartSend)
    tid = start.header.transfer_id
    dev.run()
    agent.on_iteration()  # 4 chunks on the copy stream
    agent.mailbox.post_to_scheduler(m.SendCancelled(tid))
    agent.on_iteration()
    # the copies still read the pages: the lock stays, nothing more is issued, nothing is handed over
    assert view.unlocked == [] and tid in agent.gathers and dev.fences == 4
    dev.run()
    agent.on_iteration()
    assert view.unlocked == ["lock1"] and not agent.gathers and posted(agent, (m.ChunkGathered, m.GatherFailed)) == []


def test_a_source_whose_gather_fails_with_copies_in_flight_unlocks_after_them_and_reports_once(monkeypatch):
    from sglang_kvrep.agent import source_side

    dev = FakeDevice()
    view, agent, cmd = source(dev, monkeypatch)
    real, calls = source_side.gather_pages, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: device gather failed")
        return real(*args, **kw)

    monkeypatch.setattr(source_side, "gather_pages", flaky)
    agent._on_message(m.Replicate(cmd))
    dev.run()
    agent.on_iteration()  # chunk 0 issued, chunk 1 fails
    assert posted(agent, (m.ChunkGathered, m.GatherFailed)) == [] and view.unlocked == []
    dev.run()
    agent.on_iteration()
    [failed] = posted(agent, (m.ChunkGathered, m.GatherFailed))
    assert isinstance(failed, m.GatherFailed) and "chunk 1" in failed.error and view.unlocked == ["lock1"]
    agent.on_iteration()
    assert posted(agent, (m.ChunkGathered, m.GatherFailed)) == [] and len(calls) == 2


def incoming(view, num_pages=4, ttl_s=30.0):
    """A verified transfer of pool pages 1..num_pages of `view` (as a source would have gathered them)."""
    tokens = list(range(5000, 5000 + num_pages * PS))
    payload = view.expected_chunk(1, num_pages).contiguous()
    h = p.TransferHeader(
        transfer_id="t1", replication_id="rep1", auth_token="t", source_id="s", fingerprint="f", namespace="",
        token_ids=tokens, page_size=PS, num_pages=num_pages, dtype="torch.float32", layout="NHD",
        buffer_shape=list(payload.shape), num_bytes=payload.numel() * 4, pages_per_chunk=num_pages, num_chunks=1,
        checksum_kind="xxh3", ttl_s=ttl_s)
    storage = payload.reshape(-1).view(torch.uint8).clone()
    return Incoming(header=h, peer=b"s", storage=storage, started_s=0.0, last_progress_s=0.0), payload


@pytest.mark.parametrize("fenced", [True, False])
def test_a_target_scatters_after_late_forward_writes_and_inserts_only_once_the_copy_is_done(fenced):
    dev = FakeDevice(fenced=fenced)
    view = PoolView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0, replica_budget_tokens=256),
                        ops=dev)
    inc, payload = incoming(view)
    slot0 = view.next_slot  # the slots the install will get were just freed; a forward still writes one of them
    dev.forward.append(lambda: [k[slot0 + 3].fill_(-9.0) for k in view.k])
    agent._on_message(m.Install(inc, [11, 12, 13, 14]))
    assert posted(agent, (m.Installed, m.InstallFailed)) == [] and view.inserted == []
    assert agent.replicas.live_tokens() == 64 and agent.replicas.free_tokens() == 192  # counted while in flight
    dev.run()
    agent.on_iteration()  # upload done: scatter issued (after the fence), not done
    assert view.inserted == [] and posted(agent, m.Installed) == []
    dev.run()
    agent.on_iteration()
    [done] = posted(agent, m.Installed)
    assert done.inserted_len == 64 and done.block_hashes == [11, 12, 13, 14] and done.incoming is inc
    [(tokens, slots)] = view.inserted
    assert tokens == inc.header.token_ids and torch.equal(slots, torch.arange(slot0, slot0 + 64))
    dev.finish_forward()  # unfenced, the late forward write lands over the replica now: the hazard
    rows = slice(slot0, slot0 + 64)
    got = torch.stack([torch.stack([k[rows].view(4, PS, 2, 8), v[rows].view(4, PS, 2, 8)], 1)
                       for k, v in zip(view.k, view.v)])
    assert torch.equal(got, payload) == fenced
    assert agent.replicas.live_tokens() == 64 and "rep1" in agent.replicas.replicas


def test_a_target_install_that_fails_on_the_copy_stream_frees_its_slots_and_answers_failed():
    dev = FakeDevice()
    view = PoolView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0, replica_budget_tokens=256),
                        ops=dev)
    inc, _ = incoming(view)

    def broken_insert(*_):
        raise RuntimeError("injected: tree insert failed")

    view.insert = broken_insert
    agent._on_message(m.Install(inc, [1, 2, 3, 4]))
    for _ in range(2):
        dev.run()
        agent.on_iteration()
    [failed] = posted(agent, (m.Installed, m.InstallFailed))
    assert isinstance(failed, m.InstallFailed) and "injected" in failed.error
    assert len(view.freed) == 1 and view.freed[0].numel() == 64 and agent.replicas.live_tokens() == 0
    assert not agent.replicas.pending and not agent._installing


def test_a_weight_update_abandons_installs_on_the_copy_stream():
    from sglang_kvrep import compat

    dev = FakeDevice()
    view = PoolView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0, replica_budget_tokens=256),
                        ops=dev)
    inc, _ = incoming(view)
    agent._on_message(m.Install(inc, [1]))
    agent.on_weights_updated(compat.WeightUpdate(scheduler=None, kind="tensor", model_path=None,
                                                 weight_version="2", succeeded=True))
    [failed] = posted(agent, m.InstallFailed)
    assert "weights were updated" in failed.error
    dev.run()
    agent.on_iteration()
    assert view.inserted == [] and agent.replicas.live_tokens() == 0 and posted(agent, m.Installed) == []


def test_synchronous_copies_install_and_gather_in_the_call_as_before(monkeypatch):
    """A CPU pool (`SyncOps`): no polling, the answer in the same iteration."""
    view = PoolView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0, replica_budget_tokens=256),
                        ops=SyncOps())
    inc, payload = incoming(view)
    agent._on_message(m.Install(inc, [1]))
    [done] = posted(agent, m.Installed)
    assert done.inserted_len == 64 and not agent.replicas.pending
    _, agent2, cmd = source(SyncOps(), monkeypatch)
    agent2._on_message(m.Replicate(cmd))
    assert [c.index for c in posted(agent2, m.ChunkGathered)] == [0, 1, 2, 3]


def test_the_default_copy_ops_follow_the_pools_device():
    from sglang_kvrep.device import make_ops

    agent = WorkerAgent(PoolView(), KvrepConfig(worker_id="w", load_interval_s=3600.0))
    assert isinstance(agent.ops, SyncOps) and isinstance(make_ops(torch.device("cpu")), SyncOps)


class HndView(PoolView):
    """The same pool in SGLang's HND layout (`SGLANG_USE_HND_KVCACHE=1`): per layer (num_pages, H, ps, D)."""

    def __init__(self):
        super().__init__()
        self.k = [k.view(ROWS // PS, PS, 2, 8).transpose(1, 2).contiguous() for k in self.k]
        self.v = [v.view(ROWS // PS, PS, 2, 8).transpose(1, 2).contiguous() for v in self.v]

    def kv_buffers(self):
        return self.k, self.v, "HND"


def test_an_hnd_pool_with_pages_of_16_announces_the_page_shape_its_gathers_have(monkeypatch):
    """Issue 18: with `SGLANG_USE_HND_KVCACHE=1` and page size > 1 the agent announced (2, ps, H, ps, D) pages, so
    every chunk was refused; a page is (2, H, ps, D), as gathered."""
    monkeypatch.setattr("sglang_kvrep.agent.source_side.GATHER_SLICE_S", 3600.0)
    view = HndView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", chunk_bytes=4 * 4096, load_interval_s=3600.0), ops=SyncOps())
    assert agent.geometry.page_shape == (2, 2, PS, 8)
    cmd = p.ReplicatePages(replication_id="r1", auth_token="t", token_ids=list(range(256)), namespace="src",
                           target_id="x", target_endpoint="tcp://127.0.0.1:1", target_fingerprint=agent.fingerprint,
                           ttl_s=5.0)
    agent._on_message(m.Replicate(cmd))
    msgs = posted(agent, (m.StartSend, m.ChunkGathered))
    h = msgs[0].header
    assert h.layout == "HND" and h.buffer_shape == [2, 16, 2, 2, PS, 8]
    assert all(tuple(c.buffer.shape) == (2, 4, 2, 2, PS, 8) for c in msgs[1:]) and len(msgs) == 5
    # a target with the same pool takes the chunks: its install scatters them into its HND pool bit for bit
    dst = HndView()
    dst.next_slot = 4 * PS  # (16 pages from page 4 on fit this 32-page pool)
    target = WorkerAgent(dst, KvrepConfig(worker_id="t", load_interval_s=3600.0, replica_budget_tokens=256),
                         ops=SyncOps())
    payload = torch.cat([c.buffer for c in msgs[1:]], dim=1).contiguous()
    inc = Incoming(header=msgspec_replace(h, namespace=""), peer=b"s",
                   storage=payload.reshape(-1).view(torch.uint8).clone(), started_s=0.0, last_progress_s=0.0)
    target._on_message(m.Install(inc, [1]))
    [done] = posted(target, (m.Installed, m.InstallFailed))
    assert isinstance(done, m.Installed), done.error
    slot0 = dst.next_slot - 256
    assert done.inserted_len == 256
    for layer in range(2):
        assert torch.equal(dst.k[layer][slot0 // PS:slot0 // PS + 16], view.k[layer][1:17])
        assert torch.equal(dst.v[layer][slot0 // PS:slot0 // PS + 16], view.v[layer][1:17])


def msgspec_replace(header, **changes):
    import msgspec

    return msgspec.structs.replace(header, **changes)


def test_with_asynchronous_copies_a_source_runs_ahead_by_bytes_not_by_four_chunks(monkeypatch):
    """Issue 18 item 3: on a GPU the launches take microseconds; four 4 MiB chunks a scheduler step paced a 4 GiB
    replica by the steps (5-13 s). Asynchronous copies run up to 256 MiB of pinned host memory ahead instead."""
    from sglang_kvrep.agent.source_side import DEVICE_AHEAD_BYTES, MAX_AHEAD, ahead_chunks

    assert ahead_chunks(4 << 20, is_async=False) == MAX_AHEAD == 4
    assert ahead_chunks(4 << 20, is_async=True) == DEVICE_AHEAD_BYTES // (4 << 20) == 64
    assert ahead_chunks(1 << 30, is_async=True) == MAX_AHEAD  # never fewer than the synchronous bound
    runs = {}
    for name, dev in (("sync", SyncOps()), ("async", FakeDevice())):
        _, agent, cmd = source(dev, monkeypatch, chunk_pages=1)  # 16 chunks of one page
        agent._on_message(m.Replicate(cmd))
        if name == "async":
            dev.run()
            agent.on_iteration()
            dev.run()
            agent.on_iteration()
        runs[name] = [c.index for c in posted(agent, m.ChunkGathered)]
    assert runs == {"sync": [0, 1, 2, 3], "async": list(range(16))}  # nothing sent yet in either


def test_a_source_names_xxh3_whatever_its_pools_device_the_io_side_hashes_host_memory(monkeypatch):
    _, agent, cmd = source(FakeDevice(), monkeypatch)
    agent._on_message(m.Replicate(cmd))
    [start] = posted(agent, m.StartSend)
    assert start.header.checksum_kind == "xxh3"


def test_an_agent_whose_io_thread_died_lets_go_of_locks_and_slots_only_after_its_copies(monkeypatch):
    """Issue 18 item 6: the I/O thread dies with a gather and an install on the copy stream. The agent disables
    itself (SGLang serves on) and releases the prefix's lock and the install's slots once each copy is done, never
    before (a copy in flight still reads those pages / writes those slots); nothing is inserted."""
    dev = FakeDevice()
    view, agent, cmd = source(dev, monkeypatch)
    agent.replicas.budget_tokens = 256
    agent._on_message(m.Replicate(cmd))
    dev.run()
    agent.on_iteration()  # chunks on the copy stream
    inc, _ = incoming(view)
    agent._on_message(m.Install(inc, [1]))  # its upload on the copy stream
    agent.mailbox.post_to_scheduler(m.IoDied())
    agent.on_iteration_safe()
    assert agent.disabled and view.unlocked == [] and view.freed == [] and agent.replicas.pending
    agent.on_iteration_safe()  # still in flight: still held
    assert view.unlocked == [] and view.freed == []
    dev.run()
    agent.on_iteration_safe()
    assert view.unlocked == ["lock1"] and not agent.gathers
    assert len(view.freed) == 1 and view.freed[0].numel() == 64 and not agent.replicas.pending
    assert view.inserted == [] and agent.replicas.live_tokens() == 0


def scheduler_view(pool_fields=(), **scheduler_fields):
    """`SchedulerView` over a stand-in scheduler: a 32-row NHD pool (plus `pool_fields`), page size 16, no tree
    cache unless `scheduler_fields` gives one (and whatever else they give)."""
    import types

    from sglang_kvrep.compat import SchedulerView

    pool = types.SimpleNamespace(k_buffer=[torch.zeros(32, 2, 8)], v_buffer=[torch.zeros(32, 2, 8)],
                                 **dict(pool_fields))
    fields = {"tree_cache": None, **scheduler_fields}
    return SchedulerView(types.SimpleNamespace(server_args=types.SimpleNamespace(page_size=16),
                                               token_to_kv_pool_allocator=types.SimpleNamespace(
                                                   get_kvcache=lambda: pool), **fields))


def test_a_quantized_pool_with_block_scales_is_refused_not_copied_without_them():
    """Issue 18: SGLang's FP4 / MXFP8 pools keep per-block scales beside K/V; the view refuses them (the plugin
    then serves as plain SGLang, saying why) instead of copying pages whose scales stay behind."""
    assert scheduler_view().kv_buffers()[2] == "NHD"
    with pytest.raises(RuntimeError, match="k_scale_buffer"):
        scheduler_view({"k_scale_buffer": [torch.zeros(32, 1)], "v_scale_buffer": [torch.zeros(32, 1)]}).kv_buffers()


def test_the_view_names_the_streams_a_copy_is_fenced_behind():
    """SGLang's forward stream (the model runner's) and, with HiCache, its load-back stream (pages loading back
    already match as device prefix); None where there is none (a CPU worker without HiCache)."""
    import types

    forward, load = object(), object()
    engine = types.SimpleNamespace(host_to_device_stream=load)
    view = scheduler_view(
        tree_cache=types.SimpleNamespace(cache_controller=types.SimpleNamespace(l2_transfer_engine=engine)),
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(forward_stream=forward)))
    assert view.forward_stream() is forward and view.load_back_stream() is load
    plain = scheduler_view(tree_cache=types.SimpleNamespace(cache_controller=None))
    assert plain.forward_stream() is None and plain.load_back_stream() is None


def test_while_copies_are_on_the_device_the_io_side_is_told_to_keep_the_scheduler_awake(monkeypatch):
    """A device copy ends without waking anyone: with `--sleep-on-idle` an idle scheduler would hand a finished
    chunk over only at the next request. While copies are in flight the I/O side is told so (`DeviceBusy`), once
    when it starts and once when it ends, and rings the scheduler on a timer meanwhile (the scheduler no longer
    rings itself at every iteration: an idle scheduler spun, holding the GIL the I/O thread needed)."""
    import select

    dev = FakeDevice()
    view, agent, cmd = source(dev, monkeypatch)
    bell = agent.mailbox.scheduler_bell_fd

    def rung():
        return bool(select.select([bell], [], [], 0)[0])

    agent.on_iteration()
    assert posted(agent, m.DeviceBusy) == [] and not rung()  # nothing in flight: the scheduler may sleep
    agent._on_message(m.Replicate(cmd))
    agent.on_iteration()  # the slots' copy is in flight
    assert posted(agent, m.DeviceBusy) == [m.DeviceBusy(True)] and not rung()
    agent.on_iteration()
    assert posted(agent, m.DeviceBusy) == []  # said once
    for _ in range(3):
        dev.run()
        agent.on_iteration()
    assert not agent.gathers and posted(agent, m.DeviceBusy) == [m.DeviceBusy(False)]


def test_the_io_side_rings_a_busy_scheduler_on_a_timer_and_stops_when_told(tmp_path):
    """The I/O side's half: told `DeviceBusy(True)`, its loop rings the scheduler's bell every `DEVICE_POLL_S`
    (a real I/O thread here); told `DeviceBusy(False)`, it stops."""
    import select
    import threading
    import time

    from sglang_kvrep.agent import io_side
    from sglang_kvrep.agent.mailbox import Mailbox

    agent = WorkerAgent(PoolView(), KvrepConfig(worker_id="w", load_interval_s=3600.0), ops=FakeDevice())
    box = Mailbox()
    thread = threading.Thread(target=io_side.run_io_thread, args=(agent.config, agent.info, box), daemon=True)
    thread.start()
    assert isinstance(box.take_for_scheduler(timeout_s=10), m.IoStarted)
    bell = box.scheduler_bell_fd

    def rings_within(seconds):
        box.clear_bell()
        return bool(select.select([bell], [], [], seconds)[0])

    time.sleep(0.1)  # IoStarted's own ring may land after its message was taken
    assert not rings_within(0.3)
    box.post_to_io(m.DeviceBusy(True))
    time.sleep(0.05)
    assert all(rings_within(0.5) for _ in range(5))
    box.post_to_io(m.DeviceBusy(False))
    time.sleep(0.05)
    assert not rings_within(0.3)
    box.post_to_io(m.Stop())
    thread.join(10)
    assert not thread.is_alive()


def test_a_gpu_pools_agent_compiles_its_copy_kernels_when_it_starts(monkeypatch):
    """The first copy must not compile the kernel on SGLang's scheduler thread: an agent over a CUDA pool warms
    the kernels up in its constructor, on its copy stream (a CPU pool's agent does not: torch copies it)."""
    from sglang_kvrep.agent import scheduler_side

    calls = []
    monkeypatch.setattr(scheduler_side, "warm_up", lambda k, v, ps, layout: calls.append((len(k), ps, layout)))

    class CudaLike(FakeDevice):
        device = torch.device("cuda")

        def stream(self):
            calls.append("stream")
            return contextlib.nullcontext()

    WorkerAgent(PoolView(), KvrepConfig(worker_id="w", load_interval_s=3600.0), ops=FakeDevice())
    assert calls == []
    WorkerAgent(PoolView(), KvrepConfig(worker_id="w", load_interval_s=3600.0), ops=CudaLike())
    assert calls == ["stream", (2, PS, "NHD")]


def test_a_target_uploads_a_transfer_in_slices_bounded_per_iteration_and_scatters_after_the_last(monkeypatch):
    """A pageable upload holds the scheduler thread until it is done (0.6 s for 4 GiB on an H200): the target
    uploads at most a slice budget per iteration, records the copy's event after the last slice, and scatters only
    once that is done; the pages land intact."""
    from sglang_kvrep import replicas

    monkeypatch.setattr(replicas, "UPLOAD_SLICE_BYTES", 1000)  # 4 pages x 2 layers x 2 x 16 x 16 x 4 B = 16 KiB
    monkeypatch.setattr(replicas, "UPLOAD_SLICE_S", 0.0)        # one slice per iteration
    dev = FakeDevice()
    view = PoolView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0, replica_budget_tokens=256),
                        ops=dev)
    inc, payload = incoming(view)
    slot0 = view.next_slot
    agent._on_message(m.Install(inc, [1, 2, 3, 4]))
    job = agent.replicas.pending["t1"]
    total = payload.numel() * 4
    assert job.uploaded == 1000 and len(dev.copies) == 2  # the slots' copy and one slice
    steps = 1
    while job.uploaded < total:
        agent.on_iteration()
        steps += 1
        assert view.inserted == [] and not job.scattered
    assert steps == -(-total // 1000) and dev.fences == 0  # nothing scattered yet: no fence either
    dev.run()
    agent.on_iteration()  # every slice done: scatter issued
    assert job.scattered and dev.fences == 1 and view.inserted == []
    dev.run()
    agent.on_iteration()
    [done] = posted(agent, m.Installed)
    assert done.inserted_len == 64
    rows = slice(slot0, slot0 + 64)
    got = torch.stack([torch.stack([k[rows].view(4, PS, 2, 8), v[rows].view(4, PS, 2, 8)], 1)
                       for k, v in zip(view.k, view.v)])
    assert torch.equal(got, payload)


def test_a_source_takes_host_memory_from_slots_it_keeps_and_reuses_one_only_once_every_holder_let_go(monkeypatch):
    """A GPU source's chunks are views of host slots the scheduler side allocated at start and keeps (no pinned block is
    ever freed or allocated off the scheduler thread): a slot is taken again only once the I/O side, the transport
    and zero-copy frames dropped every view of it; while none is free the chunk waits (the job runs on) and the
    scheduler is kept from sleeping."""
    from sglang_kvrep.agent import source_side

    monkeypatch.setattr(source_side, "DEVICE_AHEAD_BYTES", 2 * 4 * 2 * 2 * PS * 16 * 4)  # two chunks' worth
    dev = FakeDevice()
    view, agent, cmd = source(dev, monkeypatch)
    slots = agent._host_slots  # every slot allocated when the agent started, not in a serving step
    assert slots is not None and len(slots.slots) == 2 and slots.in_use() == 0
    agent._on_message(m.Replicate(cmd))
    dev.run()
    agent.on_iteration()  # slots on the host: two chunks issued, the other two wait for a slot
    assert agent.gathers and dev.fences == 2 and slots.in_use() == 2 and len(slots.slots) == 2
    assert agent.slot_starved and m.DeviceBusy(True) in posted(agent, m.DeviceBusy)
    dev.run()
    agent.on_iteration()
    held = posted(agent, m.ChunkGathered)  # the I/O side holds chunks 0 and 1
    assert [c.index for c in held] == [0, 1] and dev.fences == 2
    frame = memoryview(held[0].buffer.reshape(-1).view(torch.uint8).numpy())  # as a zero-copy frame holds it
    del held[0]
    agent.on_iteration()
    assert dev.fences == 2 and slots.in_use() == 2  # the frame still reads slot 0
    del frame
    agent.on_iteration()
    assert dev.fences == 3 and slots.in_use() == 2 and len(slots.slots) == 2  # slot 0 again
    held.clear()
    agent.on_iteration()
    assert dev.fences == 4
    for _ in range(2):
        dev.run()
        agent.on_iteration()
    assert [c.index for c in posted(agent, m.ChunkGathered)] == [2, 3] and view.unlocked == ["lock1"]



def test_a_cpu_source_gathers_straight_into_host_slots_it_reuses_once_every_holder_let_go(monkeypatch):
    """A CPU pool (`SyncOps`): each chunk is gathered into a view of a kept host slot (no fresh buffer, no page
    faults per chunk on the scheduler thread), allocated as needed up to `CPU_HOST_SLOTS`; a slot is taken again
    only once the I/O side and zero-copy frames let go of it, and the bytes are the pages' bytes every time."""
    from sglang_kvrep.agent import source_side

    monkeypatch.setattr(source_side, "CPU_HOST_SLOTS", 2)
    view, agent, cmd = source(SyncOps(), monkeypatch)
    agent._on_message(m.Replicate(cmd))
    msgs = posted(agent, object)
    held = [x for x in msgs if isinstance(x, m.ChunkGathered)]  # two chunks in the call; the other two wait for a slot
    del msgs
    slots = agent._host_slots
    assert [c.index for c in held] == [0, 1] and len(slots.slots) == 2 and slots.in_use() == 2
    assert agent.slot_starved and agent.gathers
    agent.on_iteration()  # still no slot free: the I/O side is told to ring a sleeping scheduler meanwhile
    assert m.DeviceBusy(True) in posted(agent, object) and slots.in_use() == 2
    ptrs = {buf.data_ptr() for buf, _ in slots.slots}
    assert {c.buffer.data_ptr() for c in held} == ptrs  # the chunks are the slots' memory
    assert torch.equal(held[0].buffer, view.expected_chunk(1, 4))
    assert torch.equal(held[1].buffer, view.expected_chunk(5, 4))
    frame = memoryview(held[0].buffer.reshape(-1).view(torch.uint8).numpy())  # as a zero-copy frame holds it
    del held[0]
    agent.on_iteration()
    assert posted(agent, m.ChunkGathered) == [] and slots.in_use() == 2  # the frame still reads slot 0
    del frame
    agent.on_iteration()
    [c2] = posted(agent, m.ChunkGathered)
    assert c2.index == 2 and c2.buffer.data_ptr() in ptrs and torch.equal(c2.buffer, view.expected_chunk(9, 4))
    del c2
    held.clear()
    agent.on_iteration()
    [c3] = posted(agent, m.ChunkGathered)
    assert c3.index == 3 and torch.equal(c3.buffer, view.expected_chunk(13, 4)) and len(slots.slots) == 2
    assert view.unlocked == ["lock1"] and not agent.gathers


def test_an_asynchronous_source_gathers_several_chunks_in_one_launch_each_to_its_own_slot_and_event(monkeypatch):
    """Issuing a gather costs ~1.6 ms of the scheduler thread on an H200 (Python, not the GPU): a GPU source gathers
    up to `GATHER_BATCH_BYTES` of chunks behind one fence and one launch, then copies each chunk to its own host
    slot with its own event; the I/O side gets them in order, byte for byte the pages'."""
    from sglang_kvrep.agent import source_side

    calls = []
    real = source_side.gather_pages
    monkeypatch.setattr(source_side, "gather_pages", lambda *a, **kw: calls.append(len(a[2])) or real(*a, **kw))
    dev = FakeDevice()
    view, agent, cmd = source(dev, monkeypatch, batch=True)
    agent._on_message(m.Replicate(cmd))
    dev.run()
    agent.on_iteration()
    assert calls == [16] and dev.fences == 1 and len(dev.events) == 1 + 4  # the slots' copy, then one per chunk
    assert posted(agent, m.ChunkGathered) == [] and view.unlocked == []
    dev.run()
    agent.on_iteration()
    chunks = posted(agent, m.ChunkGathered)
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    for c in chunks:
        assert c.buffer.is_contiguous() and torch.equal(c.buffer, view.expected_chunk(1 + 4 * c.index, 4))
    assert view.unlocked == ["lock1"] and not agent.gathers


def test_a_transfer_received_into_pinned_staging_uploads_in_one_asynchronous_copy(monkeypatch):
    """A transfer that landed in the pinned arena uploads in one asynchronous copy issued with the install (no
    slices, no wait on the scheduler thread), then scatters after the fence as any other."""
    from sglang_kvrep import replicas

    monkeypatch.setattr(replicas, "UPLOAD_SLICE_BYTES", 1000)
    dev = FakeDevice()
    view = PoolView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0, replica_budget_tokens=256),
                        ops=dev)
    inc, payload = incoming(view)
    inc.pinned = True
    agent._on_message(m.Install(inc, [1, 2, 3, 4]))
    job = agent.replicas.pending["t1"]
    assert job.uploaded == payload.numel() * 4 and len(dev.copies) == 2  # the slots' copy and the whole upload
    dev.run()
    agent.on_iteration()  # upload done: scatter issued
    assert job.scattered and dev.fences == 1
    dev.run()
    agent.on_iteration()
    [done] = posted(agent, m.Installed)
    assert done.inserted_len == 64


def test_an_asynchronous_agent_gives_its_io_side_a_staging_arena_it_allocated_itself():
    """The arena is made on the scheduler thread (pinned on a GPU: the I/O thread must make no CUDA call), of
    `--kvrep-staging-bytes`, once; a CPU pool's agent (synchronous copies) has none."""
    dev = FakeDevice()
    made = []
    real = dev.host_buffer
    dev.host_buffer = lambda n: made.append(n) or real(n)
    agent = WorkerAgent(PoolView(), KvrepConfig(worker_id="w", load_interval_s=3600.0, staging_bytes=1 << 16),
                        ops=dev)
    slots = agent._host_slots  # (a source's chunk slots are made at start too)
    assert made == [slots.slot_bytes] * slots.max_slots
    made.clear()
    info = agent.info
    assert info.staging_arena is not None and info.staging_arena.numel() == 1 << 16 and made == [1 << 16]
    assert agent.info.staging_arena is info.staging_arena and made == [1 << 16]
    plain = WorkerAgent(PoolView(), KvrepConfig(worker_id="w", load_interval_s=3600.0), ops=SyncOps())
    assert plain.info.staging_arena is None


def test_no_job_left_means_no_device_polling_after_a_weight_update_or_once_disabled(monkeypatch):
    """A source starved of host slots keeps the I/O side ringing (`DeviceBusy(True)`); when its job is gone (a
    weight update drops running gathers) the next iteration says `DeviceBusy(False)`, not a ring every
    millisecond forever. A disabled agent with copies still on the device rings itself (its I/O side may be gone)
    and says `DeviceBusy(False)` once they are done."""
    import select

    from sglang_kvrep import compat
    from sglang_kvrep.agent import source_side

    monkeypatch.setattr(source_side, "DEVICE_AHEAD_BYTES", 2 * 4 * 2 * 2 * PS * 16 * 4)  # two chunks' worth
    dev = FakeDevice()
    view, agent, cmd = source(dev, monkeypatch)
    agent._on_message(m.Replicate(cmd))
    dev.run()
    agent.on_iteration()
    assert agent.slot_starved and posted(agent, m.DeviceBusy) == [m.DeviceBusy(True)]
    agent.on_weights_updated(compat.WeightUpdate(scheduler=None, kind="tensor", model_path=None,
                                                 weight_version="2", succeeded=True))
    agent.on_iteration()
    assert not agent.gathers and not agent.slot_starved and posted(agent, m.DeviceBusy) == [m.DeviceBusy(False)]

    dev2 = FakeDevice()
    view2, agent2, cmd2 = source(dev2, monkeypatch)
    agent2._on_message(m.Replicate(cmd2))
    agent2.on_iteration()  # the slots' copy in flight
    assert posted(agent2, m.DeviceBusy) == [m.DeviceBusy(True)]
    agent2.disabled = True
    agent2.mailbox.clear_bell()
    agent2.on_iteration_safe()
    assert select.select([agent2.mailbox.scheduler_bell_fd], [], [], 0)[0]  # rang itself
    dev2.run()
    agent2.on_iteration_safe()  # copies done: the lock goes, polling stops
    assert not agent2.gathers and view2.unlocked == ["lock1"]
    assert posted(agent2, m.DeviceBusy) == [m.DeviceBusy(False)]


def test_waiting_tokens_are_what_the_waiting_prompts_will_compute():
    """A load report's `num_waiting_tokens` is the policies' `waiting_new_tokens`: each waiting prompt less the
    device prefix its worker's tree holds (a queued follow-up of a cached session is 10 new tokens, not 3,066),
    matched read-only with the request's own salt and extra key; whole prompts past the limit or without the
    read-only match."""
    import types

    asked = []

    class Core:
        def match_full_device_prefix(self, key):
            asked.append((len(key.token_ids), key.cache_salt, key.extra_key))
            held = 3056 if key.cache_salt == "ns-a" else 0
            return min(held, len(key.token_ids)), 7, 0

    def req(n, salt, extra=None):
        return types.SimpleNamespace(origin_input_ids=list(range(n)), cache_salt=salt, extra_key=extra)

    waiting = [req(3066, "ns-a"), req(3066, "ns-b", "lora1"), req(500, "ns-a")]
    view = scheduler_view(tree_cache=types.SimpleNamespace(tree_core=Core(), evictable_size=lambda: 0),
                          waiting_queue=waiting, running_batch=None)
    view.allocator = types.SimpleNamespace(available_size=lambda: 100)
    assert view.waiting_new_tokens(waiting) == 10 + 3066 + 0
    assert asked == [(3066, "ns-a", None), (3066, "ns-b", "lora1"), (500, "ns-a", None)]
    assert view.load()["num_waiting_tokens"] == 3076
    assert view.waiting_new_tokens(waiting, limit=1) == 10 + 3066 + 500

    class Broken:
        def match_full_device_prefix(self, key):
            raise AttributeError("no read-only match in this cache")

    view = scheduler_view(tree_cache=types.SimpleNamespace(tree_core=Broken()))
    assert view.waiting_new_tokens(waiting) == 3066 + 3066 + 500
