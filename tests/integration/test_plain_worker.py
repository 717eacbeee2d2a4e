"""A mixed fleet: a plain SGLang worker (no plugin) beside a plugin worker, one coordinator, one router.

The plain worker runs SGLang 0.5.23 with its own KV-event publisher (`--kv-events-config`, ZMQ PUB plus replay
socket); the coordinator follows it (`--plain-worker`), so its pages are in the directory like the plugin worker's
and the router sends a prompt's next turn to it from the directory. It is never a copy's end: a replication from
or to it is refused by name (409), and the plugin worker keeps replicating as before.
"""
import json

import pytest

from kvrep_dev.cluster import Coordinator, Router, Worker, free_port, http_json

from .conftest import LOGS, PAGE_SIZE, WORKER_ARGS, prompt, router_keys, router_status, wait_until

pytestmark = pytest.mark.server

PLAIN_ID = "plain-P"


@pytest.fixture(scope="module")
def fleet():
    LOGS.mkdir(parents=True, exist_ok=True)
    pport, eport, rport = free_port(), free_port(), free_port()
    spec = (f"id={PLAIN_ID},url=http://127.0.0.1:{pport},events=tcp://127.0.0.1:{eport},"
            f"replay=tcp://127.0.0.1:{rport},page_size={PAGE_SIZE}")
    procs = []
    try:
        coord = Coordinator(LOGS, name="coordinator-mixed",
                            extra_args=("--policy", "none", "--ledger-holdout", "0", "--plain-worker", spec))
        procs.append(coord)
        coord.wait_ready()
        events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{eport}", "bind": True,
                  "replay_endpoint": f"tcp://127.0.0.1:{rport}"}
        plain = Worker("P-plain", "tiny", LOGS, port=pport, kvrep=False, page_size=PAGE_SIZE,
                       extra_args=WORKER_ARGS + ("--kv-events-config", json.dumps(events)))
        procs.append(plain)
        q = Worker("Q-plugin", "tiny", LOGS, coordinator=coord.endpoint, page_size=PAGE_SIZE,
                   extra_args=WORKER_ARGS)
        procs.append(q)
        plain.wait_ready()
        q.wait_ready()
        coord.wait_workers([PLAIN_ID, q.worker_id], timeout_s=60)
        router = Router(LOGS, router_keys(), coordinator=coord, name="router-mixed")
        procs.append(router)

        def up():
            try:
                return http_json(router.url + "/health", timeout=1)[0] == 200
            except OSError:
                assert router.alive(), router.tail()
                return False
        wait_until(up, timeout_s=120, what="router up")
        yield coord, plain, q, router.url
    finally:
        for proc in reversed(procs):
            proc.stop()


def lookup(coord, ids) -> dict:
    status, body = coord.post("/directory/lookup", {"input_ids": ids, "cache_salt": ""})
    assert status == 200, body
    return body["matched"]


def test_plain_worker_pages_reach_the_directory_and_the_router_uses_them(fleet):
    coord, plain, q, router = fleet
    workers = coord.workers()
    assert workers[PLAIN_ID]["plain"] is True and workers[q.worker_id]["plain"] is False
    ids_p, ids_q = prompt(9100, 8 * PAGE_SIZE), prompt(9200, 8 * PAGE_SIZE)
    plain.generate(ids_p, max_new_tokens=2)
    q.generate(ids_q, max_new_tokens=2)
    wait_until(lambda: lookup(coord, ids_p).get(PLAIN_ID, 0) >= 7 * PAGE_SIZE, timeout_s=30,
               what="the plain worker's pages in the directory (from SGLang's own KV events)")
    wait_until(lambda: lookup(coord, ids_q).get(q.worker_id, 0) >= 7 * PAGE_SIZE, timeout_s=30,
               what="the plugin worker's pages in the directory")
    assert lookup(coord, ids_p).get(q.worker_id, 0) == 0

    def routed(ids, want_url):
        status, out = http_json(router + "/generate", {"input_ids": ids + [7, 8, 9], "sampling_params": {
            "max_new_tokens": 2, "temperature": 0.0}}, timeout=120)
        assert status == 200, out
        d = router_status(router)["last_decisions"][-1]
        return d if d["worker"] == want_url and d["cached_tokens"] >= 7 * PAGE_SIZE else None
    # (the router's mirror of the directory follows the coordinator's feed: retry until it has the pages)
    d = wait_until(lambda: routed(ids_p, plain.url), timeout_s=30, what="the next turn routed to the plain worker")
    assert d["mode"] == "directory"
    wait_until(lambda: routed(ids_q, q.url), timeout_s=30, what="the next turn routed to the plugin worker")
    st = coord.get("/status")[1]
    feed = st["plain_workers"][0]
    assert feed["worker"] == PLAIN_ID and feed["batches"] >= 1 and feed["errors"] == 0
    assert st["integrity"] == "ok"


def test_plain_worker_is_never_a_copy_end(fleet):
    coord, plain, q, _ = fleet
    ids = prompt(9300, 6 * PAGE_SIZE)
    plain.generate(ids, max_new_tokens=2)
    wait_until(lambda: lookup(coord, ids).get(PLAIN_ID, 0) >= 5 * PAGE_SIZE, timeout_s=30,
               what="the plain worker's pages in the directory")
    for src, dst in ((PLAIN_ID, q.worker_id), (q.worker_id, PLAIN_ID)):
        status, body = coord.post("/replicate", {"source": src, "target": dst, "input_ids": ids})
        assert status == 409 and "without the kvrep plugin" in json.dumps(body), (status, body)
    status, body = coord.post("/demote", {"worker": PLAIN_ID, "input_ids": ids})
    assert status == 409, body
    assert plain.alive() and coord.get("/status")[1]["integrity"] == "ok"
