"""The router as a real process, with stub upstream workers and a real coordinator process, over loopback.

Fake worker agents (ZMQ DEALER sockets speaking the protocol) tell the coordinator which stub holds which pages,
so the directory the router consults is the real one. No SGLang server is started here.
"""
import json
import signal
import sys
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from kvrep_dev.cluster import Coordinator, Proc, Router, free_port, local_keys
from tests.util import wait_until  # noqa: F401 (re-exported to the tests)

PAGE = 16
KEYS = {"tenants": {"acme": {"namespace": "ns-acme", "api_keys": ["sk-acme"]},
                    "globex": {"namespace": "ns-globex", "api_keys": ["sk-globex"]}}}
ACME = {"Authorization": "Bearer sk-acme"}
GLOBEX = {"Authorization": "Bearer sk-globex"}




def call(url, body=None, headers=None, timeout=10.0, method=None):
    """Returns: (status, content type, body) of one HTTP call (JSON body, if any)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def metric(router, sample, **labels):
    """Returns: the value of the router's Prometheus sample `sample` with exactly these labels (None: absent)."""
    status, _, raw = call(router.url + "/metrics", headers=router.admin("read"))
    assert status == 200, raw
    text = raw.decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return s.value
    return None


def ids(seed, n=64):
    return [1000 + seed * 100 + i for i in range(n)]


class Agent:
    """A fake worker agent: says hello for a stub and publishes the pages it 'holds'."""

    def __init__(self, coord, wid, url):
        self.wid, self.url, self.seq = wid, url, 0
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(coord.endpoint)
        self.sock.send(p.encode(p.Hello(worker_id=wid, http_url=url, data_endpoint="tcp://127.0.0.1:1",
                                        fingerprint="f", fingerprint_fields={}, page_size=PAGE,
                                        pool_capacity_tokens=10_000, replica_budget_tokens=2_500)))
        assert self.sock.poll(5000) and isinstance(p.decode_for_worker(self.sock.recv()), p.HelloAck)

    def store(self, tokens, namespace=""):
        hashes = page_hashes(tokens, PAGE, namespace)
        blocks = [p.BlockFact(h, par, tokens[i * PAGE:(i + 1) * PAGE])
                  for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
        self.seq += 1
        self.sock.send(p.encode(p.PagesStored(worker_id=self.wid, seq=self.seq, namespace=namespace, blocks=blocks)))

    def close(self):
        self.sock.close(0)


def start_stub(name, tmp, delay_s=0.0, keys=None, extra=()):
    """A stub worker; with `keys` (a `local_keys` folder) it requires the workers' API key, as SGLang's --api-key."""
    port = free_port()
    key = ["--api-key", (keys / "worker-api-key").read_text().strip()] if keys else []
    proc = Proc(f"stub-{name}", [sys.executable, "-m", "kvrep_dev.stub_worker", "--port", str(port), "--name",
                                 name, "--delay-s", str(delay_s), *key, *extra], tmp / f"stub-{name}.log")
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def ready(url):
    try:
        return call(url + "/health", timeout=1)[0] == 200
    except OSError:
        return False


def mirror_synced(coord, router) -> bool:
    """Whether `router`'s mirror of the directory has every change `coord` has made."""
    feed = coord.get("/status")[1]["feed"]
    mirror = router.status()["coordinator"]["directory_replica"]
    return mirror["usable"] and (mirror["epoch"], mirror["seq"]) == (feed["epoch"], feed["seq"])


class Env:
    def __init__(self, tmp):
        self.tmp = tmp
        self.keys = local_keys(tmp / "keys")
        self.coord = Coordinator(tmp, extra_args=("--policy", "none", "--worker-timeout-s", "120"))
        self.a, self.b = start_stub("A", tmp, keys=self.keys), start_stub("B", tmp, keys=self.keys)
        (tmp / "tenants.json").write_text(json.dumps(KEYS))
        self.router = Router(tmp, self.keys, coordinator=self.coord, workers=(self.a.url, self.b.url),
                             extra_args=("--tenants", str(tmp / "tenants.json"), "--connect-timeout-s", "1"))
        self.url = self.router.url
        self.ns_acme, self.ns_globex = self.router.namespace("ns-acme"), self.router.namespace("ns-globex")
        self.agents = []
        try:  # a set-up that fails must not leave its processes behind (the fixture's finally never runs)
            self.coord.wait_ready()
            self.agents = [Agent(self.coord, "wA", self.a.url), Agent(self.coord, "wB", self.b.url)]
            for proc in (self.a, self.b):
                wait_until(lambda: ready(proc.url), what=f"{proc.name} up")
            wait_until(lambda: ready(self.url), what="router up")
            # Ready means routing from the directory: on a cold start (modules compiling) the router's first
            # coordinator calls can time out and it routes from its own view until the link's backoff expires.
            probe = ids(99)

            def on_directory():
                self.generate(probe + [1])
                known = self.status()["workers"]
                return (self.last_decision()["mode"] == "directory" and len(known) == 2
                        and all(w["id"] for w in known))
            wait_until(on_directory, what="router routing from the coordinator's directory, both workers known")
        except BaseException:
            self.stop()
            raise

    def stop(self):
        for agent in self.agents:
            agent.close()
        for proc in (self.router, self.a, self.b, self.coord):
            proc.stop(5)

    def generate(self, tokens, headers=ACME, **extra):
        status, _, raw = call(self.url + "/generate", {"input_ids": tokens, **extra}, headers)
        assert status == 200, raw
        return json.loads(raw)["meta_info"]

    def status(self):
        return self.router.status()

    def last_decision(self):
        return self.status()["last_decisions"][-1]

    def wait_synced(self):
        """Until the router's mirror of the directory has every change the coordinator has made."""
        wait_until(lambda: mirror_synced(self.coord, self.router),
                   what="router's directory mirror in sync with the coordinator")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("router"))
    try:
        yield e
    finally:
        e.stop()


def served_by(env, tokens, headers=ACME):
    return env.generate(tokens, headers)["served_by"]


def test_routing_follows_the_directory_and_arrivals_are_reported(env):
    before = env.coord.get("/status")[1]["num_recent_arrivals"]
    p1, p2 = ids(1), ids(2)
    env.agents[1].store(p1, env.ns_acme)
    env.agents[0].store(p2, env.ns_acme)
    # the two agents are separate sockets: wait for both facts, not just the last one sent
    for tokens, holder in ((p1, "wB"), (p2, "wA")):
        wait_until(lambda: env.coord.post("/directory/lookup", {"input_ids": tokens, "cache_salt": env.ns_acme})[1]
                   ["matched"].get(holder) == 64, what=f"directory has the pages on {holder}")
        env.wait_synced()
    for _ in range(3):  # the holder wins every time, whatever the order
        assert served_by(env, p1 + [5, 6, 7]) == "B"
        assert env.last_decision()["mode"] == "directory" and env.last_decision()["cached_tokens"] == 64
        assert served_by(env, p2 + [9]) == "A"
    # matched against the router's own mirror of the directory, not one coordinator call per request
    assert env.status()["coordinator"]["directory_replica"]["matches"] >= 6
    wait_until(lambda: env.coord.get("/status")[1]["num_recent_arrivals"] >= before + 6, what="arrivals reported")


def test_prompts_no_worker_holds_take_turns_over_idle_workers(env):
    # one after the other, nothing held, both workers idle: a full tie each time; the workers take turns (before:
    # all to the first in id order, which became most sessions' home)
    got = [served_by(env, ids(500 + k) + [k]) for k in range(4)]
    assert all(env.status()["last_decisions"][-1 - k]["cached_tokens"] == 0 for k in range(4))
    assert got[0] != got[1] and got[2:] == got[:2], got


def test_tenants_namespace_is_set_by_the_router_and_keys_are_checked(env):
    p1 = ids(1)  # held by B in ns-acme only (previous test)
    env.agents[1].store(p1, env.ns_acme)
    meta = env.generate(p1 + [1], ACME, cache_salt=env.ns_globex, extra_key="evil")
    assert (meta["served_by"], meta["cache_salt"], meta["extra_key"]) == ("B", env.ns_acme, None)
    meta = env.generate(p1 + [1], GLOBEX, cache_salt=env.ns_acme)
    assert meta["cache_salt"] == env.ns_globex
    assert env.last_decision()["cached_tokens"] == 0  # another tenant never sees acme's pages
    for headers in ({}, {"Authorization": "Bearer nope"}):
        status, _, raw = call(env.url + "/generate", {"input_ids": p1}, headers)
        assert status == 401, raw
    assert call(env.url + "/v1/models", headers={"Authorization": "nope"})[0] == 401


def test_streaming_is_passed_through_chunk_by_chunk(env):
    status, ctype, raw = call(env.url + "/generate", {"input_ids": ids(3), "stream": True,
                                                      "sampling_params": {"max_new_tokens": 5}}, ACME)
    assert status == 200 and "text/event-stream" in ctype
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 6
    assert [json.loads(e[6:])["meta_info"]["seq"] for e in events[:-1]] == [0, 1, 2, 3, 4]
    status, ctype, raw = call(env.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "stream": True, "max_tokens": 3}, ACME)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and "text/event-stream" in ctype and len(events) == 4
    assert json.loads(events[0][6:])["sglext"]["cache_salt"] == env.ns_acme


def test_finished_answers_reach_the_coordinator_and_the_next_turn_is_recognised(env):
    def sessions():
        return env.coord.get("/status")[1]["sessions"]

    # (reports of the previous tests' last requests may still arrive after the reset: counts are lower bounds)
    assert env.coord.post("/policy", {"policy": "kvrep", "mode": "shadow", "reset_demand": True})[0] == 200
    try:
        p11 = ids(11)
        env.agents[0].store(p11, env.ns_acme)
        wait_until(lambda: env.coord.post("/directory/lookup", {"input_ids": p11, "cache_salt": env.ns_acme})[1]
                   ["matched"].get("wA") == 64, what="directory has p11 on A")
        env.wait_synced()
        status, _, raw = call(env.url + "/generate", {"input_ids": p11 + [1, 2], "stream": True,
                                                      "sampling_params": {"max_new_tokens": 3}}, ACME)
        assert status == 200 and raw.decode().rstrip().endswith("[DONE]")
        wait_until(lambda: sessions()["open"] >= 1, what="the streamed answer's end tracked as an open session")
        assert env.status()["coordinator"]["finishes_sent"] >= 1
        # the next turn extends the finished prompt: a follow-up of class "acme" (the tenant), stop "length"
        assert served_by(env, p11 + [1, 2, 3, 4]) == "A"
        wait_until(lambda: sessions()["followups"] == 1, what="the next turn recognised as the follow-up")
        model = sessions()["gap_models"]["acme/other"]
        assert model["followups"] == 3.0  # the prior's 2 pseudo-observations + this one
        # another tenant's identical prompt is another namespace: no follow-up of acme's session
        before = env.coord.get("/status")[1]["num_recent_finishes"]
        timed = env.coord.get("/status")[1]["ledger"]["answers_timed"]
        status, _, raw = call(env.url + "/generate", {"input_ids": p11 + [1, 2, 3, 4, 5]}, GLOBEX)
        assert status == 200
        wait_until(lambda: env.coord.get("/status")[1]["num_recent_finishes"] > before, what="globex's finish")
        # every finish carries the router's time to first token: the copy ledger's evidence
        assert env.coord.get("/status")[1]["ledger"]["answers_timed"] > timed
        assert sessions()["followups"] == 1
    finally:
        env.coord.post("/policy", {"policy": "none", "mode": "shadow", "reset_demand": True})


def test_requests_that_ran_alone_set_the_speed_both_the_router_and_the_coordinators_planner_price_with(env):
    def planner_scale():
        return env.coord.get("/status")[1]["sessions"]["prefill_scale"]

    assert env.coord.post("/policy", {"policy": "kvrep", "mode": "shadow", "reset_demand": True})[0] == 200
    try:
        before = env.status()["prefill_speed"]["observed"]
        for i in range(8):  # one at a time: each finds both stubs idle (no load reports, nothing outstanding)
            assert served_by(env, ids(40 + i)) in ("A", "B")
            assert env.last_decision()["mode"] == "directory"
        speed = env.status()["prefill_speed"]
        assert speed["observed"] == before + 8 and speed["samples"] >= 8 and speed["min_samples"] == 8
        # the stubs answer in milliseconds, far below any profile's prefill: the scale left 1, within its bounds
        assert 0.05 <= speed["scale"] < 1.0
        assert metric(env.router, "kvrep_router_prefill_speed_scale") == pytest.approx(speed["scale"], abs=1e-4)
        # the same requests reached the coordinator with their counts; its planner prices at the learned speed
        wait_until(lambda: planner_scale() != 1.0, what="the planner's prefill scale learned from the finishes")
        assert 0.05 <= planner_scale() < 1.0
        assert env.coord.post("/policy", {"policy": "kvrep_fixed", "mode": "shadow"})[0] == 200
        wait_until(lambda: planner_scale() == 1.0, what="kvrep_fixed pricing at the profile's times")
    finally:
        env.coord.post("/policy", {"policy": "none", "mode": "shadow", "reset_demand": True})


def test_service_endpoints(env):
    status, _, raw = call(env.url + "/v1/models", headers=ACME)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "stub-model"
    assert call(env.url + "/server_info", headers=ACME)[0] == 200
    assert call(env.url + "/model_info", headers=ACME)[0] == 200
    # a flush is an admin write: a tenant's key is no admin token
    assert call(env.url + "/flush_cache", headers=ACME, method="POST")[0] == 401
    status, _, raw = call(env.url + "/flush_cache", headers=env.router.admin("write"), method="POST")
    assert status == 200 and set(json.loads(raw)["workers"]) == {env.a.url, env.b.url}
    for stub in (env.a, env.b):
        assert json.loads(call(stub.url + "/stub/stats")[2]).get("/flush_cache", 0) >= 1
    assert metric(env.router, "kvrep_router_requests_total", worker=env.b.url, endpoint="generate",
                  mode="directory") >= 1
    assert metric(env.router, "kvrep_router_decision_seconds_count") >= 1
    assert metric(env.router, "kvrep_router_decision_seconds_bucket", le="+Inf") >= 1
    assert metric(env.router, "kvrep_router_unauthorized_total") is not None
    hints_before = env.coord.get("/status")[1]["num_live_hints"]
    status, _, raw = call(env.url + "/kvrep/hints", {"kind": "fanout", "input_ids": ids(4), "k": 4,
                                                     "cache_salt": "evil"}, ACME)
    assert status == 200 and json.loads(raw)["kind"] == "fanout"
    assert env.coord.get("/status")[1]["num_live_hints"] == hints_before + 1


def test_workers_are_learned_from_the_coordinator_alone(env, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Router(tmp_path, env.keys, coordinator=env.coord, port=port, name="router-discover")
    try:
        wait_until(lambda: ready(url), what="router without static workers healthy")
        p1 = ids(1)  # B holds it in ns-acme; this router has no tenants file: default namespace, no match
        status, _, raw = call(url + "/generate", {"input_ids": p1})
        assert status == 200 and json.loads(raw)["meta_info"]["served_by"] in ("A", "B")
        workers = proc.status()["workers"]
        assert {w["url"]: w["id"] for w in workers} == {env.a.url: "wA", env.b.url: "wB"}
    finally:
        proc.stop(5)


def test_coordinator_down_falls_back_then_recovers(env):
    p5 = ids(5)
    env.agents[1].store(p5, env.ns_acme)
    wait_until(lambda: env.coord.post("/directory/lookup", {"input_ids": p5, "cache_salt": env.ns_acme})[1]
               ["matched"].get("wB") == 64, what="directory has p5 on B")
    env.wait_synced()
    assert served_by(env, p5 + [1]) == "B"  # the router's own view now also has p5 on B
    env.coord.stop(5)
    for k in range(4):  # the router's own view: longest match, B, even for new suffixes (a hang fails call()'s
        assert served_by(env, p5 + [2, k]) == "B"  # own 10 s timeout)
        assert env.last_decision()["mode"] == "fallback"
    st = env.status()["coordinator"]
    assert st["reachable"] is False and st["last_error"] and st["directory_replica"]["usable"] is False
    assert metric(env.router, "kvrep_router_fallback_decisions_total") > 0
    # restart on the same ports; the agents say hello again; A now holds p6
    env.coord = Coordinator(env.tmp, extra_args=("--policy", "none", "--worker-timeout-s", "120"),
                            name="coordinator2", port=env.coord.zmq_port, admin_port=env.coord.admin_port)
    env.coord.wait_ready()
    for agent in env.agents:
        agent.close()
    env.agents = [Agent(env.coord, "wA", env.a.url), Agent(env.coord, "wB", env.b.url)]
    p6 = ids(6)
    env.agents[0].store(p6, env.ns_acme)
    wait_until(lambda: env.coord.post("/directory/lookup", {"input_ids": p6, "cache_salt": env.ns_acme})[1]
               ["matched"].get("wA") == 64, what="new coordinator has p6 on A")
    env.wait_synced()

    def back():
        env.generate(p6 + [3])
        return env.last_decision()["mode"] == "directory"
    wait_until(back, timeout_s=15, what="router back on the directory")
    assert served_by(env, p6 + [4]) == "A" and env.status()["coordinator"]["reachable"] is True


def test_without_the_directory_feed_the_router_asks_the_coordinator_per_request(env):
    p12 = ids(12)
    env.agents[0].store(p12, env.ns_acme)
    wait_until(lambda: env.coord.post("/directory/lookup", {"input_ids": p12, "cache_salt": env.ns_acme})[1]
               ["matched"].get("wA") == 64, what="directory has p12 on A")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Router(env.tmp, env.keys, coordinator=env.coord, workers=(env.a.url, env.b.url), port=port,
                  name="router-nofeed", extra_args=("--tenants", str(env.tmp / "tenants.json"), "--no-directory-feed"))
    try:
        wait_until(lambda: ready(url), what="router without the feed up")

        def on_directory():  # a cold router's first coordinator calls may time out: probe until it is on it
            call(url + "/generate", {"input_ids": ids(98) + [1]}, ACME)
            return proc.status()["last_decisions"][-1]["mode"] == "directory"
        wait_until(on_directory, what="router without the feed routing from the coordinator's directory")
        for _ in range(3):  # the holder wins every time: the coordinator's per-request lookup found it
            status, _, raw = call(url + "/generate", {"input_ids": p12 + [5]}, ACME)
            assert status == 200 and json.loads(raw)["meta_info"]["served_by"] == "A", raw
        st = proc.status()
        assert st["coordinator"]["directory_replica"] is None
        assert st["last_decisions"][-1]["mode"] == "directory" and st["last_decisions"][-1]["cached_tokens"] == 64
    finally:
        proc.stop(5)


def test_killed_upstream_fails_over_without_hanging(env):
    p7 = ids(7)
    env.agents[1].store(p7, env.ns_acme)
    wait_until(lambda: env.coord.post("/directory/lookup", {"input_ids": p7, "cache_salt": env.ns_acme})[1]
               ["matched"].get("wB") == 64, what="directory has p7 on B")
    env.wait_synced()
    env.b.stop(5)  # B is still in the directory: the router picks it first and must move on
    meta = env.generate(p7 + [1])
    assert meta["served_by"] == "A"
    d = env.last_decision()
    assert d["ranked"][0] == env.b.url and d["attempt"] == 1 and d["worker"] == env.a.url
    assert [w for w in env.status()["workers"] if w["url"] == env.b.url][0]["cooldown_s"] > 0
    assert metric(env.router, "kvrep_router_failovers_total") > 0
    for k in range(3):  # during the cool-down B is tried last: no more failed attempts
        assert served_by(env, p7 + [2, k]) == "A"
    env.a.stop(5)
    status, _, raw = call(env.url + "/generate", {"input_ids": p7}, ACME, timeout=15)
    assert status == 503, raw  # every worker dead: a clear answer, no hang


def test_sigterm_lets_in_flight_streams_finish(tmp_path):
    stub = start_stub("slow", tmp_path, delay_s=0.1)
    port = free_port()
    router = Router(tmp_path, local_keys(tmp_path / "keys"), workers=(stub.url,), port=port, name="router-term")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: ready(stub.url) and ready(url), what="stub and router up")
        req = urllib.request.Request(url + "/generate", data=json.dumps({"input_ids": [1, 2, 3], "stream": True,
                                     "sampling_params": {"max_new_tokens": 10}}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=15) as resp:
            first = resp.readline()
            router.kill(signal.SIGTERM)
            rest = resp.read()
        events = [e for e in (first + rest).decode().split("\n\n") if e.strip()]
        assert events[-1].strip() == "data: [DONE]" and len(events) == 11
        assert router.popen.wait(15) == 0
        with pytest.raises(OSError):
            call(url + "/health", timeout=2)
    finally:
        router.stop(5)
        stub.stop(5)


def test_a_pooled_connection_dropped_before_an_answer_is_retried_on_the_same_worker(tmp_path):
    """A worker that closes an idle keep-alive connection just as the router reuses it has not failed: the request
    goes to it again on a new connection, with no cool-down and no failover (before: 503 with a single worker)."""
    stub = start_stub("dropper", tmp_path, extra=("--drop-reused",))
    port = free_port()
    router = Router(tmp_path, local_keys(tmp_path / "keys"), workers=(stub.url,), port=port, name="router-drop",
                    extra_args=("--worker-keepalive-s", "60"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: ready(stub.url) and ready(url), what="stub and router up")
        for k in range(3):  # the 2nd reuses the 1st's connection, which the stub drops unanswered
            status, _, raw = call(url + "/generate", {"input_ids": [1, 2, 3, k]})
            assert status == 200 and json.loads(raw)["meta_info"]["served_by"] == "dropper", raw
        stats = json.loads(call(stub.url + "/stub/stats")[2])
        assert stats["dropped"] == 1 and stats["/generate"] == 3, stats  # 3 answered, 1 dropped
        assert metric(router, "kvrep_router_upstream_failures_total", worker=stub.url,
                      reason="dropped_ServerDisconnectedError") == 1
        assert metric(router, "kvrep_router_failovers_total") == 0
        status, _, raw = call(url + "/kvrep/status", headers=router.admin("read"))
        assert [w["cooldown_s"] for w in json.loads(raw)["workers"]] == [0], raw
    finally:
        router.stop(5)
        stub.stop(5)
