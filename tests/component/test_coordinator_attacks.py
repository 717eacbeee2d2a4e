"""The attacks of issue 17 on the coordinator, run against a real coordinator process over loopback (fake worker
agents are ZMQ DEALER sockets speaking the protocol), each now refused: forged page claims, replication facts
from non-parties, a copy from a source that never held the prefix, the remote crash by an out-of-range token id,
non-finite timings, anonymous admin calls, unbounded hints and lookups, and expired replicas re-reported."""
import os
import stat
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from kvrep_dev.cluster import ROOT, Coordinator, free_port, http_json
from radix_sync import protocol as p
from radix_sync.hashing import page_hashes

PS = 4


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    # rules: one hit of a 4-token prefix on a worker with a waiting request is enough to plan a copy
    c = Coordinator(tmp_path_factory.mktemp("attacks"), extra_args=(
        "--policy", "rules", "--rule-min-hits", "1", "--rule-min-prefix-len", "4", "--rule-max-queue", "0",
        "--worker-timeout-s", "60", "--max-prompt-tokens", "1000", "--hint-rate-per-s", "0.001",
        "--max-hint-ttl-s", "120", "--ledger-holdout", "0"))
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


class FakeWorker:
    """A worker agent's DEALER: says hello, numbers its facts."""

    def __init__(self, coord, wid: str, fingerprint: str = "f", vocab_size: int = 0) -> None:
        self.wid, self.seq = wid, 0
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(coord.endpoint)
        self.sock.send(p.encode(p.Hello(worker_id=wid, http_url=f"http://{wid}", data_endpoint="tcp://127.0.0.1:1",
                                        fingerprint=fingerprint, fingerprint_fields={}, page_size=PS,
                                        pool_capacity_tokens=4096, replica_budget_tokens=1024,
                                        vocab_size=vocab_size)))
        assert isinstance(self.recv(), p.HelloAck)

    def fact(self, msg) -> None:
        self.seq += 1
        msg.seq = self.seq
        self.sock.send(p.encode(msg))

    def recv(self, timeout_ms: int = 5000):
        assert self.sock.poll(timeout_ms), f"{self.wid}: no message from the coordinator"
        return p.decode_for_worker(self.sock.recv())

    def quiet(self, timeout_ms: int = 300) -> bool:
        return not self.sock.poll(timeout_ms)

    def store(self, tokens, ns: str = "") -> list[int]:
        hashes = page_hashes(tokens, PS, ns)
        self.fact(p.PagesStored(worker_id=self.wid, seq=0, namespace=ns, blocks=[
            p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS]) for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]))
        return hashes

    def close(self) -> None:
        self.sock.close(0)


def wait_for(check, what: str, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        out = check()
        if out:
            return out
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def status_of(url: str, token: str) -> int:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def lookup(coord, tokens, ns=""):
    return coord.post("/directory/lookup", {"input_ids": tokens, "cache_salt": ns})[1]["matched"]


# -------------------------------------------------------------------------------------------- admin credentials
READ_ROUTES = ["/workers", "/replications", "/status", "/metrics", "/directory/lookup?input_ids=1,2,3,4",
               "/directory/feed?since=0", "/sends/feed?router=probe&wait_s=0"]
WRITE_ROUTES = [("/directory/lookup", {"input_ids": [1]}), ("/arrivals", {"arrivals": []}),
                ("/hints", {"kind": "fanout", "input_ids": [1]}),
                ("/replicate", {"source": "a", "target": "b", "input_ids": [1, 2, 3, 4]}),
                ("/replicas/drop", {}), ("/demote", {"worker": "a", "input_ids": [1]}), ("/policy", {"policy": "none"}),
                ("/sends", {"router": "probe", "events": []})]


def test_the_admin_api_needs_a_token_and_the_write_token_to_act(coord):
    for path in READ_ROUTES:
        for token in ("", "not-the-token-0123456789"):
            status, body = coord.get(path, token=token)
            assert status == 401 and "Bearer" in body["error"], (path, token, status)
        assert status_of(coord.admin + path, coord.tokens.read) == 200, path
    for path, body in WRITE_ROUTES:
        assert coord.post(path, body, token="")[0] == 401, path
        status, answer = coord.post(path, body, token=coord.tokens.read)
        assert status == 403 and "write token" in answer["error"], path
    # /health is open and tells nothing but ok
    assert http_json(coord.admin + "/health") == (200, {"ok": True})


def test_without_a_token_file_the_coordinator_creates_one_0600_and_logs_its_path(tmp_path):
    state_dir = tmp_path / "state"
    port = free_port()
    log = open(tmp_path / "c.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "radix_sync.cli", "coordinator", "--bind",
                             f"tcp://127.0.0.1:{free_port()}", "--admin-port", str(port), "--state-dir",
                             str(state_dir), "--policy", "none"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    try:
        path = state_dir / "admin-tokens.json"
        wait_for(lambda: path.exists() and http_json(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200,
                 "the coordinator up with its token file", timeout_s=30)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        from radix_sync.secret_files import read_tokens as load_tokens
        tokens = load_tokens(path)
        assert http_json(f"http://127.0.0.1:{port}/status")[0] == 401
        assert http_json(f"http://127.0.0.1:{port}/status", token=tokens.read)[0] == 200
        assert str(path) in (tmp_path / "c.log").read_text()
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


# ---------------------------------------------------------------------------------------- what workers claim
def test_a_fake_worker_cannot_claim_a_tenants_pages_without_their_tokens(coord):
    honest, fake = FakeWorker(coord, "honest-1"), FakeWorker(coord, "fake-1")
    try:
        prompt = list(range(1000, 1016))
        hashes = honest.store(prompt, ns="tenant-a")
        wait_for(lambda: lookup(coord, prompt, "tenant-a").get("honest-1") == 16, "the honest pages")
        # the fake worker copies the hashes (the feed shows them) with made-up tokens, or no tokens at all
        fake.fact(p.PagesStored(worker_id="fake-1", seq=0, namespace="tenant-a", blocks=[
            p.BlockFact(h, par, [0] * PS) for h, par in zip(hashes, [None] + hashes[:-1])]))
        err = fake.recv()
        assert isinstance(err, p.Error) and "refused 4 of 4 pages" in err.error and "does not match" in err.error
        fake.fact(p.PagesStored(worker_id="fake-1", seq=0, namespace="tenant-a",
                                blocks=[p.BlockFact(hashes[1], hashes[0], [])]))
        assert "page size 4" in fake.recv().error
        assert lookup(coord, prompt, "tenant-a") == {**lookup(coord, prompt, "tenant-a"), "fake-1": 0}
        assert coord.get("/status")[1]["num_refused_facts"]["PagesStored"] >= 2
    finally:
        honest.close()
        fake.close()


def test_replication_facts_come_only_from_its_parties_and_its_source_must_hold_the_prefix(coord):
    a, b, c = FakeWorker(coord, "src-2"), FakeWorker(coord, "dst-2"), FakeWorker(coord, "other-2")
    try:
        prompt = list(range(2000, 2016))
        a.store(prompt)
        wait_for(lambda: lookup(coord, prompt).get("src-2") == 16, "the source's pages")
        # a source that never held the prefix is refused before anyone is told anything
        status, body = coord.post("/replicate", {"source": "other-2", "target": "dst-2", "input_ids": prompt})
        assert status == 400 and "holds no page of this prefix" in body["error"]
        assert b.quiet() and c.quiet()
        status, rep = coord.post("/replicate", {"source": "src-2", "target": "dst-2", "input_ids": prompt})
        assert status == 200
        expect = b.recv()
        assert isinstance(expect, p.ExpectReplica) and expect.source_id == "src-2"
        # a third worker cannot fail it, nor say it sent it, nor that it landed
        c.fact(p.ReplicationFailed(worker_id="other-2", seq=0, replication_id=rep["id"], role="target", error="x"))
        assert "not the target" in c.recv().error
        c.fact(p.SourceSent(worker_id="other-2", seq=0, replication_id=rep["id"], num_tokens=16, num_bytes=1,
                            gather_s=0.0, send_s=0.0))
        assert "not the source" in c.recv().error
        c.fact(p.ReplicaStored(worker_id="other-2", seq=0, replication_id=rep["id"], namespace="",
                               block_hashes=expect.block_hashes, inserted_len=16, expires_in_s=30.0, num_bytes=1,
                               receive_s=0.0, scatter_s=0.0, insert_s=0.0))
        assert "not the target" in c.recv().error
        # the target cannot claim pages it was not granted
        b.fact(p.ReplicaStored(worker_id="dst-2", seq=0, replication_id=rep["id"], namespace="",
                               block_hashes=page_hashes(list(range(9000, 9016)), PS), inserted_len=16,
                               expires_in_s=30.0, num_bytes=1, receive_s=0.0, scatter_s=0.0, insert_s=0.0))
        assert "not a prefix of those granted" in b.recv().error
        [state] = [r["state"] for r in coord.get("/replications")[1] if r["id"] == rep["id"]]
        assert state == "pending" and lookup(coord, prompt)["other-2"] == 0 and lookup(coord, prompt)["dst-2"] == 0
        # a router asks for the copies in flight only; a state not known is refused
        assert rep["id"] in [r["id"] for r in coord.get("/replications?state=pending,running")[1]]
        assert rep["id"] not in [r["id"] for r in coord.get("/replications?state=done,failed")[1]]
        status, answer = coord.get("/replications?state=pending,gone")
        assert status == 400 and "state must be" in answer["error"]
    finally:
        for w in (a, b, c):
            w.close()


# ------------------------------------------------------------------------------------------------------- bounds
def test_a_token_id_past_2_31_with_hits_and_a_busy_load_no_longer_crashes_the_coordinator(coord):
    a, b = FakeWorker(coord, "crash-a", fingerprint="crash"), FakeWorker(coord, "crash-b", fingerprint="crash")
    try:
        tokens = [1, 2, 3, 2 ** 40]
        h = page_hashes([1, 2, 3, 4], PS)[0]  # (a hash is not computable for the bad ids: any will do)
        bad = msgspec.msgpack.encode({"type": "PagesStored", "worker_id": "crash-a", "seq": 1, "namespace": "",
                                      "blocks": [[h, None, tokens]], "medium": "GPU"})
        a.sock.send(bad)
        err = a.recv()
        assert isinstance(err, p.Error) and "malformed" in err.error and "2147483647" in err.error
        # the rest of the reproduction: hits on it and a busy holder; the policy ticks, nothing stops it
        a.sock.send(p.encode(p.Hello(worker_id="crash-a", http_url="http://crash-a", data_endpoint="tcp://1.1.1.1:1",
                                     fingerprint="crash", fingerprint_fields={}, page_size=PS,
                                     pool_capacity_tokens=4096, replica_budget_tokens=1024)))
        assert isinstance(a.recv(), p.HelloAck)
        a.seq = 0
        for _ in range(3):
            a.fact(p.PrefixHit(worker_id="crash-a", seq=0, namespace="", block_hash=h, matched_len=4, key_len=8))
        a.fact(p.LoadReported(worker_id="crash-a", seq=0, num_running_reqs=4, num_waiting_reqs=9,
                              num_waiting_tokens=99, available_tokens=0, evictable_tokens=0, replica_tokens=0))
        ticks = coord.get("/status")[1]["loop"]["ticks"]
        wait_for(lambda: coord.get("/status")[1]["loop"]["ticks"] >= ticks + 4, "more policy ticks")
        assert coord.alive() and coord.get("/status")[1]["num_tick_errors"] == 0
    finally:
        a.close()
        b.close()


def test_a_non_finite_or_absurd_timing_is_refused(coord):
    w = FakeWorker(coord, "timing-1")
    try:
        for field, value in (("gather_s", float("inf")), ("send_s", float("nan")), ("gather_s", 1e9),
                             ("send_s", -1.0)):
            msg = {"type": "SourceSent", "worker_id": "timing-1", "seq": 1, "replication_id": "r", "num_tokens": 1,
                   "num_bytes": 1, "gather_s": 0.1, "send_s": 0.1, field: value}
            w.sock.send(msgspec.msgpack.encode(msg))
            err = w.recv()
            assert isinstance(err, p.Error) and "malformed" in err.error and field in err.error
    finally:
        w.close()


def test_hints_are_rate_limited_per_tenant_and_their_ttl_capped(coord):
    status, body = coord.post("/hints", {"kind": "keepalive", "input_ids": list(range(8)), "ttl_s": 86400.0,
                                         "cache_salt": "hint-tenant"})
    assert status == 200 and body["ttl_s"] == 120.0  # capped to --max-hint-ttl-s
    # the bucket (200 hints, refilled at 0.001/s here) runs dry for this tenant only
    codes = [coord.post("/hints", {"kind": "fanout", "input_ids": list(range(8)), "cache_salt": "hint-tenant"})[0]
             for _ in range(200)]
    assert codes.count(200) == 199 and codes[-1] == 429
    assert coord.post("/hints", {"kind": "fanout", "input_ids": list(range(8)), "cache_salt": "quiet-tenant"})[0] == 200


def test_a_long_admin_lookup_is_refused_before_it_takes_the_lock(coord):
    status, body = coord.post("/directory/lookup", {"input_ids": list(range(1001))})
    assert status == 400 and "max_prompt_tokens=1000" in body["error"]
    status, body = coord.post("/directory/lookup", {"page_hashes": [1] * 251, "page_size": 4})
    assert status == 400 and "max_prompt_tokens" in body["error"]
    assert coord.post("/directory/lookup", {"input_ids": list(range(1000))})[0] == 200


def land_replica(coord, a: "FakeWorker", b: "FakeWorker", prompt, ttl_s: float):
    """`a` stores `prompt`, the admin asks for a copy to `b` with `ttl_s`, both play their part, and `b` reports it
    landed. Returns: the `ReplicaStored` fact `b` sent (to re-send, changed, as a resync would)."""
    a.store(prompt)
    wait_for(lambda: lookup(coord, prompt).get(a.wid) == len(prompt), "the source's pages")
    status, rep = coord.post("/replicate", {"source": a.wid, "target": b.wid, "input_ids": prompt, "ttl_s": ttl_s})
    assert status == 200, rep
    expect = b.recv()
    b.fact(p.ReplicaExpected(worker_id=b.wid, seq=0, replication_id=rep["id"]))
    assert isinstance(a.recv(), p.ReplicatePages)
    landed = p.ReplicaStored(worker_id=b.wid, seq=0, replication_id=rep["id"], namespace="",
                             block_hashes=expect.block_hashes, inserted_len=len(prompt), expires_in_s=ttl_s,
                             num_bytes=64, receive_s=0.01, scatter_s=0.01, insert_s=0.01)
    b.fact(msgspec.structs.replace(landed))
    wait_for(lambda: lookup(coord, prompt).get(b.wid) == len(prompt), "the replica in the directory")
    return landed


# ------------------------------------------------------------------------------------------------------ restart
def test_an_expired_replica_is_never_resurrected_by_a_re_report(coord):
    a, b = FakeWorker(coord, "src-3"), FakeWorker(coord, "dst-3")
    try:
        prompt = list(range(3000, 3016))
        landed = land_replica(coord, a, b, prompt, 0.5)
        time.sleep(0.6)  # its TTL passes (the worker, busy, has not evicted it yet)
        # a resync re-reports it with its first TTL: refused, the expiry is absolute
        b.fact(msgspec.structs.replace(landed, expires_in_s=30.0))
        assert "expired" in b.recv().error
        # after a restart (an unknown replication), a re-report says what is left: <= 0 is refused ...
        b.fact(msgspec.structs.replace(landed, replication_id="r-before-restart", expires_in_s=-100.0))
        assert "has expired" in b.recv().error
        # ... and a replica fact never makes a worker the holder of pages it did not report with their tokens
        other = list(range(4000, 4016))
        b.fact(msgspec.structs.replace(landed, replication_id="r-old", block_hashes=page_hashes(other, PS)))
        assert b.quiet() and lookup(coord, other)["dst-3"] == 0
    finally:
        a.close()
        b.close()


def test_token_ids_at_or_over_the_fleets_vocabulary_are_refused(tmp_path):
    c = Coordinator(tmp_path, extra_args=("--policy", "none"))
    try:
        c.wait_ready()
        w = FakeWorker(c, "vocab-1", vocab_size=500)
        try:
            w.store([1, 2, 3, 499])
            assert w.quiet()
            w.store([1, 2, 3, 500])
            assert "vocab_size 500" in w.recv().error
            for path, body in (("/directory/lookup", {"input_ids": [1, 2, 3, 500]}),
                               ("/hints", {"kind": "fanout", "input_ids": [1, 2, 3, 500]}),
                               ("/demote", {"worker": "vocab-1", "input_ids": [600]})):
                status, answer = c.post(path, body)
                assert status == 400 and "[0, 500)" in answer["error"], (path, answer)
            assert c.post("/arrivals", {"arrivals": [{"input_ids": [700]}]})[1]["dropped"] == 1
        finally:
            w.close()
    finally:
        c.stop()
    assert os.path.exists(tmp_path / "admin-tokens.json")


def test_after_a_real_restart_an_expired_replica_stays_gone(tmp_path):
    """The reproduction with a real restart: a replica lands with a 0.5 s TTL, its TTL passes, the coordinator
    process is killed and started again on the same ports (it knows nothing of the replication). The workers say
    hello again and resync: the target's re-report of the expired replica, with the TTL left (<= 0, as the agent
    sends it: `test_agent_resync`), is refused and the new directory never lists it; one with TTL left (pages
    re-reported with their tokens) is accepted."""
    import signal

    def start(port=None, admin_port=None, name="coord-old"):
        c = Coordinator(tmp_path, extra_args=("--policy", "none", "--worker-timeout-s", "60"), name=name,
                        port=port, admin_port=admin_port)
        c.wait_ready()
        return c

    old = start()
    new = None
    prompt = list(range(5000, 5016))
    try:
        a, b = FakeWorker(old, "src-9"), FakeWorker(old, "dst-9")
        landed = land_replica(old, a, b, prompt, 0.5)
        a.close()
        b.close()
        time.sleep(0.6)  # its TTL passes
        old.kill(signal.SIGKILL)
        old.popen.wait(10)
        new = start(old.zmq_port, old.admin_port, "coord-new")
        a, b = FakeWorker(new, "src-9"), FakeWorker(new, "dst-9")  # hello again, then the resync
        a.store(prompt)
        wait_for(lambda: lookup(new, prompt).get("src-9") == 16, "the source's pages after the restart")
        b.fact(msgspec.structs.replace(landed, expires_in_s=-0.1))
        assert "has expired" in b.recv().error
        assert lookup(new, prompt).get("dst-9", 0) == 0
        assert new.get("/status")[1]["integrity"] == "ok"
        # a replica with TTL left, its pages re-reported with their tokens first (as the resync sends them), is
        # taken as reported (its expiry, absolute from now, is the coordinator's from then on)
        b.store(prompt)
        b.fact(msgspec.structs.replace(landed, replication_id="r-alive", expires_in_s=1.0))
        assert b.quiet(), b.recv()
        wait_for(lambda: lookup(new, prompt).get("dst-9") == 16, "the live replica in the directory")
        a.close()
        b.close()
    finally:
        for c in (old, new):
            if c is not None:
                c.stop()
