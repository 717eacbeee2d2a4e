"""Tensor-parallel groups as one replication target (`sglang_kvrep.agent.group`): rank i to rank i, one decision by
rank 0 applied by every rank in the same iteration, so the ranks' pools stay equal and a replica is on all of them
or on none, with no staging or pool slot leaked. A group of ranks in lockstep, without SGLang (it cannot run a TP
group on the CPU engine)."""
import pytest

from sglang_kvrep.agent.group import (GroupCommit, GroupDecision, GroupLayout, GroupMismatch, RankInstaller,
                                      shard_routes)


class Rank:
    """One rank: a KV pool of `free` slots, its staging memory and what it installed."""

    def __init__(self, free: int) -> None:
        self.free, self.staging, self.installed = free, 0, {}
        self.installer = RankInstaller(self._install, self._free)

    def _install(self, rid, shard) -> bool:
        if shard > self.free:
            return False
        self.free -= shard
        self.installed[rid] = shard
        self.staging -= shard
        return True

    def _free(self, shard) -> None:
        self.staging -= shard

    def receive(self, rid, shard) -> bool:
        self.staging += shard
        return self.installer.stage(rid, shard)


def group(n=4, free=100):
    return GroupCommit(n, timeout_s=5.0), [Rank(free) for _ in range(n)]


def step(commit, ranks, now):
    """One scheduler iteration: rank 0's due decisions ride its broadcast; every rank applies them."""
    decisions = commit.due(now)
    results = [r.installer.apply(decisions) for r in ranks]
    assert all(res == results[0] for res in results), results  # the ranks agree
    assert len({(r.free, tuple(sorted(r.installed.items()))) for r in ranks}) == 1  # their pools are equal
    return results[0]


def test_a_replica_is_committed_on_every_rank_in_the_same_iteration_once_all_staged():
    commit, ranks = group()
    commit.begin("r1", 0.0)
    for i, rank in enumerate(ranks[:3]):
        assert rank.receive("r1", 10)
        commit.staged("r1", i, 0.1)
    assert step(commit, ranks, 0.2) == [] and commit.num_pending == 1  # rank 3 not yet: nothing decided
    ranks[3].receive("r1", 10)
    commit.staged("r1", 3, 0.3)
    commit.staged("r1", 3, 0.3)  # (a report twice changes nothing)
    assert step(commit, ranks, 0.4) == [("r1", True, "")]
    assert all(r.installed == {"r1": 10} and r.free == 90 and r.staging == 0 for r in ranks)
    assert step(commit, ranks, 0.5) == [] and commit.num_pending == 0  # decided once


def test_one_rank_failing_aborts_on_all_and_leaks_nothing():
    commit, ranks = group()
    for i in (0, 1, 2):
        ranks[i].receive("r", 10)
        commit.staged("r", i, 0.0)
    commit.failed("r", 3, "checksum mismatch", 0.1)
    assert step(commit, ranks, 0.2) == [("r", False, "rank 3: checksum mismatch")]
    assert all(r.installed == {} and r.free == 100 and r.staging == 0 for r in ranks)
    # rank 3's shard comes after all (a retry): freed at once, never installed
    assert not ranks[3].receive("r", 10) and ranks[3].staging == 0
    commit.staged("r", 3, 0.3)
    assert step(commit, ranks, 0.4) == [] and commit.num_pending == 0


def test_a_rank_that_never_reports_is_aborted_at_the_deadline():
    commit, ranks = group(n=2)
    commit.begin("r", 0.0)
    ranks[0].receive("r", 10)
    commit.staged("r", 0, 0.1)
    assert step(commit, ranks, 4.9) == []
    assert step(commit, ranks, 5.0) == [("r", False, "ranks [1] did not stage within 5 s")]
    assert all(r.staging == 0 and r.installed == {} for r in ranks)


def test_no_room_on_commit_fails_on_every_rank_alike():
    commit, ranks = group(n=2, free=15)
    for rid in ("a", "b"):
        for i, rank in enumerate(ranks):
            rank.receive(rid, 10)
            commit.staged(rid, i, 0.0)
    assert step(commit, ranks, 0.1) == [("a", True, ""), ("b", False, "no room in the pool")]
    assert all(r.installed == {"a": 10} and r.free == 5 and r.staging == 0 for r in ranks)


def test_bad_reports_and_bounds():
    commit = GroupCommit(2, timeout_s=1.0, max_pending=2)
    with pytest.raises(ValueError, match="rank 2 not in a group of 2"):
        commit.staged("x", 2, 0.0)
    for rid in ("a", "b", "c"):  # the third is not kept
        commit.begin(rid, 0.0)
    assert commit.num_pending == 2
    assert [d.replication_id for d in commit.due(1.0)] == ["a", "b"]
    rank = Rank(10)
    assert rank.receive("s", 1) and not rank.receive("s", 2)  # a second shard under one id is freed
    assert rank.staging == 1
    assert rank.installer.apply([GroupDecision("zz", True)]) == [("zz", False, "committed but not staged on this rank")]
    with pytest.raises(ValueError):
        GroupCommit(0, 1.0)


def test_rank_i_copies_to_rank_i_of_an_equal_layout_and_the_fingerprint_says_the_layout():
    src = GroupLayout(2, ("tcp://s0:1", "tcp://s1:1"))
    dst = GroupLayout(2, ("tcp://t0:1", "tcp://t1:1"))
    assert shard_routes(src, dst) == [(0, "tcp://t0:1"), (1, "tcp://t1:1")]
    assert src.fingerprint_fields() == {"tp_size": "2", "pp_size": "1", "attn_dp_size": "1"}
    with pytest.raises(GroupMismatch, match="layouts differ"):
        shard_routes(src, GroupLayout(4, ("a", "b", "c", "d")))
    with pytest.raises(GroupMismatch, match="not supported"):
        shard_routes(GroupLayout(2, ("a", "b"), pp_size=2), GroupLayout(2, ("c", "d"), pp_size=2))
    with pytest.raises(GroupMismatch, match="3 data endpoints for 2 ranks"):
        GroupLayout(2, ("a", "b", "c"))
