"""The workers' host-memory tiers, live: SGLang's KV events of medium `CPU_PINNED` (its hierarchical cache) go from
the agent (or a plain worker's event stream) to the coordinator, which checks every page as it checks a device page,
keeps them apart (`radix_sync.host_tier`) and feeds them to the routers (ops +2 / -2), whose rule prices a prefix
in a worker's host tier as loaded back (`--host-load-gbytes-s`). SGLang 0.5.23's hierarchical cache does not start
on the CPU engine (docs/simulator.md), so the events here are SGLang's own structs, made by hand."""
import time
from types import SimpleNamespace

import pytest

from radix_sync import protocol as p
from radix_sync.coordinator.state import ClusterState
from radix_sync.directory import PrefixDirectory
from radix_sync.hashing import page_hashes
from radix_sync.host_tier import HOST_MEDIUM
from radix_sync.policy.cost import CostModel
from radix_sync.router.directory_replica import DirectoryReplica
from radix_sync.router.policy import RouterCosts, WorkerState, rank_by_ttft

PS = 4
TOKENS = list(range(10, 26))  # 4 pages
HASHES = page_hashes(TOKENS, PS, "")


def blocks(tokens=TOKENS, ns="", first=0, upto=None):
    hs = page_hashes(tokens, PS, ns)
    upto = len(hs) if upto is None else upto
    return [(hs[i], hs[i - 1] if i else None, tokens[i * PS:(i + 1) * PS]) for i in range(first, upto)]


def test_host_pages_are_checked_as_device_pages_are():
    d = PrefixDirectory()
    dev, errors = d.verify_blocks("w", "", blocks(upto=2), PS)
    d.add_pages("w", "", dev)
    # pages 0-1 held on the device (taken with their digests), pages 2-3 only in host memory (checked by tokens)
    added, errors = d.add_host_pages("w", "", blocks(), PS)
    assert (added, errors) == (4, []) and d.host.num_pages("w") == 4
    # another worker cannot claim a page under a parent it does not hold; nor a forged hash; nor another namespace
    _, errors = d.add_host_pages("x", "", blocks(first=2), PS)
    assert errors and "is not a verified page of x" in errors[0] and d.host.num_pages("x") == 0
    forged = [(HASHES[0], None, [9, 9, 9, 9])]
    _, errors = d.add_host_pages("x", "", forged, PS)
    assert "does not match its token ids" in errors[0]
    _, errors = d.add_host_pages("w", "tenant-b", [(page_hashes(TOKENS, PS, "tenant-b")[1], HASHES[0], TOKENS[4:8])],
                                 PS)
    assert "not a verified page of w in this namespace" in errors[0]
    _, errors = d.add_host_pages("x", "", blocks(), PS, vocab_size=12)
    assert ">= vocab_size 12" in errors[0]
    added, errors = d.add_host_pages("y", "", blocks(), PS, max_new=2)  # a cap
    assert added == 2 and "cap of host pages" in errors[0]
    # the device evicts page 1 (the host tier keeps it); the host tier evicts page 3; dropping the worker takes all
    d.remove_pages("w", [HASHES[1]])
    assert d.host.num_pages("w") == 4 and d.match(HASHES)["w"] == 1
    assert d.host.remove("w", [HASHES[3], 12345]) == 1 and d.host.num_pages("w") == 3
    d.drop_worker("w")
    assert d.host.num_pages("w") == 0 and d.host.num_pages("y") == 2


def test_the_feed_carries_host_changes_only_to_a_reader_that_asks():
    d = PrefixDirectory()
    d.add_pages("w", "", d.verify_blocks("w", "", blocks(upto=2), PS)[0])
    snap = d.feed_since("", 0, tiers=True)
    assert snap["snapshot"] == {"w": HASHES[:2]} and snap["host_snapshot"] == {}
    head = snap["seq"]
    d.add_host_pages("w", "", blocks(), PS)
    d.host.remove("w", [HASHES[3]])
    plain = d.feed_since(snap["epoch"], head)
    assert plain["changes"] == [] and plain["seq"] == head + 5  # (counted, not sent)
    tiers = d.feed_since(snap["epoch"], head, tiers=True)
    assert tiers["changes"] == [(2, "w", h) for h in HASHES] + [(-2, "w", HASHES[3])]
    assert "host_snapshot" not in d.feed_since("", 0)
    r = DirectoryReplica()
    r.apply(d.feed_since("", 0, tiers=True), now=0.0)  # a snapshot with the host tier
    assert r.match_host(HASHES, r.match(HASHES)) == {"w": 1}  # device pages 0-1, host pages 2 (3 was evicted)
    r2 = DirectoryReplica()
    r2.apply(snap, now=0.0)
    r2.apply({k: ([list(c) for c in v] if k == "changes" else v) for k, v in tiers.items()}, now=0.0)
    assert r2.match_host(HASHES, r2.match(HASHES)) == {"w": 1} and r2.status()["host_pages"] == 3
    d.remove_pages("w", HASHES[:2])  # the device evicted all: the host tier holds the whole prefix but page 3
    r2.apply({k: ([list(c) for c in v] if k == "changes" else v) for k, v in
              d.feed_since(r2.epoch, r2.seq, tiers=True).items()}, now=0.0)
    assert r2.match(HASHES) == {} and r2.match_host(HASHES, {}) == {"w": 3}


def hello(wid="w"):
    return p.Hello(worker_id=wid, http_url=f"http://{wid}", data_endpoint=f"tcp://{wid}:1", fingerprint="fp",
                   fingerprint_fields={"fp": "fp", "page_size": str(PS)}, page_size=PS, pool_capacity_tokens=4096,
                   replica_budget_tokens=0, vocab_size=1000)


def test_the_coordinator_takes_host_tier_facts_apart_and_refuses_bad_ones():
    st = ClusterState()
    st.handle(b"r", hello(), 0.0)
    bf = [p.BlockFact(h, par, t) for h, par, t in blocks()]
    st.handle(b"r", p.PagesStored(worker_id="w", seq=1, namespace="", blocks=bf[:2]), 0.0)
    st.handle(b"r", p.PagesStored(worker_id="w", seq=2, namespace="", blocks=bf, medium=HOST_MEDIUM), 0.0)
    assert st.directory.num_pages("w") == 2 and st.directory.host.num_pages("w") == 4
    st.handle(b"r", p.PagesRemoved(worker_id="w", seq=3, block_hashes=HASHES[2:], medium=HOST_MEDIUM), 0.0)
    assert st.directory.num_pages("w") == 2 and st.directory.host.num_pages("w") == 2
    bad = [p.BlockFact(HASHES[2], HASHES[1], [1, 2, 3, 4])]
    out = st.handle(b"r", p.PagesStored(worker_id="w", seq=4, namespace="", blocks=bad, medium=HOST_MEDIUM), 0.0)
    assert isinstance(out[0][1], p.Error) and "does not match" in out[0][1].error
    assert st.num_refused_facts == {"PagesStored": 1}
    st.handle(b"r", p.PagesStored(worker_id="w", seq=5, namespace="", blocks=bf, medium="DISK"), 0.0)  # ignored
    assert st.directory.host.num_pages("w") == 2
    st.handle(b"r", p.AllPagesCleared(worker_id="w", seq=6), 0.0)  # a flush: both tiers
    assert st.directory.num_pages("w") == 0 and st.directory.host.num_pages("w") == 0


def test_the_router_prices_a_host_tier_prefix_as_loaded_back():
    # 16-token prompt, 1 ms a token to prefill, 10 B a token; worker a holds 4 tokens on its device and 8 more in
    # host memory, b nothing, both idle. Priced at 100 B/s: a = load 8 x 10 B (0.8 s) + prefill 4 (0.004 s) +
    # 0.005 s overhead; b = 0.016 + 0.005 s: b first. At 1e6 B/s the load is 0.08 ms: a first.
    costs = RouterCosts(prefill_s_per_token=1e-3, queue_s_per_request=0.005, kv_bytes_per_token=10)
    model = CostModel(costs.profile())
    ws = [WorkerState("a", page_size=PS), WorkerState("b", page_size=PS)]
    args = (ws, {"a": 4}, (), 16, "", 0.0, model)
    unpriced = rank_by_ttft(*args, host_matched={"a": 8})
    slow = rank_by_ttft(*args, host_matched={"a": 8}, host_load_bytes_per_s=100.0)
    fast = rank_by_ttft(*args, host_matched={"a": 8}, host_load_bytes_per_s=1e6)
    assert slow.ranked[0] == "b" and slow.expected_ttft_s[1] == pytest.approx(0.8 + 0.004 + 0.005)
    assert fast.ranked[0] == "a" and fast.expected_ttft_s[0] == pytest.approx(8 * 10 / 1e6 + 0.004 + 0.005)
    assert unpriced.ranked[0] == "a" and unpriced.expected_ttft_s[0] == pytest.approx(0.012 + 0.005)


def test_the_agent_reports_its_host_tier_and_resyncs_it():
    from sglang_kvrep import events
    from sglang_kvrep.agent.io_side import IoSide
    io = IoSide.__new__(IoSide)
    io.cfg = SimpleNamespace(worker_id="w")
    sent = []
    io.send_coord, io.to_sched = sent.append, lambda m: None
    io.mirror, io.host_mirror, io.replica_facts, io.replica_blocks = {}, {}, {}, {}
    events.SINK.append(events.KvStored("", blocks(upto=2), "GPU"))
    events.SINK.append(events.KvStored("", blocks(), HOST_MEDIUM))
    events.SINK.append(events.KvRemoved(block_hashes=HASHES[3:], medium=HOST_MEDIUM))
    events.SINK.append(events.KvStored("", blocks(), "DISK"))  # (no other tier)
    io.drain_events()
    assert [(type(m).__name__, m.medium) for m in sent] == [("PagesStored", "GPU"), ("PagesStored", HOST_MEDIUM),
                                                           ("PagesRemoved", HOST_MEDIUM)]
    assert list(io.mirror) == HASHES[:2] and list(io.host_mirror) == HASHES[:3]
    sent.clear()
    hellos = []
    io.coord = SimpleNamespace(send=lambda data, flags=0: hellos.append(p.decode_for_coordinator(data)))
    io.info = SimpleNamespace(fingerprint="f", fingerprint_fields={}, page_size=PS, pool_capacity_tokens=4096,
                              replica_budget_tokens=0, vocab_size=1000)
    io.cfg.http_url, io.data_endpoint, io.last_load = "http://w", "tcp://127.0.0.1:1", None
    io.seq, io.stats = 0, {"hellos": 0}
    io.hello()  # a resync: the device pages, then the host tier's
    assert len(hellos) == 1 and isinstance(hellos[0], p.Hello)
    assert [(m.medium, [b.block_hash for b in m.blocks]) for m in sent] == [("GPU", HASHES[:2]),
                                                                           (HOST_MEDIUM, HASHES[:3])]
    events.SINK.append(events.KvCleared())
    io.drain_events()
    assert not io.mirror and not io.host_mirror
