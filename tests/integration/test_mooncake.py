"""`--kvrep-transport mooncake` on real CPU SGLang servers: two workers whose data plane is Mooncake Transfer
Engine (its TCP transport on loopback) replicate a prefix, the pages written by Mooncake into the target's
registered staging and verified there, and the target's greedy output from the copy equals the source's; a NIXL
worker of the session replicates to a Mooncake worker over ZeroMQ (a mixed fleet: each refuses the other's
engine, and the source falls back)."""
import pytest

from kvrep_dev.cluster import Worker
from tests.integration.conftest import LOGS, PAGE_SIZE, WORKER_ARGS, prompt, wait_until

pytestmark = pytest.mark.server

MOONCAKE = ("--kvrep-transport", "mooncake")


@pytest.fixture(scope="module")
def mooncake_pair(cluster):
    # (both started before either is waited for: their ~30 s start-ups overlap)
    workers = []
    try:
        for name in ("M1-mooncake", "M2-mooncake"):
            workers.append(Worker(name, "tiny", LOGS, coordinator=cluster.coord.endpoint, page_size=PAGE_SIZE,
                                  extra_args=WORKER_ARGS + MOONCAKE))
        for w in workers:
            w.wait_ready()
        cluster.coord.wait_workers([w.worker_id for w in workers])
        yield tuple(workers)
    finally:
        for w in workers:
            w.stop()


def test_mooncake_workers_replicate_and_the_copy_decodes_identically(cluster, mooncake_pair):
    m1, m2 = mooncake_pair
    P = prompt(81, 1100)
    m1.generate(P, 4)
    rep = cluster.replicate(m1, m2, P, ttl_s=120)
    assert rep["state"] == "done", rep
    assert rep["num_tokens"] == len(P) // PAGE_SIZE * PAGE_SIZE and rep["bytes"] > 0
    wait_until(lambda: f"mooncake: replication {rep['id']} " in m2.log_path.read_text(errors="replace"),
               what="M2's log: the replication's chunks written in place by Mooncake and verified")
    query = P + prompt(82, 24)
    out_1, out_2 = m1.generate(query, 24), m2.generate(query, 24)
    assert out_2["meta_info"]["cached_tokens"] >= len(P) - PAGE_SIZE
    assert out_2["output_ids"] == out_1["output_ids"]
    # a mixed fleet: the session's NIXL worker A to Mooncake worker M2 goes over ZeroMQ, and lands
    a = cluster.a
    Q = prompt(83, 700)
    a.generate(Q, 2)
    rep2 = cluster.replicate(a, m2, Q, ttl_s=120)
    assert rep2["state"] == "done", rep2
    log = m2.log_path.read_text(errors="replace")
    assert f"mooncake: replication {rep2['id']} " not in log  # not written by an engine: ZeroMQ frames
    assert cluster.lookup(Q)[m2.worker_id] >= len(Q) // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE
