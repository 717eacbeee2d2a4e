"""A pull on the critical path over real processes: the router (`--pull`) and the coordinator as real processes,
stub upstream workers, and fake worker agents (ZMQ DEALER sockets speaking the protocol) that play a copy's
handshake: the target answers `ExpectReplica`, the source answers `ReplicatePages` with `SourceSent` (or fails it),
and the target says `ReplicaStored` when the test lets it. No SGLang server, no pages moved.

Worker A holds a 480-640-token prefix and reports a queue (300 tokens): with the `cpu-wide` profile, A's expected
TTFT for the prompt is ~0.22 s, B's cold ~0.26-0.33 s, B's after a pull of the prefix ~0.12 s. So the pull is decided,
and its fallback (no copy) is A: where the request went shows which happened.
"""
import json
import queue
import threading

import pytest
import zmq

from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from kvrep_dev.cluster import Coordinator, Router, local_keys
from tests.component.test_router_process import PAGE, call, metric, ready, start_stub
from tests.util import wait_until

PROMPT_LEN = 640


def prompt(seed):
    """A prompt A holds: 640 tokens for seed 1, two pages shorter for each next seed.

    NOTE: the router knows a copy in flight only by its source, target and length, and counts it for any prompt of
    which the source holds that much (`rank_by_ttft`); shorter prompts keep one test's copy out of the next's."""
    return [5000 + seed * 1000 + i for i in range(PROMPT_LEN - 32 * (seed - 1))]


class CopyAgent:
    """A fake worker agent on its own thread: hello, facts the test queues, and its half of every copy."""

    def __init__(self, coord, wid, url):
        self.wid, self.url, self.seq = wid, url, 0
        self.out: "queue.Queue[p._Msg]" = queue.Queue()
        self.mode = "send"
        """As a source: `send` answers `ReplicatePages` with `SourceSent`, `fail` with `ReplicationFailed`."""
        self.release = threading.Event()
        """As a target: `ReplicaStored` is said for what was sent while this is set."""
        self.release.set()
        self.seen: list[p._Msg] = []
        self._expected: dict[str, p.ExpectReplica] = {}
        self._stop = threading.Event()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(coord.endpoint)
        self.sock.send(p.encode(p.Hello(worker_id=wid, http_url=url, data_endpoint="tcp://127.0.0.1:1",
                                        fingerprint="f", fingerprint_fields={}, page_size=PAGE,
                                        pool_capacity_tokens=10_000, replica_budget_tokens=2_500)))
        assert self.sock.poll(5000) and isinstance(p.decode_for_worker(self.sock.recv()), p.HelloAck)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def fact(self, make):
        """Queues a fact; `make(seq)` builds it with the next sequence number (numbered on the agent's thread)."""
        self.out.put(make)

    def store(self, tokens, namespace=""):
        hashes = page_hashes(tokens, PAGE, namespace)
        blocks = [p.BlockFact(h, par, tokens[i * PAGE:(i + 1) * PAGE])
                  for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
        self.fact(lambda seq: p.PagesStored(worker_id=self.wid, seq=seq, namespace=namespace, blocks=blocks))

    def load(self, waiting_reqs=0, waiting_tokens=0, replica_tokens=0):
        self.fact(lambda seq: p.LoadReported(worker_id=self.wid, seq=seq, num_running_reqs=0,
                                             num_waiting_reqs=waiting_reqs, num_waiting_tokens=waiting_tokens,
                                             available_tokens=9_000, evictable_tokens=0,
                                             replica_tokens=replica_tokens))

    def _send(self, make):
        self.seq += 1
        self.sock.send(p.encode(make(self.seq)))

    def _run(self):
        while not self._stop.is_set():
            while True:
                try:
                    self._send(self.out.get_nowait())
                except queue.Empty:
                    break
            for rid, exp in list(self._expected.items()):  # targets: land what was sent, once released
                if self.release.is_set() and rid in SENT:
                    del self._expected[rid]
                    self._send(lambda seq, e=exp: p.ReplicaStored(
                        worker_id=self.wid, seq=seq, replication_id=e.replication_id, namespace=e.namespace,
                        block_hashes=e.block_hashes, inserted_len=len(e.block_hashes) * PAGE, expires_in_s=30.0,
                        num_bytes=len(e.block_hashes) * PAGE * 1024, receive_s=0.0, scatter_s=0.0, insert_s=0.0))
            if not self.sock.poll(10):
                continue
            msg = p.decode_for_worker(self.sock.recv())
            self.seen.append(msg)
            if isinstance(msg, p.ExpectReplica):
                self._expected[msg.replication_id] = msg
                self._send(lambda seq, m=msg: p.ReplicaExpected(worker_id=self.wid, seq=seq,
                                                                replication_id=m.replication_id))
            elif isinstance(msg, p.ReplicatePages):
                if self.mode == "fail":
                    self._send(lambda seq, m=msg: p.ReplicationFailed(
                        worker_id=self.wid, seq=seq, replication_id=m.replication_id, role="source",
                        error="prefix not cached here (0 of 640 tokens)"))
                else:
                    self._send(lambda seq, m=msg: p.SourceSent(
                        worker_id=self.wid, seq=seq, replication_id=m.replication_id, num_tokens=len(m.token_ids),
                        num_bytes=len(m.token_ids) * 1024, gather_s=0.0, send_s=0.0))
                    SENT.add(msg.replication_id)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


SENT: set[str] = set()
"""Replication ids whose (fake) source sent them: a (fake) target lands only what was sent."""


def router_proc(tmp, name, coord, stubs, *extra):
    return Router(tmp, local_keys(tmp / "keys"), coordinator=coord, workers=tuple(s.url for s in stubs), name=name,
                  extra_args=("--profile", "cpu-wide", "--pull", *extra))


class Env:
    def __init__(self, tmp):
        self.coord = Coordinator(tmp, extra_args=("--policy", "none", "--worker-timeout-s", "120",
                                                  "--ledger-holdout", "0"))  # every pull made, none held out
        self.a, self.b = start_stub("A", tmp), start_stub("B", tmp)
        # `patient` waits up to 30 s for a copy (the test holds copies); `hasty` gives up after 0.3 s
        self.patient = router_proc(tmp, "router-patient", self.coord, (self.a, self.b),
                                   "--pull-min-wait-s", "30", "--pull-max-wait-s", "30")
        self.hasty = router_proc(tmp, "router-hasty", self.coord, (self.a, self.b),
                                 "--pull-min-wait-s", "0.3", "--pull-max-wait-s", "0.3")
        self.agents = []
        try:
            self.coord.wait_ready()
            self.agents = [CopyAgent(self.coord, "wA", self.a.url), CopyAgent(self.coord, "wB", self.b.url)]
            self.A, self.B = self.agents
            self.A.load(waiting_reqs=1, waiting_tokens=300)
            wait_until(lambda: (self.coord.workers().get("wA", {}).get("load") or {}).get("num_waiting_tokens")
                       == 300, what="A's load at the coordinator")
            for proc in (self.a, self.b, self.patient, self.hasty):
                wait_until(lambda: ready(proc.url), what=f"{proc.name} up")
            for r in (self.patient, self.hasty):
                wait_until(lambda: self._on_directory(r), what=f"{r.name} routing from the directory")
        except BaseException:
            self.stop()
            raise

    def _on_directory(self, router):
        self.generate(router, [1, 2, 3])
        st = self.status(router)
        return (st["last_decisions"][-1]["mode"] == "directory" and len(st["workers"]) == 2
                and all(w["id"] for w in st["workers"]))

    def stop(self):
        for agent in self.agents:
            agent.close()
        for proc in (self.patient, self.hasty, self.a, self.b, self.coord):
            proc.stop(5)

    def generate(self, router, tokens):
        status, _, raw = call(router.url + "/generate", {"input_ids": tokens}, timeout=60)
        assert status == 200, raw
        return json.loads(raw)["meta_info"]

    def status(self, router):
        return router.status()

    def held_by_a(self, tokens, *routers):
        """A stores `tokens`; waits until the coordinator and the routers' mirrors have it."""
        self.A.store(tokens)
        wait_until(lambda: self.coord.post("/directory/lookup", {"input_ids": tokens})[1]["matched"].get("wA")
                   == len(tokens), what="A's pages in the directory")
        feed = lambda: self.coord.get("/status")[1]["feed"]  # noqa: E731
        for r in routers:
            wait_until(lambda: (lambda m, f: m["usable"] and (m["epoch"], m["seq"]) == (f["epoch"], f["seq"]))(
                self.status(r)["coordinator"]["directory_replica"], feed()), what=f"{r.name}'s mirror in sync")

    def pulls(self):
        return [r for r in self.coord.get("/replications")[1] if r["origin"] == "pull"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("pull"))
    try:
        yield e
    finally:
        e.stop()


def replica_tokens(env, wid):
    return (env.coord.workers()[wid].get("load") or {}).get("replica_tokens")


def ask(env, router, tokens):
    """Sends a request in the background; returns (thread, a one-item list its answer lands in)."""
    box = []
    t = threading.Thread(target=lambda: box.append(env.generate(router, tokens)), daemon=True)
    t.start()
    return t, box


def test_the_request_waits_for_its_copy_then_goes_to_the_copy(env):
    tokens = prompt(1)
    env.held_by_a(tokens, env.patient)
    env.B.release.clear()  # B will not say ReplicaStored until released
    served_before = call(env.b.url + "/stub/stats")[2]
    t, box = ask(env, env.patient, tokens + [7])
    rep = wait_until(lambda: next((r for r in env.pulls() if r["state"] == "running"), None),
                     what="the pull running (the source sent it)")
    assert (rep["source"], rep["target"], rep["num_tokens"]) == ("wA", "wB", PROMPT_LEN)
    assert not box and call(env.b.url + "/stub/stats")[2] == served_before  # held while the copy is not done
    env.B.release.set()
    t.join(30)
    assert box and box[0]["served_by"] == "B"
    d = env.status(env.patient)["last_decisions"][-1]
    assert d["worker"] == env.b.url and d["cached_tokens"] == PROMPT_LEN
    assert d["pull"]["outcome"] == "done" and d["pull"]["replication_id"] == rep["id"]
    assert d["pull"]["source"] == env.a.url and d["pull"]["pull_len"] == PROMPT_LEN
    assert d["ranked"][:2] == [env.b.url, env.a.url]
    assert metric(env.patient, "kvrep_router_pulls_done_total") == 1.0
    assert metric(env.patient, "kvrep_router_pull_wait_seconds_count") == 1.0
    assert next(r for r in env.pulls() if r["id"] == rep["id"])["state"] == "done"
    # the copy landed: B holds the prefix now, the next request goes there without copying
    wait_until(lambda: env.coord.post("/directory/lookup", {"input_ids": tokens})[1]["matched"].get("wB")
               == PROMPT_LEN, what="B's replica in the directory")


@pytest.mark.parametrize("how, reason, needle", [
    ("shadow", "refused", "shadow mode"),
    ("budget", "refused", "has room for 0 replica tokens"),
    ("source_fails", "failed", "prefix not cached here"),
])
def test_a_refused_or_failed_pull_falls_back_to_the_holder(env, how, reason, needle):
    tokens = prompt({"shadow": 2, "budget": 3, "source_fails": 4}[how])
    env.held_by_a(tokens, env.patient)
    before = metric(env.patient, "kvrep_router_pulls_fallen_back_total", reason=reason) or 0.0
    try:
        if how == "shadow":
            assert env.coord.post("/policy", {"policy": "none", "mode": "shadow"})[0] == 200
        elif how == "budget":
            env.B.load(replica_tokens=2_500)
            wait_until(lambda: replica_tokens(env, "wB") == 2_500, what="B's load")
        else:
            env.A.mode = "fail"
        meta = env.generate(env.patient, tokens + [7])
    finally:
        env.coord.post("/policy", {"policy": "none", "mode": "active"})
        env.A.mode = "send"
        if how == "budget":
            env.B.load(replica_tokens=0)
            wait_until(lambda: replica_tokens(env, "wB") == 0, what="B's budget back")
    assert meta["served_by"] == "A"  # the fallback: the holder, as without --pull; the request is answered
    d = env.status(env.patient)["last_decisions"][-1]
    assert d["pull"]["outcome"] == reason and needle in d["pull"]["detail"]
    assert d["ranked"][0] == env.a.url and d["cached_tokens"] == len(tokens)
    assert metric(env.patient, "kvrep_router_pulls_fallen_back_total", reason=reason) == before + 1


def test_past_the_deadline_the_request_falls_back_and_the_copy_is_left_to_finish(env):
    tokens = prompt(5)
    env.held_by_a(tokens, env.hasty)
    env.B.release.clear()  # the copy never lands while the request waits
    try:
        meta = env.generate(env.hasty, tokens + [7])
        d = env.status(env.hasty)["last_decisions"][-1]
        assert meta["served_by"] == "A" and d["pull"]["outcome"] == "deadline"
        assert metric(env.hasty, "kvrep_router_pulls_fallen_back_total", reason="deadline") == 1.0
        rep = next(r for r in env.pulls() if r["id"] == d["pull"]["replication_id"])
        assert rep["state"] in ("pending", "running")
    finally:
        env.B.release.set()
