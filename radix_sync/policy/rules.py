"""The rule-based baseline replication policy (pure: a snapshot and `now` in, decisions out).

Replicate a prefix of at least `min_prefix_len` tokens that was hit at least `min_hits` times in the last
`window_s` seconds on a worker whose queue holds more than `max_queue` waiting requests, to the least-loaded
compatible worker that does not hold it yet. It is the baseline the predictive planner must beat, and stays
available as `--policy rules` (`radix_sync.coordinator.policies.RulesPolicy` feeds it the coordinator's
`RuleSnapshot`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import msgspec


@dataclass(frozen=True)
class RuleConfig:
    min_prefix_len: int = 512
    """L: tokens; shorter hot prefixes are cheaper to recompute than to copy."""
    min_hits: int = 3
    """H: hits of the prefix within the window."""
    window_s: float = 30.0
    """W: seconds of hit history considered."""
    max_queue: int = 0
    """Q: the holder must have more than this many waiting requests."""
    ttl_s: float = 60.0
    """Seconds an unhit replica lives."""

    def __post_init__(self) -> None:
        if self.min_prefix_len < 1:
            raise ValueError(f"min_prefix_len must be >= 1, got {self.min_prefix_len}")
        if self.min_hits < 1:
            raise ValueError(f"min_hits must be >= 1, got {self.min_hits}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")


class HitRecord(msgspec.Struct, frozen=True, gc=False):
    """A worker's prefix hit. NOTE: a struct the cycle collector does not track (every field a scalar): the
    coordinator keeps the hit window's records, tens of thousands at scale."""

    time_s: float
    worker_id: str
    namespace: str
    block_hash: int
    matched_len: int


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    fingerprint: str
    num_waiting_reqs: int
    num_running_reqs: int
    free_replica_tokens: int


@dataclass(frozen=True)
class RuleSnapshot:
    hits: tuple[HitRecord, ...]
    workers: tuple[WorkerView, ...]
    held_len: dict[tuple[int, str], int]
    """(block_hash, worker_id) -> tokens of that prefix the worker holds (directory match)."""
    in_flight: frozenset[tuple[int, str]]
    """(block_hash, target) pairs with a replication pending or running."""


@dataclass(frozen=True)
class ReplicateDecision:
    source: str
    target: str
    namespace: str
    block_hash: int
    prefix_len: int
    ttl_s: float


class RuleBasedPolicy:
    name = "rules"

    def __init__(self, config: RuleConfig) -> None:
        self.config = config

    def decide(self, snapshot: RuleSnapshot, now_s: float) -> list[ReplicateDecision]:
        """Returns:
            at most one decision per hot prefix, hottest first (ties by block hash for determinism)."""
        cfg = self.config
        workers = {w.worker_id: w for w in snapshot.workers}
        counts: dict[tuple[str, str, int], list[HitRecord]] = {}
        for hit in snapshot.hits:
            if now_s - hit.time_s > cfg.window_s or hit.matched_len < cfg.min_prefix_len:
                continue
            counts.setdefault((hit.worker_id, hit.namespace, hit.block_hash), []).append(hit)
        hot = sorted(((len(h), key, h) for key, h in counts.items() if len(h) >= cfg.min_hits),
                     key=lambda item: (-item[0], item[1][2], item[1][0]))
        decisions: list[ReplicateDecision] = []
        planned: set[tuple[int, str]] = set(snapshot.in_flight)
        for _, (source, namespace, block_hash), hits in hot:
            holder = workers.get(source)
            if holder is None or holder.num_waiting_reqs <= cfg.max_queue:
                continue
            prefix_len = max(h.matched_len for h in hits)
            target = self._pick_target(holder, snapshot, planned, block_hash, prefix_len)
            if target is None:
                continue
            planned.add((block_hash, target.worker_id))
            decisions.append(ReplicateDecision(source, target.worker_id, namespace, block_hash, prefix_len,
                                               cfg.ttl_s))
        return decisions

    @staticmethod
    def _pick_target(holder: WorkerView, snapshot: RuleSnapshot, planned: set[tuple[int, str]],
                     block_hash: int, prefix_len: int) -> Optional[WorkerView]:
        candidates = [
            w for w in snapshot.workers
            if w.worker_id != holder.worker_id and w.fingerprint == holder.fingerprint
            and (block_hash, w.worker_id) not in planned
            and snapshot.held_len.get((block_hash, w.worker_id), 0) < prefix_len
            and w.free_replica_tokens >= prefix_len
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.num_waiting_reqs + w.num_running_reqs, w.worker_id))
