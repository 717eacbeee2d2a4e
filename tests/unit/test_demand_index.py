"""`DemandLog`'s index by prefix (what a plan tick reads instead of a pass over every record): kept with the logs
as records come and are trimmed, and `popular` is exactly the prefixes with two hits or two arrivals."""
import random

import pytest

from radix_sync.coordinator.demand import ArrivalRecord, DemandLog
from radix_sync.integrity import IntegrityError
from radix_sync.policy.rules import HitRecord


def test_the_index_follows_the_logs_through_adds_and_trims():
    rng = random.Random(7)
    log = DemandLog(max_events=1000)
    for step in range(2000):
        now = step * 0.01
        block = rng.choice([None, 1, 2, 3, 4, 5, 6, 7, 8])
        if rng.random() < 0.5:
            log.add_hit(HitRecord(now, "w0", "ns", block, 16))
        else:
            log.add_arrival(ArrivalRecord(now, "ns", block, 32, "w1"), [], 0, (0, []))
        if step % 37 == 0:
            log.trim(now, window_s=rng.choice([0.05, 0.2, 1.0]))
            log.check_integrity()
        expected = {}
        for which, records in enumerate((log.hits, log.arrivals)):
            for rec in records:
                if rec.block_hash is not None:
                    expected.setdefault(rec.block_hash, [[], []])[which].append(rec.time_s)
        assert {b: [[t for _, t, _ in e] for e in entries] for b, entries in log.by_prefix.items()} == expected
        assert set(log.popular) == {b for b, (h, a) in expected.items() if len(h) >= 2 or len(a) >= 2}
    log.trim(100.0, window_s=1.0)
    assert not log.by_prefix and not log.popular and not log.hits and not log.arrivals
    log.check_integrity()


def test_an_index_out_of_step_with_its_logs_is_an_integrity_error():
    log = DemandLog(max_events=10)
    for t in (1.0, 2.0):
        log.add_hit(HitRecord(t, "w0", "", 5, 16))
    assert list(log.popular) == [5]
    log.hits.popleft()  # a record dropped behind the index's back
    with pytest.raises(IntegrityError, match="by prefix disagree"):
        log.check_integrity()
    log.clear()
    assert not log.by_prefix and not log.popular
    log.check_integrity()
