"""Many routers, one directory (issue 20 item 4): four real router processes in front of the same two stub workers,
one real coordinator process, fake worker agents publishing what each stub holds.

Every router mirrors the coordinator's one exact directory (its feed), routes from it, and reports its arrivals and
finishes; a session may move from one router to another between turns and is still one session at the
coordinator. The live hit-rate measure with real SGLang workers (`kvrep bench --arms shadow,shadow@4`) is in
docs/bench.md; here the same request list is sent through one router and then spread over four, and the prefix
tokens each routing decision finds cached must be the same. No SGLang server is started here.
"""
import json
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrep_dev.cluster import Coordinator, Router, local_keys
from tests.component.test_router_process import ACME, KEYS, Agent, call, ids, mirror_synced, ready, start_stub
from tests.util import wait_until

N_ROUTERS = 4


class Fleet:
    def __init__(self, tmp):
        self.tmp = tmp
        self.keys = local_keys(tmp / "keys")
        (tmp / "tenants.json").write_text(json.dumps(KEYS))
        self.coord = Coordinator(tmp, extra_args=("--policy", "none", "--worker-timeout-s", "120"))
        self.a, self.b = start_stub("A", tmp, keys=self.keys), start_stub("B", tmp, keys=self.keys)
        self.routers = [Router(tmp, self.keys, coordinator=self.coord, workers=(self.a.url, self.b.url),
                               name=f"router-{i}",
                               extra_args=("--tenants", str(tmp / "tenants.json"), "--connect-timeout-s", "1"))
                        for i in range(N_ROUTERS)]
        self.agents = []
        try:  # a set-up that fails must not leave its processes behind
            self.coord.wait_ready()
            self.agents = [Agent(self.coord, "wA", self.a.url), Agent(self.coord, "wB", self.b.url)]
            for proc in (self.a, self.b, *self.routers):
                wait_until(lambda: ready(proc.url), what=f"{proc.name} up")
            self.ns = self.routers[0].namespace("ns-acme")
            probe = ids(99)
            for r in self.routers:  # each one routes from the directory (a cold start may time out at first)
                def on_directory():
                    self.generate(r, probe + [1])
                    known = r.status()["workers"]
                    return (self.last_decision(r)["mode"] == "directory" and len(known) == 2
                            and all(w["id"] for w in known))
                wait_until(on_directory, what=f"{r.name} routing from the coordinator's directory")
        except BaseException:
            self.stop()
            raise

    def stop(self):
        for agent in self.agents:
            agent.close()
        for proc in (*self.routers, self.a, self.b, self.coord):
            proc.stop(5)

    def settle(self, held=None):
        """Until no router counts another's request as open (but `held`'s one, counted by every other router): the send
        relay's `done` of a request comes a few ms after its answer, and until then that worker looks busy to the
        other routers (a prefix of a page or two is then as fast elsewhere)."""
        def settled():
            return all(q.status()["coordinator"]["send_relay"]["peers"]["open"] == int(held is not None and q != held)
                       for q in self.routers)
        wait_until(settled, what="no router counts another's request as open")

    def generate(self, router, tokens, held=None, **extra):
        self.settle(held)
        status, _, raw = call(router.url + "/generate", {"input_ids": tokens, **extra}, ACME)
        assert status == 200, raw
        return json.loads(raw)["meta_info"]

    @staticmethod
    def last_decision(router):
        return router.status()["last_decisions"][-1]

    def store(self, agent, tokens):
        agent.store(tokens, self.ns)
        wait_until(lambda: self.coord.post("/directory/lookup", {"input_ids": tokens, "cache_salt": self.ns})[1]
                   ["matched"].get(agent.wid) == len(tokens), what=f"directory has the pages on {agent.wid}")

    def wait_synced(self):
        """Until every router's mirror of the directory has every change the coordinator has made."""
        wait_until(lambda: all(mirror_synced(self.coord, r) for r in self.routers),
                   what="every router's directory mirror in sync with the coordinator")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("routers"))
    try:
        yield f
    finally:
        f.stop()


def _route(fleet, requests, routers):
    """Sends request i through routers[i % len(routers)] (each once the one before has settled: `Fleet.settle`).
    Returns: [(served_by, decision)] in order."""
    out = []
    for i, tokens in enumerate(requests):
        r = routers[i % len(routers)]
        served = fleet.generate(r, tokens)["served_by"]
        out.append((served, fleet.last_decision(r)))
    return out


def test_one_router_or_four_the_same_requests_find_the_same_cached_prefix(fleet):
    holders = {}
    for k in range(8):  # prefixes of 1-4 pages, alternately on A and B
        tokens = ids(10 + k, 16 * (1 + k % 4))
        agent = fleet.agents[k % 2]
        fleet.store(agent, tokens)
        holders[k] = ("A", "B")[k % 2], tokens
    fleet.wait_synced()
    requests = [holders[k][1] + [7, k] for k in (0, 3, 5, 1, 6, 2, 7, 4, 3, 0, 6, 5)]
    want = [holders[k][0] for k in (0, 3, 5, 1, 6, 2, 7, 4, 3, 0, 6, 5)]
    one = _route(fleet, requests, fleet.routers[:1])
    four = _route(fleet, requests, fleet.routers)
    for label, got in (("one router", one), ("four routers", four)):
        assert [s for s, _ in got] == want, label
        assert all(d["mode"] == "directory" for _, d in got), label
    hit_one = sum(d["cached_tokens"] for _, d in one) / sum(map(len, requests))
    hit_four = sum(d["cached_tokens"] for _, d in four) / sum(map(len, requests))
    assert hit_one == hit_four and hit_one > 0.9
    # each router matched against its own mirror of the directory, not one coordinator call per request
    for r in fleet.routers:
        assert r.status()["coordinator"]["directory_replica"]["matches"] >= 3


def test_a_holding_published_once_reaches_every_router(fleet):
    tokens = ids(30, 48)
    fleet.store(fleet.agents[1], tokens)  # B
    fleet.wait_synced()
    for r in fleet.routers:
        assert fleet.generate(r, tokens + [1])["served_by"] == "B"
        assert fleet.last_decision(r)["cached_tokens"] == 48


def test_every_router_reports_its_arrivals_to_the_coordinator(fleet):
    before = fleet.coord.get("/status")[1]["num_recent_arrivals"]
    sent = [r.status()["coordinator"]["arrivals_sent"] for r in fleet.routers]
    tokens = ids(40)
    for r in fleet.routers:
        for j in range(2):
            fleet.generate(r, tokens + [j])
    wait_until(lambda: all(r.status()["coordinator"]["arrivals_sent"] >= s + 2
                           for r, s in zip(fleet.routers, sent)), what="each router sent its arrivals")
    wait_until(lambda: fleet.coord.get("/status")[1]["num_recent_arrivals"] >= before + 2 * N_ROUTERS,
               what="the coordinator has every router's arrivals")


def test_a_session_that_moves_to_another_router_is_one_session(fleet):
    def sessions():
        return fleet.coord.get("/status")[1]["sessions"]

    assert fleet.coord.post("/policy", {"policy": "kvrep", "mode": "shadow", "reset_demand": True})[0] == 200
    try:
        turn1 = ids(50) + [1, 2]
        fleet.store(fleet.agents[0], ids(50))
        fleet.wait_synced()
        first, second = fleet.routers[0], fleet.routers[2]
        status, _, raw = call(first.url + "/generate", {"input_ids": turn1, "stream": True,
                                                        "sampling_params": {"max_new_tokens": 3}}, ACME)
        assert status == 200 and raw.decode().rstrip().endswith("[DONE]")
        wait_until(lambda: sessions()["open"] >= 1, what="the answer's end, reported by router 0, tracked")
        # the next turn arrives at another router: routed to the holder, and recognised as the follow-up
        assert fleet.generate(second, turn1 + [3, 4])["served_by"] == "A"
        wait_until(lambda: sessions()["followups"] == 1, what="router 2's arrival recognised as the follow-up")
    finally:
        fleet.coord.post("/policy", {"policy": "none", "mode": "shadow", "reset_demand": True})


def test_a_request_another_router_sent_loads_that_worker_in_every_router_until_it_ends(fleet):
    """Each router counts the others' sends, relayed through the coordinator (`radix_sync.coordinator.relay`), as it
    counts its own: a worker holding another router's request that has not started is not the idle one."""
    def relay(r):
        return r.status()["coordinator"]["send_relay"]

    for k, r in enumerate(fleet.routers):  # (a router counts on the relay once it serves requests)
        fleet.generate(r, ids(90 + k) + [k])
    wait_until(lambda: all(relay(r)["routers"] == N_ROUTERS for r in fleet.routers),
               what="every router sees the others on the send relay")
    hold = {"input_ids": ids(60) + [1], "stream": True, "stub_hold_s": 4.0, "sampling_params": {"max_new_tokens": 2}}
    done = []
    headers = {**ACME, "X-Request-Id": "held-by-router-0"}
    thread = threading.Thread(target=lambda: done.append(call(fleet.routers[0].url + "/generate", hold, headers)))
    thread.start()
    try:
        def held():
            return [d for d in fleet.routers[0].status()["last_decisions"] if d.get("request_id") == headers[
                "X-Request-Id"]]
        wait_until(held, what="router 0 sent the held request")
        busy = held()[0]["worker"]
        busy_id = next(w["id"] for w in fleet.routers[0].status()["workers"] if w["url"] == busy)
        for r in fleet.routers[1:]:
            wait_until(lambda: relay(r)["peers"]["by_worker"].get(busy_id) == 1,
                       what=f"{r.name} counts router 0's request at {busy_id}")
        # a prompt nobody holds, while both workers are idle but for router 0's request: every other router
        # sends it to the other worker (without the relay: a full tie, taken in turns, half of them to `busy`)
        for k, r in enumerate(fleet.routers[1:] * 2):
            fleet.generate(r, ids(70 + k) + [k], held=fleet.routers[0])
            assert fleet.last_decision(r)["worker"] != busy, r.name
            # four routers serve: ties on the expected TTFT go by each one's own draw, not the shared load's order
            assert fleet.last_decision(r).get("ties") == "drawn", r.name
    finally:
        thread.join(30)
    assert done and done[0][0] == 200
    for r in fleet.routers[1:]:
        wait_until(lambda: relay(r)["peers"]["open"] == 0, what=f"{r.name} saw router 0's request end")
        assert relay(r)["posted"] >= 6 and relay(r)["dropped"] == 0
    lag = [m for m in text_string_to_metric_families(call(fleet.routers[1].url + "/metrics", None,
                                                          fleet.routers[1].admin())[2].decode())
           if m.name == "kvrep_router_peer_send_lag_seconds"][0]
    assert any(s.name.endswith("_count") and s.value >= 1 for s in lag.samples)
