"""Acceptance of the foundation on real CPU SGLang servers: replicate, hit, expire, isolate, refuse."""
import threading
import time
import uuid

import pytest
import zmq

from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from sglang_kvrep.dataplane.wire import send_transfer
from tests.integration.conftest import PAGE_SIZE, prompt, wait_until

pytestmark = pytest.mark.server



def test_replica_hit_gives_identical_greedy_output(cluster):
    a, b, coord = cluster.a, cluster.b, cluster.coord
    P = prompt(1, 1100)
    a.generate(P, 4)
    rep = cluster.replicate(a, b, P, ttl_s=120)
    assert rep["state"] == "done", rep
    assert rep["num_tokens"] == len(P) // PAGE_SIZE * PAGE_SIZE and rep["bytes"] > 0
    # the session's workers run --kvrep-transport nixl: the pages were NIXL WRITEs into B's staging
    wait_until(lambda: f"nixl: replication {rep['id']} " in b.log_path.read_text(errors="replace"),
               what="B's log: the replication's chunks written in place by NIXL and verified")
    query = P + prompt(2, 24)
    out_a = a.generate(query, 24)
    out_b = b.generate(query, 24)
    assert out_b["meta_info"]["cached_tokens"] >= len(P) - PAGE_SIZE
    assert out_b["output_ids"] == out_a["output_ids"]
    # the model's output really depends on its input (so equality above is evidence about the copied KV)
    assert a.generate(prompt(3, 1100) + prompt(2, 24), 24)["output_ids"] != out_a["output_ids"]
    # B's request cached through the replica: it is promoted to ordinary cache and leaves the replica list,
    # while B still holds the pages
    wait_until(lambda: all(r["replication_id"] != rep["id"] for r in coord.get("/status")[1]["replicas"]), 10,
               what="the replica to be promoted")
    assert cluster.lookup(P)[b.worker_id] >= len(P) - PAGE_SIZE


def test_directory_lists_target_as_replica_holder(cluster):
    a, b, coord = cluster.a, cluster.b, cluster.coord
    P = prompt(10, 1040)
    a.generate(P, 2)
    rep = cluster.replicate(a, b, P, ttl_s=120)
    assert rep["state"] == "done", rep
    replicas = {(r["worker"], r["replication_id"]): r for r in coord.get("/status")[1]["replicas"]}
    entry = replicas[(b.worker_id, rep["id"])]
    assert entry["num_pages"] == rep["inserted_len"] // PAGE_SIZE == len(P) // PAGE_SIZE
    assert cluster.lookup(P)[b.worker_id] == len(P) // PAGE_SIZE * PAGE_SIZE
    # an admin can evict replicas at once (a benchmark between arms): the directory forgets them when B confirms
    assert coord.post("/replicas/drop", {"worker": "no-such-worker"})[0] == 404
    status, out = coord.post("/replicas/drop", {"worker": b.worker_id})
    assert status == 200 and out["dropped"] >= 1
    wait_until(lambda: all(r["worker"] != b.worker_id for r in coord.get("/status")[1]["replicas"]), 15,
               what="B's replicas dropped")
    assert cluster.lookup(P)[b.worker_id] == 0 and cluster.lookup(P)[a.worker_id] > 0


def test_a_replica_sglang_no_longer_holds_leaves_the_budget_at_once(cluster):
    """A cache flush (or SGLang's own eviction, which takes replicas first) removes a replica long before its TTL:
    the worker's replica budget gets its room back at once and the coordinator is told; before, the replica held
    the budget until its TTL, refusing pulls."""
    import urllib.request

    a, b, coord = cluster.a, cluster.b, cluster.coord
    P = prompt(12, 800)
    a.generate(P, 2)
    rep = cluster.replicate(a, b, P, ttl_s=120)
    assert rep["state"] == "done" and rep["inserted_len"] > 0, rep
    wait_until(lambda: cluster.load(b)["replica_tokens"] >= rep["inserted_len"], 10, what="B's report of it")
    with urllib.request.urlopen(urllib.request.Request(b.url + "/flush_cache", data=b"", method="POST"),
                                timeout=30) as resp:  # (a text answer)
        assert resp.status == 200
    wait_until(lambda: cluster.load(b)["replica_tokens"] == 0, 10, what="B's budget back after the flush")
    wait_until(lambda: all(r["replication_id"] != rep["id"] for r in coord.get("/status")[1]["replicas"]), 10,
               what="the coordinator told")
    assert cluster.lookup(P)[b.worker_id] == 0 and cluster.lookup(P)[a.worker_id] > 0


def test_replica_without_hit_expires(cluster):
    a, b, coord = cluster.a, cluster.b, cluster.coord
    P = prompt(20, 600)
    a.generate(P, 2)
    rep = cluster.replicate(a, b, P, ttl_s=2)
    assert rep["state"] == "done", rep
    assert cluster.lookup(P)[b.worker_id] > 0
    wait_until(lambda: cluster.lookup(P)[b.worker_id] == 0, 15, what="the directory to drop the expired replica")
    assert all(r["replication_id"] != rep["id"] for r in coord.get("/status")[1]["replicas"])
    assert b.generate(P + prompt(21, 8), 2)["meta_info"]["cached_tokens"] == 0
    assert cluster.lookup(P)[a.worker_id] > 0  # the source is untouched


def test_replica_kept_while_a_queued_request_wants_it(cluster):
    """A replica's TTL passes while the request routed to it is still queued behind busy slots (a queued request
    holds no tree lock): the replica stays until that request is admitted, which then hits it."""
    from kvrep_dev.cluster import http_json
    a, b, coord = cluster.a, cluster.b, cluster.coord
    P = prompt(60, 640)
    a.generate(P, 2)
    # B's two running slots (--max-running-requests 2) taken by long decodes, aborted once the check is done
    rids = [f"blocker-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    blockers = [threading.Thread(target=http_json, args=(b.url + "/generate", {
        "input_ids": prompt(61 + i, 32), "rid": rid,
        "sampling_params": {"max_new_tokens": 6000, "temperature": 0.0, "ignore_eos": True}}), kwargs={"timeout": 300})
        for i, rid in enumerate(rids)]
    for t in blockers:
        t.start()
    try:
        wait_until(lambda: cluster.load(b)["num_running_reqs"] == 2, 30, what="B's two slots busy")
        rep = cluster.replicate(a, b, P, ttl_s=1)
        assert rep["state"] == "done", rep
        done_at = time.monotonic()
        result = {}
        query = threading.Thread(target=lambda: result.update(b.generate(P + prompt(62, 16), 2, timeout=300)))
        query.start()
        wait_until(lambda: cluster.load(b)["num_waiting_reqs"] >= 1, 30, what="the request queued on B")
        # well past the TTL, with several expiry passes (one per load report) while the request waits
        time.sleep(max(0.0, done_at + 4.0 - time.monotonic()))
        assert query.is_alive() and all(t.is_alive() for t in blockers), "B's slots freed before the check"
        assert any(r["replication_id"] == rep["id"] for r in coord.get("/status")[1]["replicas"])
        assert cluster.lookup(P)[b.worker_id] >= len(P) - PAGE_SIZE
    finally:
        for rid in rids:
            http_json(b.url + "/abort_request", {"rid": rid})
        for t in blockers:
            t.join(60)
    query.join(120)
    assert result["meta_info"]["cached_tokens"] >= len(P) - PAGE_SIZE
    # admitted, it hit the replica; unpromoted replicas of this id are gone from the table (promoted or expired)
    wait_until(lambda: all(r["replication_id"] != rep["id"] for r in coord.get("/status")[1]["replicas"]), 15,
               what="the replica to leave the table once used")


def test_replica_visible_only_in_its_namespace(cluster):
    a, b = cluster.a, cluster.b
    P = prompt(30, 700)
    a.generate(P, 2, cache_salt="tenant-a")
    rep = cluster.replicate(a, b, P, cache_salt="tenant-a", ttl_s=120)
    assert rep["state"] == "done", rep
    assert cluster.lookup(P, "tenant-a")[b.worker_id] > 0
    assert cluster.lookup(P, "tenant-b")[b.worker_id] == 0
    assert cluster.lookup(P)[b.worker_id] == 0
    query = P + prompt(31, 8)
    assert b.generate(query, 2, cache_salt="tenant-b")["meta_info"]["cached_tokens"] == 0
    assert b.generate(query, 2)["meta_info"]["cached_tokens"] == 0
    assert b.generate(query, 2, cache_salt="tenant-a")["meta_info"]["cached_tokens"] >= len(P) - PAGE_SIZE


class FakeSource:
    """The test plays a (buggy or hostile) source worker: it says hello with the target's fingerprint, asks the
    coordinator for a replication from itself, and receives the authorized `ReplicatePages` command."""

    def __init__(self, cluster, like: dict) -> None:
        self.worker_id = "fake-" + uuid.uuid4().hex[:6]
        self.like = like
        self.cluster = cluster
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(cluster.coord.endpoint)
        self.sock.send(p.encode(p.Hello(
            worker_id=self.worker_id, http_url="http://127.0.0.1:9", data_endpoint="tcp://127.0.0.1:9",
            fingerprint=like["fingerprint"], fingerprint_fields=like["fingerprint_fields"], page_size=PAGE_SIZE,
            pool_capacity_tokens=1000, replica_budget_tokens=1000)))
        assert isinstance(self.recv(), p.HelloAck)

    def recv(self):
        assert self.sock.poll(10_000), "nothing from the coordinator"
        return p.decode_for_worker(self.sock.recv())

    def request(self, target_id: str, token_ids: list[int]) -> p.ReplicatePages:
        # a source must hold the prefix (its pages reported with their tokens) to be given a replication
        n = len(token_ids) // PAGE_SIZE * PAGE_SIZE
        hashes = page_hashes(token_ids[:n], PAGE_SIZE)
        self.sock.send(p.encode(p.PagesStored(worker_id=self.worker_id, seq=1, namespace="", blocks=[
            p.BlockFact(h, par, token_ids[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])
            for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))])))
        deadline = time.monotonic() + 10
        while self.cluster.coord.post("/directory/lookup", {"input_ids": token_ids})[1]["matched"].get(
                self.worker_id, 0) < n:
            assert time.monotonic() < deadline, "the fake source's pages never reached the directory"
            time.sleep(0.05)
        status, rep = self.cluster.coord.post("/replicate", {"source": self.worker_id, "target": target_id,
                                                             "input_ids": token_ids, "ttl_s": 3})
        assert status == 200, rep
        msg = self.recv()
        assert isinstance(msg, p.ReplicatePages), msg
        return msg

    def geometry(self) -> tuple[int, int, int]:
        fields = self.like["fingerprint_fields"]
        heads, dim = (int(x) for x in fields["kv_geometry"].strip("()").split(","))
        return int(fields["num_layers"]), heads, dim

    def dtype(self) -> tuple[str, int]:
        """The KV pool's dtype as the worker reports it (bf16, or float32 on a CPU without native bf16) and its
        item size in bytes."""
        name = self.like["fingerprint_fields"]["kv_store_dtype"]
        return name, {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}[name]

    def header(self, cmd: p.ReplicatePages, payload: bytes, **overrides) -> p.TransferHeader:
        layers, heads, dim = self.geometry()
        num_pages = len(cmd.token_ids) // PAGE_SIZE
        fields = dict(
            transfer_id=uuid.uuid4().hex[:12], replication_id=cmd.replication_id, auth_token=cmd.auth_token,
            source_id=self.worker_id, fingerprint=self.like["fingerprint"], namespace=cmd.namespace,
            token_ids=cmd.token_ids, page_size=PAGE_SIZE, num_pages=num_pages, dtype=self.dtype()[0],
            layout="NHD", buffer_shape=[layers, num_pages, 2, PAGE_SIZE, heads, dim], num_bytes=len(payload),
            pages_per_chunk=1, num_chunks=num_pages, checksum_kind="xxh64", ttl_s=cmd.ttl_s)
        fields.update(overrides)
        return p.TransferHeader(**fields)

    def payload(self, num_pages: int) -> bytes:
        layers, heads, dim = self.geometry()
        size = layers * num_pages * 2 * PAGE_SIZE * heads * dim * self.dtype()[1]
        return bytes((i * 7) % 251 for i in range(size))

    def close(self) -> None:
        self.sock.close()


FAULTS = {
    "unauthorized": ("not authorized", dict(auth_token="0" * 32)),
    "fingerprint": ("fingerprint mismatch", dict(fingerprint="0" * 24)),
    "checksum": ("checksum mismatch", None),
    "missing_chunk": ("incomplete", None),
    "other_tokens": ("not the prefix the coordinator authorized", None),
    "other_namespace": ("does not match its authorization", dict(namespace="someone-else")),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_bad_transfer_is_refused_and_nothing_is_written(cluster, fault):
    b, coord = cluster.b, cluster.coord
    fake = FakeSource(cluster, coord.workers()[b.worker_id])
    try:
        tokens = prompt(500 + sorted(FAULTS).index(fault), 4 * PAGE_SIZE)
        before = cluster.free_plus_evictable(b)
        cmd = fake.request(b.worker_id, tokens)
        payload = fake.payload(4)
        needle, overrides = FAULTS[fault]
        header = fake.header(cmd, payload, **(overrides or {}))
        if fault == "other_tokens":
            header.token_ids = prompt(700, 4 * PAGE_SIZE)
        reply = send_transfer(coord.workers()[b.worker_id]["data_endpoint"], header, payload,
                              corrupt_chunk=2 if fault == "checksum" else None,
                              skip_chunk=1 if fault == "missing_chunk" else None)
        assert isinstance(reply, p.TransferRefused), reply
        assert needle in reply.error, reply.error
        for ns in {cmd.namespace, header.namespace}:
            assert cluster.lookup(header.token_ids, ns)[b.worker_id] == 0
            assert cluster.lookup(tokens, ns)[b.worker_id] == 0
        assert cluster.free_plus_evictable(b) == before
        rep = next(r for r in coord.get("/replications")[1] if r["id"] == cmd.replication_id)
        if fault == "unauthorized":
            assert rep["state"] == "pending"  # a stranger cannot fail someone else's replication
        else:
            assert rep["state"] == "failed" and needle in rep["error"], rep
        assert b.generate(prompt(600, 40), 2)["meta_info"]["prompt_tokens"] == 40  # still serving
    finally:
        fake.close()


def test_authorized_transfer_from_outside_is_accepted(cluster):
    """The positive control for the refusals above: the same path with nothing wrong writes a replica."""
    b, coord = cluster.b, cluster.coord
    fake = FakeSource(cluster, coord.workers()[b.worker_id])
    try:
        tokens = prompt(98, 4 * PAGE_SIZE)
        cmd = fake.request(b.worker_id, tokens)
        payload = fake.payload(4)
        reply = send_transfer(coord.workers()[b.worker_id]["data_endpoint"], fake.header(cmd, payload), payload)
        assert isinstance(reply, p.TransferAccepted) and reply.inserted_len == 4 * PAGE_SIZE, reply
        wait_until(lambda: cluster.lookup(tokens)[b.worker_id] == 4 * PAGE_SIZE, 10,
                   what="the directory to see the accepted replica")
        rep = next(r for r in coord.get("/replications")[1] if r["id"] == cmd.replication_id)
        assert rep["state"] == "done", rep
    finally:
        fake.close()


def test_automatic_rule_replicates_hot_prefix_under_load(cluster):
    a, b, coord = cluster.a, cluster.b, cluster.coord
    hot = prompt(40, 640)
    errors = []

    def send(i):
        try:
            a.generate(hot + prompt(1000 + i, 32), 96)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(300)
    assert not errors
    wait_until(lambda: [r for r in coord.get("/replications")[1]
                        if r["origin"] == "rules" and r["state"] == "done"
                        and r["source"] == a.worker_id and r["target"] == b.worker_id], 30,
               what="the rule-based policy to replicate the hot prefix")
    assert cluster.lookup(hot)[b.worker_id] >= len(hot) - PAGE_SIZE
    out = b.generate(hot + prompt(2000, 16), 4)
    assert out["meta_info"]["cached_tokens"] >= len(hot) - PAGE_SIZE
