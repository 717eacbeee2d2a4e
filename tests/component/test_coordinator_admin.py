"""The coordinator's admin API over real sockets, two coordinators in one process: every endpoint refuses a
malformed body with a 400 naming the bad field, an unknown endpoint or method is a JSON 404, and `/metrics` is
Prometheus text (parsed with prometheus_client's own parser) from each coordinator's own registry."""
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from radix_sync import protocol as p
from radix_sync.coordinator.server import Coordinator, CoordinatorConfig
from radix_sync.hashing import page_hashes


def call(url: str, body=None, method: str = None, raw: bytes = None, token: str = ""):
    """Returns: (status, content type, body bytes). `token`: sent as a bearer token."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


class Running:
    """A Coordinator serving on free ports in a thread of this process."""

    def __init__(self, state_dir: str) -> None:
        self.coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:*", admin_port=0, policy="none",
                                                   tick_s=0.05, state_dir=state_dir))
        self.tokens = self.coord._http.tokens
        self.url = f"http://127.0.0.1:{self.coord.admin_port}"
        self.thread = threading.Thread(target=self.coord.serve_forever, daemon=True)
        self.thread.start()
        assert self.coord._http._ready.wait(10), "admin server not up"

    def stop(self) -> None:
        self.coord.stop()
        self.thread.join(10)

    def call(self, path: str, body=None, **kw):
        """`call` with the write token (or `token=`)."""
        kw.setdefault("token", self.tokens.write)
        return call(self.url + path, body, **kw)

    def json(self, path: str, body=None, **kw):
        status, _, data = self.call(path, body, **kw)
        return status, json.loads(data)

    def metrics(self) -> dict[str, dict]:
        """{sample name: {labels as a sorted tuple: value}} of one scrape."""
        status, ctype, data = self.call("/metrics")
        assert status == 200 and ctype.startswith("text/plain"), (status, ctype)
        out: dict[str, dict] = {}
        for family in text_string_to_metric_families(data.decode()):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    a, b = Running(str(tmp_path_factory.mktemp("a"))), Running(str(tmp_path_factory.mktemp("b")))
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def hello(wid: str) -> p.Hello:
    return p.Hello(worker_id=wid, http_url=f"http://{wid}", data_endpoint="tcp://127.0.0.1:1", fingerprint="f",
                   fingerprint_fields={}, page_size=4, pool_capacity_tokens=100, replica_budget_tokens=25)


def connect(running: Running, wid: str):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(running.coord.endpoint)
    sock.send(p.encode(hello(wid)))
    assert sock.poll(5000) and isinstance(p.decode_for_worker(sock.recv()), p.HelloAck)
    return sock


MALFORMED = [  # (method, path, body, what the error must say)
    ("POST", "/directory/lookup", {"page_hashes": [1], "page_size": 0}, "page_size must be an integer >= 1"),
    ("POST", "/directory/lookup", {"page_hashes": [1]}, "page_size must be an integer >= 1 with page_hashes"),
    ("POST", "/directory/lookup", {"input_ids": [1, "2"]}, "Expected `int`, got `str` - at `$.input_ids[1]`"),
    ("POST", "/directory/lookup", {"cache_salt": "t"}, "input_ids must be a list of integers"),
    ("POST", "/directory/lookup", {"input_ids": [1], "cache_salt": 5}, "at `$.cache_salt`"),
    ("GET", "/directory/lookup?input_ids=1,x", None, "input_ids must be comma-separated integers"),
    ("GET", "/directory/feed?since=x", None, "since must be an integer"),
    ("GET", "/directory/feed?wait_s=soon", None, "wait_s a number"),
    ("POST", "/arrivals", {}, "either list may be absent"),
    ("POST", "/arrivals", {"arrivals": {"input_ids": [1]}}, "Expected `array`, got `object` - at `$.arrivals`"),
    ("POST", "/hints", {"kind": "prefetch", "input_ids": [1]}, "Invalid enum value 'prefetch' - at `$.kind`"),
    ("POST", "/hints", {"kind": "fanout"}, "Object missing required field `input_ids`"),
    ("POST", "/hints", {"kind": "fanout", "input_ids": [1], "k": 0}, "Expected `int` >= 1 - at `$.k`"),
    ("POST", "/hints", {"kind": "keepalive", "input_ids": [1], "ttl_s": 0}, "Expected `float` > 0.0 - at `$.ttl_s`"),
    ("POST", "/hints", {"kind": "fanout", "input_ids": [1], "delay_s": 61}, "<= 60.0 - at `$.delay_s`"),
    ("POST", "/replicate", {"target": "w1", "input_ids": [1]}, "Object missing required field `source`"),
    ("POST", "/replicate", {"source": "w1", "target": "w2", "input_ids": [1, 2 ** 63]},
     "Expected `int` <= 2147483647 - at `$.input_ids[1]`"),
    ("POST", "/replicate", {"source": 1, "target": "w2", "input_ids": [1]}, "Expected `str`, got `int` - at `$.source`"),
    ("POST", "/replicate", {"source": "w1", "target": "w2", "input_ids": [1], "ttl_s": "long"}, "at `$.ttl_s`"),
    ("POST", "/replicas/drop", {"worker": 7}, "Expected `str | null`, got `int` - at `$.worker`"),
    ("POST", "/demote", {"input_ids": [1]}, "Object missing required field `worker`"),
    ("POST", "/demote", {"worker": "w1", "input_ids": []}, "Expected `array` of length >= 1 - at `$.input_ids`"),
    ("POST", "/demote", {"worker": "w1", "input_ids": "p2"}, "Expected `array`, got `str` - at `$.input_ids`"),
    ("POST", "/policy", {"policy": "kvrep", "reset_demand": "yes"}, "Expected `bool`, got `str` - at `$.reset_demand`"),
    ("POST", "/policy", {"policy": "nope"}, "unknown policy 'nope'"),
    ("POST", "/policy", {"policy": "none", "mode": "loud"}, "mode must be active or shadow"),
]


@pytest.mark.parametrize("method,path,body,needle", MALFORMED, ids=[f"{m} {p_}" for m, p_, _, _ in MALFORMED])
def test_each_endpoint_refuses_a_malformed_request_with_a_clear_400(pair, method, path, body, needle):
    a, _ = pair
    status, ctype, data = a.call(path, body, method=method)
    assert status == 400 and ctype.startswith("application/json"), (status, data)
    assert needle in json.loads(data)["error"]


def test_a_bad_report_is_dropped_and_named_and_the_rest_of_its_batch_recorded(pair):
    a, _ = pair
    good = {"input_ids": list(range(8)), "worker": "w1"}
    for bad, needle in (({"input_ids": [-1]}, "arrivals[1]: Expected `int` >= 0 - at `$.input_ids[0]`"),
                        ({"session_id": "u" * 257}, "arrivals[1]: Expected `str` of length <= 256"),
                        ({"page_hashes": [1], "page_size": 4}, "arrivals[1]: prompt_len must be")):
        status, body = a.json("/arrivals", {"arrivals": [good, bad, good]})
        assert status == 200 and (body["recorded"], body["dropped"]) == (2, 1) and needle in body["errors"][0]
    status, body = a.json("/arrivals", {"finishes": [{"input_ids": [1], "stop": "s" * 65}]})
    assert (body["finishes_recorded"], body["dropped"]) == (0, 1) and "finishes[0]" in body["errors"][0]


POST_ENDPOINTS = ["/directory/lookup", "/arrivals", "/hints", "/replicate", "/replicas/drop", "/demote", "/policy"]


@pytest.mark.parametrize("path", POST_ENDPOINTS)
def test_each_post_endpoint_refuses_a_body_that_is_not_a_json_object(pair, path):
    a, _ = pair
    status, _, data = a.call(path, raw=b"{not json")
    assert status == 400 and json.loads(data)["error"].startswith("body is not JSON")
    status, _, data = a.call(path, raw=b"[1, 2]")
    assert status == 400 and json.loads(data)["error"] == "Expected `object`, got `array`"


def test_unknown_endpoints_and_methods_are_json_404s(pair):
    a, _ = pair
    for method, path in (("GET", "/nope"), ("GET", "/replicate"), ("POST", "/workers"), ("DELETE", "/status"),
                         ("HEAD", "/health")):
        status, _, data = a.call(path, method=method)
        assert status == 404, (method, path, status)
        if method != "HEAD":
            assert json.loads(data) == {"error": f"no such endpoint: {method} {path}"}
    assert a.json("/health") == (200, {"ok": True})


def test_answers_keep_their_json_shape(pair):
    a, _ = pair
    sock = connect(a, "w-shape")
    try:
        toks = list(range(8))
        hashes = page_hashes(toks, 4)
        sock.send(p.encode(p.PagesStored(worker_id="w-shape", seq=1, namespace="", blocks=[
            p.BlockFact(hashes[0], None, toks[:4]), p.BlockFact(hashes[1], hashes[0], toks[4:])])))
        deadline = time.monotonic() + 5
        while a.json("/directory/lookup", {"input_ids": toks})[1]["matched"].get("w-shape") != 8:
            assert time.monotonic() < deadline, "pages never reached the directory"
            time.sleep(0.02)
        [w] = [w for w in a.json("/workers")[1] if w["id"] == "w-shape"]
        assert list(w) == ["id", "url", "data_endpoint", "fingerprint", "fingerprint_fields", "page_size",
                           "pool_capacity_tokens", "replica_budget_tokens", "load", "plain"] and w["load"] is None
        assert w["plain"] is False
        assert a.json("/directory/lookup", {"page_hashes": hashes, "page_size": 4})[1]["matched"]["w-shape"] == 8
        assert a.json("/arrivals", {"arrivals": [{"input_ids": toks, "worker": "w-shape"}]}) == (
            200, {"recorded": 1, "finishes_recorded": 0, "dropped": 0, "errors": []})
        assert a.json("/hints", {"kind": "fanout", "input_ids": toks, "k": 2}) == (
            200, {"recorded": 1, "kind": "fanout", "prefix_len": 8, "ttl_s": 60.0})
        assert a.json("/replicas/drop", {}) == (200, {"dropped": 0})
        assert a.json("/demote", {"worker": "w-shape", "input_ids": toks}) == (200, {"worker": "w-shape",
                                                                                     "tokens": 8})
        assert a.json("/demote", {"worker": "nobody", "input_ids": toks})[0] == 404
        status, feed = a.json("/directory/feed?epoch=&since=0")
        assert status == 200 and set(feed) == {"epoch", "seq", "head", "snapshot"}
        assert sorted(feed["snapshot"]["w-shape"]) == sorted(hashes)
        status, st = a.json("/status")
        assert status == 200 and st["integrity"] == "ok" and st["num_live_hints"] == 1
    finally:
        sock.close(0)


def test_metrics_are_prometheus_text_from_each_coordinators_own_registry(pair):
    a, b = pair
    sock = connect(a, "w-metrics")
    try:
        toks = list(range(100, 112))
        hashes = page_hashes(toks, 4)
        sock.send(p.encode(p.PagesStored(worker_id="w-metrics", seq=1, namespace="", blocks=[
            p.BlockFact(h, par, toks[i * 4:(i + 1) * 4]) for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))])))
        sock.send(b"\xc1garbage")
        assert sock.poll(5000) and isinstance(p.decode_for_worker(sock.recv()), p.Error)
        deadline = time.monotonic() + 5
        while True:
            m = a.metrics()
            if m["kvrep_coordinator_facts_total"].get((("type", "PagesStored"),), 0) >= 1 \
                    and m["kvrep_coordinator_tick_seconds_count"][()] >= 1:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        before = a.metrics()
        workers = a.json("/status")[1]["num_workers"]
        assert before["kvrep_coordinator_workers"][()] == workers >= 1
        assert before["kvrep_coordinator_directory_pages"][()] >= 3
        assert before["kvrep_coordinator_protocol_errors_total"][()] >= 1
        assert before["kvrep_coordinator_facts_total"][(("type", "Hello"),)] >= 1
        assert set(before["kvrep_coordinator_replications"]) == {(("state", s),) for s in
                                                                 ("pending", "running", "done", "failed")}
        assert before["kvrep_coordinator_policy"] == {(("mode", "active"), ("policy", "none")): 1.0}
        assert before["kvrep_coordinator_tick_seconds_bucket"][(("le", "+Inf"),)] >= 1
        # each tick's CPU time of the loop thread too, never more than its wall time (a scrape may come between
        # the two observations of one tick)
        wall, cpu = (before[f"kvrep_coordinator_tick{k}_seconds_count"][()] for k in ("", "_cpu"))
        assert 0 <= wall - cpu <= 1 and cpu >= 1
        wall, cpu = (before[f"kvrep_coordinator_tick{k}_seconds_sum"][()] for k in ("", "_cpu"))
        assert cpu <= wall + 1e-3
        assert all(name.startswith("kvrep_") for name in before)
        # a replication shows up by state
        sock2 = connect(a, "w-metrics-2")
        try:
            assert a.json("/replicate", {"source": "w-metrics", "target": "w-metrics-2", "input_ids": toks})[0] == 200
            assert a.metrics()["kvrep_coordinator_replications"][(("state", "pending"),)] >= 1
        finally:
            sock2.close(0)
        # the other coordinator's registry saw none of it
        other = b.metrics()
        assert other["kvrep_coordinator_protocol_errors_total"][()] == 0
        assert other["kvrep_coordinator_directory_pages"][()] == 0
        assert (("type", "PagesStored"),) not in other.get("kvrep_coordinator_facts_total", {})
    finally:
        sock.close(0)


def test_a_policy_tick_that_raises_is_logged_and_counted_and_serving_goes_on(pair):
    a, _ = pair
    coord = a.coord
    policy = coord.policy

    class Broken:
        name, hint_outcomes = "none", {}

        def decide(self, state, now_s):
            raise OverflowError("a policy bug")

        def take_demotions(self):
            return []

        def session_stats(self):
            return None

    with coord.lock:
        coord.policy = Broken()
    try:
        deadline = time.monotonic() + 10
        while a.metrics().get("kvrep_coordinator_tick_errors_total", {}).get((), 0) < 3:
            assert time.monotonic() < deadline, "the broken policy never ticked"
            time.sleep(0.05)
        assert coord.num_tick_errors >= 3 and a.json("/status")[1]["num_tick_errors"] >= 3
        sock = connect(a, "w-after-tick-errors")  # still serving workers and the admin API
        sock.close(0)
        assert a.json("/health") == (200, {"ok": True})
    finally:
        with coord.lock:
            coord.policy = policy
