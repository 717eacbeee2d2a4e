"""Forwarding to workers: the ranked failover, the streaming relay, and the calls that go to any or every worker.

A connection failure before the worker answered moves the request on to the next choice and puts the worker in
cool-down; a failure after it started answering cannot be failed over (bytes were sent). A pooled connection the
worker dropped before answering (it closed it as idle while the request was being written: "Connection reset",
"Server disconnected") is not the worker failing: the request is sent to the same worker once more, on a new
connection, and only if that fails too does it move on. Streams (SSE) are passed through chunk by chunk, keeping
the tail where the answer's `finish_reason` is. Owned by `radix_sync.router.service.Router`; runs on its event loop.

Every call to a worker carries the workers' API key (`Authorization: Bearer <worker-api-key>`, SGLang's
`--api-key`) and never the client's own `Authorization` / `x-api-key`; a worker's answer that quotes the key
(SGLang's `/server_info` lists its server args and launch command) has it replaced before the client sees it.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Awaitable, Callable, Optional, Sequence

import aiohttp
from aiohttp import web

from radix_sync.fastjson import dumps as _dumps
from radix_sync.router.config import RouterConfig
from radix_sync.router.metrics import RouterMetrics
from radix_sync.router.policy import Decision
from radix_sync.router.pool import WorkerPool

log = logging.getLogger("kvrep.router")

_RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_HOP_HEADERS = {"host", "content-length", "authorization", "x-api-key", "connection", "keep-alive",
                "transfer-encoding", "te", "upgrade", "proxy-authorization", "accept-encoding"}

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


class Proxy:
    """Sends requests to workers over one connection pool (`session`, set by the owner when it starts)."""

    def __init__(self, cfg: RouterConfig, pool: WorkerPool, metrics: RouterMetrics,
                 worker_api_key: Optional[str] = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.session: Optional[aiohttp.ClientSession] = None
        self.fresh_session: Optional[aiohttp.ClientSession] = None
        """Never reuses a connection: the second try after a pooled connection was dropped."""
        self._key = worker_api_key
        self.worker_headers: dict[str, str] = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        """What every call to a worker carries (the workers' API key)."""

    def redact(self, payload: bytes) -> bytes:
        """Returns: `payload` with every occurrence of the workers' API key replaced."""
        return payload.replace(self._key.encode(), b"<redacted>") if self._key else payload

    async def forward(self, request: web.Request, path: str, body: dict, decision: Decision, prompt_len: int,
                      wait_for_copy: Callable[[str], Awaitable[None]],
                      on_dispatched: Callable[[str, int], None],
                      on_finished: Callable[[str, Optional[str], Optional[float]], None],
                      pages: Sequence[int] = ()) -> web.StreamResponse:
        """Sends the body to the ranked workers in turn until one answers; streams or returns its answer.

        From the decision until the worker starts answering, the request counts as queued on the worker it is
        headed for (also while it is held for a copy in flight), so the next decisions see it.

        Args:
            request: the client's request (its headers and query go along).
            path: the worker's endpoint.
            body: what to send (the tenant's namespace already applied).
            decision: the ranking; its first choice may be waiting for a copy in flight.
            prompt_len: tokens of the prompt.
            wait_for_copy: holds the request (bounded) for the copy in flight to a worker.
            on_dispatched: called with (url, attempt) once a worker accepted the request.
            on_finished: called with (url, how the answer ended, when its first output came: `time.monotonic()`)
                after a 200 answer.
            pages: the prompt's page hashes at the decision's page size: when the request goes to a worker that is
                idle (`Decision.idle`), counted as headed there with its queued work (`WorkerPool.queue`), so the
                next decisions see what it will have computed there before theirs start.
        Returns:
            the response sent to the client.
        Raises:
            NoWorker: every choice failed before answering.
        """
        data = _dumps(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.update(self.worker_headers, **{"Content-Type": "application/json"})
        pool = self.pool
        last_exc: Optional[BaseException] = None
        for attempt, url in enumerate(decision.ranked):
            cached = min(prompt_len, decision.cached_tokens) if attempt == 0 else 0
            # NOTE: only a request that starts at once (an idle worker, not held) computes its prefix before the
            # next ones there start: SGLang batches the requests waiting together, none reusing another's prefix
            alone = attempt == 0 and url in decision.idle and not decision.wait_inflight
            sent = pool.dispatch(url, prompt_len - cached, cached, pages if alone else ())
            started = False
            try:
                if attempt == 0 and decision.wait_inflight and self.cfg.max_wait_inflight_s > 0:
                    await wait_for_copy(url)
                elif alone:  # it starts computing now (`WorkerPool.alone_since`)
                    pool.started_alone(url, time.monotonic())
                async with await self._send(url, url + path, data, headers, request.query) as up:
                    started = True
                    on_dispatched(url, attempt)
                    # its prefill counts as queued work until the first output arrives (a stream's first chunk)
                    first: list[float] = []

                    def first_output(sent=sent, first=first) -> None:
                        if not first:
                            first.append(time.monotonic())
                            sent.started()

                    resp, tail = await self._relay(request, up, first_output, url)
                    if up.status == 200:
                        on_finished(url, finish_reason(tail), first[0] if first else None)
                    return resp
            except _RETRYABLE as exc:
                if started:
                    raise
                last_exc = exc
                pool.mark_down(url, time.monotonic())
                self.metrics.upstream_failures.labels(url, type(exc).__name__).inc()
                log.warning("worker %s failed before answering (%s); trying the next choice", url, exc)
            finally:
                sent.done()
        raise NoWorker(f"no worker answered: {last_exc}")

    async def _send(self, url: str, target: str, data: bytes, headers: dict, params) -> aiohttp.ClientResponse:
        """Returns: the worker's response (its status and headers read), sent on a pooled connection, or once more
        on a new one when the pooled one was dropped before an answer (not when connecting failed)."""
        try:
            return await self.session.post(target, data=data, headers=headers, params=params, timeout=self._timeout())
        except _RETRYABLE as exc:
            if isinstance(exc, aiohttp.ClientConnectorError) or self.fresh_session is None:
                raise
            self.metrics.upstream_failures.labels(url, "dropped_" + type(exc).__name__).inc()
            log.info("worker %s dropped the connection before answering (%s); once more on a new connection", url, exc)
        return await self.fresh_session.post(target, data=data, headers=headers, params=params,
                                             timeout=self._timeout())

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                     sock_read=self.cfg.read_timeout_s)

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
        payload = self.redact(await up.read())
        on_first_output()
        return web.Response(body=payload, status=up.status, headers={"Content-Type": ctype}), payload

    async def _end_broken_stream(self, resp: web.StreamResponse, url: str, exc: BaseException) -> web.StreamResponse:
        self.metrics.upstream_failures.labels(url, "stream_" + type(exc).__name__).inc()
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

    async def any_worker(self, request: web.Request, method: str, path: str, urls: Sequence[str]) -> web.Response:
        """Proxies a read-only call (models, server info) to the first of `urls` that answers, the least busy
        first."""
        for url in sorted(urls, key=lambda u: self.pool.outstanding[u]):
            try:
                async with self.session.request(method, url + path, params=request.query, headers=self.worker_headers,
                                                timeout=aiohttp.ClientTimeout(total=30,
                                                                              connect=self.cfg.connect_timeout_s)) as up:
                    return web.Response(body=self.redact(await up.read()), status=up.status,
                                        headers={"Content-Type": up.headers.get("Content-Type", "application/json")})
            except _RETRYABLE + (asyncio.TimeoutError,):
                self.pool.mark_down(url, time.monotonic())
        raise NoWorker("no worker answered")

    async def fan_out(self, request: web.Request, path: str, urls: Sequence[str]) -> list[tuple[str, int, str]]:
        """Sends a call to every one of `urls`.

        Returns:
            per worker (url, HTTP status (502: no answer), the start of its answer or error).
        """
        async def one(url: str) -> tuple[str, int, str]:
            try:
                async with self.session.post(url + path, params=request.query, headers=self.worker_headers,
                                             timeout=aiohttp.ClientTimeout(total=120,
                                                                           connect=self.cfg.connect_timeout_s)) as r:
                    return url, r.status, self.redact(await r.read())[:500].decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return url, 502, f"{type(exc).__name__}: {exc}"

        return list(await asyncio.gather(*(one(u) for u in urls)))
