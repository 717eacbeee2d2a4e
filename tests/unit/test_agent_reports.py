"""The worker agent's scheduler-thread duties, on a stand-in for SGLang's scheduler (no I/O thread started): KV
events are flushed every iteration, and a worker that goes idle reports its load at once."""
import pytest
import torch

from radix_sync import protocol as p
from sglang_kvrep.agent import WorkerAgent
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.config import KvrepConfig


class FakeView:
    page_size = 16

    def __init__(self):
        self.running, self.waiting, self.flushes, self.touches = 1, 0, 0, 0

    def fingerprint_fields(self):
        return {"model": "fake"}

    def kv_buffers(self):
        k = [torch.zeros(64, 2, 8) for _ in range(2)]
        return k, [torch.zeros(64, 2, 8) for _ in range(2)], "NHD"

    def pool_capacity_tokens(self):
        return 64

    def load(self):
        return {"num_running_reqs": self.running, "num_waiting_reqs": self.waiting, "num_waiting_tokens": 0,
                "available_tokens": 10, "evictable_tokens": 0}

    def is_idle(self):
        return self.running == 0 and self.waiting == 0

    def flush_kv_events(self):
        self.flushes += 1

    def touch_waiting_prefixes(self):
        self.touches += 1
        return self.waiting


def loads(agent):
    out = []
    while (msg := agent.mailbox.take_for_io()) is not None:
        if isinstance(msg, m.ToCoordinator) and isinstance(msg.message, p.LoadReported):
            out.append(msg.message)
    return out


def test_events_flush_every_iteration_and_going_idle_is_reported_at_once():
    view = FakeView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0))
    agent.on_iteration()  # first report is due at once
    [first] = loads(agent)
    assert first.num_running_reqs == 1 and view.flushes == 1
    agent.on_iteration()  # busy, not due: nothing
    assert loads(agent) == [] and view.flushes == 2
    view.running = 0  # the last request finished: the next iteration says so, whatever the interval
    agent.on_iteration()
    [idle] = loads(agent)
    assert idle.num_running_reqs == 0 and idle.num_waiting_reqs == 0
    agent.on_iteration()  # still idle: no repeat before the interval
    assert loads(agent) == [] and view.flushes == 4


def test_the_iteration_length_while_busy_is_reported(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("sglang_kvrep.agent.scheduler_side.time.monotonic", lambda: clock[0])
    view = FakeView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=1e-6))  # report every iteration
    agent.on_iteration()               # t=100, busy: the first boundary, no length yet
    assert loads(agent)[-1].iteration_s == 0.0
    clock[0] += 2.0
    agent.on_iteration()               # a 2 s iteration with work from end to end
    assert loads(agent)[-1].iteration_s == 2.0
    clock[0] += 1.0
    agent.on_iteration()               # EWMA: 0.8 x 2 + 0.2 x 1
    assert abs(loads(agent)[-1].iteration_s - 1.8) < 1e-9
    view.running = 0
    clock[0] += 5.0
    agent.on_iteration()               # went idle: that stretch is no iteration length
    clock[0] += 30.0                   # asleep (--sleep-on-idle)
    view.running = 1
    agent.on_iteration()               # woke with work: the idle stretch is not counted either
    assert abs(loads(agent)[-1].iteration_s - 1.8) < 1e-9


def test_a_request_reusing_exactly_a_demoted_chain_takes_the_demotion_back():
    import types

    agent = WorkerAgent(FakeView(), KvrepConfig(worker_id="w", load_interval_s=3600.0))
    chain = list(range(100, 132))  # two of these fit in the stand-in's 64-token pool
    agent._on_message(m.Demote("t1", chain))
    agent._on_message(m.Demote("t2", chain))
    assert len(agent.demoted) == 2

    def match(rid, ids, salt, matched):
        params = types.SimpleNamespace(req=types.SimpleNamespace(rid=rid),
                                       key=types.SimpleNamespace(token_ids=ids, cache_salt=salt))
        agent.on_request_match_safe(params, types.SimpleNamespace(device_prefix_len=matched))

    match("r1", chain + [1, 2, 3], "t1", 16)  # reuses only part of it: still demoted
    match("r2", chain + [1, 2, 3], "t3", 32)  # another namespace: not this chain
    assert len(agent.demoted) == 2
    match("r3", chain + [1, 2, 3], "t1", 32)  # exactly the chain, in its namespace
    assert [ns for ns, _ in agent.demoted.values()] == ["t2"] and agent.demote_stats["taken_back"] == 1


class SourceView(FakeView):
    """A stand-in that holds a 256-token cached prefix (16 pages of 16, slots from page 1 on: page 0 is the pool's
    padding page) a source can lock and gather."""

    def __init__(self):
        super().__init__()
        self.locks, self.unlocked = 0, []

    def kv_buffers(self):
        k = [torch.arange(512 * 16, dtype=torch.float32).view(512, 2, 8) + i for i in range(2)]
        return k, [x + 0.5 for x in k], "NHD"

    def pool_capacity_tokens(self):
        return 512

    def match(self, token_ids, namespace):
        return min(len(token_ids), 256), "node"

    def lock(self, node):
        self.locks += 1
        return f"lock{self.locks}"

    def unlock(self, lock):
        self.unlocked.append(lock)

    def path_slots(self, node):
        return torch.arange(16, 16 + 256)


def posted(agent, kind):
    out = []
    while (msg := agent.mailbox.take_for_io()) is not None:
        if isinstance(msg, kind):
            out.append(msg)
    return out


def test_a_source_gathers_ahead_of_the_wire_and_stops_when_the_transfer_is_cancelled(monkeypatch):
    monkeypatch.setattr("sglang_kvrep.agent.source_side.GATHER_SLICE_S", 3600.0)  # no time slicing here
    view = SourceView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", chunk_bytes=4096, load_interval_s=3600.0))  # 1 page a chunk
    cmd = p.ReplicatePages(replication_id="r1", auth_token="t", token_ids=list(range(256)), namespace="",
                           target_id="x", target_endpoint="tcp://127.0.0.1:1", target_fingerprint=agent.fingerprint,
                           ttl_s=5.0)
    agent._on_message(m.Replicate(cmd))
    [tid] = agent.gathers
    msgs = posted(agent, (m.StartSend, m.ChunkGathered))
    assert isinstance(msgs[0], m.StartSend) and msgs[0].target_endpoint == "tcp://127.0.0.1:1"
    assert msgs[0].header.num_chunks == 16
    assert [c.index for c in msgs[1:]] == [0, 1, 2, 3]  # MAX_AHEAD chunks ahead of what was sent
    agent.mailbox.post_to_scheduler(m.ChunksSent(tid, 2))
    agent.on_iteration()
    assert [c.index for c in posted(agent, m.ChunkGathered)] == [4, 5]
    agent.mailbox.post_to_scheduler(m.SendCancelled(tid))
    agent.on_iteration()
    assert not agent.gathers and view.unlocked == ["lock1"] and not agent.sent_chunks and not agent.cancelled
    assert posted(agent, m.ChunkGathered) == []
    agent.mailbox.post_to_scheduler(m.ChunksSent(tid, 3))  # a late report of the ended transfer: kept nowhere
    agent.mailbox.post_to_scheduler(m.SendCancelled("someone-else"))
    agent.on_iteration()
    assert not agent.sent_chunks and not agent.cancelled


def test_progress_reports_do_not_count_against_the_per_iteration_command_budget():
    from sglang_kvrep.agent.scheduler_side import MAX_COMMANDS

    agent = WorkerAgent(SourceView(), KvrepConfig(worker_id="w", load_interval_s=3600.0))
    for i in range(MAX_COMMANDS + 1):
        agent.mailbox.post_to_scheduler(m.ChunksSent(f"t{i}", 1))  # progress of no running job
        agent.mailbox.post_to_scheduler(m.Demote("", [i]))
    agent.on_iteration()
    assert len(agent.demoted) == MAX_COMMANDS  # the last command waits for the next iteration
    agent.on_iteration()
    assert len(agent.demoted) == MAX_COMMANDS + 1


@pytest.mark.parametrize("failure", ["gather", "host copy"])
def test_a_failed_gather_releases_the_lock_and_ends_the_transfer(monkeypatch, failure):
    """A chunk whose gather (or its copy to the host) fails: the prefix's lock is released, the I/O side is told
    to end the transfer (it reports it failed), nothing more is gathered, and the agent keeps serving."""
    from sglang_kvrep.agent import source_side

    monkeypatch.setattr(source_side, "GATHER_SLICE_S", 3600.0)
    real, calls = source_side.gather_pages, []

    def flaky(*args, **kw):
        calls.append(1)
        buf = real(*args, **kw)
        if len(calls) == 3:
            if failure == "gather":
                raise RuntimeError("injected: device gather failed")
            return buf.to("meta")  # a buffer off the host whose copy to the host fails
        return buf

    monkeypatch.setattr(source_side, "gather_pages", flaky)
    view = SourceView()
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", chunk_bytes=4096, load_interval_s=3600.0))
    cmd = p.ReplicatePages(replication_id="r1", auth_token="t", token_ids=list(range(256)), namespace="",
                           target_id="x", target_endpoint="tcp://127.0.0.1:1", target_fingerprint=agent.fingerprint,
                           ttl_s=5.0)
    agent._on_message(m.Replicate(cmd))
    msgs = posted(agent, (m.StartSend, m.ChunkGathered, m.GatherFailed))
    tid = msgs[0].header.transfer_id
    assert [type(x) for x in msgs] == [m.StartSend, m.ChunkGathered, m.ChunkGathered, m.GatherFailed]
    assert all(c.buffer.device.type == "cpu" for c in msgs[1:3])
    assert msgs[3].transfer_id == tid and "chunk 2" in msgs[3].error
    assert not agent.gathers and view.unlocked == ["lock1"] and not agent.disabled
    agent.mailbox.post_to_scheduler(m.ChunksSent(tid, 2))
    agent.on_iteration()
    assert posted(agent, (m.ChunkGathered, m.GatherFailed)) == [] and len(calls) == 3


def test_kvrep_actions_of_a_requests_kv_hints_envelope_go_to_the_coordinator_once_per_request():
    """A request sent straight to the worker with SGLang's `kv_hints` envelope (no router of ours in front): its
    kvrep actions are reported as hints on its prompt, with the envelope's ids (idempotent with a router's send);
    other consumers' actions are left alone; a bad action of ours is dropped, never the request."""
    import types

    import msgspec
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    from radix_sync.kv_hints import envelope

    agent = WorkerAgent(FakeView(), KvrepConfig(worker_id="w", load_interval_s=3600.0))
    prompt = list(range(100, 140))

    def match(rid, hints, matched=0):
        req = types.SimpleNamespace(rid=rid, kv_hints=None if hints is None else decode_kv_hints_envelope(hints))
        params = types.SimpleNamespace(req=req, key=types.SimpleNamespace(token_ids=prompt, cache_salt="t1"))
        agent.on_request_match_safe(params, types.SimpleNamespace(device_prefix_len=matched))

    hints = envelope(("kvrep.fanout", {"k": 4}), ("acme.x", {"y": 1}), ("kvrep.keepalive", {"ttl_s": 9}),
                     message_id="msg-7")
    match("r1", hints)
    match("r1", hints, matched=16)  # the same request matched again (a retraction, a chunk): reported once
    match("r2", None)
    reported = [x.message for x in posted(agent, m.ToCoordinator) if isinstance(x.message, p.HintReported)]
    assert [(h.kind, h.k, h.ttl_s, h.hint_id, h.namespace, h.token_ids) for h in reported] == [
        ("fanout", 4, 60.0, "msg-7/a-0", "t1", prompt), ("keepalive", 1, 9.0, "msg-7/a-2", "t1", prompt)]
    for h in reported:  # what goes on the wire decodes as the coordinator reads it
        assert p.decode_for_coordinator(p.encode(h)) == h
    match("r3", envelope(("kvrep.fanout", {"k": 4, "delay_s": 99})))  # SGLang cannot check our payloads
    assert [x for x in posted(agent, m.ToCoordinator) if isinstance(x.message, p.HintReported)] == []
    assert agent.kv_hint_stats == {"reported": 2, "malformed": 1}
    assert msgspec.to_builtins(decode_kv_hints_envelope(hints)) == hints  # what compat hands over


def test_queued_requests_prefixes_are_kept_recent_while_busy_at_most_every_quarter_second(monkeypatch):
    """The plugin runs SGLang's `priority` eviction (replicas first), under which SGLang does not refresh its
    waiting requests' prefixes as it does under `lru`: the agent does, so LRU does not evict a queued request's
    prefix before it is scheduled."""
    clock = [100.0]
    monkeypatch.setattr("sglang_kvrep.agent.scheduler_side.time.monotonic", lambda: clock[0])
    view = FakeView()
    view.waiting = 3
    agent = WorkerAgent(view, KvrepConfig(worker_id="w", load_interval_s=3600.0))
    agent.on_iteration()
    assert view.touches == 1
    clock[0] += 0.1
    agent.on_iteration()  # not due yet
    assert view.touches == 1
    clock[0] += 0.2
    agent.on_iteration()
    assert view.touches == 2
    view.running = view.waiting = 0  # idle: nothing waits, nothing to touch
    clock[0] += 1.0
    agent.on_iteration()
    assert view.touches == 2


def test_the_view_touches_the_first_waiting_prefixes_head_last_through_sglangs_own_helper():
    from array import array
    from types import SimpleNamespace

    from sglang_kvrep.compat import SchedulerView

    touched = []
    cache = SimpleNamespace(supports_prefix_sharing=lambda: True, swa_reprefill_tail_tokens=lambda req: 0,
                            touch_prefix=lambda key: touched.append(list(key.token_ids)))
    reqs = [SimpleNamespace(origin_input_ids=array("q", [i, i + 1]), output_ids=array("q", []), extra_key=None,
                            cache_salt=None) for i in range(0, 6, 2)]
    view = SchedulerView.__new__(SchedulerView)
    view.scheduler, view.tree_cache = SimpleNamespace(waiting_queue=reqs), cache
    assert view.touch_waiting_prefixes(limit=2) == 2
    assert touched == [[2, 3], [0, 1]]  # the queue's head last: the most recent
    view.scheduler.waiting_queue = []
    assert view.touch_waiting_prefixes() == 0 and len(touched) == 2
