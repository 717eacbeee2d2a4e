"""The target side of replication, on the scheduler thread: write a verified transfer into the pool and the radix
tree as a replica, expire replicas whose TTL passed, and account the replica budget.

Replicas are inserted at priority `REPLICA_PRIORITY_BASE + expiry time in ms` under SGLang's `priority` eviction
policy (smallest evicted first): every replica sorts below every ordinary cache entry (priorities >= 0), and among
replicas the one that expires first is evicted first, so `evict(n)` for an expired replica removes exactly it.
A real request that caches through a replica raises its path to the request's priority: it becomes ordinary
cache ("promotion") and no longer expires.

A critical copy (a router's pull: its request waits for it, `ExpectReplica.critical`) is inserted at
`PULLED_PRIORITY`, what SGLang gives a prompt it has just computed: ordinary cache, in LRU order from its insertion, as
the simulator models pulled pages. At a replica's priority, on a full pool (every serving worker's steady state) it
was the next allocation's first victim: pulled fan-out trunks were evicted before the branches they were pulled for
were admitted, which recomputed them (docs/bench.md, "Fan-out after two fixes"). It keeps its TTL: unused, it expires
as a replica does. A planner's copy goes in the same way when the coordinator's policy says so
(`ExpectReplica.ordinary`, policy `kvrep_lru`): evict-first, half of the agent sessions' copies were evicted within
seconds of landing, before the turn they were made for (docs/bench.md, "Copies that land as ordinary cache").
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvrep_kernels import scatter_pages, slots_to_page_ids
from sglang_kvrep.device import CopyOps, SyncOps, flat_bytes, host_copy
from sglang_kvrep.compat import SchedulerView
from sglang_kvrep.dataplane.checks import DTYPES
from sglang_kvrep.dataplane.staging import Incoming

log = logging.getLogger("kvrep.replicas")

REPLICA_PRIORITY_BASE = -(1 << 60)
PULLED_PRIORITY = 0
"""A request's default priority: SGLang 0.5.23 caches a prompt it computed at it (`cache_unfinished_req`, and
`cache_finished_req` for the whole sequence), and raises the prompt to it + 1 only when the answer's own pages follow
it ("Split the leaf at the prompt boundary": a page-aligned prompt with a 1-8 token answer stays at 0). Under
`priority` eviction a priority only ever goes up (an insert keeps the max along its path), so a copy at 1 outranked
every prompt left at 0 for good: on a fan-out run's full pools the copies of earlier rounds piled up at 1 and the
newest prompts were the first victims (traced: a pull's allocation evicted all 1,808 tokens of a trunk prefilled 0.1 s
before, and its six branches recomputed it; docs/bench.md, "Copies that outranked fresh prompts"). At 0 a copy ranks
as the prompt it stands for, just computed: by recency among the entries SGLang leaves at 0, below those it raised."""
UPLOAD_SLICE_BYTES = 16 << 20
UPLOAD_SLICE_S = 0.005
"""A GPU target uploads a transfer from (pageable) host memory in slices, at most this much scheduler time per
iteration: such an upload holds the calling thread until it is done, and one 4 GiB upload held SGLang's scheduler
thread 0.58-0.63 s on an H200 (scripts/gpu_agent_path.py): every running request stalled that long."""


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


@dataclass
class PendingInstall:
    """A transfer being written into the pool on the copy stream: its slots are allocated (counted against the
    replica budget) and not in the tree until the copy's event is done."""

    inc: Incoming
    slots: torch.Tensor
    expires_at_s: float
    priority: int
    started_s: float
    slots_host: torch.Tensor
    event: Any
    """Phase 1: the slots' copy to the host and the payload's upload; phase 2 (`scattered`): the scatter."""
    device_buffer: torch.Tensor
    scattered: bool = False
    scatter_s: float = 0.0
    uploaded: int = -1
    """Bytes of the payload uploaded so far (-1: nothing to upload, the pool is host memory)."""


class ReplicaTable:
    def __init__(self, view: SchedulerView, budget_tokens: int, clock=time.monotonic,
                 ops: Optional[CopyOps] = None) -> None:
        self.view = view
        self.budget_tokens = budget_tokens
        self.clock = clock
        self.ops: CopyOps = ops if ops is not None else SyncOps()
        self._t0 = clock()
        self.replicas: dict[str, Replica] = {}
        self.pending: dict[str, PendingInstall] = {}
        """Installs on the copy stream, by transfer id (their tokens count against the budget)."""
        self.extended: list[str] = []
        """Replicas found extended by a later request at their expiry (ordinary cache now), not yet told to the
        coordinator (`take_extended`)."""

    def live_tokens(self, below_priority: Optional[int] = None) -> int:
        """Tokens of the live (unpromoted) replicas and of those still arriving, all of them (the budget's count),
        or those inserted below `below_priority` (`evict_first_tokens`)."""
        def counted(priority: int) -> bool:
            return below_priority is None or priority < below_priority

        return (sum(r.inserted_len for r in self.replicas.values() if not r.promoted and counted(r.priority))
                + sum(len(x.inc.header.token_ids) for x in self.pending.values() if counted(x.priority)))

    def evict_first_tokens(self) -> int:
        """Tokens of the live replicas below every ordinary cache entry (what SGLang evicts first here; a copy
        landed as ordinary cache is not among them), and of those still arriving that will be."""
        return self.live_tokens(below_priority=PULLED_PRIORITY)

    def free_tokens(self) -> int:
        return max(0, self.budget_tokens - self.live_tokens())

    def install(self, inc: Incoming, ordinary: bool = False) -> Optional[InstallResult]:
        """Allocate, then on the copy stream: fence behind the forward stream (slots just freed may still take a
        late forward write), upload the payload, scatter; insert into the tree once that is done. On any failure
        nothing stays allocated and the tree is unchanged. `ordinary`: a pull or a policy's copy the coordinator
        lands as ordinary cache (`Install.ordinary`), inserted at `PULLED_PRIORITY`.

        Returns:
            the result when the install is over now (always with synchronous copies, a CPU pool); None while it
            runs on the copy stream (`poll` finishes it).
        Raises:
            RuntimeError / ValueError with the reason (budget, out of memory, bad buffer).
        """
        h = inc.header
        view, ops = self.view, self.ops
        n = len(h.token_ids)
        if n > self.free_tokens():
            raise RuntimeError(f"replica budget exceeded: {n} tokens > {self.free_tokens()} free")
        present, _ = view.match(h.token_ids, h.namespace)
        if present >= n:
            return InstallResult(0, 0.0, 0.0)
        expires_at = self.clock() + h.ttl_s
        priority = PULLED_PRIORITY if ordinary else REPLICA_PRIORITY_BASE + int((expires_at - self._t0) * 1000)
        t0 = time.perf_counter()
        slots = view.alloc_slots(n)
        try:
            buffer = inc.buffer.view(DTYPES[h.dtype]).view(h.buffer_shape)
            with ops.stream():
                slots_host = host_copy(ops, slots)  # (a GPU allocator's slots are on the device)
                device_buffer = torch.empty_like(buffer, device=ops.device) if ops.is_async else buffer
                event = ops.record()
            job = PendingInstall(inc, slots, expires_at, priority, t0, slots_host, event, device_buffer,
                                 uploaded=-1 if device_buffer is buffer else 0)
            if job.uploaded == 0:
                self._upload_slices(job)  # the first slices now; the rest at the next iterations
            if not ops.is_async:
                self._step(job)
                return self._step(job)
        except BaseException:
            view.free_slots(slots)
            raise
        self.pending[h.transfer_id] = job
        return None

    def _step(self, job: PendingInstall) -> Optional[InstallResult]:
        """Moves an install on once its event is done: scatter (phase 1 done), insert (phase 2 done). Raises as
        `install` (the caller frees the slots)."""
        h, ops, view = job.inc.header, self.ops, self.view
        if 0 <= job.uploaded < job.device_buffer.numel() * job.device_buffer.element_size():
            self._upload_slices(job)
            return None
        if not job.event.query():
            return None
        if not job.scattered:
            k_bufs, v_bufs, layout = view.kv_buffers()
            with ops.stream():
                ops.fence()
                scatter_pages(job.device_buffer, k_bufs, v_bufs, slots_to_page_ids(job.slots_host, h.page_size),
                              h.page_size, layout=layout)
                job.event = ops.record()
            job.scattered = True
            return None
        t1 = time.perf_counter()
        job.scatter_s = t1 - job.started_s
        already = view.insert(h.token_ids, h.namespace, job.slots, job.priority)
        inserted = len(h.token_ids) - already
        if inserted > 0:
            self.replicas[h.replication_id] = Replica(h.replication_id, h.namespace, list(h.token_ids), inserted,
                                                      job.expires_at_s, job.priority)
        return InstallResult(inserted, job.scatter_s, time.perf_counter() - t1)

    def _upload_slices(self, job: PendingInstall) -> None:
        """Uploads the next slices of the payload on the copy stream, for at most `UPLOAD_SLICE_S`; records the
        job's event after the last one. A payload in pinned staging is one slice: its copy is asynchronous."""
        src, dst = flat_bytes(job.inc.buffer), flat_bytes(job.device_buffer)
        total, deadline = dst.numel(), time.perf_counter() + UPLOAD_SLICE_S
        step = total if job.inc.pinned else UPLOAD_SLICE_BYTES
        with self.ops.stream():
            while job.uploaded < total:
                end = min(total, job.uploaded + step)
                self.ops.to_device(src[job.uploaded:end], out=dst[job.uploaded:end])
                job.uploaded = end
                if time.perf_counter() > deadline:
                    break
            if job.uploaded == total:
                job.event = self.ops.record()

    def poll(self) -> list[tuple[Incoming, "InstallResult | Exception"]]:
        """Moves the installs on the copy stream on. Returns: those that ended (a failure's slots are freed)."""
        out = []
        for tid, job in list(self.pending.items()):
            try:
                res = self._step(job)
                if res is None and job.scattered:  # a scatter issued just now may be done already
                    res = self._step(job)
            except Exception as exc:
                self.view.free_slots(job.slots)
                del self.pending[tid]
                out.append((job.inc, exc))
                continue
            if res is not None:
                del self.pending[tid]
                out.append((job.inc, res))
        return out

    def wind_down(self) -> None:
        """The agent stopped: installs whose copy is done let go of their slots (never inserted); the others wait
        for their copy (call again)."""
        for tid, job in list(self.pending.items()):
            if job.event.query():
                del self.pending[tid]
                self.view.free_slots(job.slots)

    def abandon_pending(self) -> list[Incoming]:
        """Forgets the installs on the copy stream (the pool was reset: a weight update's flush); their slots went
        with it. Returns: their transfers (to be answered failed)."""
        out = [job.inc for job in self.pending.values()]
        self.pending.clear()
        return out

    def raise_wanted(self) -> list[str]:
        """Raises to `PULLED_PRIORITY` (ordinary cache) each live replica below it that a request waiting in the
        scheduler's queue has as a prefix of its prompt: that request was routed here for it and holds no lock
        until it is admitted, and on a full pool the next allocation (another request's prefill or decode,
        another copy) evicts a replica first (live fan-out: a planner copy of a 1,632-token trunk evicted in the
        second it landed; docs/bench.md). It keeps its TTL. Returns: the replicas raised."""
        live = [r for r in self.replicas.values() if not r.promoted and r.priority < PULLED_PRIORITY]
        if not live:
            return []
        wanted = self.view.waiting_wanting([(r.token_ids, r.namespace) for r in live])
        out = []
        for i in sorted(wanted):
            self._raise(live[i])  # also when it was gone already: never tried again
            out.append(live[i].replication_id)
        return out

    def _raise(self, r: Replica) -> None:
        self.view.raise_priority(r.token_ids, r.namespace, PULLED_PRIORITY)
        r.priority = PULLED_PRIORITY

    def want(self, replication_id: str) -> bool:
        """A request waits for this replica (the coordinator's `WantReplica`: a router holds it until the copy
        lands): being installed, it goes in at `PULLED_PRIORITY`; landed, it is raised to it (as `raise_wanted`
        does for a request already queued here). Returns: whether one was raised (False: unknown, gone, promoted,
        or ordinary cache already)."""
        for job in self.pending.values():
            if job.inc.header.replication_id == replication_id and job.priority < PULLED_PRIORITY:
                job.priority = PULLED_PRIORITY
                return True
        r = self.replicas.get(replication_id)
        if r is None or r.promoted or r.priority >= PULLED_PRIORITY:
            return False
        self._raise(r)
        return True

    def promote(self, replication_id: str) -> bool:
        r = self.replicas.get(replication_id)
        if r is None or r.promoted:
            return False
        r.promoted = True
        return True

    def forget(self, replication_id: str) -> bool:
        """SGLang evicted the replica already (`ReplicaGone`): it leaves the table and the budget. Returns: whether
        it was a live (unpromoted) replica here."""
        r = self.replicas.pop(replication_id, None)
        return r is not None and not r.promoted

    def take_extended(self) -> list[str]:
        """The replicas found extended since the last call: the coordinator is told they are ordinary cache
        (`ReplicaPromoted` with no tokens: its directory's role changes, no use is counted), or its directory would
        keep them as replicas past their expiry, and a resync would send them again as replicas due now."""
        out, self.extended = self.extended, []
        return out

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
            evicted = self._evict(r)
            if evicted is None:  # still held (tried again at the next call) or taken over by a request
                continue
            out.append((rid, evicted))
            del self.replicas[rid]
        return out

    def drop(self, replication_id: str) -> Optional[int]:
        """The coordinator asks for the replica to go now. Returns: tokens freed, or None (unknown, promoted, or it
        cannot go yet: a running request holds it, kept and due at the next expiry pass; a queued request was routed
        here for it, kept as it is; extended, ordinary cache)."""
        r = self.replicas.get(replication_id)
        if r is None or r.promoted:
            return None
        if self.view.waiting_wants(r.token_ids, r.namespace):  # as at expiry: it would recompute the whole prefix
            return None
        evicted = self._evict(r)
        if evicted is not None:
            del self.replicas[replication_id]
        elif not r.promoted:  # held: not forgotten (it was, leaving a replica nobody would ever expire)
            r.expires_at_s = min(r.expires_at_s, self.clock())
        return evicted

    def _evict(self, r: Replica) -> Optional[int]:
        """Evicts the replica's own pages: its chain from its end up to a page another chain shares (SGLang's
        exact `evict_chain`, as demotion does), at most what it inserted. Returns: tokens freed (0: gone already),
        or None when it cannot go: a running request holds it (left as it is: tried again later), or a later
        request extended it (ordinary cache now: marked promoted, its pages stay in the directory).

        NOTE: this was `view.evict(inserted_len)`, SGLang's policy-ordered eviction: when the replica could not go,
        that evicted as many tokens of *other* cache, and `ReplicaExpired` dropped from the coordinator's directory
        pages the worker still held, which the planner then copied again (docs/bench.md, "Use calibration")."""
        got, outcome, _ = self.view.evict_chain(r.token_ids, r.namespace, max(1, r.inserted_len))
        if outcome == "in_use":
            return None
        if outcome == "extended":
            r.promoted = True
            self.extended.append(r.replication_id)
            return None
        if outcome != "unsupported":  # evicted, partial (its own part freed), absent (SGLang evicted it)
            return got
        # HiCache: the exact walk is not ours to do; SGLang's eviction, as before
        before, _ = self.view.match(r.token_ids, r.namespace)
        if before <= len(r.token_ids) - r.inserted_len:
            return 0  # SGLang already evicted it under memory pressure
        evicted = self.view.evict(r.inserted_len)
        after, _ = self.view.match(r.token_ids, r.namespace)
        if after > len(r.token_ids) - r.inserted_len:
            log.warning("replica %s: %d tokens still cached after evicting %d", r.replication_id, after, evicted)
        return evicted
