"""Runs last (it restarts the session's coordinator): workers keep serving without a coordinator, and a new
coordinator on the same endpoint rebuilds the exact directory from the workers' resync. A router in front keeps
serving throughout: from its own view while the coordinator is gone, from the directory again once it is back."""
import signal

import pytest

from kvrep_dev.cluster import Coordinator, Router, http_json, model_path
from tests.integration.conftest import (LOGS, PAGE_SIZE, RULES, prompt, router_keys, router_status,
                                        wait_router_synced, wait_until)

pytestmark = pytest.mark.server


@pytest.fixture
def router(cluster):
    proc = Router(LOGS, router_keys(), coordinator=cluster.coord, tokenizer=model_path("tiny"),
                  name="router-restart")
    url = proc.url

    def both_known():
        try:
            workers = router_status(url, timeout=1)["workers"]
        except OSError:
            assert proc.alive(), proc.tail()
            return False
        return {w["url"] for w in workers if w["id"]} >= {cluster.a.url, cluster.b.url}
    try:
        wait_until(both_known, timeout_s=120, what="router up, both workers known")
        yield url
    finally:
        proc.stop()


def route(router, input_ids):
    status, out = http_json(router + "/generate", {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}}, timeout=60)
    assert status == 200, out
    return out["meta_info"], router_status(router)["last_decisions"][-1]


def test_workers_survive_and_resync_after_coordinator_restart(cluster, router):
    a, b, old = cluster.a, cluster.b, cluster.coord
    P = prompt(90, 800)
    a.generate(P, 2)
    wait_until(lambda: cluster.lookup(P)[a.worker_id] >= len(P) - PAGE_SIZE, 10, what="P in the directory")
    wait_router_synced(old, router)
    meta, d = route(router, P + prompt(93, 8))
    assert (d["mode"], d["worker"]) == ("directory", a.url) and meta["cached_tokens"] >= len(P) - PAGE_SIZE
    old.kill(signal.SIGKILL)
    old.popen.wait(10)
    # no coordinator: both workers serve as plain SGLang, the cache still hits
    assert a.generate(P + prompt(91, 8), 2)["meta_info"]["cached_tokens"] >= len(P) - PAGE_SIZE
    # and the router serves from its own view (it routed P to A): same worker, cache hit, no hang
    meta, d = route(router, P + prompt(94, 8))
    assert (d["mode"], d["worker"]) == ("fallback", a.url) and meta["cached_tokens"] >= len(P) - PAGE_SIZE
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
    # the router is back on the directory (probed with unrelated prompts, so no probe puts Q anywhere) ...
    probes = iter(range(200, 400))
    wait_until(lambda: route(router, prompt(next(probes), 40))[1]["mode"] == "directory", 20,
               what="router routing from the new coordinator's directory")
    wait_router_synced(new, router)
    # ... and Q, which it never routed, goes to B, which resynced it
    meta, d = route(router, Q + prompt(95, 8))
    assert (d["mode"], d["worker"]) == ("directory", b.url) and meta["cached_tokens"] >= len(Q) - PAGE_SIZE
    # and replication works again through the new coordinator
    rep = cluster.replicate(a, b, P, ttl_s=60)
    assert rep["state"] == "done", rep
