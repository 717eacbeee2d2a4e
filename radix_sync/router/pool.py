"""The router's workers: who they are, which are up, and what this router has sent them.

One id per worker throughout the router: its base URL (no trailing slash). Rankings, counters, cool-downs and the
router's own view are keyed by it. The coordinator names workers by its own ids; they are kept here
(`coordinator_ids`) and translated at the boundary only: a directory answer and the copies in flight on the way
in (`by_url`, `copies_by_url`), the reports on the way out (`report_id`).

Owned by `radix_sync.router.service.Router`; runs on its event loop (no locks). Reads no clock: callers pass `now`.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Callable, Iterable, Mapping, Optional, Sequence

from radix_sync.policy.routers import count_pages
from radix_sync.router.peers import PeerSends, QueuedSums
from radix_sync.router.policy import CopyInFlight, WorkerState, queued_work, with_local_load


class WorkerPool:
    """The workers to route to: the static ones, plus every worker the coordinator ever listed.

    Args:
        static_urls: the `--worker` URLs (kept whatever the coordinator says).
        page_size: the page size of a worker until the coordinator reports its own.
        cooldown_s: how long a worker that refused a connection is tried last, s.
    """

    def __init__(self, static_urls: Sequence[str], page_size: int, cooldown_s: float) -> None:
        self.default_page_size = page_size
        self.cooldown_s = cooldown_s
        self.known: dict[str, WorkerState] = {u.rstrip("/"): WorkerState(u.rstrip("/"), page_size)
                                              for u in static_urls}
        """url -> worker (no load), as last heard of."""
        self.static_urls = frozenset(self.known)
        self.listed: Optional[frozenset[str]] = None
        """Urls in the coordinator's last /workers answer (None before the first)."""
        self.coordinator_ids: dict[str, str] = {}
        """url -> the coordinator's id of the worker."""
        self._url_of: dict[str, str] = {}
        """coordinator id -> url (the inverse of `coordinator_ids`, rebuilt when it changes)."""
        self.outstanding: dict[str, int] = defaultdict(int)
        """url -> requests sent and not finished."""
        self._queued: dict[str, QueuedSums] = defaultdict(QueuedSums)
        self.sent_pages: dict[str, dict[int, int]] = defaultdict(dict)
        """url -> page hash -> how many of the requests sent there and not started hold it (`queue`'s `pages`)."""
        self.alone_since: dict[str, float] = {}
        """url -> when the first of this router's requests there not started went to it while it was idle (it has
        computed them since; `started_alone`); dropped once none of them is left."""
        self.down_until: dict[str, float] = {}
        """url -> end of its cool-down."""
        self.peers = PeerSends()
        """The other routers' requests sent and not ended (the coordinator's send relay), merged into every load."""
        self.relay: Optional[Callable[[str, str, int, int, int], None]] = None
        """Tells the other routers of this router's sends: (kind, worker, rid, uncached, cached tokens)
        (`CoordinatorLink.relay`; None: no coordinator)."""
        self._rids = itertools.count()
        self.last_dispatch_s = -float("inf")
        """When this router last sent a request to a worker (`time.monotonic()`)."""

    # ---------------------------------------------------------------------------------------------- membership
    def sync(self, workers: Iterable[dict]) -> dict[str, WorkerState]:
        """Merges the coordinator's /workers answer into `known`.

        Returns:
            url -> the worker with its reported load, for the workers of this answer.
        """
        out = {}
        changed = False
        for w in workers:
            url = (w.get("url") or "").rstrip("/")
            if not url:
                continue
            load = w.get("load") or {}
            st = WorkerState(url, int(w.get("page_size") or self.default_page_size),
                             int(load.get("num_running_reqs", 0)), int(load.get("num_waiting_reqs", 0)),
                             int(load.get("num_waiting_tokens", 0)), copies=not w.get("plain", False))
            self.known[url] = WorkerState(url, st.page_size, copies=st.copies)
            cid = str(w.get("id"))
            if self.coordinator_ids.get(url) != cid:
                self.coordinator_ids[url] = cid
                changed = True
            out[url] = st
        if changed:
            self._url_of = {cid: u for u, cid in self.coordinator_ids.items()}
        self.listed = frozenset(out)
        return out

    def unidentified(self) -> bool:
        """Returns: whether a known worker has no coordinator id yet (its directory matches would read as 0)."""
        return any(u not in self.coordinator_ids for u in self.known)

    def serving(self, coordinator_reachable: bool) -> list[str]:
        """The workers to serve from: while the coordinator answers, a worker it no longer lists (it went silent:
        dead, or cut off) is left out unless it is a static one or nothing else is left; with the coordinator
        down (or restarted and not yet told) every known worker stays."""
        pool = list(self.known)
        if self.listed and coordinator_reachable:
            pool = [u for u in pool if u in self.listed or u in self.static_urls] or pool
        return pool

    def candidates(self, now: float, coordinator_reachable: bool) -> list[str]:
        """Workers `serving` not in cool-down (all of them if every one is)."""
        pool = self.serving(coordinator_reachable)
        up = [u for u in pool if self.down_until.get(u, 0.0) <= now]
        return up or pool

    def mark_down(self, url: str, now: float) -> None:
        """Puts a worker that refused a connection in cool-down."""
        self.down_until[url] = now + self.cooldown_s

    def page_size(self, url: str, default: int) -> int:
        """Returns: the worker's page size (`default` for a worker not known)."""
        w = self.known.get(url)
        return w.page_size if w is not None else default

    # ------------------------------------------------------------------------- the coordinator's ids, translated
    def by_url(self, matched: Mapping[str, int]) -> dict[str, int]:
        """Returns: a directory answer (coordinator id -> tokens held) keyed by url."""
        return {u: matched.get(cid, 0) for u, cid in self.coordinator_ids.items()}

    def copies_by_url(self, copies: Iterable[CopyInFlight]) -> list[CopyInFlight]:
        """Returns: the copies in flight between workers this router knows, their ends named by url."""
        url_of = self._url_of
        return [CopyInFlight(url_of[c.source], url_of[c.target], c.namespace, c.num_tokens, c.id)
                for c in copies if c.source in url_of and c.target in url_of]

    def report_id(self, url: str) -> str:
        """Returns: the coordinator's id of the worker (its url when the coordinator has not listed it)."""
        return self.coordinator_ids.get(url, url)

    # ----------------------------------------------------------------------------------------- local accounting
    def with_local_load(self, st: WorkerState, directory: bool, now: Optional[float] = None) -> WorkerState:
        """Returns: `st` merged with this router's counts of its worker (`policy.with_local_load`) at `now`
        (default: the monotonic clock)."""
        q = self._queued[st.worker_id]
        since = self.alone_since.get(st.worker_id)
        elapsed = max(0.0, (time.monotonic() if now is None else now) - since) if since is not None else 0.0
        # (the other routers' sends there count as this router's own: `peers.PeerSends`)
        n, tokens, pairs, cached_pairs = self.peers.counts(self.report_id(st.worker_id))
        return with_local_load(st, self.outstanding[st.worker_id] + n, q.num_tokens + tokens,
                               q.attn_pairs + pairs, q.cached_pairs + cached_pairs, directory, elapsed)

    def started_alone(self, url: str, now: float) -> None:
        """Records that a request of this router went to `url` while it was idle (`Decision.idle`) at `now`: the
        worker computes this router's requests there from then on (kept until none of them is left)."""
        if self._queued[url].count > 0:
            self.alone_since.setdefault(url, now)

    def queue(self, url: str, uncached: int, cached: int, pages: Sequence[int] = ()):
        """Counts a request's prefill work, and its prompt's page hashes `pages`, as headed for `url` and not
        started.

        Returns:
            the (idempotent) call that stops counting it.
        """
        work = queued_work(uncached, cached)
        q = self._queued[url]
        q.add(work, +1)
        own = self.sent_pages[url]
        count_pages(own, pages, +1)
        done = []

        def unqueue() -> None:
            if not done:
                done.append(True)
                q.add(work, -1)
                if q.count == 0:
                    self.alone_since.pop(url, None)
                count_pages(own, pages, -1)
        return unqueue

    def dispatch(self, url: str, uncached: int, cached: int, pages: Sequence[int] = ()) -> "Dispatched":
        """Counts a request as sent to `url` and not ended (`outstanding`), its prefill work as queued (`queue`), and
        tells the other routers (`relay`).

        Returns:
            its handle: `started()` when its first output came, `done()` when it ended (both idempotent).
        """
        self.outstanding[url] += 1
        self.last_dispatch_s = time.monotonic()
        return Dispatched(self, url, next(self._rids), self.queue(url, uncached, cached, pages), uncached, cached)

    def _relay(self, kind: str, url: str, rid: int, uncached: int = 0, cached: int = 0) -> None:
        if self.relay is not None:  # (the worker by the coordinator's id; by its url while not listed)
            self.relay(kind, self.report_id(url), rid, uncached, cached)

    def status(self, now: float) -> list[dict]:
        """Returns: per known worker, what `/kvrep/status` shows of it."""
        return [{"url": u, "id": self.coordinator_ids.get(u), "page_size": w.page_size,
                 "listed": None if self.listed is None else (u in self.listed),
                 "outstanding": self.outstanding[u],
                 "cooldown_s": round(max(0.0, self.down_until.get(u, 0.0) - now), 3)}
                for u, w in self.known.items()]


class Dispatched:
    """A request sent to a worker (`WorkerPool.dispatch`)."""

    __slots__ = ("_pool", "url", "rid", "_unqueue", "_started", "_done")

    def __init__(self, pool: WorkerPool, url: str, rid: int, unqueue: Callable[[], None], uncached: int,
                 cached: int) -> None:
        self._pool, self.url, self.rid, self._unqueue = pool, url, rid, unqueue
        self._started = self._done = False
        pool._relay("sent", url, rid, uncached, cached)

    def started(self) -> None:
        """Its first output came: its prefill is no longer queued work."""
        if not self._started:
            self._started = True
            self._unqueue()
            self._pool._relay("started", self.url, self.rid)

    def done(self) -> None:
        """It ended (answered, failed or given up)."""
        if not self._done:
            self._done = True
            self._unqueue()  # (not `started`: a request that never started tells its peers `done` alone)
            self._pool.outstanding[self.url] -= 1
            self._pool._relay("done", self.url, self.rid)

