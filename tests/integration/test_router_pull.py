"""A pull on the critical path with real CPU SGLang workers (the shared `cluster`: coordinator + workers A and B)
and a real router process started with `--pull`.

A 1,024-token prompt is cached on A; A is then made busy (requests with long answers sent to it directly, so two
run and two queue); the router's cost profile (written here) prices a prefill at 2 s a request plus 1 ms/token and
a copy at 4 us/token, so A's queue (two waiting: ~4 s) loses to a copy of the prefix to B (~4 ms) and to B's cold
prefill (~1 s more than the copy). The next request with that prefix is pulled to B, and B's own answer reports the copied prefix
as cached tokens. With the coordinator in shadow mode, the same kind of request is refused its copy and still
answered (the fallback: the best option without a copy).
"""
import json
import threading

import pytest

from kvrep_dev.cluster import Router, http_json

from .conftest import LOGS, PAGE_SIZE, prompt, router_keys, router_status, wait_router_synced, wait_until

pytestmark = pytest.mark.server

PROFILE = {"name": "pull-test", "provenance": "tests/integration/test_router_pull.py: prefill dear, copies cheap",
           "values": {"kv_bytes_per_token": 4096, "kv_capacity_tokens": 100000, "max_context_len": 32768,
                      "chunked_prefill_len": 8192, "max_running_requests": 2, "prefill_overhead_s": 2.0,
                      "prefill_s_per_token": 0.001, "prefill_s_per_token_pair": 0.0, "decode_step_s": 0.0,
                      "decode_s_per_request": 0.0, "decode_s_per_ctx_token": 0.0,
                      "nic_bandwidth_bytes_per_s": 1e9, "transfer_latency_s": 0.0}}
PREFIX_LEN = 1024


@pytest.fixture(scope="module")
def router(cluster):
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / "pull-profile.json").write_text(json.dumps(PROFILE))
    proc = Router(LOGS, router_keys(), coordinator=cluster.coord, name="router-pull",
                  extra_args=("--pull", "--profile", str(LOGS / "pull-profile.json"), "--pull-max-wait-s", "20",
                              "--pull-min-wait-s", "20"))
    url = proc.url

    def up():
        try:
            return http_json(url + "/health", timeout=1)[0] == 200
        except OSError:
            assert proc.alive(), proc.tail()
            return False
    try:
        wait_until(up, timeout_s=120, what="router up")
        yield url
    finally:
        proc.stop()


def generate(url, ids, max_new_tokens=4):
    status, out = http_json(url + "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}, timeout=300)
    assert status == 200, out
    return out["meta_info"]


class Busy:
    """Four streams of requests with long answers sent straight to a worker (two run, two queue), kept up until
    `join`, and waited on until the router sees the queue.

    NOTE: each stream sends its next request as soon as one ends: on the tiny model a single request is over in
    about a second, less than the router's view of the loads may lag."""

    def __init__(self, cluster, worker, seed, router):
        self.cluster, self.worker = cluster, worker
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(seed + 1000 * i,), daemon=True)
                        for i in range(4)]
        for t in self.threads:
            t.start()
        wait_until(lambda: (cluster.load(worker) or {}).get("num_waiting_reqs", 0) >= 1, timeout_s=120,
                   interval_s=0.05, what=f"{worker.name} reporting a queue")
        # NOTE: the router routes on a view of the loads up to 0.5 s old; a short prompt nobody holds shows when
        # its view has the queue (the worker's expected TTFT then exceeds the other's by seconds)
        other = cluster.b if worker is cluster.a else cluster.a

        def router_sees_it():
            generate(router, prompt(seed + 99, 8), 1)
            d = decisions(router)[-1]
            ttft = dict(zip(d["ranked"], d["expected_ttft_s"]))
            return ttft[worker.url] > ttft[other.url] + 1.0
        wait_until(router_sees_it, timeout_s=60, interval_s=0.05, what=f"the router seeing {worker.name}'s queue")

    def _stream(self, seed):
        # NOTE: each stream sends one prompt again and again (greedy, so the same answer too): once cached, the
        # streams insert nothing new into A's pool, so nothing they do pushes the test's prefix out. Workers report
        # a waiting request's uncached tokens (none here); the queue the router prices is the profile's 2 s a
        # waiting request. (Fresh 800-token suffixes each time, the way before, churned A's 16,384-token pool fast
        # enough on a slow CI machine that the prefix, computed again, was gone before the directory saw it.)
        ids = prompt(seed, 1200)
        while not self.stop.is_set():
            generate(self.worker.url, ids, 256)

    def join(self):
        self.stop.set()
        for t in self.threads:
            t.join(300)


def decisions(router):
    return router_status(router)["last_decisions"]


def hold_on(cluster, worker, head, router):
    """Until `worker` holds `head` again and the router's mirror says so. NOTE: the busy streams' first, cold
    round inserts ~6,000 tokens into a 16,384-token pool and can push `head` out; once each stream's prompt is
    cached the streams insert nothing new, so `head`, computed again here (it queues behind them), stays."""
    held = lambda: cluster.lookup(head).get(worker.worker_id, 0) >= PREFIX_LEN - PAGE_SIZE  # noqa: E731
    if not held():
        worker.generate(head, 1, timeout=300)
        wait_until(held, what=f"{worker.name} holding the prefix again")
    wait_router_synced(cluster.coord, router)


def test_a_busy_holders_prefix_is_pulled_to_the_idle_worker_and_used_there(cluster, router):
    a, b = cluster.a, cluster.b
    head = prompt(7001, PREFIX_LEN)
    a.generate(head, 1)  # cached on A
    wait_until(lambda: cluster.lookup(head).get(a.worker_id, 0) >= PREFIX_LEN - PAGE_SIZE, what="A holds it")
    wait_router_synced(cluster.coord, router)
    busy = Busy(cluster, a, 7100, router)
    try:
        hold_on(cluster, a, head, router)
        meta = generate(router, head + prompt(7002, 16))
        d = decisions(router)[-1]
    finally:
        busy.join()
    assert d.get("pull") and d["pull"]["outcome"] == "done", json.dumps(d)
    assert d["pull"]["source"] == a.url and d["pull"]["target"] == b.url and d["worker"] == b.url
    pulled = d["pull"]["pull_len"]
    assert pulled >= PREFIX_LEN - PAGE_SIZE
    # B's own answer: the copied prefix was a cache hit there (SGLang counts it)
    assert meta["cached_tokens"] >= pulled - PAGE_SIZE
    rep = next(r for r in cluster.coord.get("/replications")[1] if r["id"] == d["pull"]["replication_id"])
    assert (rep["origin"], rep["state"], rep["source"], rep["target"]) == ("pull", "done", a.worker_id,
                                                                            b.worker_id)
    assert cluster.coord.get("/status")[1]["integrity"] == "ok"


def test_a_refused_pull_still_answers_the_request(cluster, router):
    a = cluster.a
    head = prompt(7201, PREFIX_LEN)
    a.generate(head, 1)
    wait_until(lambda: cluster.lookup(head).get(a.worker_id, 0) >= PREFIX_LEN - PAGE_SIZE, what="A holds it")
    wait_router_synced(cluster.coord, router)
    policy = cluster.coord.get("/status")[1]["policy"]
    assert cluster.coord.post("/policy", {"policy": policy, "mode": "shadow"})[0] == 200
    try:
        busy = Busy(cluster, a, 7300, router)
        try:
            hold_on(cluster, a, head, router)
            meta = generate(router, head + prompt(7202, 16))
            d = decisions(router)[-1]
        finally:
            busy.join()
    finally:
        cluster.coord.post("/policy", {"policy": policy, "mode": "active"})
    assert d.get("pull") and d["pull"]["outcome"] == "refused" and "shadow mode" in d["pull"]["detail"], json.dumps(d)
    assert meta["prompt_tokens"] == PREFIX_LEN + 16  # answered, by the best option without a copy
    assert d["worker"] == d["ranked"][0]
