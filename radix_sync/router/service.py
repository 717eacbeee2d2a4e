"""The router service: one request's way through the router, and what it tells the coordinator.

Per request: a ranked decision (`policy.rank_by_ttft` on the coordinator's directory, matched against the local
mirror of it or asked per request, or `ApproxPrefixIndex.rank` when the coordinator is unreachable), then the
`Proxy` sends the body to the first choice and fails over down the ranking. The arrival, and the end of the answer
(with how it ended: the session-continuation signal), are reported to the coordinator in the background.

`Router` owns the parts: the `WorkerPool` (workers by URL, the one id), the `Proxy` (upstream connections), the
`CoordinatorLink`, the `DirectoryReplica`, the router's own `ApproxPrefixIndex`, the cost model and the metrics.
Built by `radix_sync.router.app.build_app`, which maps HTTP routes onto it.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import socket
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import aiohttp
from aiohttp import web

from radix_sync.hashing import page_hashes
from radix_sync.policy.routers import tie_draws
from radix_sync.policy.speed import SpeedCalibration
from radix_sync.router.auth import RouterSecrets, load_secrets
from radix_sync.router.config import MAX_TOKEN_ID, RouterConfig
from radix_sync.router.coordinator_link import CoordinatorLink, LinkConfig
from radix_sync.router.directory_replica import DirectoryReplica
from radix_sync.router.limits import PromptBounds, TokenBuckets
from radix_sync.router.metrics import RouterMetrics
from radix_sync.router.policy import DIRECTORY, ApproxPrefixIndex, CopyInFlight, Decision, cost_model, rank_by_ttft
from radix_sync.router.pool import WorkerPool
from radix_sync.router.proxy import NoWorker, Proxy
from radix_sync.router.pull import PullRunner
from radix_sync.router.tenants import Tenant, TenantTable
from radix_sync.router.tokenize import PromptTokenizer

log = logging.getLogger("kvrep.router")

MAX_SESSION_ID_LEN = 256
"""A session id (the body's `session_id` or `user`) longer than this is reported as its SHA-256 (the coordinator
refuses longer ones, and one refused item would cost the whole batch of arrivals)."""
MAX_DECISIONS_KEPT = 4096
"""Routing decisions a router keeps for `/kvrep/status` (a benchmark cell of a few thousand requests, whole)."""
MAX_REQUEST_ID_LEN = 128
SERVING_S = 5.0
"""A router that sent a request within this long counts among the routers of the send relay (it then posts its sends
while another one does too), s."""


def client_request_id(request: web.Request) -> Optional[str]:
    """Returns: the client's `X-Request-Id` (the header gateways and SGLang's router pass along), when it is
    printable ASCII of at most `MAX_REQUEST_ID_LEN` characters; None otherwise (absent, or not kept)."""
    value = request.headers.get("X-Request-Id")
    if value is None or not 0 < len(value) <= MAX_REQUEST_ID_LEN or not (value.isascii() and value.isprintable()):
        return None
    return value


class Router:
    """Decides, forwards through the `Proxy`, reports; one per router process (or per `build_app`)."""

    def __init__(self, cfg: RouterConfig, tokenizer: Optional[PromptTokenizer] = None,
                 tenants: Optional[TenantTable] = None, secrets: Optional[RouterSecrets] = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.secrets = secrets or load_secrets(cfg)
        if tenants is None and cfg.tenants_path:
            tenants = TenantTable.load(cfg.tenants_path, self.secrets.tenant_secret)
        self.tenants = tenants or TenantTable.open()
        self.hint_buckets = TokenBuckets(cfg.hints_per_s, cfg.hints_burst)
        self.tokenize_pool = ThreadPoolExecutor(cfg.tokenize_threads, thread_name_prefix="kvrep-tokenize")
        """Text prompts are tokenized here, never on the event loop."""
        self.link: Optional[CoordinatorLink] = None
        self.metrics = RouterMetrics(lambda: self.link.num_arrivals_dropped if self.link is not None else 0)
        self.index = ApproxPrefixIndex()
        self._tie_after: Optional[str] = None
        """The worker that took the last full tie (`Decision.tie_taken`): the next one goes to the worker after it."""
        self._tie_rng = random.Random()
        """Ties' draws while other routers serve the same workers (`radix_sync.policy.routers.tie_draws`)."""
        if cfg.profile:
            from radix_sync.policy.cost import CostModel, load_profile
            self.model = CostModel(load_profile(cfg.profile))
        else:
            self.model = cost_model(cfg.costs)
        self.speed = SpeedCalibration() if cfg.speed_calibration else None
        """The workers' prefill speed, from the requests that ran alone (scales `model`'s prefill terms)."""
        self.pool = WorkerPool(cfg.worker_urls, cfg.page_size, cfg.worker_cooldown_s)
        self.proxy = Proxy(cfg, self.pool, self.metrics, self.secrets.worker_api_key)
        self.puller = PullRunner(cfg.pull_policy, self.pool, self.metrics)
        self.replica: Optional[DirectoryReplica] = None
        """The coordinator's holdings, mirrored from its change feed (None: ask it per request)."""
        self._tasks: list[asyncio.Task] = []
        self.name = f"{socket.gethostname()[:64]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        """This router's name among the routers of the coordinator's send relay."""
        self.decisions: deque = deque(maxlen=MAX_DECISIONS_KEPT)
        """The last routing decisions, each with the client's `X-Request-Id` when it sent one (for the record)."""

    # --------------------------------------------------------------------------------------------- lifecycle
    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.cfg.max_connections_per_worker,
                                         keepalive_timeout=self.cfg.worker_keepalive_s, enable_cleanup_closed=True)
        self.proxy.session = session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.proxy.fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=self.cfg.max_connections_per_worker,
                                           force_close=True), auto_decompress=False)
        if self.cfg.coordinator_url:
            self.link = CoordinatorLink(LinkConfig(self.cfg.coordinator_url.rstrip("/"),
                                                   timeout_s=self.cfg.coordinator_timeout_s,
                                                   token=self.secrets.coordinator_token), session)
            self.puller.link = self.link
            self._tasks.append(asyncio.create_task(self.link.run_arrivals()))
            if self.cfg.peer_sends:  # (sends relayed between the routers in front of the same workers)
                self.pool.relay = self.link.relay
                self.pool.peers.on_lag = self.metrics.peer_send_lag_seconds.observe
                self._tasks.append(asyncio.create_task(self.link.run_send_feed(
                    self.pool.peers, self.name, lambda: time.monotonic() - self.pool.last_dispatch_s < SERVING_S)))
            if self.cfg.directory_feed:
                self.replica = DirectoryReplica()
                self._tasks.append(asyncio.create_task(self.link.run_directory_feed(self.replica)))
            await self.refresh_workers()
        if self.cfg.tokenizer == "auto" and self.tokenizer is None:
            self._tasks.append(asyncio.create_task(self._load_tokenizer_from_worker()))
        elif self.tokenizer is None and self.cfg.vocab_size is None:
            log.warning("no tokenizer and no --vocab-size: token ids are only checked to be in [0, 2^31); an id past "
                        "the model's vocabulary can crash an SGLang worker")

    async def stop(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.link is not None:
            await self.link.flush_arrivals()
        for session in (self.proxy.session, self.proxy.fresh_session):
            if session is not None:
                await session.close()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def bounds(self) -> PromptBounds:
        """Returns: the bounds every request is checked against (`limits.check_request`)."""
        cfg = self.cfg
        vocab = cfg.vocab_size or (self.tokenizer.vocab_size if self.tokenizer is not None else MAX_TOKEN_ID + 1)
        return PromptBounds(vocab, cfg.max_prompt_tokens, cfg.max_prompt_chars, cfg.max_batch_prompts,
                            cfg.max_messages)

    async def _load_tokenizer_from_worker(self) -> None:
        for url in self.candidates():
            try:
                async with self.proxy.session.get(url + "/model_info", timeout=aiohttp.ClientTimeout(total=5),
                                                  headers=self.proxy.worker_headers) as r:
                    info = await r.json(content_type=None)
                path = info.get("tokenizer_path") or info.get("model_path")
                self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                    None, PromptTokenizer.from_pretrained, path)
                log.info("tokenizer loaded from %s (reported by %s)", path, url)
                return
            except Exception as exc:  # noqa: BLE001 - try the next worker; text is routed by load meanwhile
                log.warning("no tokenizer from %s: %s", url, exc)
        log.warning("no tokenizer: text prompts are routed by load only (give --tokenizer)")

    # ------------------------------------------------------------------------------------------------ workers
    def _coordinator_reachable(self) -> bool:
        return self.link is not None and self.link.reachable

    async def refresh_workers(self) -> None:
        """Learns the coordinator's workers (if it is reachable) without routing anything."""
        if self.link is not None:
            state = await self.link.cluster_state()
            if state is not None:
                self.pool.sync(state.workers)

    def serving(self) -> list[str]:
        """Returns: the workers to serve from (`WorkerPool.serving`)."""
        return self.pool.serving(self._coordinator_reachable())

    def candidates(self) -> list[str]:
        """Returns: the workers to serve from not in cool-down (`WorkerPool.candidates`)."""
        return self.pool.candidates(time.monotonic(), self._coordinator_reachable())

    # ----------------------------------------------------------------------------------------------- deciding
    async def decide(self, ids: list[int], namespace: str) -> tuple[Decision, list[int], int]:
        """Ranks the candidate workers for a prompt.

        Returns:
            the decision, the prompt's page hashes (for the router's own view) and their page size.
        """
        pool = self.pool
        state = await self.link.cluster_state() if self.link is not None else None
        reported = pool.sync(state.workers) if state is not None else {}
        if state is not None and pool.unidentified():
            # a worker we route to is missing from the (cached) coordinator view: without its id its directory
            # matches would read as 0, so refresh once before deciding
            state = await self.link.cluster_state(force=True)
            reported = pool.sync(state.workers) if state is not None else {}
        cands = self.candidates()
        if not cands:
            raise NoWorker("no worker known")
        page_size = min(pool.known[u].page_size for u in cands)
        hashes = page_hashes(ids, page_size, namespace)
        matched, host = None, {}
        if state is not None and ids:
            same = all(pool.known[u].page_size == page_size for u in cands)
            replica = self.replica
            if same and replica is not None and replica.usable():
                # NOTE: the local mirror of the directory: no call per request (the coordinator's admin API
                # cannot answer ~1,000 lookups/s on a small machine); at most a long poll's delivery behind
                pages = replica.match(hashes)
                matched = {wid: n * page_size for wid, n in pages.items()}
                if self.cfg.host_load_bytes_per_s:  # (and what each worker's host tier holds past it)
                    host = {wid: n * page_size for wid, n in replica.match_host(hashes, pages).items()}
            else:
                matched = await self.link.lookup(ids, namespace, (hashes, page_size) if same and hashes else None)
        if matched is not None:
            workers = [pool.with_local_load(reported.get(u, pool.known[u]), True) for u in cands]
            # this router's own pulls count as in flight before the coordinator's view lists them (once)
            copies = list(dict.fromkeys([*state.copies, *self.puller.in_flight.values()]))
            decision = rank_by_ttft(workers, pool.by_url(matched), pool.copies_by_url(copies), len(ids),
                                    namespace, time.monotonic(), self.model, allow_pull=self.cfg.pull,
                                    pull_cfg=self.cfg.pull_policy, host_matched=pool.by_url(host),
                                    host_load_bytes_per_s=self.cfg.host_load_bytes_per_s, tie_after=self._tie_after,
                                    page_hashes=hashes, page_len=page_size,
                                    sent_pages=pool.sent_pages if self.cfg.sent_pages else {},
                                    tie_draw=tie_draws(self._tie_rng, len(cands))
                                    if self.cfg.tie_draws and self.link is not None and self.link.num_routers >= 2
                                    else None)
            if decision.tie_taken is not None and self.cfg.tie_turns:
                self._tie_after = decision.tie_taken
        else:
            workers = [pool.with_local_load(pool.known[u], False) for u in cands]
            decision = self.index.rank(workers, hashes, len(ids))
            self.metrics.fallback_decisions.inc()
        return decision, hashes, page_size

    async def _wait_for_copy(self, url: str, copy: Optional[CopyInFlight] = None) -> None:
        """Holds a request (bounded by `max_wait_inflight_s`) until the copy it waits for (`Decision.wait_copy`, its
        ends named by url) is no longer pending/running at the coordinator nor among this router's pulls; without
        one, until no copy to `url` is. Other copies landing there do not hold it: a worker the planner sends
        several copies to would otherwise hold a request for all of them.

        Once the copy's replication id is known (listed by the coordinator, or this router's own pull once the
        coordinator took it), the request waits on the coordinator's long poll for it (`POST /replications/wait`)
        and goes the moment the coordinator has it done or failed. Polling the cached cluster view instead
        (`state_ttl_s` old at most, refreshed in the background) released it a median 27-115 ms (a run's; up to
        150) after the copy landed (stop 52); the view stays for a copy without an id and when the long poll gets
        no answer."""
        deadline = time.monotonic() + self.cfg.max_wait_inflight_s
        cid = self.pool.coordinator_ids.get(url)
        src = self.pool.coordinator_ids.get(copy.source) if copy is not None else None

        def waited(c: CopyInFlight) -> bool:
            return c.target == cid and (copy is None or (c.source == src and c.namespace == copy.namespace
                                                         and c.num_tokens == copy.num_tokens))
        long_poll = copy is not None
        while time.monotonic() < deadline and self.link is not None:
            rid = (copy.id or next((c.id for c in self.puller.in_flight.values() if c.id and waited(c)), "")
                   ) if long_poll else ""
            if rid:
                info, _ = await self.link.wait_replication(rid, max(0.0, deadline - time.monotonic()))
                if info is not None:  # done, failed, or still in flight at the bound: the request goes now
                    return
                long_poll = False
                continue
            state = await self.link.cluster_state()
            if not any(waited(c) for c in (state.copies if state is not None else ())) \
                    and not any(waited(c) for c in self.puller.in_flight.values()):
                return
            await asyncio.sleep(0.02)

    # --------------------------------------------------------------------------------------------- forwarding
    async def forward(self, request: web.Request, path: str, body: dict, decision: Decision, endpoint: str,
                      ids: list[int], hashes: list[int], tenant: Tenant,
                      hash_page_size: int = 0) -> web.StreamResponse:
        """Forwards a decided request (`Proxy.forward`), recording and reporting where it went and how it ended."""
        pull = None
        t0 = time.monotonic()  # the time to first token reported with the finish counts a pull's wait too
        if decision.pull is not None:  # a copy on the critical path first (radix_sync.router.pull)
            decision, pull = await self.puller.run(decision, ids, tenant.namespace)

        request_id = client_request_id(request)
        attempts: list[int] = []

        held: list[float] = []

        def dispatched(url: str, attempt: int) -> None:
            attempts.append(attempt)
            self._on_dispatched(url, endpoint, decision, ids, hashes, tenant, body, attempt, hash_page_size, pull,
                                request_id, held[0] if held and attempt == 0 else None)

        def finished(url: str, stop: Optional[str], first_output_s: Optional[float]) -> None:
            ttft_s = None if first_output_s is None else first_output_s - t0
            alone = (self._ran_alone(url, decision, len(ids), ttft_s)
                     if pull is None and attempts == [0] else None)
            self._on_finished(url, ids, hashes, hash_page_size, tenant, stop, ttft_s, alone)

        async def wait_for_copy(url: str) -> None:
            t = time.monotonic()
            await self._wait_for_copy(url, decision.wait_copy if url == decision.ranked[0] else None)
            held.append(time.monotonic() - t)

        return await self.proxy.forward(request, path, body, decision, len(ids), wait_for_copy, dispatched, finished,
                                        pages=hashes if decision.mode == DIRECTORY else ())

    async def any_worker(self, request: web.Request, method: str, path: str) -> web.Response:
        """Proxies a read-only call (models, server info) to the first worker that answers."""
        return await self.proxy.any_worker(request, method, path, self.candidates())

    async def fan_out(self, request: web.Request, path: str) -> web.Response:
        """Sends a call to every known worker; 200 only if all answered 200. Clears the router's own view."""
        await self.refresh_workers()
        results = await self.proxy.fan_out(request, path, self.serving())
        self.index = ApproxPrefixIndex(self.index.cfg)
        ok = bool(results) and all(s == 200 for _, s, _ in results)
        return web.json_response({"success": ok, "workers": {u: {"status": s, "body": b} for u, s, b in results}},
                                 status=200 if ok else 500)

    # ---------------------------------------------------------------------------------------------- reporting
    def _on_dispatched(self, url: str, endpoint: str, decision: Decision, ids: list[int], hashes: list[int],
                       tenant: Tenant, body: dict, attempt: int, hash_page_size: int = 0,
                       pull: Optional[dict] = None, request_id: Optional[str] = None,
                       held_s: Optional[float] = None) -> None:
        now = time.monotonic()
        self.index.observe(url, hashes, self.pool.page_size(url, self.cfg.page_size), now)
        self.metrics.requests.labels(url, endpoint, decision.mode).inc()
        if attempt:
            self.metrics.failovers.inc()
        self.decisions.append({"time_s": round(now, 3), "endpoint": endpoint, "tenant": tenant.name,
                               "prompt_len": len(ids), "mode": decision.mode, "worker": url, "attempt": attempt,
                               "ranked": list(decision.ranked),
                               "expected_ttft_s": [round(t, 6) for t in decision.expected_ttft_s],
                               "cached_by_worker": list(decision.cached_by_worker),
                               "cached_tokens": decision.cached_tokens if attempt == 0 else None,
                               **({"pull": pull} if pull is not None else {}),
                               **({"ties": "drawn"} if decision.tie_drawn else {}),  # (other routers serve too)
                               **({"request_id": request_id} if request_id is not None else {}),
                               # held for a copy in flight to its first choice (`Decision.wait_inflight`), seconds
                               **({"held_s": round(held_s, 4)} if held_s is not None else {})})
        if self.link is not None and ids:
            item = {**self._report_fields(url, ids, hashes, hash_page_size, tenant), "prompt_len": len(ids)}
            session_id = body.get("session_id") or body.get("user")
            if isinstance(session_id, str):
                if len(session_id) > MAX_SESSION_ID_LEN:
                    session_id = hashlib.sha256(session_id.encode()).hexdigest()
                item["session_id"] = session_id
            self.link.report_arrival(item)

    def _report_fields(self, url: str, ids: list[int], hashes: list[int], hash_page_size: int,
                       tenant: Tenant) -> dict:
        """What an arrival or finish report says of a request: its prompt as page hashes when they were computed
        at this worker's page size (the coordinator needs not rehash them), else as token ids."""
        item: dict = {"cache_salt": tenant.namespace, "worker": self.pool.report_id(url), "class": tenant.name}
        page_size = self.pool.page_size(url, 0)
        if hashes and page_size == hash_page_size:
            item.update(page_hashes=hashes, page_size=page_size)
        else:
            item["input_ids"] = ids
        return item

    def _ran_alone(self, url: str, decision: Decision, prompt_len: int,
                   ttft_s: Optional[float]) -> Optional[tuple[int, int]]:
        """A request sent straight to a worker where it ran alone (`Decision.idle`, no copy awaited): its
        (uncached, cached) tokens after feeding its time to first token to the speed calibration, which then
        rescales the cost model's prefill terms; None for any other request, or without calibration."""
        if (self.speed is None or ttft_s is None or decision.mode != DIRECTORY or url not in decision.idle
                or decision.wait_inflight or url not in decision.ranked):
            return None
        cached = min(prompt_len, decision.cached_by_worker[decision.ranked.index(url)])
        if not self.speed.observe(prompt_len - cached, cached, ttft_s):
            return None
        self.model.prefill_scale = self.speed.scale(self.model.profile)
        self.metrics.prefill_speed.set(self.model.prefill_scale)
        return prompt_len - cached, cached

    def _on_finished(self, url: str, ids: list[int], hashes: list[int], hash_page_size: int, tenant: Tenant,
                     stop: Optional[str], ttft_s: Optional[float] = None,
                     alone: Optional[tuple[int, int]] = None) -> None:
        """Reports an answer's end, how it ended (so the coordinator can predict the session's next turn), its
        time to first token from the router's decision (the coordinator's copy ledger judges copies by it) and,
        when it ran alone, its uncached and cached tokens (the coordinator's speed calibration)."""
        if self.link is not None and ids:
            item = {**self._report_fields(url, ids, hashes, hash_page_size, tenant), "stop": stop}
            if ttft_s is not None and ttft_s >= 0:
                item["ttft_s"] = round(ttft_s, 6)
                if alone is not None:
                    item["alone_new_tokens"], item["alone_cached_tokens"] = alone
            self.link.report_finish(item)

    def status(self, num_decisions: int = 256) -> dict:
        """Returns: what `/kvrep/status` shows: the coordinator link, the workers, the last `num_decisions`
        decisions (at most `MAX_DECISIONS_KEPT`)."""
        link = self.link
        return {
            "coordinator": None if link is None else {
                "url": link.cfg.url, "reachable": link.reachable, "last_error": link.last_error,
                "arrivals_sent": link.num_arrivals_sent, "arrivals_dropped": link.num_arrivals_dropped,
                "finishes_sent": link.num_finishes_sent, "finishes_dropped": link.num_finishes_dropped,
                "lookups_shed": link.num_lookups_shed,
                "send_relay": {"name": self.name, "routers": link.num_routers, "posted": link.outbox.num_sent,
                               "posts": link.outbox.num_posts, "dropped": link.outbox.num_dropped,
                               "peers": self.pool.peers.status()},
                "directory_replica": None if self.replica is None else self.replica.status()},
            "tokenizer": self.tokenizer is not None,
            "vocab_size": self.bounds().vocab_size,
            "tenants": self.tenants.namespaces() if self.tenants.required else None,
            "workers": self.pool.status(time.monotonic()),
            "prefill_speed": None if self.speed is None else self.speed.status(self.model.profile),
            "last_decisions": list(self.decisions)[-num_decisions:] if num_decisions > 0 else [],
        }
