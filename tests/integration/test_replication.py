"""Acceptance of the foundation on real CPU SGLang servers: replicate, hit, expire, isolate, refuse."""
import threading
import time
import uuid

import pytest
import xxhash

from radix_sync import protocol as p
from sglang_kvrep.dataplane import send_transfer
from tests.integration.conftest import PAGE_SIZE, prompt, wait_until

pytestmark = pytest.mark.server



def test_replica_hit_gives_identical_greedy_output(cluster):
    a, b, coord = cluster.a, cluster.b, cluster.coord
    P = prompt(1, 1100)
    a.generate(P, 4)
    rep = cluster.replicate(a, b, P, ttl_s=120)
    assert rep["state"] == "done", rep
    assert rep["num_tokens"] == len(P) // PAGE_SIZE * PAGE_SIZE and rep["bytes"] > 0
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


def _header_for(worker_info: dict, num_pages: int, payload: bytes, *, fingerprint=None, checksum=None) -> p.TransferHeader:
    fields = worker_info["fingerprint_fields"]
    heads, dim = eval(fields["kv_geometry"])  # "(H, D)" as written by the worker
    layers = int(fields["num_layers"])
    tokens = prompt(hash(payload[:16]) % 10_000, num_pages * PAGE_SIZE)
    return p.TransferHeader(
        transfer_id=uuid.uuid4().hex[:12], replication_id="test-" + uuid.uuid4().hex[:6], source_id="test",
        fingerprint=fingerprint or worker_info["fingerprint"], namespace="garbage-" + uuid.uuid4().hex[:6],
        token_ids=tokens, page_size=PAGE_SIZE, num_pages=num_pages, dtype="torch.bfloat16", layout="NHD",
        buffer_shape=[layers, num_pages, 2, PAGE_SIZE, heads, dim], num_bytes=len(payload), num_chunks=4,
        checksum=checksum if checksum is not None else xxhash.xxh64_intdigest(payload), checksum_kind="xxh64",
        ttl_s=3.0)


def _payload(worker_info: dict, num_pages: int) -> bytes:
    fields = worker_info["fingerprint_fields"]
    heads, dim = eval(fields["kv_geometry"])
    size = int(fields["num_layers"]) * num_pages * 2 * PAGE_SIZE * heads * dim * 2
    return bytes((i * 7) % 251 for i in range(size))


@pytest.mark.parametrize("fault", ["fingerprint", "checksum", "truncated"])
def test_bad_transfer_is_refused_and_nothing_is_written(cluster, fault):
    b, coord = cluster.b, cluster.coord
    info = coord.workers()[b.worker_id]
    payload = _payload(info, 4)
    before = cluster.free_plus_evictable(b)
    header = _header_for(info, 4, payload,
                         fingerprint="0" * 24 if fault == "fingerprint" else None,
                         checksum=(xxhash.xxh64_intdigest(payload) ^ 1) if fault == "checksum" else None)
    if fault == "truncated":
        payload = payload[:-100]
    reply = send_transfer(info["data_endpoint"], header, payload, chunk_bytes=-(-len(payload) // 4))
    assert isinstance(reply, p.TransferRefused), reply
    needle = {"fingerprint": "fingerprint mismatch", "checksum": "checksum mismatch", "truncated": "incomplete"}
    assert needle[fault] in reply.error
    assert cluster.lookup(header.token_ids, header.namespace)[b.worker_id] == 0
    assert cluster.free_plus_evictable(b) == before
    assert b.generate(prompt(99, 40), 2)["meta_info"]["prompt_tokens"] == 40  # still serving


def test_well_formed_transfer_from_outside_is_accepted(cluster):
    """The positive control for the refusals above: the same path with a correct header is written."""
    b, coord = cluster.b, cluster.coord
    info = coord.workers()[b.worker_id]
    payload = _payload(info, 4)
    header = _header_for(info, 4, payload)
    reply = send_transfer(info["data_endpoint"], header, payload, chunk_bytes=-(-len(payload) // 4))
    assert isinstance(reply, p.TransferAccepted) and reply.inserted_len == 4 * PAGE_SIZE, reply
    wait_until(lambda: cluster.lookup(header.token_ids, header.namespace)[b.worker_id] == 4 * PAGE_SIZE, 10,
               what="the directory to see the accepted replica")


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
    reps = wait_until(lambda: [r for r in coord.get("/replications")[1]
                               if r["origin"] == "rules" and r["state"] == "done"
                               and r["source"] == a.worker_id and r["target"] == b.worker_id], 30,
                      what="the rule-based policy to replicate the hot prefix")
    assert cluster.lookup(hot)[b.worker_id] >= len(hot) - PAGE_SIZE
    out = b.generate(hot + prompt(2000, 16), 4)
    assert out["meta_info"]["cached_tokens"] >= len(hot) - PAGE_SIZE
