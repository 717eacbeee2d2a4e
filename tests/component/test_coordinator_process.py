"""The coordinator as a real process over real sockets: bad input gets an error and the coordinator keeps serving."""
import time
import urllib.request

import msgspec
import pytest
import zmq

from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from kvrep_dev.cluster import Coordinator


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    c = Coordinator(tmp_path_factory.mktemp("coord"), extra_args=("--policy", "none", "--worker-timeout-s", "30"))
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture
def dealer(coord):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coord.endpoint)
    yield sock
    sock.close()


def reply(sock, timeout_ms=5000):
    assert sock.poll(timeout_ms), "no reply from the coordinator"
    return p.decode_for_worker(sock.recv())


def hello(wid):
    return p.Hello(worker_id=wid, http_url=f"http://{wid}", data_endpoint="tcp://127.0.0.1:1", fingerprint="f",
                   fingerprint_fields={}, page_size=4, pool_capacity_tokens=100, replica_budget_tokens=25)


@pytest.mark.parametrize("raw", [b"\xc1\x00garbage", msgspec.msgpack.encode({"type": "Hello", "worker_id": 1}),
                                 msgspec.msgpack.encode({"type": "ReplicatePages"}), b""])
def test_malformed_message_gets_error_and_coordinator_keeps_serving(coord, dealer, raw):
    before = coord.get("/status")[1]["num_protocol_errors"]
    dealer.send(raw)
    msg = reply(dealer)
    assert isinstance(msg, p.Error) and "malformed" in msg.error
    status = coord.get("/status")[1]
    assert status["num_protocol_errors"] == before + 1
    # still serving: a proper hello is acknowledged and shows up in /workers
    dealer.send(p.encode(hello("w-after-garbage")))
    assert isinstance(reply(dealer), p.HelloAck)
    assert "w-after-garbage" in coord.workers()


def test_multiframe_message_is_refused(coord, dealer):
    dealer.send_multipart([b"a", b"b"])
    assert isinstance(reply(dealer), p.Error)


def test_facts_flow_to_lookup_over_real_sockets(coord, dealer):
    dealer.send(p.encode(hello("w1")))
    assert isinstance(reply(dealer), p.HelloAck)
    toks = list(range(40, 52))
    hashes = page_hashes(toks, 4)
    blocks = [p.BlockFact(h, par, toks[i * 4:(i + 1) * 4])
              for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
    dealer.send(p.encode(p.PagesStored(worker_id="w1", seq=1, namespace="", blocks=blocks)))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        status, body = coord.post("/directory/lookup", {"input_ids": toks + [1]})
        if body["matched"].get("w1") == 12:
            break
        time.sleep(0.05)
    assert body["matched"]["w1"] == 12
    status, body = coord.get("/directory/lookup?input_ids=" + ",".join(map(str, toks)))
    assert status == 200 and body["matched"]["w1"] == 12
    # the router's way: its own page hashes (namespace in them), no token list
    status, body = coord.post("/directory/lookup", {"page_hashes": page_hashes(toks + [1, 2, 3, 4], 4),
                                                    "page_size": 4})
    assert status == 200 and body["matched"]["w1"] == 12
    assert coord.post("/directory/lookup", {"page_hashes": hashes, "page_size": 16})[1]["matched"]["w1"] == 0
    assert coord.post("/directory/lookup", {"page_hashes": page_hashes(toks, 4, "other-tenant"),
                                            "page_size": 4})[1]["matched"]["w1"] == 0
    for bad in ({"page_hashes": "x", "page_size": 4}, {"page_hashes": [1], "page_size": 0},
                {"page_hashes": [-(1 << 63) - 1], "page_size": 4}, {"page_hashes": [1 << 63], "page_size": 4},
                {"page_hashes": [1.5], "page_size": 4}):
        status, body = coord.post("/directory/lookup", bad)
        assert status == 400 and "page_hashes" in body["error"]


def test_directory_feed_long_poll_wakes_on_a_change(coord, dealer):
    import threading

    dealer.send(p.encode(hello("w-feed")))
    assert isinstance(reply(dealer), p.HelloAck)
    status, snap = coord.get("/directory/feed?epoch=&since=0")
    assert status == 200 and "snapshot" in snap and snap["seq"] == snap["head"]
    epoch, seq = snap["epoch"], snap["seq"]
    # nothing new: a long poll returns empty after its window
    status, out = coord.get(f"/directory/feed?epoch={epoch}&since={seq}&wait_s=0.2")
    assert status == 200 and out["changes"] == [] and out["seq"] == seq
    # a long poll in flight is answered by the next change, well before its 20 s window
    answer = {}
    t = threading.Thread(target=lambda: answer.update(
        out=coord.get(f"/directory/feed?epoch={epoch}&since={seq}&wait_s=20")[1]))
    t.start()
    time.sleep(0.3)
    toks = list(range(300, 308))
    hashes = page_hashes(toks, 4)
    dealer.send(p.encode(p.PagesStored(worker_id="w-feed", seq=1, namespace="", blocks=[
        p.BlockFact(hashes[0], None, toks[:4]), p.BlockFact(hashes[1], hashes[0], toks[4:])])))
    t.join(15)
    assert not t.is_alive(), "the long poll was not woken by the change"
    assert answer["out"]["changes"] == [[1, "w-feed", hashes[0]], [1, "w-feed", hashes[1]]]
    assert answer["out"]["seq"] == seq + 2 and coord.get("/status")[1]["feed"]["seq"] == seq + 2
    assert coord.get("/directory/feed?since=x")[0] == 400


@pytest.mark.parametrize("body,status,needle", [
    ({"source": "nope", "target": "w1", "input_ids": [1, 2, 3, 4]}, 404, "unknown worker"),
    ({"target": "w1", "input_ids": [1]}, 400, "missing required field `source`"),
    ({"source": "w1", "target": "w1", "input_ids": [1, 2, 3, 4]}, 400, "same worker"),
    ({"source": "w1", "target": "w2", "input_ids": "abc"}, 400, "input_ids"),
    # a router's pull: refused at once when the source does not hold the prefix (nothing stored here)
    ({"source": "w1", "target": "w2", "input_ids": [1, 2, 3, 4], "critical": True}, 409, "holds 0 of the 4"),
    ({"source": "w1", "target": "w2", "input_ids": [1, 2, 3, 4], "critical": "yes"}, 400, "critical"),
])
def test_admin_errors_are_clear_json(coord, dealer, body, status, needle):
    for wid in ("w1", "w2"):
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.connect(coord.endpoint)
        d.send(p.encode(hello(wid)))
        reply(d)
        d.close(0)
    got_status, got = coord.post("/replicate", body)
    assert got_status == status and needle in got["error"]
    assert coord.get("/health")[0] == 200


@pytest.mark.parametrize("body,status,needle", [
    ({"id": "r0-none"}, 404, "unknown replication"),
    ({"id": "r1", "wait_s": 60}, 400, "wait_s"),
    ({"wait_s": 1}, 400, "missing required field `id`"),
])
def test_replication_wait_errors_are_clear_json(coord, body, status, needle):
    got_status, got = coord.post("/replications/wait", body)
    assert got_status == status and needle in got["error"]
    assert coord.get("/health")[0] == 200


def test_bad_json_body_and_unknown_endpoint(coord):
    import urllib.request
    req = urllib.request.Request(coord.admin + "/replicate", data=b"{not json", method="POST",
                                 headers={"Authorization": f"Bearer {coord.tokens.write}"})
    try:
        urllib.request.urlopen(req, timeout=5)
        raise AssertionError("expected an HTTP error")
    except urllib.error.HTTPError as exc:
        assert exc.code == 400 and b"not JSON" in exc.read()
    assert coord.get("/nope")[0] == 404


def test_arrivals_and_hints_are_recorded_and_validated(coord):
    status, body = coord.post("/arrivals", {"arrivals": [{"input_ids": list(range(9)), "worker": "w1"},
                                                         {"input_ids": [1, 2], "cache_salt": "t"}]})
    assert status == 200 and body == {"recorded": 2, "finishes_recorded": 0, "dropped": 0, "errors": []}
    status, body = coord.post("/arrivals", {"finishes": [{"input_ids": list(range(9)), "stop": "tool_use"}]})
    assert status == 200 and body["finishes_recorded"] == 1
    # a batch with one bad item drops that item, naming it, and records the rest
    status, body = coord.post("/arrivals", {"arrivals": [{"input_ids": [1]}], "finishes": [{"stop": 7}]})
    assert status == 200 and body["recorded"] == 1 and body["dropped"] == 1 and "finishes[0]" in body["errors"][0]
    assert coord.post("/arrivals", {})[0] == 400
    status, body = coord.post("/hints", {"kind": "fanout", "input_ids": list(range(16)), "k": 8})
    assert status == 200 and body["kind"] == "fanout"
    status_after = coord.get("/status")[1]
    assert status_after["num_recent_arrivals"] >= 2 and status_after["num_live_hints"] >= 1
    assert status_after["num_recent_finishes"] == 1
    assert coord.post("/arrivals", {"arrivals": [{"input_ids": "x"}]})[1]["dropped"] == 1
    assert coord.post("/hints", {"kind": "prefetch", "input_ids": [1]})[0] == 400
    assert coord.post("/hints", {"kind": "keepalive", "input_ids": [1], "ttl_s": -1})[0] == 400


def test_status_shows_loop_timing_and_each_hints_timeline(coord, dealer):
    dealer.send(p.encode(hello("w-hint")))
    assert isinstance(reply(dealer), p.HelloAck)
    toks = list(range(500, 516))
    hashes = page_hashes(toks, 4)
    coord.post("/hints", {"kind": "fanout", "input_ids": toks, "k": 3})  # before the trunk is computed
    [entry] = [h for h in coord.get("/status")[1]["hints"] if h["block_hash"] == hashes[-1]]
    assert "hint_s" in entry and "stored_s" not in entry and entry["planner"] == []
    dealer.send(p.encode(p.PagesStored(worker_id="w-hint", seq=1, namespace="", blocks=[
        p.BlockFact(h, par, toks[i * 4:(i + 1) * 4]) for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))])))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        st = coord.get("/status")[1]
        [entry] = [h for h in st["hints"] if h["block_hash"] == hashes[-1]]
        if "stored_s" in entry:
            break
        time.sleep(0.05)
    assert entry["stored_s"] >= entry["hint_s"]  # when the trunk's pages reached the directory
    loop = st["loop"]
    assert loop["ticks"] > 0 and loop["messages"] >= 2 and loop["tick_ms"]["max"] >= loop["tick_ms"]["p50"] >= 0
    assert loop["tick_cpu_ms"]["p99"] >= loop["tick_cpu_ms"]["p50"] >= 0  # the loop thread's own CPU per tick


def test_policy_switch_can_forget_demand(coord):
    coord.post("/arrivals", {"arrivals": [{"input_ids": list(range(9)), "worker": "w1"}]})
    coord.post("/hints", {"kind": "fanout", "input_ids": list(range(16)), "k": 4})
    st = coord.get("/status")[1]
    assert st["num_recent_arrivals"] >= 1 and st["num_live_hints"] >= 1
    # a plain switch keeps what was seen ...
    assert coord.post("/policy", {"policy": "kvrep", "mode": "shadow"}) == (200, {"policy": "kvrep", "mode": "shadow"})
    assert coord.get("/status")[1]["num_live_hints"] >= 1
    # ... reset_demand forgets it (an earlier benchmark arm must not steer the next one)
    assert coord.post("/policy", {"policy": "kvrep", "mode": "shadow", "reset_demand": True})[0] == 200
    st = coord.get("/status")[1]
    assert st["num_recent_arrivals"] == 0 and st["num_live_hints"] == 0 and st["hints"] == []
    assert coord.post("/policy", {"policy": "kvrep", "reset_demand": "yes"})[0] == 400
    assert coord.post("/policy", {"policy": "none", "mode": "shadow"})[0] == 200


def test_the_process_paces_its_collector_and_the_directory_survives_thorough_passes(tmp_path):
    """`kvrep coordinator` freezes what lives after each tick and collects the whole heap every
    `--gc-thorough-every-s`: facts stored before and between the passes are all still answered."""
    c = Coordinator(tmp_path, extra_args=("--policy", "kvrep", "--worker-timeout-s", "30",
                                          "--gc-thorough-every-s", "0.3"))
    try:
        c.wait_ready()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(c.endpoint)
        sock.send(p.encode(hello("w-gc")))
        assert isinstance(reply(sock), p.HelloAck)
        prompts = []
        for seq in range(1, 5):
            toks = list(range(1000 * seq, 1000 * seq + 16))
            hashes = page_hashes(toks, 4)
            sock.send(p.encode(p.PagesStored(worker_id="w-gc", seq=seq, namespace="", blocks=[
                p.BlockFact(h, par, toks[i * 4:(i + 1) * 4])
                for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))])))
            prompts.append(toks)
            passes = c.get("/status")[1]["loop"]["gc"]["thorough_passes"]
            deadline = time.monotonic() + 10
            while c.get("/status")[1]["loop"]["gc"]["thorough_passes"] == passes and time.monotonic() < deadline:
                time.sleep(0.1)
        gc_ = c.get("/status")[1]["loop"]["gc"]
        assert gc_["thorough_passes"] >= 4 and gc_["frozen_at_thorough"] > 0 and gc_["settles"] >= gc_["thorough_passes"]
        assert gc_["thorough_every_s"] == 0.3 and gc_["thorough_ms"]["max"] >= gc_["thorough_ms"]["last"] > 0
        for toks in prompts:
            assert c.post("/directory/lookup", {"input_ids": toks})[1]["matched"]["w-gc"] == 16
        req = urllib.request.Request(c.admin + "/metrics", headers={"Authorization": f"Bearer {c.tokens.read}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert "kvrep_coordinator_gc_thorough_seconds_count" in resp.read().decode()
        sock.close()
    finally:
        c.stop()


def test_the_collector_is_left_alone_when_asked(tmp_path, coord):
    assert coord.get("/status")[1]["loop"]["gc"]["settles"] > 0  # the CLI's default paces
    c = Coordinator(tmp_path, extra_args=("--policy", "none", "--gc-thorough-every-s", "0"))
    try:
        c.wait_ready()
        assert c.get("/status")[1]["loop"]["gc"] == {"paced": False}
    finally:
        c.stop()
