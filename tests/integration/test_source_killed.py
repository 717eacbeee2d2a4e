"""A source killed in the middle of a transfer: the target keeps no partial replica and leaks no slot."""
import signal
import time

import pytest

from tests.integration.conftest import WORKER_ARGS, joined_worker, prompt, wait_until

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def slow_source(cluster):
    # 50 kB/s in 8 kB frames: a 1,100-token prefix of the tiny model (~550 kB) takes ~11 s to send.
    with joined_worker(cluster, "D-slow-source", extra_args=WORKER_ARGS + (
            "--kvrep-send-rate-mbps", "0.05", "--kvrep-chunk-bytes", "8192")) as d:
        yield d


def test_killing_source_mid_transfer_leaves_nothing_on_target(cluster, slow_source):
    b, coord, d = cluster.b, cluster.coord, slow_source
    P = prompt(70, 1100)
    d.generate(P, 2)
    before = cluster.free_plus_evictable(b)
    status, rep = coord.post("/replicate", {"source": d.worker_id, "target": b.worker_id, "input_ids": P})
    assert status == 200, rep
    time.sleep(3.0)  # well inside the ~11 s transfer
    rep_now = next(r for r in coord.get("/replications")[1] if r["id"] == rep["id"])
    assert rep_now["state"] == "pending", rep_now  # still sending when we pull the plug
    d.kill(signal.SIGKILL)
    d.popen.wait(10)
    final = coord.wait_replication(rep["id"], timeout_s=30)
    assert final["state"] == "failed", final
    assert final["error"], final
    assert cluster.lookup(P)[b.worker_id] == 0
    assert cluster.free_plus_evictable(b) == before
    assert b.generate(P + prompt(71, 8), 2)["meta_info"]["cached_tokens"] == 0
    wait_until(lambda: d.worker_id not in coord.workers(), 15, what="the coordinator to drop the dead worker")
