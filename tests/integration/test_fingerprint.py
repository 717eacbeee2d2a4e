"""Workers with different compatibility fingerprints never exchange pages."""
import pytest

from sglang_kvrep.devtools.cluster import Worker
from tests.integration.conftest import LOGS, WORKER_ARGS, prompt

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def other_page_size(cluster):
    c = Worker("C-page8", "tiny", LOGS, coordinator=cluster.coord.endpoint, page_size=8, extra_args=WORKER_ARGS)
    try:
        c.wait_ready()
        cluster.coord.wait_workers([c.worker_id])
        yield c
    finally:
        c.stop()


def test_replication_across_fingerprints_is_refused(cluster, other_page_size):
    a, c, coord = cluster.a, other_page_size, cluster.coord
    workers = coord.workers()
    assert workers[a.worker_id]["fingerprint"] != workers[c.worker_id]["fingerprint"]
    P = prompt(50, 600)
    a.generate(P, 2)
    before = cluster.free_plus_evictable(c)
    for src, dst in ((a, c), (c, a)):
        status, body = coord.post("/replicate", {"source": src.worker_id, "target": dst.worker_id, "input_ids": P})
        assert status == 400, body
        assert "fingerprint mismatch" in body["error"] and "page_size" in body["error"]
    assert cluster.lookup(P)[c.worker_id] == 0
    assert cluster.free_plus_evictable(c) == before
    assert c.generate(P + prompt(51, 8), 2)["meta_info"]["cached_tokens"] == 0
