"""The other routers' sends, as this router counts them: each request another router in front of the same workers
sent and did not see end, by worker, with the prefill work of those not started, merged with this router's own
sends (`WorkerPool.with_local_load`), as the simulator's `--door-sends-s` relay merges them (`radix_sync.sim.views`).

In: the coordinator's send feed (`GET /sends/feed`, `radix_sync.coordinator.relay`), applied by `apply`. Out:
`SendOutbox`, this router's own events, posted (`POST /sends`) at once while another router polls the feed, nothing
while this one is alone. Owned by `radix_sync.router.service.Router`; runs on its event loop (no locks); reads no
clock: callers pass `now`.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

from radix_sync import api
from radix_sync.router.policy import QueuedWork, queued_work


class QueuedSums:
    """The sums of `QueuedWork` of one worker's requests sent and not started (`count` of them): this router's own
    (`WorkerPool`) and the other routers' (`PeerSends`)."""

    __slots__ = ("num_tokens", "attn_pairs", "cached_pairs", "count")

    def __init__(self) -> None:
        self.count = 0
        self.num_tokens = 0
        self.attn_pairs = 0.0
        self.cached_pairs = 0.0

    def add(self, work: QueuedWork, sign: int) -> None:
        self.count += sign
        self.num_tokens += sign * work.num_tokens
        self.attn_pairs += sign * work.attn_pairs
        self.cached_pairs += sign * work.cached_pairs
        if self.num_tokens == 0:
            self.attn_pairs = self.cached_pairs = 0.0  # no float drift


class PeerSends:
    """The other routers' requests sent and not ended (see the module docstring).

    Args:
        ttl_s: a request not heard of for this long is dropped (its `done` was lost), s.
    """

    def __init__(self, ttl_s: float = 120.0) -> None:
        self.ttl_s = ttl_s
        self._open: dict[tuple[str, int], list] = {}
        """(router, rid) -> [worker, QueuedWork or None once started, when sent (this router's clock)]."""
        self._outstanding: dict[str, int] = {}
        """Coordinator worker id -> the other routers' requests there not ended."""
        self._queued: dict[str, QueuedSums] = defaultdict(QueuedSums)
        """Coordinator worker id -> the sums of those not started."""
        self.num_applied = 0
        self.num_answers = 0
        """Feed answers applied."""
        self.num_resets = 0
        self.on_lag: Callable[[float], None] = lambda lag_s: None
        """Called with each `sent` event's relay lag (its `at` to this router's wall clock), s."""

    def counts(self, worker_id: str) -> tuple[int, int, float, float]:
        """Returns: (requests, queued tokens, attention pairs, cached pairs) of the other routers at a worker."""
        n = self._outstanding.get(worker_id, 0)
        if not n:
            return 0, 0, 0.0, 0.0
        q = self._queued[worker_id]
        return n, q.num_tokens, q.attn_pairs, q.cached_pairs

    def apply(self, events: Iterable[api.SendEvent], now: float, wall_now: float) -> None:
        """Applies the feed's events in order; `now`: this router's monotonic clock, `wall_now`: its wall clock."""
        self.num_answers += 1
        for e in events:
            self.num_applied += 1
            key = (e.router, e.rid)
            if e.kind == "sent":
                if key in self._open:
                    continue  # (a repeat)
                work = queued_work(e.new_tokens, e.cached_tokens)
                self._open[key] = [e.worker, work, now]
                self._outstanding[e.worker] = self._outstanding.get(e.worker, 0) + 1
                self._queued[e.worker].add(work, +1)
                if e.at > 0:
                    self.on_lag(max(0.0, wall_now - e.at))
            elif e.kind == "started":
                rec = self._open.get(key)
                if rec is not None and rec[1] is not None:
                    self._queued[rec[0]].add(rec[1], -1)
                    rec[1] = None
            elif e.kind == "done":
                self._end(key)
            elif e.kind == "gone":
                for k in [k for k in self._open if k[0] == e.router]:
                    self._end(k)
        self.expire(now)

    def _end(self, key: tuple[str, int]) -> None:
        rec = self._open.pop(key, None)
        if rec is None:
            return
        worker, work = rec[0], rec[1]
        if work is not None:
            self._queued[worker].add(work, -1)
        self._outstanding[worker] -= 1
        if not self._outstanding[worker]:  # (nothing of the others there: no float drift left behind)
            del self._outstanding[worker]
            self._queued.pop(worker, None)

    def expire(self, now: float) -> None:
        """Drops the requests sent more than `ttl_s` ago."""
        cutoff = now - self.ttl_s
        for k in [k for k, rec in self._open.items() if rec[2] < cutoff]:
            self._end(k)

    def reset(self) -> None:
        """Forgets everything (the feed lost events: what was told before no longer adds up)."""
        self._open.clear()
        self._outstanding.clear()
        self._queued.clear()
        self.num_resets += 1

    def status(self) -> dict:
        return {"open": len(self._open), "applied": self.num_applied, "answers": self.num_answers,
                "resets": self.num_resets,
                "by_worker": dict(self._outstanding)}


class SendOutbox:
    """This router's own send events, waiting for the next `POST /sends` (bounded: beyond `max_pending` they are
    dropped and counted; a peer then misses one request, which its TTL or the next load report corrects)."""

    def __init__(self, max_pending: int = api.MAX_SEND_EVENTS) -> None:
        self.max_pending = max_pending
        self.pending: list[api.SendEvent] = []
        self.num_dropped = 0
        self.num_sent = 0
        self.num_posts = 0

    def add(self, event: api.SendEvent) -> bool:
        if len(self.pending) >= self.max_pending:
            self.num_dropped += 1
            return False
        self.pending.append(event)
        return True

    def take(self) -> list[api.SendEvent]:
        out, self.pending = self.pending, []
        return out
