"""The router's worker pool: one id per worker (its URL), the coordinator's ids translated at the boundary, who is
served, cool-downs, and the router's own queued-work accounting."""
from radix_sync.router.policy import CopyInFlight, WorkerState
from radix_sync.router.pool import WorkerPool

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def listed(*rows):
    return [{"id": wid, "url": url, "page_size": ps, "load": load} for wid, url, ps, load in rows]


def test_static_workers_and_the_coordinators_list_merge_by_url():
    pool = WorkerPool([A + "/", B], 16, 5.0)
    assert list(pool.known) == [A, B] and pool.static_urls == {A, B} and pool.listed is None
    assert pool.unidentified()
    reported = pool.sync(listed(("wB", B + "/", 32, {"num_running_reqs": 2, "num_waiting_reqs": 1,
                                                      "num_waiting_tokens": 40}),
                                ("wC", C, None, {}), ("wX", "", 16, {})))  # no url: ignored
    assert reported == {B: WorkerState(B, 32, 2, 1, 40), C: WorkerState(C, 16)}
    assert list(pool.known) == [A, B, C] and pool.known[B] == WorkerState(B, 32)  # no load kept
    assert pool.listed == {B, C} and pool.coordinator_ids == {B: "wB", C: "wC"} and pool.unidentified()
    assert (pool.report_id(B), pool.report_id(A)) == ("wB", A)
    assert (pool.page_size(B, 0), pool.page_size("http://zz", 7)) == (32, 7)


def test_directory_answers_and_copies_are_translated_to_urls():
    pool = WorkerPool([], 16, 5.0)
    pool.sync(listed(("wA", A, 16, {}), ("wB", B, 16, {})))
    assert pool.by_url({"wA": 64, "wZ": 5}) == {A: 64, B: 0}
    copies = [CopyInFlight("wA", "wB", "ns", 48), CopyInFlight("wA", "wZ", "ns", 48)]  # wZ: unknown
    assert pool.copies_by_url(copies) == [CopyInFlight(A, B, "ns", 48)]
    pool.sync(listed(("wA2", A, 16, {}), ("wB", B, 16, {})))  # A re-registered under a new id
    assert pool.copies_by_url([CopyInFlight("wA2", "wB", "", 1)]) == [CopyInFlight(A, B, "", 1)]


def test_unlisted_workers_leave_while_the_coordinator_answers_static_ones_stay():
    pool = WorkerPool([A], 16, 5.0)
    pool.sync(listed(("wA", A, 16, {}), ("wB", B, 16, {}), ("wC", C, 16, {})))
    pool.sync(listed(("wC", C, 16, {})))  # A (static) and B went silent
    assert pool.serving(True) == [A, C]
    assert pool.serving(False) == [A, B, C]  # coordinator down: every known worker
    pool.mark_down(C, now=10.0)
    assert pool.candidates(12.0, True) == [A] and pool.candidates(15.0, True) == [A, C]
    pool.mark_down(A, now=10.0)
    assert pool.candidates(12.0, True) == [A, C]  # all in cool-down: all of them
    assert [(w["url"], w["listed"], w["cooldown_s"]) for w in pool.status(12.0)] == \
        [(A, False, 3.0), (B, False, 0.0), (C, True, 3.0)]


def test_queued_work_is_counted_until_unqueued_once():
    pool = WorkerPool([A], 16, 5.0)
    idle = pool.known[A]
    first = pool.queue(A, 10, 6)  # 10 new after 6 cached: 10*6 + 10*11/2 = 115 pairs, 6*7/2 = 21 cached pairs
    second = pool.queue(A, -3, 4)  # nothing new: 0 tokens, 0 pairs, 10 cached pairs
    pool.outstanding[A] += 2
    assert pool.with_local_load(idle, False) == WorkerState(A, 16, 2, 0, 10, 115.0, 31.0, own_waiting_tokens=10)
    reported = WorkerState(A, 16, num_running=1, num_waiting=0, num_waiting_tokens=4)
    assert pool.with_local_load(reported, True) == WorkerState(A, 16, 1, 1, 10, 115.0, 31.0, own_waiting_tokens=10)
    busy = WorkerState(A, 16, num_running=1, num_waiting=5, num_waiting_tokens=400)
    assert pool.with_local_load(busy, True) == WorkerState(A, 16, 1, 5, 400, 115.0, 31.0, own_waiting_tokens=10)
    first()
    first()  # idempotent
    assert pool.with_local_load(idle, False) == WorkerState(A, 16, 2, 0, 0, 0.0, 0.0)  # 0 tokens: pairs reset
    second()
    assert pool.with_local_load(idle, False) == WorkerState(A, 16, 2, 0, 0, 0.0, 0.0)


def test_a_queued_requests_pages_are_counted_at_its_worker_until_unqueued_once():
    pool = WorkerPool([A, B], 16, 5.0)
    first = pool.queue(A, 32, 0, [1, 2])
    second = pool.queue(A, 48, 0, [1, 2, 3])
    other = pool.queue(B, 16, 0, [9])
    assert pool.sent_pages[A] == {1: 2, 2: 2, 3: 1} and pool.sent_pages[B] == {9: 1}
    second()
    second()  # idempotent
    assert pool.sent_pages[A] == {1: 1, 2: 1}
    first()
    other()
    assert pool.sent_pages[A] == {} and pool.sent_pages[B] == {}
