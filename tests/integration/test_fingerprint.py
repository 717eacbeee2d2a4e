"""Page size 1 workers: replication works between them, and never with the page-size-16 workers (another
compatibility fingerprint)."""
import pytest

from kvrep_dev.cluster import Worker
from tests.integration.conftest import LOGS, WORKER_ARGS, prompt, wait_until

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def page1(cluster):
    procs = []
    try:
        for name in ("C-page1", "C2-page1"):
            procs.append(Worker(name, "tiny", LOGS, coordinator=cluster.coord.endpoint, page_size=1,
                                extra_args=WORKER_ARGS))
        for proc in procs:
            proc.wait_ready()
        cluster.coord.wait_workers([w.worker_id for w in procs])
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def test_replication_across_fingerprints_is_refused(cluster, page1):
    a, c, coord = cluster.a, page1[0], cluster.coord
    workers = coord.workers()
    assert workers[a.worker_id]["fingerprint"] != workers[c.worker_id]["fingerprint"]
    P = prompt(50, 600)
    a.generate(P, 2)
    c.generate(P, 2)
    before = cluster.free_plus_evictable(c)
    for src, dst in ((a, c), (c, a)):
        status, body = coord.post("/replicate", {"source": src.worker_id, "target": dst.worker_id, "input_ids": P})
        assert status == 400, body
        assert "fingerprint mismatch" in body["error"] and "page_size" in body["error"]
    assert cluster.free_plus_evictable(c) == before
    assert not [r for r in coord.get("/replications")[1] if c.worker_id in (r["source"], r["target"])]


def test_page_size_1_replication_gives_identical_output(cluster, page1):
    c, c2 = page1
    P = prompt(52, 1000)
    c.generate(P, 2)
    # C's KV events reach the directory after the answer: replicate once the coordinator knows C holds P
    wait_until(lambda: cluster.lookup(P).get(c.worker_id, 0) == len(P), 10, what="the directory to list C")
    rep = cluster.replicate(c, c2, P, ttl_s=120)
    assert rep["state"] == "done", rep
    assert rep["inserted_len"] == len(P)
    query = P + prompt(53, 16)
    out_c, out_c2 = c.generate(query, 24), c2.generate(query, 24)
    assert out_c2["meta_info"]["cached_tokens"] >= len(P) - 1
    assert out_c2["output_ids"] == out_c["output_ids"]
    wait_until(lambda: cluster.lookup(P)[c2.worker_id] == len(P), 10, what="the directory to list C2")
