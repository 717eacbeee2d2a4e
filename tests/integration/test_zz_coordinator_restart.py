"""Runs last (it restarts the session's coordinator): workers keep serving without a coordinator, and a new
coordinator on the same endpoint rebuilds the exact directory from the workers' resync."""
import signal

import pytest

from sglang_kvrep.devtools.cluster import Coordinator
from tests.integration.conftest import LOGS, PAGE_SIZE, RULES, prompt, wait_until

pytestmark = pytest.mark.server


def test_workers_survive_and_resync_after_coordinator_restart(cluster):
    a, b, old = cluster.a, cluster.b, cluster.coord
    P = prompt(90, 800)
    a.generate(P, 2)
    wait_until(lambda: cluster.lookup(P)[a.worker_id] >= len(P) - PAGE_SIZE, 10, what="P in the directory")
    old.kill(signal.SIGKILL)
    old.popen.wait(10)
    # no coordinator: both workers serve as plain SGLang, the cache still hits
    assert a.generate(P + prompt(91, 8), 2)["meta_info"]["cached_tokens"] >= len(P) - PAGE_SIZE
    Q = prompt(92, 500)
    b.generate(Q, 2)  # facts produced while the coordinator is down
    new = Coordinator(LOGS, extra_args=RULES, name="coordinator-restarted", port=old.zmq_port,
                      admin_port=old.admin_port)
    cluster.procs.append(new)
    cluster.coord = new
    new.wait_ready()
    new.wait_workers([a.worker_id, b.worker_id], timeout_s=30)
    wait_until(lambda: cluster.lookup(P)[a.worker_id] >= len(P) - PAGE_SIZE, 20, what="A's pages after resync")
    wait_until(lambda: cluster.lookup(Q)[b.worker_id] >= len(Q) - PAGE_SIZE, 20, what="B's pages after resync")
    assert new.get("/status")[1]["integrity"] == "ok"
    # and replication works again through the new coordinator
    rep = cluster.replicate(a, b, P, ttl_s=60)
    assert rep["state"] == "done", rep
