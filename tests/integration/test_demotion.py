"""Eviction order on a real SGLang worker with a small pool. Demotion: a chain the coordinator marked stale is evicted
before older ordinary cache when an allocation needs room (plain LRU would evict the oldest entry instead), the
coordinator's directory follows, and no slot leaks. Copies: a speculative replica goes first, a pulled prefix (a
critical copy) is ordinary cache in LRU order."""
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.conftest import PAGE_SIZE, WORKER_ARGS, joined_worker, prompt, wait_until

pytestmark = pytest.mark.server

POOL = 4096
N = 1024  # tokens per prompt: 64 pages; with one new token the finished request caches exactly the prompt


@pytest.fixture(scope="module")
def small(cluster):
    with joined_worker(cluster, "C-small-pool", max_total_tokens=POOL,  # room for the two copies of the last test
                       extra_args=WORKER_ARGS + ("--kvrep-replica-budget-tokens", "2048")) as c:
        yield c


def cached(worker, ids) -> int:
    return worker.generate(ids, 1)["meta_info"]["cached_tokens"]


def test_a_demoted_chain_is_evicted_before_older_cache(cluster, small):
    coord, c = cluster.coord, small
    p1, p2, p3 = prompt(301, N), prompt(302, N), prompt(303, N)
    for ids in (p1, p2, p3):
        c.generate(ids, 1)
    before = cluster.free_plus_evictable(c)
    wait_until(lambda: all(cluster.lookup(ids).get(c.worker_id, 0) == N for ids in (p1, p2, p3)), 10,
               what="the three prompts in the directory")
    # a bad demotion is refused with the reason and changes nothing
    status, body = coord.post("/demote", {"worker": c.worker_id, "input_ids": "p2"})
    assert status == 400 and "input_ids" in body["error"], body
    status, body = coord.post("/demote", {"worker": "nobody", "input_ids": p2})
    assert status == 404, body
    # p2 (newer than p1) is demoted; a prefix of p3 that ends inside its cached chain is demoted too, and must
    # not evict p3 (the cache holds more beyond it: it is not a stale copy's end)
    for ids in (p2, p3[: N // 2]):
        status, body = coord.post("/demote", {"worker": c.worker_id, "input_ids": ids})
        assert status == 200, body
    assert coord.get("/status")[1]["demotions"]["sent"] >= 2
    # a fourth prompt does not fit next to the three: room must be made. LRU alone would take p1 (the oldest).
    p4 = prompt(304, 1536)
    c.generate(p4, 1)
    wait_until(lambda: cluster.lookup(p2).get(c.worker_id, 0) == 0, 10, what="p2 gone from the directory")
    assert cluster.lookup(p1).get(c.worker_id, 0) == N
    assert cluster.lookup(p3).get(c.worker_id, 0) == N
    assert cached(c, p1) == N - PAGE_SIZE and cached(c, p3) == N - PAGE_SIZE  # the last page is always computed
    assert cluster.free_plus_evictable(c) == before  # every slot is back: free or evictable cache
    assert coord.get("/status")[1]["integrity"] == "ok"
    # the worker reports what demotion did: p2's chain freed; p3's inner prefix still listed (p2 covered the need)
    load = wait_until(lambda: (lambda w: w if w["demoted_evicted_tokens"] >= N else None)(cluster.load(c)), 10,
                      what="the worker's demotion counters")
    assert load["demoted_chains"] == 1 and load["demotions_taken_back"] == 0
    assert cached(c, p2) == 0  # recomputed (and cached again): room is needed again
    # this time the inner prefix of p3 is looked at: the cache holds more beyond it, so it is taken back, not evicted
    wait_until(lambda: (lambda w: w["demoted_chains"] == 0 and w["demotions_taken_back"] == 1)(cluster.load(c)), 10,
               what="p3's inner prefix taken back")
    assert cached(c, p3) == N - PAGE_SIZE
    assert c.alive()


def test_a_sessions_next_turn_elsewhere_demotes_the_old_copy(cluster, small):
    """The planner's session tracking and demotion in active mode (`demote`: kvrep's, without copies, so that no
    replication of this test outlives it): a finished turn cached on C and on A, its next turn reported routed to
    A: the coordinator decides that C's copy is stale. Its demotion gate sends nothing at first (a control: moved
    sessions might come back); once the session's next turns kept going to A (8 outcomes, none back on C) it tells C
    (and only C) that its copy is stale."""
    coord, a, c = cluster.coord, cluster.a, small
    turn = prompt(310, 512)
    c.generate(turn, 1)
    a.generate(turn, 1)
    wait_until(lambda: all(cluster.lookup(turn).get(w.worker_id, 0) == 512 for w in (a, c)), 10,
               what="the turn cached on A and C")
    try:
        assert coord.post("/policy", {"policy": "demote", "mode": "active", "reset_demand": True})[0] == 200
        sent = coord.get("/status")[1]["demotions"]["sent"]

        def next_turn_on_a(i: int) -> dict:
            status, _ = coord.post("/arrivals", {"finishes": [{"input_ids": turn, "worker": c.worker_id,
                                                               "stop": "tool_use", "seq": 2 * i}],
                                                 "arrivals": [{"input_ids": turn + prompt(311 + i, 40),
                                                               "worker": a.worker_id, "seq": 2 * i + 1}]})
            assert status == 200
            return wait_until(lambda: (lambda s: s if s["sessions"]["demotion_gate"]["decided"] > i else None)(
                coord.get("/status")[1]), 10, what=f"demotion decision {i}")

        st = next_turn_on_a(0)
        gate = st["sessions"]["demotion_gate"]
        assert st["sessions"]["followups"] >= 1 and gate["controls"] == 1 and not gate["open"]
        assert st["demotions"]["sent"] == sent  # decided, not sent
        for i in range(1, 9):
            st = next_turn_on_a(i)
        gate = st["sessions"]["demotion_gate"]
        assert gate["moved_on"] == 8 and gate["returned"] == 0 and gate["open"] and gate["sent"] == 1
        st = wait_until(lambda: (lambda s: s if s["demotions"]["sent"] > sent else None)(coord.get("/status")[1]),
                        10, what="a demotion")
        assert [d["worker"] for d in st["demotions"]["recent"] if d["sent"]][-1] == c.worker_id
        assert st["demotions"]["sent"] == sent + 1  # A, where the turn went, keeps its copy
    finally:
        coord.post("/policy", {"policy": "rules", "mode": "active", "reset_demand": True})


def test_a_pulled_prefix_is_ordinary_cache_and_a_speculative_replica_goes_first(cluster, small):
    """Before, a pull was inserted at a replica's priority, below every ordinary entry: on a full pool the next
    allocation evicted it first, before the request it was pulled for was admitted (live fan-out: pulled trunks
    evicted 0.1 s after they landed, the branches recomputed them). Now it ranks as the prompt it stands for,
    inserted when it landed: the oldest ordinary entry goes before it. A speculative replica still goes first."""
    coord, a, c = cluster.coord, cluster.a, small
    status = urllib.request.urlopen(urllib.request.Request(c.url + "/flush_cache", data=b"", method="POST"),
                                    timeout=30).status
    assert status == 200
    q1, q2, q3 = prompt(321, 1024), prompt(322, 1024), prompt(323, 2048)
    pulled, spec = prompt(324, 512), prompt(325, 512)
    wait_until(lambda: cluster.lookup(q1).get(c.worker_id, 0) == 0, 10, what="C's cache flushed")
    before = cluster.free_plus_evictable(c)
    for ids in (q1, q2):  # ordinary cache on C, q1 the oldest
        c.generate(ids, 1)
    for ids in (pulled, spec):
        a.generate(ids, 1)
    wait_until(lambda: all(cluster.lookup(ids).get(a.worker_id, 0) == 512 for ids in (pulled, spec)), 10,
               what="the copies' prefixes on A")
    assert cluster.replicate(a, c, spec)["state"] == "done"
    assert cluster.replicate(a, c, pulled, critical=True)["state"] == "done"
    assert [r["origin"] for r in coord.get("/replications")[1][-2:]] == ["admin", "pull"]
    wait_until(lambda: all(cluster.lookup(ids).get(c.worker_id, 0) == n for ids, n in
                           ((q1, 1024), (q2, 1024), (pulled, 512), (spec, 512))), 10, what="3,072 tokens cached on C")
    c.generate(q3, 1)  # 2,064 tokens into 1,024 free: 1,040 or more must be evicted
    wait_until(lambda: cluster.lookup(spec).get(c.worker_id, 0) == 0, 10, what="the speculative replica evicted")
    wait_until(lambda: cluster.lookup(q1).get(c.worker_id, 0) == 0, 10, what="the oldest ordinary entry evicted")
    assert cluster.lookup(pulled).get(c.worker_id, 0) == 512  # before: evicted right after the replica
    assert cluster.lookup(q2).get(c.worker_id, 0) == 1024
    assert cached(c, pulled + [7] * PAGE_SIZE) == 512  # the request it was pulled for finds it
    assert cluster.free_plus_evictable(c) == before  # every slot is back: free or evictable cache
    assert coord.get("/status")[1]["integrity"] == "ok"


def test_a_pulled_prefix_does_not_outrank_a_fresher_prompt(cluster, small):
    """A copy ranks as a prompt SGLang just computed, not above it. SGLang leaves a page-aligned prompt with a short
    answer at priority 0 (its prompt is raised to 1 only when the answer's pages follow it), and a priority never
    goes down: copies inserted at 1 outranked every such prompt for good. On the fan-out runs' full pools the copies
    of earlier rounds piled up at 1 and the next pull's allocation evicted a trunk prefilled 0.1 s before (its
    branches recomputed it). Here the older pulled copies go first and the fresher prompt stays."""
    coord, a, c = cluster.coord, cluster.a, small
    status = urllib.request.urlopen(urllib.request.Request(c.url + "/flush_cache", data=b"", method="POST"),
                                    timeout=30).status
    assert status == 200
    pulls = [prompt(341 + i, 512) for i in range(3)]
    trunk, big = prompt(345, 1024), prompt(346, 2048)
    wait_until(lambda: all(cluster.lookup(ids).get(c.worker_id, 0) == 0 for ids in pulls), 10,
               what="C's cache flushed")
    before = cluster.free_plus_evictable(c)
    for ids in pulls:
        a.generate(ids, 1)
    wait_until(lambda: all(cluster.lookup(ids).get(a.worker_id, 0) == 512 for ids in pulls), 10,
               what="the prefixes on A")
    for ids in pulls:  # three critical copies onto C: 1,536 tokens of ordinary cache, the oldest entries there
        assert cluster.replicate(a, c, ids, critical=True)["state"] == "done"
    c.generate(trunk, 1)  # a fresh prompt (1,024 tokens, a 1-token answer: SGLang caches it at priority 0)
    wait_until(lambda: cluster.lookup(trunk).get(c.worker_id, 0) == 1024, 10, what="the trunk on C")
    c.generate(big, 1)  # 2,048 tokens into 1,536 free: 512 or more must be evicted
    wait_until(lambda: cluster.lookup(pulls[0]).get(c.worker_id, 0) < 512, 10, what="the oldest copy evicted")
    assert cluster.lookup(trunk).get(c.worker_id, 0) == 1024  # before: the trunk went, the copies stayed
    assert cached(c, trunk + [5] * PAGE_SIZE) == 1024
    assert cluster.free_plus_evictable(c) == before  # every slot is back: free or evictable cache
    assert coord.get("/status")[1]["integrity"] == "ok"


def test_a_speculative_replica_a_queued_request_wants_is_not_the_next_victim(cluster, small):
    """A replica is evicted before ordinary cache, but not while a request routed to it waits in the queue (no
    lock until admitted): the agent raises it to ordinary cache then. Here C runs two requests (its limit), the
    third, which wants the replica, waits, and the two answers' decoding fills the pool: the oldest prompt is
    evicted, not the replica, and the third request finds it (before: the replica went, the request found 0)."""
    coord, a, c = cluster.coord, cluster.a, small
    status = urllib.request.urlopen(urllib.request.Request(c.url + "/flush_cache", data=b"", method="POST"),
                                    timeout=30).status
    assert status == 200
    q1, spec, r1, r2 = prompt(331, 1024), prompt(332, 512), prompt(333, 512), prompt(334, 512)
    wait_until(lambda: cluster.lookup(q1).get(c.worker_id, 0) == 0, 10, what="C's cache flushed")
    c.generate(q1, 1)
    a.generate(spec, 1)
    wait_until(lambda: cluster.lookup(spec).get(a.worker_id, 0) == 512, 10, what="the prefix on A")
    assert cluster.replicate(a, c, spec)["state"] == "done"
    wait_until(lambda: cluster.lookup(spec).get(c.worker_id, 0) == 512, 10, what="the replica on C")
    # 1,536 tokens cached, 2 x 512 prompts admitted: 1,536 free, then 2 x 1,000 decoded tokens need evictions
    with ThreadPoolExecutor(3) as pool:
        busy = [pool.submit(c.generate, ids, 1000, None, 300) for ids in (r1, r2)]
        wait_until(lambda: cluster.load(c)["num_running_reqs"] == 2, 30, interval_s=0.05, what="C running two")
        waiting = pool.submit(c.generate, spec + [9] * PAGE_SIZE, 1, None, 300)
        time.sleep(0.5)  # queued behind the two (C runs at most two): the agent sees it at its next iteration
        for f in busy:
            f.result()
        meta = waiting.result()["meta_info"]
    assert meta["cached_tokens"] == 512, meta  # the replica was still there when it was admitted
    wait_until(lambda: cluster.lookup(q1).get(c.worker_id, 0) < 1024, 10, what="the oldest prompt evicted instead")
    assert coord.get("/status")[1]["integrity"] == "ok"


def test_a_replica_a_request_waits_for_at_a_router_is_not_the_next_victim(cluster, small):
    """A router that holds a request until a planner's copy lands waits on the coordinator's long poll with `want`;
    the coordinator tells the copy's target (`WantReplica`), which raises the landed replica to ordinary cache. Here
    the replica lands after a fresh prompt and an allocation then needs room: the older prompt loses pages, the
    replica stays (before: the evict-first replica went, and the held request recomputed it). An admin's wait (no
    `want`) leaves a replica evict-first."""
    coord, a, c = cluster.coord, cluster.a, small
    status = urllib.request.urlopen(urllib.request.Request(c.url + "/flush_cache", data=b"", method="POST"),
                                    timeout=30).status
    assert status == 200
    trunk, spec, big = prompt(351, 1024), prompt(352, 512), prompt(353, 3072)
    wait_until(lambda: cluster.lookup(trunk).get(c.worker_id, 0) == 0, 10, what="C's cache flushed")
    before = cluster.free_plus_evictable(c)
    c.generate(trunk, 1)
    a.generate(spec, 1)
    wait_until(lambda: cluster.lookup(spec).get(a.worker_id, 0) == 512, 10, what="the prefix on A")
    done = cluster.replicate(a, c, spec)  # the harness waits as an admin does: the replica stays evict-first
    assert done["state"] == "done"
    wait_until(lambda: cluster.lookup(spec).get(c.worker_id, 0) == 512, 10, what="the replica on C")
    status, info = coord.post("/replications/wait", {"id": done["id"], "wait_s": 0, "want": True})
    assert status == 200 and info["state"] == "done", info
    wait_until(lambda: f"replica {done['id']} raised to ordinary cache" in c.log_path.read_text(errors="replace"),
               10, what="the replica raised on C")
    c.generate(big, 1)  # 3,072 tokens next to 1,536 cached in a 4,096-token pool: 512 or more must be evicted
    wait_until(lambda: cluster.lookup(trunk).get(c.worker_id, 0) < 1024, 10, what="the older prompt evicted")
    assert cluster.lookup(spec).get(c.worker_id, 0) == 512  # the replica the request waits for is still there
    assert cached(c, spec + [7] * PAGE_SIZE) == 512
    assert cluster.free_plus_evictable(c) == before  # every slot is back: free or evictable cache
    assert coord.get("/status")[1]["integrity"] == "ok"
