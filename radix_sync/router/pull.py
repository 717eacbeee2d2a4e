"""The router's copies on the critical path (`kvrep router --pull`): carry out a `Decision.pull`, or fall back.

`rank_by_ttft` decides (the simulator's `kvrep_pull` rule, `radix_sync.policy.pull`); `PullRunner.run` asks the
coordinator for the copy (`POST /replicate`, `critical: true`), holds the request until the copy is done or the
plan's deadline passes (`POST /replications/wait`), and returns the decision to forward:
- done: the pull's target first, then the rest of the ranking;
- refused (409: shadow mode, the source no longer holds the prefix, no replica budget; or any other refusal),
  unreachable, failed or past the deadline: the ranking without a copy, as it was (the best of the holder and the
  cold options). The request is never lost: only where it is sent changes.
While it waits the request counts as queued at the target (the next decisions see it), and the copy counts as in
flight (`in_flight`: a request for the same prefix waits for it instead of pulling again). Each pull's outcome goes
to the metrics and into the decision log. Owned by `radix_sync.router.service.Router`; runs on its event loop.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

from radix_sync import api
from radix_sync.policy.pull import PullConfig
from radix_sync.router.coordinator_link import CoordinatorLink
from radix_sync.router.metrics import RouterMetrics
from radix_sync.router.policy import CopyInFlight, Decision
from radix_sync.router.pool import WorkerPool

log = logging.getLogger("kvrep.router.pull")

DONE, REFUSED, UNREACHABLE, FAILED, DEADLINE, UNKNOWN_WORKER = (
    "done", "refused", "unreachable", "failed", "deadline", "unknown_worker")
FALLBACK_REASONS = (REFUSED, UNREACHABLE, FAILED, DEADLINE, UNKNOWN_WORKER)


class PullRunner:
    """Starts and awaits the pulls of one router.

    Args:
        cfg: deadline bounds and the pulled replica's TTL.
        pool: the workers (coordinator ids; the queued work of a waiting request).
        metrics: the router's metrics.
    """

    def __init__(self, cfg: PullConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.link: Optional[CoordinatorLink] = None
        """Set by the router once it has one (no link: no pull is ever decided)."""
        self.in_flight: dict[str, CopyInFlight] = {}
        """Replication id (`asked-<n>` until the coordinator answered) -> this router's pulls not finished yet
        (coordinator ids, as `ClusterState.copies`)."""
        self._num_asked = 0

    def targets(self) -> set[str]:
        """Returns: coordinator ids of the workers a pull of this router is headed for."""
        return {c.target for c in self.in_flight.values()}

    async def run(self, decision: Decision, ids: list[int], namespace: str) -> tuple[Decision, dict]:
        """Carries out `decision.pull`.

        Args:
            decision: a decision with a pull (its `ranked` is the fallback).
            ids: the prompt's token ids (the first `pull_len` are copied).
            namespace: the tenant's namespace.
        Returns:
            the decision to forward and the pull's record for the decision log.
        """
        plan = decision.pull
        t0 = time.monotonic()
        record = {"source": plan.source, "target": plan.target, "pull_len": plan.pull_len,
                  "expected_copy_s": round(plan.copy_eta_s - t0, 4),
                  "expected_ttft_s": round(plan.expected_ttft_s, 4),
                  "fallback_ttft_s": round(plan.fallback_ttft_s, 4), "deadline_s": round(plan.deadline_s - t0, 4)}
        self.metrics.pulls_started.inc()
        pool, target = self.pool, plan.target
        held = pool.dispatch(target, len(ids) - plan.pull_len, plan.pull_len)  # (headed there while it waits)
        try:
            outcome, detail, replication_id = await self._copy(plan, ids, namespace)
        finally:
            held.done()
        wait_s = time.monotonic() - t0
        self.metrics.pull_wait_seconds.observe(wait_s)
        record.update(outcome=outcome, wait_s=round(wait_s, 4), replication_id=replication_id)
        if detail:
            record["detail"] = detail[:300]
        if outcome != DONE:
            self.metrics.pulls_fallen_back.labels(outcome).inc()
            log.info("pull %s -> %s (%d tokens) fell back: %s %s", plan.source, target, plan.pull_len, outcome,
                     detail)
            return replace(decision, pull=None, idle=frozenset()), record  # (time passed: idle no longer known)
        self.metrics.pulls_done.inc()
        ttft = dict(zip(decision.ranked, decision.expected_ttft_s))
        held = dict(zip(decision.ranked, decision.cached_by_worker))
        ttft[target], held[target] = plan.expected_ttft_s, plan.pull_len
        ranked = (target, *(u for u in decision.ranked if u != target))
        return replace(decision, ranked=ranked, expected_ttft_s=tuple(ttft[u] for u in ranked),
                       cached_tokens=plan.pull_len, wait_inflight=False, idle=frozenset(),
                       cached_by_worker=tuple(held.get(u, 0) for u in ranked) if held else ()), record

    async def _copy(self, plan, ids: list[int], namespace: str) -> tuple[str, str, Optional[str]]:
        """Returns: (outcome, detail, replication id or None)."""
        link = self.link
        source = self.pool.coordinator_ids.get(plan.source)
        target = self.pool.coordinator_ids.get(plan.target)
        if link is None or source is None or target is None:
            return UNKNOWN_WORKER, f"no coordinator id for {plan.source if source is None else plan.target}", None
        req = api.ReplicateRequest(source=source, target=target, input_ids=list(ids[:plan.pull_len]),
                                   cache_salt=namespace or None, ttl_s=self.cfg.ttl_s, critical=True)
        # NOTE: in flight from the decision on, not from the coordinator's answer: the branches of a fan-out arrive
        # together, and each one decided while this call was out pulled the same prefix to the same target again
        # (live fan-out: 2-3 copies of one trunk within 60 ms)
        self._num_asked += 1
        provisional = f"asked-{self._num_asked}"
        self.in_flight[provisional] = CopyInFlight(source, target, namespace, plan.pull_len)
        try:
            info, why = await link.replicate(req)
        finally:
            self.in_flight.pop(provisional, None)
        if info is None:
            return (REFUSED if why.startswith("refused") else UNREACHABLE), why, None
        rid = info.id
        self.in_flight[rid] = CopyInFlight(source, target, info.namespace, info.num_tokens, rid)
        try:
            while info.state in ("pending", "running"):
                left = plan.deadline_s - time.monotonic()
                if left <= 0:
                    return DEADLINE, f"{info.state} at the deadline", rid
                answer, why = await link.wait_replication(rid, left)
                if answer is None:
                    return UNREACHABLE, why, rid
                info = answer
        finally:
            self.in_flight.pop(rid, None)
        if info.state == "done":
            return DONE, "", rid
        return FAILED, info.error or info.state, rid
