"""The ZMQ planes as real processes over loopback (a coordinator, stub agents running the real agent I/O side):
with keys only the allow-listed workers get in, and none can speak for another (the reproduction of a second hello
taking over a live worker now fails); an oversized frame disconnects its sender unread and the process keeps
serving; a coordinator restarted while a worker keeps caching pages costs exactly one resync; a public bind
without keys refuses to start; a fake source's transfers to a real worker's data port are refused and leave
nothing behind, and with keys a stranger gets no handshake and no worker speaks for another."""
import re
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvrep_dev.cluster import Coordinator, Proc, StubAgent, free_port, make_keys
from radix_sync import keys as k
from radix_sync import protocol as p
from radix_sync.hashing import page_hashes

FAILED_HANDSHAKES = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def wait_event(monitor: zmq.Socket, wanted: set[int], timeout_s: float = 60.0) -> int:
    """The first monitor event in `wanted` (raises if none comes: every one here is certain to)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            event = recv_monitor_message(monitor)["event"]
            if event in wanted:
                return event
    raise AssertionError(f"no monitor event in {wanted}")


def dealer(endpoint: str, curve=None):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        k.curve_client(sock, *curve)
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    return sock, monitor


def close(sock, monitor) -> None:
    sock.disable_monitor()  # frees its inproc address (named after the socket's fd, which a new socket reuses)
    monitor.close(0)
    sock.close(0)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def reply(sock, timeout_ms: int = 60_000):
    assert sock.poll(timeout_ms), "no reply"
    return p.decode_for_worker(sock.recv())


def hello(wid: str, url: str = "http://attacker:1") -> p.Hello:
    return p.Hello(worker_id=wid, http_url=url, data_endpoint="tcp://attacker:2", fingerprint="stub-fp",
                   fingerprint_fields={}, page_size=4, pool_capacity_tokens=100, replica_budget_tokens=25)


def num_facts(coord: Coordinator, kind: str) -> int:
    text = _metrics(coord)
    m = re.search(r'kvrep_coordinator_facts_total\{type="%s"\} ([0-9.]+)' % kind, text)
    return int(float(m.group(1))) if m else 0


def _metrics(coord: Coordinator) -> str:
    import urllib.request

    req = urllib.request.Request(coord.admin + "/metrics", headers={"Authorization": f"Bearer {coord.tokens.read}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


@pytest.fixture
def procs():
    started = []
    yield started
    for proc in reversed(started):
        proc.stop()


def test_oversized_frames_disconnect_the_sender_unread(tmp_path, procs):
    coord = Coordinator(tmp_path, extra_args=("--policy", "none"))
    procs.append(coord)
    coord.wait_ready()
    agent = StubAgent("agent", coord.endpoint, tmp_path, worker_id="w0", pages_per_s=50)
    procs.append(agent)
    data = agent.wait_stats(lambda s: s["hellos"] >= 1, what="agent up")["data_endpoint"]
    coord.wait_workers(["w0"])
    for pid, endpoint, size in ((coord.pid, coord.endpoint, 300 << 20), (agent.pid, data, 256 << 20)):
        before = rss_bytes(pid)
        sock, monitor = dealer(endpoint)
        sock.send(bytes(size), copy=False)
        wait_event(monitor, {zmq.EVENT_DISCONNECTED})  # the peer hung up on the frame's size
        assert not sock.poll(0)  # and never answered it
        grown = rss_bytes(pid) - before
        assert grown < 64 << 20, f"{endpoint} grew by {grown} bytes receiving a {size}-byte frame"
        close(sock, monitor)
    # both keep serving: the coordinator answers a hello, the data port refuses garbage with an answer
    sock, monitor = dealer(coord.endpoint)
    sock.send(p.encode(hello("w-after")))
    assert isinstance(reply(sock), p.HelloAck)
    close(sock, monitor)
    sock, monitor = dealer(data)
    sock.send(b"\xc1garbage")
    answer = p.decode_data_plane(reply_raw(sock))
    assert isinstance(answer, p.TransferRefused) and "malformed" in answer.error
    close(sock, monitor)
    assert agent.alive() and coord.alive() and agent.stats()["hellos"] == 1


def reply_raw(sock, timeout_ms: int = 60_000) -> bytes:
    assert sock.poll(timeout_ms), "no reply"
    return sock.recv_multipart()[-1]


def test_coordinator_restart_costs_one_resync(tmp_path, procs):
    """Before: the worker queued every fact (up to 100k) while the coordinator was down, the new one answered
    each with a resync request, and each got a full resync (a 20 s outage: 109 resyncs, 657,000 feed changes for
    3,000 pages). Now: no backlog, one hello and one resync per restart, every page in the feed exactly once."""
    old = Coordinator(tmp_path, extra_args=("--policy", "none"), name="coord-old")
    procs.append(old)
    old.wait_ready()
    agent = StubAgent("agent", old.endpoint, tmp_path, worker_id="w0", pages_per_s=300)
    procs.append(agent)
    agent.wait_stats(lambda s: s["hellos"] == 1 and s["pages_made"] >= 300, what="pages before the outage")
    old.wait_workers(["w0"])
    old.kill(signal.SIGKILL)
    old.popen.wait(10)
    down = agent.stats()["pages_made"]
    agent.wait_stats(lambda s: s["pages_made"] >= down + 600, what="pages cached while the coordinator is down")
    new = Coordinator(tmp_path, extra_args=("--policy", "none"), name="coord-new", port=old.zmq_port,
                      admin_port=old.admin_port)
    procs.append(new)
    new.wait_ready()
    new.wait_workers(["w0"], timeout_s=60)
    back = agent.stats()["pages_made"]
    agent.wait_stats(lambda s: s["pages_made"] >= back + 300, what="pages after the restart")
    agent.stop_making()
    final = agent.wait_stats(lambda s: not s["making"])["pages_made"]
    deadline = time.monotonic() + 60
    while new.get("/status")[1]["num_pages"] < final:
        assert time.monotonic() < deadline, f"{new.get('/status')[1]['num_pages']} of {final} pages"
        time.sleep(0.2)
    status = new.get("/status")[1]
    assert status["num_pages"] == final and status["integrity"] == "ok"
    assert status["feed"]["seq"] == final  # each page added once: no resync wiped and re-added anything
    assert num_facts(new, "Hello") == 1
    stats = agent.stats()
    assert (stats["hellos"], stats["coordinator_restarts"]) == (2, 1)
    assert stats["dropped_facts"] > 0  # what happened in the outage was dropped (the resync said it), not queued


@pytest.fixture
def keyed(tmp_path, procs):
    keys = make_keys(tmp_path / "keys", 2)
    coord = Coordinator(tmp_path, extra_args=("--policy", "none", "--worker-timeout-s", "60"), keys=keys)
    procs.append(coord)
    coord.wait_ready()
    agents = [StubAgent(f"w{i}", coord.endpoint, tmp_path, keys=keys, key_name=f"worker-{i}", pages_per_s=100)
              for i in range(2)]
    procs.extend(agents)
    for a in agents:
        a.wait_stats(lambda s: s["pages_made"] >= 100, what="pages")
        a.stop_making()
    coord.wait_workers(["worker-0", "worker-1"], timeout_s=60)
    made = [a.wait_stats(lambda s: not s["making"])["pages_made"] for a in agents]
    deadline = time.monotonic() + 60
    # the two stubs cache the same token sequence: the directory holds max(made) distinct pages
    while coord.get("/status")[1]["num_pages"] < max(made):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return keys, coord, agents, made


def lookup_w0(coord, made: int) -> int:
    tokens = [7 + i % 30_000 for i in range(made * 4)]
    return coord.post("/directory/lookup", {"input_ids": tokens})[1]["matched"]["worker-0"]


def test_only_allow_listed_keys_get_in_and_none_speaks_for_another(keyed):
    keys, coord, agents, made = keyed
    d = k.load_dir(keys)
    before = coord.workers()
    assert before["worker-0"]["url"] == "http://127.0.0.1:9" and lookup_w0(coord, made[0]) == made[0] * 4
    errors = coord.get("/status")[1]["num_protocol_errors"]
    # no CURVE at all, and a key nobody allow-listed: no handshake, not a byte delivered
    for curve in (None, (k.KeyPair("stranger", *zmq.curve_keypair()), d.coordinator.public)):
        sock, monitor = dealer(coord.endpoint, curve)
        sock.send(p.encode(hello("worker-0")))
        assert wait_event(monitor, FAILED_HANDSHAKES | {zmq.EVENT_HANDSHAKE_SUCCEEDED}) in FAILED_HANDSHAKES
        close(sock, monitor)
    # worker-1's own key: a hello as worker-0 (which used to replace its URL and data endpoint and wipe what it
    # holds) and a fact in worker-0's name are refused
    sock, monitor = dealer(coord.endpoint, (d.pair("worker-1"), d.coordinator.public))
    sock.send(p.encode(hello("worker-0")))
    refused = reply(sock)
    assert isinstance(refused, p.Error) and refused.in_reply_to == "Hello"
    assert "belongs to worker 'worker-1', the message claims 'worker-0'" in refused.error
    toks = list(range(50_000, 50_008))
    hashes = page_hashes(toks, 4)
    sock.send(p.encode(p.PagesRemoved(worker_id="worker-0", seq=1, block_hashes=page_hashes(
        [7 + i for i in range(8)], 4))))
    assert isinstance(reply(sock), p.Error)
    sock.send(p.encode(p.PagesStored(worker_id="worker-0", seq=1, namespace="", blocks=[
        p.BlockFact(hashes[0], None, toks[:4]), p.BlockFact(hashes[1], hashes[0], toks[4:])])))
    assert isinstance(reply(sock), p.Error)
    after = coord.workers()
    assert (after["worker-0"]["url"], after["worker-0"]["data_endpoint"]) == (
        before["worker-0"]["url"], before["worker-0"]["data_endpoint"])
    assert lookup_w0(coord, made[0]) == made[0] * 4  # nothing of worker-0's was wiped
    assert coord.post("/directory/lookup", {"input_ids": toks})[1]["matched"]["worker-0"] == 0  # nor claimed
    assert coord.get("/status")[1]["num_protocol_errors"] == errors + 3
    # a re-hello under a worker's own key (a restart) is accepted
    sock.send(p.encode(hello("worker-1", url="http://127.0.0.1:9")))
    assert isinstance(reply(sock), p.HelloAck)
    close(sock, monitor)
    assert all(a.alive() for a in agents) and agents[0].stats()["hellos"] == 1


def test_public_bind_refuses_to_start_without_keys(tmp_path, procs):
    bind = f"tcp://0.0.0.0:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "radix_sync.cli", "coordinator", "--bind", bind, "--admin-port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"--bind {bind} is not a loopback address" in out.stderr and "kvrep keys --out DIR" in out.stderr
    proc = Proc("coord-insecure", [sys.executable, "-m", "radix_sync.cli", "coordinator", "--bind", bind,
                                   "--admin-port", "0", "--insecure"], tmp_path / "coord-insecure.log")
    procs.append(proc)
    deadline = time.monotonic() + 60
    while "kvrep coordinator: workers ->" not in proc.tail():
        assert proc.alive() and time.monotonic() < deadline, proc.tail()
        time.sleep(0.2)
    assert "INSECURE: coordinator --bind " + bind in proc.tail()


def test_a_fake_source_installs_nothing_on_a_real_target(tmp_path, procs):
    """Before: a fake source's arbitrary bytes were installed as KV by a real worker. Now a real stub agent (the
    real I/O side and data port) refuses each forged transfer (no replication the coordinator authorized, or a
    guessed token for one it did) before staging a byte; chunks and ends sent anyway land nowhere; nothing is
    handed to the scheduler side, nothing staged or reserved, no replica reported, and it keeps serving."""
    import torch

    from kvrep_dev.stub_agent import GEOMETRY
    from sglang_kvrep.dataplane.wire import chunk_frames

    coord = Coordinator(tmp_path, extra_args=("--policy", "none"))
    procs.append(coord)
    coord.wait_ready()
    agent = StubAgent("target", coord.endpoint, tmp_path, worker_id="w1", pages_per_s=100)
    procs.append(agent)
    data = agent.wait_stats(lambda s: s["pages_made"] >= 50, what="target up")["data_endpoint"]
    agent.stop_making()
    coord.wait_workers(["w1"])
    before = agent.wait_stats(lambda s: not s["making"])
    gen = torch.Generator().manual_seed(17)
    sock, monitor = dealer(data)
    for i in range(20):
        num_pages = 1 + i % 5
        h = p.TransferHeader(
            transfer_id=f"fake-{i}", replication_id=f"r{i}", auth_token=f"{i:032x}", source_id="w0",
            fingerprint=GEOMETRY.fingerprint, namespace="", token_ids=list(range(num_pages * 4)), page_size=4,
            num_pages=num_pages, dtype=GEOMETRY.dtype, layout=GEOMETRY.layout,
            buffer_shape=list(GEOMETRY.buffer_shape(num_pages)), num_bytes=GEOMETRY.num_bytes(num_pages),
            pages_per_chunk=2, num_chunks=-(-num_pages // 2), checksum_kind="xxh3", ttl_s=30.0)
        payload = torch.randint(0, 256, (h.num_bytes,), dtype=torch.uint8, generator=gen)
        sock.send(p.encode(h))
        answer = p.decode_data_plane(reply_raw(sock))
        assert isinstance(answer, p.TransferRefused) and answer.transfer_id == h.transfer_id
        assert "not authorized by the coordinator" in answer.error
        # the bytes sent anyway, as if admitted
        whole = payload.view(GEOMETRY.buffer_shape(num_pages)[0], num_pages, -1)
        for c in range(h.num_chunks):
            part = whole[:, c * 2:(c + 1) * 2].contiguous().view(-1)
            sock.send_multipart(chunk_frames(h, c, part))
        sock.send(p.encode(p.TransferEnd(transfer_id=h.transfer_id)))
    # whatever the target answered to the stray chunks and ends, none is an acceptance
    while sock.poll(2000):
        answer = p.decode_data_plane(sock.recv_multipart()[-1])
        assert not isinstance(answer, p.TransferAccepted), answer
    close(sock, monitor)
    stats = agent.wait_stats(lambda s: s["transfers_incoming"] == 0, what="no transfer under way")
    assert (stats["staging_cached_bytes"], stats["staging_reserved_tokens"]) == (0, 0)
    assert stats["commands"] == before["commands"] and "Install" not in stats["commands"]  # nothing handed on
    assert stats["pages_held"] == before["pages_held"] and stats["hellos"] == 1
    assert coord.get("/replications")[1] == [] and coord.get("/status")[1]["integrity"] == "ok"
    # and it keeps serving: a malformed frame is answered
    sock, monitor = dealer(data)
    sock.send(b"\xc1garbage")
    assert isinstance(p.decode_data_plane(reply_raw(sock)), p.TransferRefused)
    close(sock, monitor)
    assert agent.alive()


def test_a_keyed_data_port_admits_no_stranger_and_no_impersonation(keyed):
    """With keys, a real worker's data port: no CURVE or a key outside the allow-list gets no handshake; another
    worker's genuine key speaking as a third worker (`source_id`) is refused before admit, and nothing is staged."""
    keys, coord, agents, made = keyed
    d = k.load_dir(keys)
    target = agents[1]
    data = target.stats()["data_endpoint"]
    server = d.workers["worker-1"].public
    h = p.TransferHeader(transfer_id="t1", replication_id="r1", auth_token="0" * 32, source_id="worker-0",
                         fingerprint="stub-fp", namespace="", token_ids=list(range(4)), page_size=4, num_pages=1,
                         dtype="torch.bfloat16", layout="NHD", buffer_shape=[3, 1, 2, 4, 2, 8], num_bytes=768,
                         pages_per_chunk=1, num_chunks=1, checksum_kind="xxh3", ttl_s=30.0)
    for curve in (None, (k.KeyPair("stranger", *zmq.curve_keypair()), server)):
        sock, monitor = dealer(data, curve)
        sock.send(p.encode(h))
        assert wait_event(monitor, FAILED_HANDSHAKES | {zmq.EVENT_HANDSHAKE_SUCCEEDED}) in FAILED_HANDSHAKES
        close(sock, monitor)
    sock, monitor = dealer(data, (d.pair("worker-0"), server))  # worker-0's own key, claiming worker-2
    sock.send(p.encode(msgspec.structs.replace(h, source_id="worker-2")))
    answer = p.decode_data_plane(reply_raw(sock))
    assert isinstance(answer, p.TransferRefused)
    assert answer.error == "source_id 'worker-2' is not the worker of this connection's key ('worker-0')"
    close(sock, monitor)
    stats = target.wait_stats(lambda s: s["transfers_incoming"] == 0)
    assert (stats["staging_cached_bytes"], stats["staging_reserved_tokens"]) == (0, 0)
    assert "Install" not in stats["commands"] and target.alive()
