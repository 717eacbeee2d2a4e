import pytest

from radix_sync.policy.rules import (HitRecord, ReplicateDecision, RuleBasedPolicy, RuleConfig, RuleSnapshot,
                                   WorkerView)

CFG = RuleConfig(min_prefix_len=100, min_hits=3, window_s=10.0, max_queue=1, ttl_s=30.0)


def worker(wid, waiting=0, running=0, fp="f", free=10_000):
    return WorkerView(wid, fp, waiting, running, free)


def hits(n, t=0.0, wid="a", h=7, length=200, ns=""):
    return tuple(HitRecord(t + i * 0.1, wid, ns, h, length) for i in range(n))


def decide(snapshot, now=1.0, cfg=CFG):
    return RuleBasedPolicy(cfg).decide(snapshot, now)


def snap(hit_records, workers, held=None, in_flight=()):
    return RuleSnapshot(hit_records, tuple(workers), held or {}, frozenset(in_flight))


def test_replicates_hot_prefix_of_busy_holder_to_least_loaded():
    s = snap(hits(3), [worker("a", waiting=2), worker("b", running=3), worker("c", running=1)])
    assert decide(s) == [ReplicateDecision("a", "c", "", 7, 200, 30.0)]


@pytest.mark.parametrize("case", ["too_few_hits", "too_short", "holder_not_busy", "outside_window"])
def test_each_threshold_blocks(case):
    hit_records = {"too_few_hits": hits(2), "too_short": hits(3, length=99), "holder_not_busy": hits(3),
                   "outside_window": hits(3, t=-20.0)}[case]
    waiting = 1 if case == "holder_not_busy" else 2
    s = snap(hit_records, [worker("a", waiting=waiting), worker("b")])
    assert decide(s) == []


def test_skips_incompatible_full_and_existing_holders():
    workers = [worker("a", waiting=5), worker("b", fp="other"), worker("c", free=50), worker("d"), worker("e")]
    s = snap(hits(4), workers, held={(7, "d"): 200})
    assert [d.target for d in decide(s)] == ["e"]
    s = snap(hits(4), workers, held={(7, "d"): 200}, in_flight=[(7, "e")])
    assert decide(s) == []


def test_hottest_first_and_one_target_per_prefix():
    hr = hits(3, h=1) + hits(5, h=2)
    s = snap(hr, [worker("a", waiting=3), worker("b"), worker("c", running=1)])
    assert [(d.block_hash, d.target) for d in decide(s)] == [(2, "b"), (1, "b")]


def test_config_validation():
    with pytest.raises(ValueError, match="min_hits"):
        RuleConfig(min_hits=0)
    with pytest.raises(ValueError, match="window_s"):
        RuleConfig(window_s=0)
