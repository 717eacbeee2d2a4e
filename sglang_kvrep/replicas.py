"""The target side of replication, on the scheduler thread: write a verified transfer into the pool and the radix
tree as a replica, expire replicas whose TTL passed, and account the replica budget.

Replicas are inserted at priority `REPLICA_PRIORITY_BASE + expiry time in ms` under SGLang's `priority` eviction
policy (smallest evicted first): every replica sorts below every ordinary cache entry (priorities >= 0), and among
replicas the one that expires first is evicted first, so `evict(n)` for an expired replica removes exactly it.
A real request that caches through a replica raises its path to the request's priority: it becomes ordinary
cache ("promotion") and no longer expires.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional


from kvrep_kernels import scatter_pages, slots_to_page_ids
from sglang_kvrep.compat import SchedulerView
from sglang_kvrep.dataplane.checks import DTYPES
from sglang_kvrep.dataplane.staging import Incoming

log = logging.getLogger("kvrep.replicas")

REPLICA_PRIORITY_BASE = -(1 << 60)


@dataclass
class Replica:
    replication_id: str
    namespace: str
    token_ids: list[int]
    inserted_len: int
    """Tokens this replica actually wrote (the rest was already cached here)."""
    expires_at_s: float
    priority: int
    promoted: bool = False


@dataclass(frozen=True)
class InstallResult:
    inserted_len: int
    scatter_s: float
    insert_s: float


class ReplicaTable:
    def __init__(self, view: SchedulerView, budget_tokens: int, clock=time.monotonic) -> None:
        self.view = view
        self.budget_tokens = budget_tokens
        self.clock = clock
        self._t0 = clock()
        self.replicas: dict[str, Replica] = {}

    def live_tokens(self) -> int:
        return sum(r.inserted_len for r in self.replicas.values() if not r.promoted)

    def free_tokens(self) -> int:
        return max(0, self.budget_tokens - self.live_tokens())

    def install(self, inc: Incoming) -> InstallResult:
        """Allocate, scatter, insert. On any failure nothing stays allocated and the tree is unchanged.

        Raises:
            RuntimeError / ValueError with the reason (budget, out of memory, bad buffer).
        """
        h = inc.header
        view = self.view
        n = len(h.token_ids)
        if n > self.free_tokens():
            raise RuntimeError(f"replica budget exceeded: {n} tokens > {self.free_tokens()} free")
        present, _ = view.match(h.token_ids, h.namespace)
        if present >= n:
            return InstallResult(0, 0.0, 0.0)
        expires_at = self.clock() + h.ttl_s
        priority = REPLICA_PRIORITY_BASE + int((expires_at - self._t0) * 1000)
        t0 = time.perf_counter()
        slots = view.alloc_slots(n)
        try:
            k_bufs, v_bufs, layout = view.kv_buffers()
            buffer = inc.buffer.view(DTYPES[h.dtype]).view(h.buffer_shape)
            scatter_pages(buffer, k_bufs, v_bufs, slots_to_page_ids(slots, h.page_size), h.page_size,
                          layout=layout)
            t1 = time.perf_counter()
            already = view.insert(h.token_ids, h.namespace, slots, priority)
        except BaseException:
            view.free_slots(slots)
            raise
        t2 = time.perf_counter()
        inserted = n - already
        if inserted > 0:
            self.replicas[h.replication_id] = Replica(h.replication_id, h.namespace, list(h.token_ids), inserted,
                                                      expires_at, priority)
        return InstallResult(inserted, t1 - t0, t2 - t1)

    def promote(self, replication_id: str) -> bool:
        r = self.replicas.get(replication_id)
        if r is None or r.promoted:
            return False
        r.promoted = True
        return True

    def expire_due(self) -> list[tuple[str, int]]:
        """Evict unpromoted replicas whose TTL passed. Returns (replication id, tokens evicted)."""
        now = self.clock()
        out = []
        for rid, r in list(self.replicas.items()):
            if r.promoted:
                del self.replicas[rid]  # ordinary cache now: SGLang's own LRU owns it
                continue
            if r.expires_at_s > now:
                continue
            if self.view.waiting_wants(r.token_ids, r.namespace):
                # a request queued behind a busy scheduler was routed here for this copy: it has not taken its
                # lock yet, and expiring now would make it recompute the whole prefix (seen live: fan-out
                # branches queued 6-7 s behind others, their replicas expired, every one recomputed its trunk)
                continue
            out.append((rid, self._evict(r)))
            del self.replicas[rid]
        return out

    def drop(self, replication_id: str) -> Optional[int]:
        r = self.replicas.pop(replication_id, None)
        if r is None or r.promoted:
            return None
        return self._evict(r)

    def _evict(self, r: Replica) -> int:
        before, _ = self.view.match(r.token_ids, r.namespace)
        if before <= len(r.token_ids) - r.inserted_len:
            return 0  # SGLang already evicted it under memory pressure
        evicted = self.view.evict(r.inserted_len)
        after, _ = self.view.match(r.token_ids, r.namespace)
        if after > len(r.token_ids) - r.inserted_len:
            log.warning("replica %s: %d tokens still cached after evicting %d", r.replication_id, after, evicted)
        return evicted
