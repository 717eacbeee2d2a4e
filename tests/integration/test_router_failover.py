"""The router on real CPU workers when one dies: a third worker C (started here) holds a prefix, so the router
sends that prefix's requests to it; C is SIGKILLed in the middle of a streamed answer. The stream ends (no hang),
the next request that ranks C first fails over to a live worker before any byte was sent, and once the
coordinator drops C the router routes from the directory among the survivors."""
import json
import signal
import urllib.request

import pytest

from kvrep_dev.cluster import Router, http_json, model_path
from tests.integration.conftest import (LOGS, PAGE_SIZE, joined_worker, prompt, router_admin, router_keys,
                                        router_status, wait_router_synced, wait_until)

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def victim(cluster):
    with joined_worker(cluster, "C-victim") as c:
        yield c


@pytest.fixture(scope="module")
def router(cluster, victim):
    proc = Router(LOGS, router_keys(), coordinator=cluster.coord, tokenizer=model_path("tiny"),
                  name="router-failover", extra_args=("--profile", "cpu-local"))  # CPU workers: CPU prefill costs
    url = proc.url

    def three_workers_known():
        try:
            st = router_status(url, timeout=1)
        except OSError:
            assert proc.alive(), proc.tail()
            return False
        return len(st["workers"]) == 3 and all(w["id"] for w in st["workers"])
    try:
        wait_until(three_workers_known, timeout_s=120, what="router up with A, B and C known")
        yield url
    finally:
        proc.stop()


def last_decision(router):
    return router_status(router)["last_decisions"][-1]


def generate(router, input_ids, max_new_tokens=2):
    status, out = http_json(router + "/generate", {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}, timeout=60)
    assert status == 200, out
    return out["meta_info"]


def test_a_killed_worker_ends_its_streams_and_its_requests_fail_over(cluster, victim, router):
    P = prompt(300, 600)
    victim.generate(P, 2)
    wait_until(lambda: cluster.lookup(P).get(victim.worker_id, 0) >= len(P) - PAGE_SIZE, 20,
               what="C's prefix in the directory")
    wait_router_synced(cluster.coord, router)
    body = {"input_ids": P + prompt(301, 8), "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(router + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    ended_with = None
    with urllib.request.urlopen(req, timeout=60) as resp:
        first = resp.readline()
        assert first.startswith(b"data: "), first
        d = last_decision(router)
        assert d["worker"] == victim.url and d["cached_tokens"] >= len(P) - PAGE_SIZE, json.dumps(d)
        victim.kill(signal.SIGKILL)
        victim.popen.wait(10)
        rest = b""
        try:
            while True:  # must end: the router closes the client's stream when its upstream dies
                line = resp.readline()
                if not line:
                    break
                rest += line
        except Exception as exc:  # noqa: BLE001 - http.client's IncompleteRead and friends
            ended_with = type(exc).__name__
    assert b"[DONE]" not in rest, "a stream from a killed worker cannot have completed 2,000 tokens"
    # the last event says why the stream stopped
    last = [e for e in rest.decode().split("\n\n") if e.strip()][-1]
    assert json.loads(last[len("data: "):])["error"]["type"] == "upstream_error", (last, ended_with)
    failovers_before = _metric(router, "kvrep_router_failovers_total")
    # C still holds the prefix in the directory until the coordinator notices it went silent; when it ranks first
    # (its last load report still shows the killed stream running, so it need not), it refuses the connection
    # and the request moves on to a live worker
    meta = generate(router, P + prompt(302, 8))
    d = last_decision(router)
    assert d["worker"] in (cluster.a.url, cluster.b.url) and meta["prompt_tokens"] == len(P) + 8
    if d["ranked"][0] == victim.url:
        assert d["attempt"] == 1, json.dumps(d)
        assert _metric(router, "kvrep_router_failovers_total") == failovers_before + 1
    else:
        assert d["attempt"] == 0, json.dumps(d)
    wait_until(lambda: victim.worker_id not in cluster.coord.workers(), 15, what="the coordinator drops C")
    # afterwards: routed from the directory among the survivors, C never tried again
    for k in range(3):
        generate(router, P + prompt(303 + k, 8))
        d = last_decision(router)
        # NOTE: a coordinator call that times out on a loaded machine sends one request down the fallback path
        # (the router's own view, every known worker); from the directory, C is out of the running
        assert d["mode"] == "fallback" or (d["attempt"] == 0 and victim.url not in d["ranked"]), json.dumps(d)


def _metric(router, name):
    req = urllib.request.Request(router + "/metrics", headers=router_admin())
    with urllib.request.urlopen(req, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
