"""The router's HTTP server (aiohttp): SGLang's native and OpenAI endpoints, proxied to the chosen worker.

Per request: tenant from the API key (401 if unknown), prompt token ids (`tokenize`), a ranked decision
(`policy.rank_by_ttft` on the coordinator's directory, or `ApproxPrefixIndex.rank` when it is unreachable), then
the body with the tenant's `cache_salt` goes to the first choice; a connection failure before the worker answered
moves on to the next choice (no request is sent twice to a worker that received it). Streams (SSE) are passed
through chunk by chunk. The arrival, and the end of the answer (with how it ended: the session-continuation
signal), are reported to the coordinator in the background.

Workers are keyed by URL inside the router; the coordinator's ids are translated through its /workers answer.
Run by `kvrep router` (`radix_sync.cli`), or in-process with `build_app` (tests, `scripts/bench_router.py`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import defaultdict, deque
from typing import Optional

import aiohttp
from aiohttp import web

from radix_sync.fastjson import dumps as _dumps, loads as _loads
from radix_sync.hashing import page_hashes
from radix_sync.router.config import RouterConfig
from radix_sync.router.coordinator_link import CoordinatorLink, LinkConfig
from radix_sync.router.directory_replica import DirectoryReplica
from radix_sync.router.metrics import RouterMetrics
from radix_sync.router.policy import (ApproxPrefixIndex, CopyInFlight, Decision, WorkerState, cost_model,
                                      rank_by_ttft)
from radix_sync.router.tenants import Tenant, TenantTable, Unauthorized, apply_namespace
from radix_sync.router.tokenize import BadRequest, PromptTokenizer


log = logging.getLogger("kvrep.router")

_RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_HOP_HEADERS = {"host", "content-length", "authorization", "x-api-key", "connection", "keep-alive",
                "transfer-encoding", "te", "upgrade", "proxy-authorization", "accept-encoding"}
ROUTER_KEY = web.AppKey("router", object)

# `"finish_reason": "tool_calls"` (OpenAI) or `"finish_reason": {"type": "length", ...}` (SGLang's meta_info)
_FINISH_RE = re.compile(rb'"finish_reason"\s*:\s*(?:"([A-Za-z_]+)"|\{[^{}]*?"type"\s*:\s*"([A-Za-z_]+)")')
_STOP_NAMES = {"tool_calls": "tool_use", "function_call": "tool_use"}
_STREAM_TAIL_BYTES = 4096


def finish_reason(data: bytes) -> Optional[str]:
    """How an answer ended, from its last `finish_reason` (JSON body or SSE tail): `tool_use` for a tool call
    (OpenAI's `tool_calls`), else the reported kind (`stop`, `length`, `abort`, ...); None if absent."""
    last = None
    for m in _FINISH_RE.finditer(data):
        last = m.group(1) or m.group(2)
    if last is None:
        return None
    name = last.decode()
    return _STOP_NAMES.get(name, name)


class NoWorker(Exception):
    """Every candidate refused the connection (HTTP 503)."""


class Router:
    """Owns the upstream connection pool, the coordinator link, the approximate index and per-worker counters."""

    def __init__(self, cfg: RouterConfig, tokenizer: Optional[PromptTokenizer] = None,
                 tenants: Optional[TenantTable] = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tenants = tenants or (TenantTable.load(cfg.tenants_path) if cfg.tenants_path else TenantTable.open())
        self.metrics = RouterMetrics()
        self.index = ApproxPrefixIndex()
        if cfg.profile:
            from radix_sync.policy.cost import CostModel, load_profile
            self.model = CostModel(load_profile(cfg.profile))
        else:
            self.model = cost_model(cfg.costs)
        self.session: Optional[aiohttp.ClientSession] = None
        self.link: Optional[CoordinatorLink] = None
        self.replica: Optional[DirectoryReplica] = None
        """The coordinator's holdings, mirrored from its change feed (None: ask it per request)."""
        self._tasks: list[asyncio.Task] = []
        self.known: dict[str, WorkerState] = {u.rstrip("/"): WorkerState(u.rstrip("/"), u.rstrip("/"), cfg.page_size)
                                              for u in cfg.worker_urls}
        """url -> worker, as last heard of (static workers plus every worker the coordinator ever listed)."""
        self.static_urls = frozenset(self.known)
        self.listed: Optional[frozenset[str]] = None
        """Urls in the coordinator's last /workers answer (None before the first)."""
        self.coord_ids: dict[str, str] = {}
        """url -> coordinator worker id."""
        self.outstanding: dict[str, int] = defaultdict(int)
        self.unstarted_tokens: dict[str, int] = defaultdict(int)
        # attention work of the same requests: (new x context pairs, cached x cached pairs)
        self.unstarted_pairs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.down_until: dict[str, float] = {}
        self.decisions: deque = deque(maxlen=256)

    # --------------------------------------------------------------------------------------------- lifecycle
    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.cfg.max_connections_per_worker,
                                         enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.cfg.coordinator_url:
            self.link = CoordinatorLink(LinkConfig(self.cfg.coordinator_url.rstrip("/"),
                                                   timeout_s=self.cfg.coordinator_timeout_s), self.session)
            self._tasks.append(asyncio.create_task(self.link.run_arrivals()))
            if self.cfg.directory_feed:
                self.replica = DirectoryReplica()
                self._tasks.append(asyncio.create_task(self.link.run_directory_feed(self.replica)))
            await self.refresh_workers()
        if self.cfg.tokenizer == "auto" and self.tokenizer is None:
            self._tasks.append(asyncio.create_task(self._load_tokenizer_from_worker()))

    async def stop(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.link is not None:
            await self.link.flush_arrivals()
        if self.session is not None:
            await self.session.close()

    async def _load_tokenizer_from_worker(self) -> None:
        for url in self._candidates():
            try:
                async with self.session.get(url + "/model_info", timeout=aiohttp.ClientTimeout(total=5)) as r:
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
    async def refresh_workers(self) -> None:
        """Learns the coordinator's workers (if it is reachable) without routing anything."""
        if self.link is not None:
            state = await self.link.cluster_state()
            if state is not None:
                self._sync_workers(state.workers)

    def _sync_workers(self, workers: tuple[dict, ...]) -> dict[str, WorkerState]:
        """Merges the coordinator's /workers into `known`; returns url -> state with reported loads."""
        out = {}
        for w in workers:
            url = (w.get("url") or "").rstrip("/")
            if not url:
                continue
            load = w.get("load") or {}
            st = WorkerState(url, url, int(w.get("page_size") or self.cfg.page_size),
                             int(load.get("num_running_reqs", 0)), int(load.get("num_waiting_reqs", 0)),
                             int(load.get("num_waiting_tokens", 0)))
            self.known[url] = WorkerState(url, url, st.page_size)
            self.coord_ids[url] = str(w.get("id"))
            out[url] = st
        self.listed = frozenset(out)
        return out

    def _pool(self) -> list[str]:
        """The workers to serve from: while the coordinator answers, a worker it no longer lists (it went silent:
        dead, or cut off) is left out unless it is a static one or nothing else is left; with the coordinator
        down (or restarted and not yet told) every known worker stays."""
        pool = list(self.known)
        if self.listed and self.link is not None and self.link.reachable:
            pool = [u for u in pool if u in self.listed or u in self.static_urls] or pool
        return pool

    def _candidates(self) -> list[str]:
        """Workers of the pool not in cool-down (all of them if every one is)."""
        now = time.monotonic()
        pool = self._pool()
        up = [u for u in pool if self.down_until.get(u, 0.0) <= now]
        return up or pool

    def _with_local_load(self, st: WorkerState, directory: bool) -> WorkerState:
        # NOTE: load reports lag; what this router sent and has not seen finish is a lower bound on the queue.
        mine = self.outstanding[st.url]
        if not directory:
            pairs, cpairs = self.unstarted_pairs[st.url]
            return WorkerState(st.worker_id, st.url, st.page_size, mine, 0, self.unstarted_tokens[st.url], pairs,
                               cpairs)
        return WorkerState(st.worker_id, st.url, st.page_size, st.num_running,
                           max(st.num_waiting, mine - st.num_running),
                           max(st.num_waiting_tokens, self.unstarted_tokens[st.url]), *self.unstarted_pairs[st.url])

    # ----------------------------------------------------------------------------------------------- deciding
    async def decide(self, ids: list[int], namespace: str) -> tuple[Decision, list[int], int]:
        """Ranks the candidate workers for a prompt.

        Returns:
            the decision, the prompt's page hashes (for the router's own view) and their page size.
        """
        state = await self.link.cluster_state() if self.link is not None else None
        reported = self._sync_workers(state.workers) if state is not None else {}
        if state is not None and any(u not in self.coord_ids for u in self.known):
            # a worker we route to is missing from the (cached) coordinator view: without its id its directory
            # matches would read as 0, so refresh once before deciding
            state = await self.link.cluster_state(force=True)
            reported = self._sync_workers(state.workers) if state is not None else {}
        cands = self._candidates()
        if not cands:
            raise NoWorker("no worker known")
        page_size = min(self.known[u].page_size for u in cands)
        hashes = page_hashes(ids, page_size, namespace)
        matched = None
        if state is not None and ids:
            same = all(self.known[u].page_size == page_size for u in cands)
            replica = self.replica
            if same and replica is not None and replica.usable():
                # NOTE: the local mirror of the directory: no call per request (the coordinator's admin API
                # cannot answer ~1,000 lookups/s on a small machine); at most a long poll's delivery behind
                matched = {wid: pages * page_size for wid, pages in replica.match(hashes).items()}
            else:
                matched = await self.link.lookup(ids, namespace, (hashes, page_size) if same and hashes else None)
        if matched is not None:
            workers = [self._with_local_load(reported.get(u, self.known[u]), True) for u in cands]
            by_url = {u: matched.get(cid, 0) for u, cid in self.coord_ids.items()}
            url_of = {cid: u for u, cid in self.coord_ids.items()}
            copies = [CopyInFlight(url_of[c.source], url_of[c.target], c.namespace, c.num_tokens)
                      for c in state.copies if c.source in url_of and c.target in url_of]
            decision = rank_by_ttft(workers, by_url, copies, len(ids), namespace, time.monotonic(), self.model)
        else:
            workers = [self._with_local_load(self.known[u], False) for u in cands]
            decision = self.index.rank(workers, hashes, len(ids))
            self.metrics.fallbacks += 1
        return decision, hashes, page_size

    async def _wait_for_copy(self, url: str) -> None:
        """Holds a request (bounded) until the copy in flight to `url` is no longer pending/running."""
        cid = self.coord_ids.get(url)
        deadline = time.monotonic() + self.cfg.max_wait_inflight_s
        while time.monotonic() < deadline and self.link is not None:
            state = await self.link.cluster_state()
            if state is None or not any(c.target == cid for c in state.copies):
                return
            await asyncio.sleep(0.02)

    # --------------------------------------------------------------------------------------------- forwarding
    async def forward(self, request: web.Request, path: str, body: dict, decision: Decision, endpoint: str,
                      ids: list[int], hashes: list[int], tenant: Tenant,
                      hash_page_size: int = 0) -> web.StreamResponse:
        """Sends the body to the ranked workers in turn until one answers; streams or returns its answer.

        From the decision until the worker starts answering, the request counts as queued on the worker it is
        headed for (also while it is held for a copy in flight), so the next decisions see it."""
        data = _dumps(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers["Content-Type"] = "application/json"
        last_exc: Optional[BaseException] = None
        for attempt, url in enumerate(decision.ranked):
            cached = min(len(ids), decision.cached_tokens) if attempt == 0 else 0
            unqueue = self._queue(url, len(ids) - cached, cached)
            self.outstanding[url] += 1
            started = False
            try:
                if attempt == 0 and decision.wait_inflight and self.cfg.max_wait_inflight_s > 0:
                    await self._wait_for_copy(url)
                async with self.session.post(url + path, data=data, headers=headers, params=request.query,
                                             timeout=self._timeout()) as up:
                    started = True
                    self._on_dispatched(url, endpoint, decision, ids, hashes, tenant, body, attempt, hash_page_size)
                    # its prefill counts as queued work until the first output arrives (a stream's first chunk)
                    resp, tail = await self._relay(request, up, unqueue, url)
                    if up.status == 200:
                        self._on_finished(url, ids, hashes, hash_page_size, tenant, finish_reason(tail))
                    return resp
            except _RETRYABLE as exc:
                if started:
                    raise
                last_exc = exc
                self.down_until[url] = time.monotonic() + self.cfg.worker_cooldown_s
                self.metrics.failures[(url, type(exc).__name__)] += 1
                log.warning("worker %s failed before answering (%s); trying the next choice", url, exc)
            finally:
                self.outstanding[url] -= 1
                unqueue()
        raise NoWorker(f"no worker answered: {last_exc}")

    def _queue(self, url: str, uncached: int, cached: int):
        """Counts a request's prefill work as headed for `url` and not started. Returns: the (idempotent) call
        that stops counting it."""
        uncached = max(0, uncached)
        work = (uncached, uncached * cached + uncached * (uncached + 1) / 2.0, cached * (cached + 1) / 2.0)
        self._add_queued(url, work, +1)
        done = []

        def unqueue() -> None:
            if not done:
                done.append(True)
                self._add_queued(url, work, -1)
        return unqueue

    def _add_queued(self, url: str, work: tuple[int, float, float], sign: int) -> None:
        self.unstarted_tokens[url] += sign * work[0]
        pairs = self.unstarted_pairs[url]
        pairs[0] += sign * work[1]
        pairs[1] += sign * work[2]
        if self.unstarted_tokens[url] == 0:
            pairs[0] = pairs[1] = 0.0  # no float drift

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                     sock_read=self.cfg.read_timeout_s)

    def _on_dispatched(self, url: str, endpoint: str, decision: Decision, ids: list[int], hashes: list[int],
                       tenant: Tenant, body: dict, attempt: int, hash_page_size: int = 0) -> None:
        now = time.monotonic()
        self.index.observe(url, hashes, self.known[url].page_size if url in self.known else self.cfg.page_size, now)
        self.metrics.requests[(url, endpoint, decision.mode)] += 1
        if attempt:
            self.metrics.failovers += 1
        self.decisions.append({"time_s": round(now, 3), "endpoint": endpoint, "tenant": tenant.name,
                               "prompt_len": len(ids), "mode": decision.mode, "worker": url, "attempt": attempt,
                               "ranked": list(decision.ranked),
                               "expected_ttft_s": [round(t, 6) for t in decision.expected_ttft_s],
                               "cached_by_worker": list(decision.cached_by_worker),
                               "cached_tokens": decision.cached_tokens if attempt == 0 else None})
        if self.link is not None and ids:
            item = {**self._report_fields(url, ids, hashes, hash_page_size, tenant), "prompt_len": len(ids)}
            session_id = body.get("session_id") or body.get("user")
            if isinstance(session_id, str):
                item["session_id"] = session_id
            self.link.report_arrival(item)

    def _report_fields(self, url: str, ids: list[int], hashes: list[int], hash_page_size: int,
                       tenant: Tenant) -> dict:
        """What an arrival or finish report says of a request: its prompt as page hashes when they were computed
        at this worker's page size (the coordinator needs not rehash them), else as token ids."""
        item: dict = {"cache_salt": tenant.namespace, "worker": self.coord_ids.get(url, url), "class": tenant.name}
        page_size = self.known[url].page_size if url in self.known else 0
        if hashes and page_size == hash_page_size:
            item.update(page_hashes=hashes, page_size=page_size)
        else:
            item["input_ids"] = ids
        return item

    def _on_finished(self, url: str, ids: list[int], hashes: list[int], hash_page_size: int, tenant: Tenant,
                     stop: Optional[str]) -> None:
        """Reports an answer's end and how it ended, so the coordinator can predict the session's next turn."""
        if self.link is not None and ids:
            self.link.report_finish({**self._report_fields(url, ids, hashes, hash_page_size, tenant), "stop": stop})

    async def _relay(self, request: web.Request, up: aiohttp.ClientResponse, on_first_output=lambda: None,
                     url: str = "") -> tuple[web.StreamResponse, bytes]:
        """Returns: the response sent to the client and the answer's tail (where its finish reason is).

        A stream whose worker dies midway (its bytes were already sent: no failover) ends with an SSE error event
        and no `[DONE]`, and the connection is closed; the tail is then empty (no finish to report)."""
        ctype = up.headers.get("Content-Type", "application/json")
        if "text/event-stream" in ctype:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
            await resp.prepare(request)
            tail = b""
            chunks = up.content.iter_any().__aiter__()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    return await self._end_broken_stream(resp, url, exc), b""
                on_first_output()
                await resp.write(chunk)  # a client that went away raises here, as it should
                tail = (tail + chunk)[-_STREAM_TAIL_BYTES:]
            await resp.write_eof()
            return resp, tail
        payload = await up.read()
        on_first_output()
        return web.Response(body=payload, status=up.status, headers={"Content-Type": ctype}), payload

    async def _end_broken_stream(self, resp: web.StreamResponse, url: str, exc: BaseException) -> web.StreamResponse:
        self.metrics.failures[(url, "stream_" + type(exc).__name__)] += 1
        log.warning("worker %s failed mid-stream (%s: %s); ending the client's stream with an error", url,
                    type(exc).__name__, exc)
        msg = {"error": {"message": f"upstream worker failed mid-stream: {type(exc).__name__}",
                         "type": "upstream_error", "code": 502}}
        try:
            await resp.write(b"data: " + _dumps(msg) + b"\n\n")
        except (ConnectionError, RuntimeError, aiohttp.ClientConnectionError):
            pass  # the client is gone too
        resp.force_close()
        return resp

    async def any_worker(self, request: web.Request, method: str, path: str) -> web.Response:
        """Proxies a read-only call (models, server info) to the first worker that answers."""
        for url in sorted(self._candidates(), key=lambda u: self.outstanding[u]):
            try:
                async with self.session.request(method, url + path, params=request.query,
                                                timeout=aiohttp.ClientTimeout(total=30,
                                                                              connect=self.cfg.connect_timeout_s)) as up:
                    return web.Response(body=await up.read(), status=up.status,
                                        headers={"Content-Type": up.headers.get("Content-Type", "application/json")})
            except _RETRYABLE + (asyncio.TimeoutError,):
                self.down_until[url] = time.monotonic() + self.cfg.worker_cooldown_s
        raise NoWorker("no worker answered")

    async def fan_out(self, request: web.Request, path: str) -> web.Response:
        """Sends a call to every known worker; 200 only if all answered 200."""
        async def one(url: str) -> tuple[str, int, str]:
            try:
                async with self.session.post(url + path, params=request.query,
                                             timeout=aiohttp.ClientTimeout(total=120,
                                                                           connect=self.cfg.connect_timeout_s)) as r:
                    return url, r.status, (await r.text())[:500]
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return url, 502, f"{type(exc).__name__}: {exc}"

        await self.refresh_workers()
        results = await asyncio.gather(*(one(u) for u in self._pool()))
        self.index = ApproxPrefixIndex(self.index.cfg)
        ok = bool(results) and all(s == 200 for _, s, _ in results)
        return web.json_response({"success": ok, "workers": {u: {"status": s, "body": b} for u, s, b in results}},
                                 status=200 if ok else 500)

    def status(self) -> dict:
        now = time.monotonic()
        link = self.link
        return {
            "coordinator": None if link is None else {
                "url": link.cfg.url, "reachable": link.reachable, "last_error": link.last_error,
                "arrivals_sent": link.num_arrivals_sent, "arrivals_dropped": link.num_arrivals_dropped,
                "finishes_sent": link.num_finishes_sent, "finishes_dropped": link.num_finishes_dropped,
                "lookups_shed": link.num_lookups_shed,
                "directory_replica": None if self.replica is None else self.replica.status()},
            "tokenizer": self.tokenizer is not None,
            "tenants": self.tenants.namespaces() if self.tenants.required else None,
            "workers": [{"url": u, "id": self.coord_ids.get(u), "page_size": w.page_size,
                         "listed": None if self.listed is None else (u in self.listed),
                         "outstanding": self.outstanding[u],
                         "cooldown_s": round(max(0.0, self.down_until.get(u, 0.0) - now), 3)}
                        for u, w in self.known.items()],
            "last_decisions": list(self.decisions),
        }


# ------------------------------------------------------------------------------------------------- handlers
def _router(request: web.Request) -> Router:
    return request.app[ROUTER_KEY]


def _tenant(request: web.Request) -> Tenant:
    r = _router(request)
    try:
        return r.tenants.resolve(request.headers.get("Authorization"), request.headers.get("x-api-key"))
    except Unauthorized as exc:
        r.metrics.unauthorized += 1
        raise web.HTTPUnauthorized(text=json.dumps({"error": str(exc)}), content_type="application/json") from None


async def _json_body(request: web.Request) -> dict:
    try:
        body = _loads(await request.read())
    except ValueError:  # json.JSONDecodeError and orjson.JSONDecodeError are ValueErrors
        raise web.HTTPBadRequest(text=json.dumps({"error": "body is not JSON"}), content_type="application/json")
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}),
                                 content_type="application/json")
    return body


def _prompt_ids(r: Router, endpoint: str, body: dict) -> list[int]:
    try:
        if r.tokenizer is not None:
            return r.tokenizer.prompt_ids(endpoint, body)
        ids = body.get("input_ids") if endpoint == "generate" else body.get("prompt")
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            return ids
        return []  # no tokenizer: routed by load only
    except BadRequest as exc:
        raise web.HTTPBadRequest(text=json.dumps({"error": str(exc)}), content_type="application/json") from None


def _proxy_handler(endpoint: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        r = _router(request)
        tenant = _tenant(request)
        body = await _json_body(request)
        t0 = time.perf_counter()
        ids = _prompt_ids(r, endpoint, body)
        try:
            decision, hashes, hash_page_size = await r.decide(ids, tenant.namespace)
            decision_s = time.perf_counter() - t0
            r.metrics.decision_s.observe(decision_s)
            resp = await r.forward(request, request.path, apply_namespace(body, tenant), decision, endpoint, ids,
                                   hashes, tenant, hash_page_size)
            if not resp.prepared:  # streams have sent their headers already
                resp.headers["x-kvrep-decision-us"] = str(int(decision_s * 1e6))
            return resp
        except NoWorker as exc:
            r.metrics.no_worker += 1
            return web.json_response({"error": str(exc)}, status=503)
        except asyncio.TimeoutError:
            return web.json_response({"error": "worker timed out"}, status=504)
        except aiohttp.ClientError as exc:  # the worker failed after it started answering: no failover
            log.warning("worker failed mid-answer: %s: %s", type(exc).__name__, exc)
            return web.json_response({"error": f"upstream worker failed mid-answer: {type(exc).__name__}"},
                                     status=502)
    return handler


def _passthrough(method: str, path: str):
    async def handler(request: web.Request) -> web.Response:
        _tenant(request)
        try:
            return await _router(request).any_worker(request, method, path)
        except NoWorker as exc:
            return web.json_response({"error": str(exc)}, status=503)
    return handler


async def _flush_cache(request: web.Request) -> web.Response:
    _tenant(request)
    return await _router(request).fan_out(request, "/flush_cache")


async def _health(request: web.Request) -> web.Response:
    r = _router(request)
    await r.refresh_workers()
    ok = bool(r.known)
    return web.json_response({"ok": ok, "num_workers": len(r.known)}, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    r = _router(request)
    if r.link is not None:
        r.metrics.arrivals_dropped = r.link.num_arrivals_dropped
    return web.Response(text=r.metrics.render(), content_type="text/plain", charset="utf-8")


async def _status(request: web.Request) -> web.Response:
    return web.json_response(_router(request).status())


async def _hints(request: web.Request) -> web.Response:
    r = _router(request)
    tenant = _tenant(request)
    body = await _json_body(request)
    if r.link is None:
        return web.json_response({"error": "no coordinator configured"}, status=503)
    endpoint = "chat" if "messages" in body else "generate"
    ids = _prompt_ids(r, endpoint, body)
    if not ids:
        return web.json_response({"error": "hint needs input_ids, text or messages (text needs a tokenizer)"},
                                 status=400)
    hint = {k: body[k] for k in ("kind", "k", "ttl_s", "delay_s") if k in body}
    hint.update(input_ids=ids, cache_salt=tenant.namespace)
    status, answer = await r.link.hint(hint)
    return web.json_response(answer, status=status)


def build_app(cfg: RouterConfig, tokenizer: Optional[PromptTokenizer] = None,
              tenants: Optional[TenantTable] = None) -> web.Application:
    """Returns: the aiohttp application (its router is `app[ROUTER_KEY]`)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    router = Router(cfg, tokenizer, tenants)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    for path, endpoint in (("/generate", "generate"), ("/v1/completions", "completions"),
                           ("/v1/chat/completions", "chat")):
        app.router.add_post(path, _proxy_handler(endpoint))
    for path in ("/v1/models", "/model_info", "/server_info", "/get_model_info", "/get_server_info"):
        app.router.add_get(path, _passthrough("GET", path))
    app.router.add_route("*", "/flush_cache", _flush_cache)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/kvrep/status", _status)
    app.router.add_post("/kvrep/hints", _hints)
    return app


async def serve(cfg: RouterConfig, tokenizer: Optional[PromptTokenizer] = None) -> None:
    """Runs the router until SIGTERM or SIGINT, then lets in-flight requests finish (`shutdown_timeout_s`)."""
    import signal

    app = build_app(cfg, tokenizer)
    runner = web.AppRunner(app, shutdown_timeout=cfg.shutdown_timeout_s, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"kvrep router: listening on http://{cfg.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: waiting up to %gs for in-flight requests", cfg.shutdown_timeout_s)
    await runner.cleanup()
