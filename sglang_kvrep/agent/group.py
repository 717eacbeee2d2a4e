"""Tensor-parallel groups as one replication source and one target (issue 19 item 1): the rank logic, pure.

Not wired yet: the plugin still refuses `--tp-size/--pp-size/--dp-size > 1` (`sglang_kvrep.plugin`), because no
supported configuration of SGLang 0.5.23 runs a TP group on the CPU engine (docs/architecture.md, "Tensor-parallel
workers") and nothing of it could be run here. This module is what the wiring will call, tested on its own
(`tests/unit/test_tp_group.py`).

How SGLang runs a TP group: one scheduler process per rank, each with its own KV pool holding its shard of the KV
heads (`head_num / tp_size` per rank) and its own radix tree. Rank 0 pulls the requests and broadcasts them to the
other ranks (`scheduler_components/request_receiver.py`, `recv_requests` -> `_broadcast_reqs_across_ranks`; "local
requests ride the same broadcast"), so every rank schedules the same batches from the same tree and pool state: a
rank whose free-token count or tree differed would schedule another batch and the group's collectives would hang.
Hence the rules below.

    source group, tp = 2                          target group, tp = 2
    rank 0 ── shard 0 (its KV heads) ──────────▶ rank 0: staged ─┐
    rank 1 ── shard 1 ─────────────────────────▶ rank 1: staged ─┤ Staged(replication, rank) to rank 0
                                                                  ▼
            rank 0 (`GroupCommit`): every rank staged -> Commit; a rank failed, or the deadline -> Abort
            the decision rides rank 0's next request broadcast: every rank applies it in the same iteration
            (`RankInstaller.apply`): allocate, scatter and insert on Commit, or free the staging on Abort

1. Rank i sends its shard to rank i of the target group (`shard_routes`): both groups have the same layout, which
   the fingerprint says (`GroupLayout.fingerprint_fields`), and copies only go between equal fingerprints.
2. A shard waits outside the KV pool (staging memory) until the decision: allocating pool slots when a shard
   arrives would make the ranks' free-token counts differ in between.
3. The decision is taken once, by rank 0, and applied by every rank at the same point of the same iteration, so
   the ranks' pools and trees stay equal: they all allocate from equal pools, so they all succeed or all fail
   (then they all free what they staged: no replica on any rank, no slot leaked).
4. A rank never frees a staged shard on its own; rank 0's deadline aborts a replication a rank never reports. A
   shard that arrives after its replication was aborted is freed at once (`RankInstaller.stage`).

The coordinator sees the group as one worker: rank 0's agent says hello with every rank's data endpoint and speaks
for the group; the other ranks' agents only move data and report to rank 0.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Optional, TypeVar

import msgspec

S = TypeVar("S")


class GroupMismatch(ValueError):
    """Two groups whose layouts do not allow a rank-to-rank copy."""


class GroupLayout(msgspec.Struct, frozen=True):
    """A worker's parallel layout: what its ranks hold and where each one takes copies."""

    tp_size: int
    """Tensor-parallel ranks (each holds `num_kv_heads / tp_size` heads of every layer's KV)."""
    data_endpoints: tuple[str, ...]
    """Per rank, rank 0 first, the data-plane endpoint its agent receives copies on."""
    pp_size: int = 1
    attn_dp_size: int = 1
    """Data-parallel attention groups (SGLang's `--enable-dp-attention`): each is its own tree; not supported yet."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1 or self.attn_dp_size < 1:
            raise GroupMismatch(f"sizes must be >= 1: tp {self.tp_size}, pp {self.pp_size}, dp {self.attn_dp_size}")
        if len(self.data_endpoints) != self.tp_size:
            raise GroupMismatch(f"{len(self.data_endpoints)} data endpoints for {self.tp_size} ranks")

    def fingerprint_fields(self) -> dict[str, str]:
        """The layout's part of the worker's fingerprint (a copy goes only between equal fingerprints)."""
        return {"tp_size": str(self.tp_size), "pp_size": str(self.pp_size), "attn_dp_size": str(self.attn_dp_size)}


def shard_routes(source: GroupLayout, target: GroupLayout) -> list[tuple[int, str]]:
    """Returns: per rank of the source, (rank, the target rank's endpoint) its shard goes to: rank i to rank i.

    Raises:
        GroupMismatch: layouts that differ, or one this code cannot copy (pipeline stages, DP attention).
    """
    if source.fingerprint_fields() != target.fingerprint_fields():
        raise GroupMismatch(f"layouts differ: {source.fingerprint_fields()} vs {target.fingerprint_fields()}")
    if source.pp_size != 1 or source.attn_dp_size != 1:
        raise GroupMismatch("pipeline stages and DP attention are not supported")
    return list(enumerate(target.data_endpoints))


class GroupDecision(msgspec.Struct, frozen=True):
    """Rank 0's decision on one replication, applied by every rank in the same iteration."""

    replication_id: str
    commit: bool
    reason: str = ""


class GroupCommit:
    """Rank 0 of a target group: collects its ranks' staging reports and decides each replication once."""

    def __init__(self, tp_size: int, timeout_s: float, max_pending: int = 1024) -> None:
        if tp_size < 1 or not timeout_s > 0 or max_pending < 1:
            raise ValueError("tp_size and max_pending must be >= 1 and timeout_s > 0")
        self.tp_size, self.timeout_s, self.max_pending = tp_size, timeout_s, max_pending
        self._pending: dict[str, tuple[float, set[int], Optional[str]]] = {}
        """Replication id -> (its deadline, the ranks staged, the first failure reported)."""
        self._decided: OrderedDict[str, bool] = OrderedDict()
        """The last decisions (bounded): a report that comes after one changes nothing."""

    def _entry(self, replication_id: str, now: float) -> Optional[tuple[float, set[int], Optional[str]]]:
        if replication_id in self._decided:
            return None
        entry = self._pending.get(replication_id)
        if entry is None:
            if len(self._pending) >= self.max_pending:
                return None  # (bounded: a flood of ids is not kept; its ranks' shards go at their deadline)
            entry = self._pending[replication_id] = (now + self.timeout_s, set(), None)
        return entry

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} not in a group of {self.tp_size}")

    def begin(self, replication_id: str, now: float) -> None:
        """The group accepted the replication (its deadline starts now)."""
        self._entry(replication_id, now)

    def staged(self, replication_id: str, rank: int, now: float) -> None:
        """Rank `rank` holds its shard, verified, in staging memory."""
        self._check_rank(rank)
        entry = self._entry(replication_id, now)
        if entry is not None:
            entry[1].add(rank)

    def failed(self, replication_id: str, rank: int, reason: str, now: float) -> None:
        """Rank `rank` could not stage its shard (a corrupted payload, a dead source, no staging memory)."""
        self._check_rank(rank)
        entry = self._entry(replication_id, now)
        if entry is not None and entry[2] is None:
            self._pending[replication_id] = (entry[0], entry[1], f"rank {rank}: {reason}"[:200])

    def due(self, now: float) -> list[GroupDecision]:
        """The decisions to broadcast now, each replication's once: Commit when every rank staged, Abort when one
        failed or the deadline passed."""
        out = []
        for rid, (deadline, ranks, failure) in list(self._pending.items()):
            if failure is not None:
                out.append(GroupDecision(rid, False, failure))
            elif len(ranks) == self.tp_size:
                out.append(GroupDecision(rid, True))
            elif now >= deadline:
                missing = sorted(set(range(self.tp_size)) - ranks)
                out.append(GroupDecision(rid, False, f"ranks {missing} did not stage within {self.timeout_s:g} s"))
            else:
                continue
            del self._pending[rid]
            self._decided[rid] = out[-1].commit
            if len(self._decided) > 4 * self.max_pending:
                self._decided.popitem(last=False)
        return out

    @property
    def num_pending(self) -> int:
        return len(self._pending)


class RankInstaller(Generic[S]):
    """Every rank of a target group: its staged shards until rank 0's decision.

    `install(replication_id, shard)` allocates pool slots, scatters and inserts (True), or allocates nothing and
    returns False; `free(shard)` releases a shard's staging memory. Both are the plugin's, on the scheduler thread.
    """

    def __init__(self, install: Callable[[str, S], bool], free: Callable[[S], None], memory: int = 4096) -> None:
        self._install, self._free = install, free
        self._staged: dict[str, S] = {}
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._memory = memory

    def stage(self, replication_id: str, shard: S) -> bool:
        """A verified shard arrived. Returns: False when its replication was already aborted (the shard is freed
        at once) or one is staged under its id already (this one is freed)."""
        if replication_id in self._aborted or replication_id in self._staged:
            self._free(shard)
            return False
        self._staged[replication_id] = shard
        return True

    def apply(self, decisions: list[GroupDecision]) -> list[tuple[str, bool, str]]:
        """Applies rank 0's decisions in order. Returns: per decision (replication id, installed?, why not)."""
        out = []
        for d in decisions:
            shard = self._staged.pop(d.replication_id, None)
            if not d.commit:
                self._aborted[d.replication_id] = None
                if len(self._aborted) > self._memory:
                    self._aborted.popitem(last=False)
                if shard is not None:
                    self._free(shard)
                out.append((d.replication_id, False, d.reason))
            elif shard is None:  # (rank 0 commits only what every rank reported staged: a broken invariant)
                out.append((d.replication_id, False, "committed but not staged on this rank"))
            else:
                ok = self._install(d.replication_id, shard)
                if not ok:
                    self._free(shard)
                out.append((d.replication_id, ok, "" if ok else "no room in the pool"))
        return out

    @property
    def num_staged(self) -> int:
        return len(self._staged)
