"""Workers without the plugin (`radix_sync.coordinator.plain`): SGLang's own KV-event wire format decoded with our
structs (checked against SGLang 0.5.23's own classes and its own ZMQ publisher), sequence gaps, restarts and replay,
and a plain worker in the coordinator's state: in the directory and routed to, never a copy's end."""
import threading
import time

import msgspec
import pytest
import zmq

from radix_sync import protocol as p
from radix_sync.api import AdminError
from radix_sync.coordinator.plain import (PlainEventError, PlainFeed, PlainWorkerSpec, batch_facts, decode_batch)
from radix_sync.coordinator.state import ClusterState, StateConfig
from radix_sync.hashing import page_hashes
from radix_sync.policy.cost import CostModel, load_profile
from radix_sync.router.policy import WorkerState, rank_by_ttft
from kvrep_dev.cluster import free_port
from tests.util import wait_until

PS = 4
kv = pytest.importorskip("sglang.srt.disaggregation.kv_events")


def sglang_batch(tokens, ns="", parent=None, size=PS, medium=None, seq_ts=0.0) -> bytes:
    """A batch as SGLang 0.5.23 publishes it: its own structs, msgpack-encoded as its publisher does."""
    hashes = page_hashes(tokens, PS, ns)
    ev = kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens), block_size=size,
                        lora_id=None, medium=medium, cache_salt=ns or None)
    return msgspec.msgpack.encode(kv.KVEventBatch(ts=seq_ts, events=[ev]))


def spec(**kw) -> PlainWorkerSpec:
    base = dict(worker_id="p", url="http://127.0.0.1:1", events="tcp://127.0.0.1:1", page_size=PS,
                capacity_tokens=1000)
    return PlainWorkerSpec(**{**base, **kw})


# ------------------------------------------------------------------------------------------------ wire format
def test_sglang_batches_decode_into_our_facts():
    toks = list(range(10, 22))
    facts = batch_facts(decode_batch(sglang_batch(toks, ns="ns1")), "p", PS)
    assert len(facts) == 1 and isinstance(facts[0], p.PagesStored)
    f = facts[0]
    assert f.namespace == "ns1" and [b.token_ids for b in f.blocks] == [toks[0:4], toks[4:8], toks[8:12]]
    hashes = page_hashes(toks, PS, "ns1")
    assert [b.block_hash for b in f.blocks] == hashes
    assert [b.parent_hash for b in f.blocks] == [None] + hashes[:-1]
    removed = msgspec.msgpack.encode(kv.KVEventBatch(ts=1.0, events=[
        kv.BlockRemoved(block_hashes=hashes[1:]), kv.AllBlocksCleared(),
        kv.BlockRemoved(block_hashes=hashes, medium="CPU_PINNED"), kv.BlockRemoved(block_hashes=hashes,
                                                                                   medium="DISK")]))
    out = batch_facts(decode_batch(removed), "p", PS)
    assert [type(m) for m in out] == [p.PagesRemoved, p.AllPagesCleared, p.PagesRemoved]  # (no disk tier)
    assert out[0].block_hashes == hashes[1:] and out[0].medium == "GPU"
    assert out[2].block_hashes == hashes and out[2].medium == "CPU_PINNED"  # the host tier's, as such


def test_host_tier_stores_go_as_such_other_tiers_are_skipped_and_bad_batches_refused():
    host = batch_facts(decode_batch(sglang_batch(list(range(8)), medium="CPU_PINNED")), "p", PS)
    assert [(type(m), m.medium, len(m.blocks)) for m in host] == [(p.PagesStored, "CPU_PINNED", 2)]
    assert batch_facts(decode_batch(sglang_batch(list(range(8)), medium="DISK")), "p", PS) == []
    with pytest.raises(PlainEventError, match="block size 8"):
        batch_facts(decode_batch(sglang_batch(list(range(8)), size=8)), "p", PS)
    with pytest.raises(PlainEventError, match="bad KV event batch"):
        decode_batch(b"\x93garbage")
    with pytest.raises(PlainEventError):
        decode_batch(msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1],
                                                     "token_ids": [-5], "block_size": 1}]]))
    bad_len = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1] * 5,
                                             "block_size": PS, "lora_id": None}]])
    with pytest.raises(PlainEventError, match="5 token ids for 2 pages"):
        batch_facts(decode_batch(bad_len), "p", PS)


def test_spec_parsing():
    s = PlainWorkerSpec.parse("id=w9,url=http://h:30000/,events=tcp://h:5557,page_size=16,replay=tcp://h:5558")
    assert (s.worker_id, s.url, s.events, s.page_size, s.replay, s.topic) == (
        "w9", "http://h:30000", "tcp://h:5557", 16, "tcp://h:5558", "")
    assert s.hello().replica_budget_tokens == 0 and s.hello().fingerprint == "plain:w9"
    assert s.routing_id().startswith(b"\x00")
    for bad, why in [("id=w,url=http://h:1,events=tcp://h:2", "missing page_size="),
                     ("id=w,url=ftp://h,events=tcp://h:2,page_size=16", "url must be"),
                     ("id=w,url=http://h:1,events=h:2,page_size=16", "events must be"),
                     ("id=w,url=http://h:1,events=tcp://h:2,page_size=0", "page_size must be"),
                     ("id=w,url=http://h:1,events=tcp://h:2,page_size=x", "integers"),
                     ("id=w,id=v,url=http://h:1,events=tcp://h:2,page_size=1", "given twice"),
                     ("id=w,colour=red", "bad part")]:
        with pytest.raises(ValueError, match=why):
            PlainWorkerSpec.parse(bad)


# ------------------------------------------------------------------------------------- sequence numbers
class Sink:
    def __init__(self):
        self.msgs = []

    def __call__(self, rid, msg, now):
        self.msgs.append(msg)
        return []

    def kinds(self):
        return [type(m).__name__ for m in self.msgs if not isinstance(m, p.Hello)]


def test_feed_applies_in_order_numbers_facts_and_reports_gaps():
    sink = Sink()
    feed = PlainFeed(spec(), sink)
    b = sglang_batch(list(range(8)))
    assert feed.on_batch(7, b) and feed.next_event_seq == 8  # the first batch seen sets the start
    assert feed.on_batch(8, b)
    assert not feed.on_batch(10, b)  # 9 missing: not applied, the caller fills or forgets
    assert feed.next_event_seq == 9
    assert [m.seq for m in sink.msgs] == [1, 2]  # ours, consecutive: the coordinator checks them as any worker's


def test_feed_restart_forgets_and_replay_duplicates_are_skipped():
    sink = Sink()
    feed = PlainFeed(spec(), sink)
    b = sglang_batch(list(range(8)))
    for s in (0, 1, 2):
        feed.on_batch(s, b, replayed=True)
    assert feed.on_batch(1, b) and feed.on_batch(2, b)  # the live feed's copies of replayed batches: skipped
    assert sink.kinds() == ["PagesStored"] * 3
    assert feed.on_batch(3, b)
    # a live batch numbered below what was applied and not replayed: SGLang restarted (its cache is empty)
    assert feed.on_batch(0, b)
    assert sink.kinds()[-2:] == ["AllPagesCleared", "PagesStored"] and feed.next_event_seq == 1
    assert feed.num_forgets == 1


def test_a_refused_batch_forgets_the_worker_pages():
    sink = Sink()
    feed = PlainFeed(spec(), sink)
    feed.on_batch(0, sglang_batch(list(range(8))))
    feed.on_batch(1, b"\x01not a batch")
    assert sink.kinds() == ["PagesStored", "AllPagesCleared"] and feed.num_errors == 1


# ----------------------------------------------------------------------------------- in the coordinator
@pytest.fixture
def st():
    s = ClusterState(StateConfig(worker_timeout_s=5.0))
    h = p.Hello(worker_id="a", http_url="http://a", data_endpoint="tcp://a:1", fingerprint="f",
                fingerprint_fields={"fp": "f"}, page_size=PS, pool_capacity_tokens=1000, replica_budget_tokens=250)
    assert isinstance(s.handle(b"A", h, 0.0)[0][1], p.HelloAck)
    return s


def test_plain_worker_in_the_directory_never_a_copy_end(st):
    lock = threading.Lock()
    sp = spec()

    def apply(rid, msg, now):
        with lock:
            return st.handle(rid, msg, now)
    feed = PlainFeed(sp, apply)
    feed._fact(sp.hello())
    toks = list(range(100, 112))
    feed.on_batch(0, sglang_batch(toks))
    assert st.lookup(toks, "") == {"a": 0, "p": 12}
    info = st.workers["p"].to_info()
    assert info.plain and not st.workers["a"].to_info().plain
    st.handle(b"A", p.PagesStored(worker_id="a", seq=1, namespace="", blocks=[
        p.BlockFact(h, par, toks[i * PS:(i + 1) * PS]) for i, (h, par) in
        enumerate(zip(page_hashes(toks, PS), [None] + page_hashes(toks, PS)[:-1]))]), 1.0)
    for src, dst in (("p", "a"), ("a", "p")):
        with pytest.raises(AdminError, match="runs without the kvrep plugin") as exc:
            st.request_replication(src, dst, toks, "", 60.0, 1.0)
        assert exc.value.status == 409
    # a ZMQ peer cannot take a configured plain worker's id (nor its socket identity: zero-byte ids are libzmq's)
    h = p.Hello(worker_id="p", http_url="http://evil", data_endpoint="tcp://evil:1", fingerprint="f",
                fingerprint_fields={}, page_size=PS, pool_capacity_tokens=1000, replica_budget_tokens=250)
    reply = st.handle(b"X", h, 2.0)[0][1]
    assert isinstance(reply, p.Error) and "plain worker" in reply.error
    assert st.workers["p"].hello.http_url == "http://127.0.0.1:1"
    # a forged page (hash not of its tokens) is refused like any worker's
    forged = p.PagesStored(worker_id="p", seq=0, namespace="", blocks=[p.BlockFact(12345, None, [1, 2, 3, 4])])
    feed._fact(forged)
    assert st.lookup([1, 2, 3, 4], "") == {"a": 0, "p": 0}
    st.check_integrity()


def test_router_never_plans_a_pull_from_or_to_a_plain_worker():
    model = CostModel(load_profile("llama3.1-8b-h200"))
    prompt_len = 32768
    # the holder is busy; an idle worker without the prefix: a pull from the holder pays (it waits for the holder's
    # iteration in progress, a chunk of 8,192 tokens, then ~0.2 s on the link; a cold prefill takes ~0.9 s)
    holder = WorkerState("h", 16, num_running=4, num_waiting=6, num_waiting_tokens=80_000)
    idle = WorkerState("i", 16)
    matched = {"h": prompt_len}
    d = rank_by_ttft([holder, idle], matched, [], prompt_len, "", 0.0, model, allow_pull=True)
    assert d.pull is not None and (d.pull.source, d.pull.target) == ("h", "i")
    for plain_holder, plain_idle in ((True, False), (False, True)):
        ws = [WorkerState("h", 16, 4, 6, 80_000, copies=not plain_holder), WorkerState("i", 16, copies=not plain_idle)]
        d = rank_by_ttft(ws, matched, [], prompt_len, "", 0.0, model, allow_pull=True)
        assert d.pull is None


# ----------------------------------------------------------------------------- SGLang's own publisher, real sockets
def test_feed_follows_sglangs_own_zmq_publisher_with_replay():
    """SGLang's `ZmqEventPublisher` (PUB + replay ROUTER), in this process: batches published before the feed
    joins come from the replay, later ones live; the directory holds all of them."""
    port, rport = free_port(), free_port()
    pub = kv.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{port}",
                               replay_endpoint=f"tcp://127.0.0.1:{rport}", topic="kv", bind=True)
    st = ClusterState(StateConfig(worker_timeout_s=30.0))
    lock = threading.Lock()

    def apply(rid, msg, now):
        with lock:
            return st.handle(rid, msg, now)
    early, late = list(range(200, 208)), list(range(300, 312))
    feed = None
    try:
        pub.publish(kv.KVEventBatch(ts=0.0, events=[kv.BlockStored(
            block_hashes=page_hashes(early, PS), parent_block_hash=None, token_ids=early, block_size=PS,
            lora_id=None)]))
        time.sleep(0.3)  # (its thread sends it before anyone listens: only the replay has it)
        sp = spec(events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}", topic="kv")
        feed = PlainFeed(sp, apply)
        feed.start()
        wait_until(lambda: feed.num_replayed >= 1, 10, what="the replayed batch")
        with lock:
            assert st.lookup(early, "")["p"] == 8

        def published_late():
            pub.publish(kv.KVEventBatch(ts=1.0, events=[kv.BlockStored(
                block_hashes=page_hashes(late, PS), parent_block_hash=None, token_ids=late, block_size=PS,
                lora_id=None)]))
            time.sleep(0.2)
            with lock:
                return st.lookup(late, "")["p"] == 12
        wait_until(published_late, 15, what=f"a live batch in the directory ({feed.stats()})")  # (resent: a SUB
        # joins late)
        assert feed.num_errors == 0
        with lock:
            st.check_integrity()
    finally:
        if feed is not None:
            feed.stop()
        pub.shutdown()
