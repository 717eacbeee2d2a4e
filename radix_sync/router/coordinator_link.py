"""The router's client of the coordinator's admin API: workers, loads and copies in flight (cached), directory
lookups, batched reports of arrivals and of finished responses (numbered, so the coordinator replays them in
order), hints.

Reachability: every call has a short timeout; a failure marks the coordinator down and the next attempt waits an
exponentially growing backoff (`backoff_min_s` doubling to `backoff_max_s`). While down, calls return None at once
(no request waits on a dead coordinator) and the router routes from its own view; the first call after the backoff
probes, and a success brings everything back. Owned by `radix_sync.router.service.Router`; runs on its event loop.

Every body is one of the structs of `radix_sync.api`, the module the coordinator's admin server decodes and encodes
with: a report or hint that does not fit is refused here (counted or answered 400), an answer that does not fit
counts as a failed call.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import aiohttp

from radix_sync import api
from radix_sync.api import AdminError
from radix_sync.router.directory_replica import DirectoryReplica, FeedError
from radix_sync.router.peers import PeerSends, SendOutbox
from radix_sync.router.policy import CopyInFlight


log = logging.getLogger("kvrep.router.coordinator")
_JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class LinkConfig:
    url: str
    """Admin API base URL, e.g. http://127.0.0.1:5680."""
    timeout_s: float = 0.5
    """Per-call timeout (connect + answer), s."""
    state_ttl_s: float = 0.1
    """How long workers/loads/copies are reused before refreshing, s."""
    state_stale_ok_s: float = 0.5
    """Up to this age a request routes on the last view while a refresh runs in the background, s."""
    backoff_min_s: float = 0.25
    backoff_max_s: float = 5.0
    arrivals_flush_s: float = 0.05
    """Arrivals are sent in batches at least this often, s."""
    max_pending_arrivals: int = 10_000
    """Arrivals (and, separately, finishes) beyond this while the coordinator is slow or down are dropped (and
    counted)."""
    max_inflight_lookups: int = 8
    """Directory lookups in flight at once; a request beyond it is routed from the router's own view (load
    shedding: the coordinator is not marked down, and the lookup is counted as shed)."""
    feed_wait_s: float = 1.0
    """Long-poll window of the directory feed, s (an answer comes at once when the directory changes)."""
    token: Optional[str] = None
    """Bearer token sent on every call (the coordinator's admin "write" token; None: none sent)."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator admin URL must be http(s)://host:port, got {self.url!r}")
        for name in ("timeout_s", "state_ttl_s", "state_stale_ok_s", "backoff_min_s", "backoff_max_s", "arrivals_flush_s",
                     "feed_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.max_inflight_lookups < 1:
            raise ValueError(f"max_inflight_lookups={self.max_inflight_lookups!r} must be >= 1")


@dataclass(frozen=True)
class ClusterState:
    """The coordinator's answer to /workers and /replications at one time."""

    workers: tuple[dict, ...]
    """`api.WorkerInfo` of each worker, as the dicts its JSON decodes to."""
    copies: tuple[CopyInFlight, ...]
    fetched_at_s: float


class CoordinatorLink:
    def __init__(self, cfg: LinkConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        self.state: Optional[ClusterState] = None
        self._refreshing: Optional[asyncio.Task] = None
        self._down_until = 0.0
        self._backoff_s = 0.0
        self.reachable = False
        self.last_error = ""
        self._arrivals: list[api.ArrivalReport] = []
        self._finishes: list[api.FinishReport] = []
        self._report_seq = 0
        self.num_arrivals_dropped = 0
        self.num_arrivals_sent = 0
        self.num_finishes_dropped = 0
        self.num_finishes_sent = 0
        self.num_lookups_shed = 0
        self._inflight_lookups = 0
        self.router_name = ""
        """This router's name on the send relay (set by `run_send_feed`)."""
        self.outbox = SendOutbox()
        self.num_routers = 0
        """Routers serving requests in front of the coordinator's workers, this one included (the send feed's last
        answer): this router relays its sends only while there are two or more."""
        self._posting: Optional[asyncio.Task] = None

    def _headers(self, json_body: bool) -> dict:
        headers = dict(_JSON) if json_body else {}
        if self.cfg.token:
            headers["Authorization"] = f"Bearer {self.cfg.token}"
        return headers

    # -------------------------------------------------------------------------------------------- reachability
    def _ok(self) -> None:
        if not self.reachable:
            log.info("coordinator %s reachable", self.cfg.url)
        self.reachable, self._backoff_s, self._down_until = True, 0.0, 0.0

    def _failed(self, exc: BaseException) -> None:
        self._backoff_s = min(self.cfg.backoff_max_s, max(self.cfg.backoff_min_s, 2 * self._backoff_s))
        self._down_until = time.monotonic() + self._backoff_s
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.reachable:
            log.warning("coordinator %s unreachable (%s); routing from the router's own view", self.cfg.url,
                        self.last_error)
        self.reachable = False

    def may_call(self) -> bool:
        """Returns: False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    def backoff_left_s(self) -> float:
        """Returns: seconds until the link calls the coordinator again (0 when it may call now)."""
        return max(0.0, self._down_until - time.monotonic())

    async def _call(self, method: str, path: str, answer_type: Any, body: Any = None) -> Optional[Any]:
        """Returns: the answer decoded as `answer_type`; None when backing off, on a failure (which starts a
        backoff: no answer, or one that does not fit `answer_type`) or on a refusal (the coordinator is up)."""
        if not self.may_call():
            return None
        try:
            async with self._session.request(method, self.cfg.url + path, timeout=self._timeout,
                                             data=None if body is None else api.encode(body),
                                             headers=self._headers(body is not None)) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._failed(exc)
            return None
        if status != 200:
            # The coordinator answered: it is up; the request was bad. Say so, do not back off.
            self._ok()
            log.warning("coordinator %s %s -> %d %s", method, path, status, raw[:500])
            return None
        try:
            out = api.decode(raw, answer_type)
        except AdminError as exc:
            self._failed(exc)
            return None
        self._ok()
        return out

    # ------------------------------------------------------------------------------------------------ queries
    async def cluster_state(self, force: bool = False) -> Optional[ClusterState]:
        """Workers, loads and copies in flight, at most `state_ttl_s` old (fresh when `force`); None when the
        coordinator is down.

        Concurrent callers share one refresh.
        """
        st = self.state
        age = time.monotonic() - st.fetched_at_s if st is not None else float("inf")
        if not force and self.reachable and age < self.cfg.state_ttl_s:
            return st
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
        if not force and self.reachable and age < self.cfg.state_stale_ok_s:
            # NOTE: a request does not wait for the refresh it started (two calls to the coordinator): it routes on
            # the view of at most `state_stale_ok_s` ago; the next one gets the fresh view
            return st
        await asyncio.shield(self._refreshing)
        return self.state if self.reachable else None

    async def _refresh(self) -> None:
        workers = await self._call("GET", "/workers", list[api.WorkerInfo])
        if workers is None:
            return
        # only the copies in flight: the whole history (up to the coordinator's `max_replications_kept`, 10,000)
        # every `state_ttl_s` cost both processes CPU that grew with every copy made (stop 51)
        reps = await self._call("GET", "/replications?state=pending,running", list[api.ReplicationInfo])
        if reps is None:
            return
        copies = tuple(CopyInFlight(r.source, r.target, r.namespace, r.num_tokens, r.id)
                       for r in reps if r.state in ("pending", "running"))
        self.state = ClusterState(tuple(api.to_builtins(w) for w in workers), copies, time.monotonic())

    async def lookup(self, input_ids: list[int], namespace: str,
                     page_hashes: Optional[tuple[list[int], int]] = None) -> Optional[dict[str, int]]:
        """Returns: tokens of the prompt each worker holds, from the exact directory; None when unreachable.

        `page_hashes`: (the prompt's page hashes in `namespace`, their page size) when every candidate worker
        uses that page size: the coordinator then matches them directly (no token list to send, parse, rehash)."""
        if page_hashes is not None:
            body = api.LookupRequest(page_hashes=page_hashes[0], page_size=page_hashes[1])
        else:
            body = api.LookupRequest(input_ids=input_ids, cache_salt=namespace)
        if self._inflight_lookups >= self.cfg.max_inflight_lookups:
            self.num_lookups_shed += 1
            return None
        self._inflight_lookups += 1
        try:
            out = await self._call("POST", "/directory/lookup", api.LookupAnswer, body)
        finally:
            self._inflight_lookups -= 1
        return None if out is None else dict(out.matched)

    async def hint(self, body: dict) -> tuple[int, dict]:
        """Forwards a hint (the fields of an `api.HintRequest`); returns (status, answer): 400 for a hint that does
        not fit the API (not sent), 503 when the coordinator is unreachable."""
        try:
            req = api.convert(body, api.HintRequest)
        except AdminError as exc:
            return 400, {"error": str(exc)}
        if not self.may_call():
            return 503, {"error": f"coordinator unreachable: {self.last_error}"}
        try:
            async with self._session.post(self.cfg.url + "/hints", data=api.encode(req), headers=self._headers(True),
                                          timeout=self._timeout) as resp:
                raw = await resp.read()
                status = resp.status
            answer = api.decode(raw, api.HintRecorded if status == 200 else api.ErrorAnswer)
        except (aiohttp.ClientError, asyncio.TimeoutError, AdminError) as exc:
            self._failed(exc)
            return 503, {"error": f"coordinator unreachable: {self.last_error}"}
        self._ok()
        return status, api.to_builtins(answer)

    # ------------------------------------------------------------------------------- copies on the critical path
    async def replicate(self, req: api.ReplicateRequest) -> tuple[Optional[api.ReplicationInfo], str]:
        """Asks for a copy (`POST /replicate`; a router's pull has `critical` set).

        Returns:
            (the replication as created, "") or (None, why not: `refused: <the coordinator's error>` when it
            answered with an error, `unreachable: ...` when it did not answer or is backing off).
        """
        status, answer, why = await self._post_answer("/replicate", req, api.ReplicationInfo, self._timeout)
        return answer, why

    async def wait_replication(self, replication_id: str, wait_s: float,
                               want: bool = True) -> tuple[Optional[api.ReplicationInfo], str]:
        """Waits (long poll, `POST /replications/wait`) until the replication is done or failed, or `wait_s`.
        `want`: a request of this router waits for it (`api.ReplicationWaitRequest.want`: it lands as ordinary cache).

        Returns:
            (the replication as it then is, "") or (None, why not, as `replicate` says it).
        """
        wait_s = min(30.0, max(0.0, wait_s))
        timeout = aiohttp.ClientTimeout(total=wait_s + self.cfg.timeout_s)
        status, answer, why = await self._post_answer(
            "/replications/wait", api.ReplicationWaitRequest(id=replication_id, wait_s=wait_s, want=want),
            api.ReplicationInfo, timeout)
        return answer, why

    async def _post_answer(self, path: str, body: Any, answer_type: Any,
                           timeout: aiohttp.ClientTimeout) -> tuple[int, Optional[Any], str]:
        """POSTs a typed body; returns (HTTP status (0: none), the answer or None, why there is none)."""
        if not self.may_call():
            return 0, None, f"unreachable: {self.last_error}"
        try:
            async with self._session.post(self.cfg.url + path, data=api.encode(body), headers=self._headers(True),
                                          timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
            if status != 200:
                self._ok()
                return status, None, f"refused: {api.decode(raw, api.ErrorAnswer).error}"
            answer = api.decode(raw, answer_type)
        except (aiohttp.ClientError, asyncio.TimeoutError, AdminError) as exc:
            self._failed(exc)
            return 0, None, f"unreachable: {self.last_error}"
        self._ok()
        return status, answer, ""

    # ------------------------------------------------------------------------------------------ directory feed
    async def _long_poll(self, path: str, params: dict, timeout: aiohttp.ClientTimeout) -> Optional[tuple[int, bytes]]:
        """One long poll of a feed: (status, body); None when it got no answer (the coordinator marked down)."""
        try:
            async with self._session.get(self.cfg.url + path, params=params, timeout=timeout,
                                         headers=self._headers(False)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._failed(exc)
            return None

    async def run_directory_feed(self, replica: DirectoryReplica) -> None:
        """Background task: keeps `replica` current from the coordinator's change feed (long poll) until
        cancelled. A failure marks the replica unusable (the router then asks per request) and the coordinator
        down (backoff); a coordinator without the feed (404) stops the task."""
        wait_s = self.cfg.feed_wait_s
        timeout = aiohttp.ClientTimeout(total=wait_s + self.cfg.timeout_s + 1.0)
        while True:
            if not self.may_call():
                replica.mark_unhealthy()
                await asyncio.sleep(max(0.05, self._down_until - time.monotonic()))
                continue
            params = {"epoch": replica.epoch, "since": str(replica.seq), "wait_s": str(wait_s), "tiers": "1"}
            got = await self._long_poll("/directory/feed", params, timeout)
            if got is None:
                replica.mark_unhealthy()
                continue
            status, data = got
            if status == 404:
                replica.mark_unhealthy()
                log.warning("coordinator %s has no directory feed; asking it per request", self.cfg.url)
                return
            try:
                if status != 200:
                    raise FeedError(f"HTTP {status}: {data[:200]!r}")
                feed = api.decode(data, api.DirectoryFeed)
                msg = {"epoch": feed.epoch, "seq": feed.seq, "head": feed.head}
                if feed.snapshot is not api.UNSET:
                    msg["snapshot"] = feed.snapshot
                    if feed.host_snapshot is not api.UNSET:
                        msg["host_snapshot"] = feed.host_snapshot
                else:
                    msg["changes"] = [] if feed.changes is api.UNSET else feed.changes
                replica.apply(msg)
            except (FeedError, AdminError) as exc:
                replica.mark_unhealthy()
                log.warning("directory feed: %s; resyncing", exc)
                replica.reset()
                await asyncio.sleep(self.cfg.backoff_min_s)
                continue
            self._ok()

    # ----------------------------------------------------------------------------------------------- arrivals
    def report_arrival(self, item: dict) -> None:
        """Queues an arrival (the fields of an `api.ArrivalReport`; fire and forget); `run_arrivals` sends them
        in batches."""
        if not self._enqueue(self._arrivals, item, api.ArrivalReport):
            self.num_arrivals_dropped += 1

    def report_finish(self, item: dict) -> None:
        """Queues a finished response (the fields of an `api.FinishReport`; fire and forget); sent with the
        arrivals, in order with them."""
        if not self._enqueue(self._finishes, item, api.FinishReport):
            self.num_finishes_dropped += 1

    def _enqueue(self, queue: list, item: dict, report_type: type) -> bool:
        """Numbers a report in the order of all reports; False (not queued) when `queue` is full or the report
        does not fit the API (logged: a bug of the caller)."""
        if len(queue) >= self.cfg.max_pending_arrivals:
            return False
        try:
            report = api.convert({**item, "seq": self._report_seq + 1}, report_type)
        except AdminError as exc:
            log.warning("dropped a malformed %s: %s", report_type.__name__, exc)
            return False
        self._report_seq += 1
        queue.append(report)
        return True

    async def flush_arrivals(self) -> None:
        if not (self._arrivals or self._finishes) or not self.may_call():
            return
        arrivals, finishes = self._arrivals, self._finishes
        self._arrivals, self._finishes = [], []
        batch = api.DemandBatch(arrivals=arrivals, finishes=finishes)
        if await self._call("POST", "/arrivals", api.DemandRecorded, batch) is None:
            # Arrivals and finishes are demand signals for the next seconds: stale ones are worth little.
            # Drop, count.
            self.num_arrivals_dropped += len(arrivals)
            self.num_finishes_dropped += len(finishes)
        else:
            self.num_arrivals_sent += len(arrivals)
            self.num_finishes_sent += len(finishes)

    async def run_arrivals(self) -> None:
        """Background task: flush arrivals every `arrivals_flush_s` until cancelled."""
        while True:
            await asyncio.sleep(self.cfg.arrivals_flush_s)
            try:
                await self.flush_arrivals()
            except Exception:  # noqa: BLE001 - a reporting bug must not stop the loop
                log.exception("arrival flush failed")

    # ---------------------------------------------------------------------------------------------- send relay
    def relay(self, kind: str, worker: str, rid: int, uncached: int = 0, cached: int = 0) -> None:
        """Sends one of this router's send events (`api.SendEvent`'s fields) to the other routers
        (`radix_sync.coordinator.relay`) at once: posted with whatever else is waiting as soon as the event loop is
        free (one post in flight at a time); nothing, not even the event, while no other router serves."""
        if self.num_routers < 2:
            return
        event = api.SendEvent(kind=kind, rid=rid, worker=worker, new_tokens=max(0, uncached),
                              cached_tokens=max(0, cached), at=time.time())
        if not self.outbox.add(event):
            return
        if self._posting is None or self._posting.done():
            self._posting = asyncio.get_running_loop().create_task(self._post_sends())

    async def _post_sends(self) -> None:
        while self.outbox.pending and self.may_call():
            self.outbox.num_posts += 1
            events = self.outbox.take()
            try:
                answer = await self._call("POST", "/sends", api.SendsAccepted,
                                          api.SendBatch(router=self.router_name, events=events))
            except RuntimeError as exc:  # (the session closed under it: the router is stopping)
                log.debug("send relay post: %s", exc)
                answer = None
            if answer is None:
                self.outbox.num_dropped += len(events)  # (a peer's TTL, or the workers' next reports, correct it)
            else:
                self.outbox.num_sent += len(events)
        self.outbox.num_dropped += len(self.outbox.take())  # (backing off: stale by the time it answers)

    async def run_send_feed(self, peers: PeerSends, router_name: str,
                            serving: Callable[[], bool] = lambda: True) -> None:
        """Background task: applies the other routers' send events to `peers` (long poll of `GET /sends/feed`)
        until cancelled; a lost stretch (coordinator restarted, or this router too far behind) resets `peers`; a
        coordinator without the relay (404) stops the task. `serving()`: this router sent requests lately (said on
        every poll: an idle router listens without counting among the routers that post)."""
        self.router_name = router_name
        epoch, since = "", 0
        wait_s = self.cfg.feed_wait_s
        timeout = aiohttp.ClientTimeout(total=wait_s + self.cfg.timeout_s + 1.0)
        while True:
            if not self.may_call():
                await asyncio.sleep(max(0.05, self._down_until - time.monotonic()))
                continue
            params = {"router": router_name, "epoch": epoch, "since": str(since), "wait_s": str(wait_s),
                      "serving": "1" if serving() else "0"}
            got = await self._long_poll("/sends/feed", params, timeout)
            if got is None:
                continue
            status, data = got
            if status == 404:
                log.warning("coordinator %s relays no sends between routers", self.cfg.url)
                self.num_routers = 0
                return
            try:
                if status != 200:
                    raise AdminError(f"HTTP {status}: {data[:200]!r}")
                feed = api.decode(data, api.SendsFeed)
            except AdminError as exc:
                log.warning("send feed: %s", exc)
                await asyncio.sleep(self.cfg.backoff_min_s)
                continue
            self._ok()
            if feed.reset and epoch:
                peers.reset()
            peers.apply(feed.events, time.monotonic(), time.time())
            epoch, since, self.num_routers = feed.epoch, feed.seq, feed.routers

