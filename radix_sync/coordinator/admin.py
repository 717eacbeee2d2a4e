"""The coordinator's admin HTTP API: one aiohttp handler per endpoint, on an event loop of its own thread.

Bodies are decoded into and answers encoded from the structs of `radix_sync.api` (the router's client uses the
same). A refused request is answered `{"error": ...}` with its status (400 for a malformed body, with msgspec's
message naming the field; 404 for an unknown worker or endpoint); a bug is a 500, logged, and the server keeps
serving. State is read and changed under `coord.lock` (the ZMQ loop thread holds it while it applies facts);
prompts are checked and hashed before the lock is taken, so a long one never holds it.

Credentials (`radix_sync.admin_auth`): every route but `/health` needs `Authorization: Bearer <token>`: the read
token for GET, the write token for POST (the write token also reads). The tokens come from `--admin-tokens PATH`;
without it from `<state dir>/admin-tokens.json`, created (0600) when absent and its path logged.
Started and stopped by `server.Coordinator`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from radix_sync import api
from radix_sync.admin_auth import bearer_middleware
from radix_sync.secret_files import AdminTokens, ensure_tokens, read_tokens as load_tokens
from radix_sync.api import AdminError
from radix_sync.coordinator.replications import STATES, check_token_ids
from radix_sync.coordinator.state import hash_prompt
from radix_sync.coordinator.pull import wait_replication
from radix_sync.coordinator.relay import SendRelay, parse_feed_query
from radix_sync.integrity import IntegrityError

log = logging.getLogger("kvrep.coordinator")


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=api.encode(obj), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except AdminError as exc:
        return _json(api.ErrorAnswer(error=str(exc)), exc.status)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
        return _json(api.ErrorAnswer(error=f"no such endpoint: {request.method} {request.path}"), 404)
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug must not take the admin API down
        log.exception("admin %s %s", request.method, request.path)
        return _json(api.ErrorAnswer(error=f"internal error: {exc}"), 500)


async def _body(request: web.Request, type_):
    return api.decode(await request.read() or b"{}", type_)


TOKENS_FILE = "admin-tokens.json"


def default_state_dir() -> Path:
    """Where a coordinator keeps the files it creates when not told (`$XDG_STATE_HOME/kvrep`, else
    `~/.local/state/kvrep`)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "kvrep"


def admin_tokens(tokens_path: str, state_dir: str) -> tuple[AdminTokens, Path]:
    """The admin tokens: of `tokens_path` when given (it must exist), else of `<state_dir>/admin-tokens.json`,
    created when absent (its path logged). Raises ValueError for a missing or malformed file."""
    if tokens_path:
        return load_tokens(tokens_path), Path(tokens_path)
    path = (Path(state_dir) if state_dir else default_state_dir()) / TOKENS_FILE
    tokens, created = ensure_tokens(path)
    log.warning("admin API tokens %s %s (read: GET routes; write: everything)",
                "created in" if created else "read from", path)
    return tokens, path


class AdminServer:
    """The admin API over HTTP/1.1 keep-alive: one aiohttp event loop on its own thread.

    NOTE: it was a stdlib ThreadingHTTPServer (a thread per connection, Python-level header parsing); at ~1,000
    router lookups/s on 2 cores that thread churn, not the directory, set the latency. The socket is bound here, in
    the constructor, so the port is known (port 0 picks one) before `serve_forever`; the listen backlog is 1,024
    (the default 5 refused connections under a router's burst, and a refused connection makes a router back off
    the directory altogether).
    """

    def __init__(self, coord, host: str, port: int) -> None:
        self.coord = coord
        """The `server.Coordinator` (not imported: it imports this module)."""
        self.tokens, self.tokens_path = admin_tokens(coord.config.admin_tokens, coord.config.state_dir)
        self.sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._changed: Optional[asyncio.Event] = None
        self.relay = SendRelay()
        """The routers' sends, relayed to one another (on this server's loop only: no lock)."""
        self._sent: Optional[asyncio.Event] = None
        self._ready = threading.Event()

    def routes(self) -> list[tuple[str, str, object]]:
        """(method, path, handler) of every endpoint (`radix_sync.api` lists their bodies)."""
        return [
            ("GET", "/health", self.health),
            ("GET", "/workers", self.workers),
            ("GET", "/replications", self.replications),
            ("GET", "/status", self.status),
            ("GET", "/metrics", self.metrics),
            ("GET", "/directory/lookup", self.lookup_query),
            ("POST", "/directory/lookup", self.lookup),
            ("GET", "/directory/feed", self.feed),
            ("POST", "/arrivals", self.arrivals),
            ("POST", "/sends", self.sends),
            ("GET", "/sends/feed", self.sends_feed),
            ("POST", "/hints", self.hints),
            ("POST", "/replicate", self.replicate),
            ("POST", "/replications/wait", self.replication_wait),
            ("POST", "/replicas/drop", self.drop_replicas),
            ("POST", "/demote", self.demote),
            ("POST", "/policy", self.policy),
        ]

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024,
                              middlewares=[bearer_middleware(self.tokens, open_paths=("/health",)), _errors])
        for method, path, handler in self.routes():
            app.router.add_route(method, path, handler)  # NOTE: no implicit HEAD (add_get would add one)
        return app

    # ----------------------------------------------------------------------------------------------- reading
    async def health(self, request: web.Request) -> web.Response:
        return _json(api.Health(ok=True))

    async def workers(self, request: web.Request) -> web.Response:
        with self.coord.lock:
            return _json([w.to_info() for w in self.coord.state.workers.values()])

    async def replications(self, request: web.Request) -> web.Response:
        """`GET /replications[?state=pending,running]`: every copy kept (up to `max_replications_kept`), or those in
        the given states only (a router's view of copies in flight: not the whole history every refresh)."""
        text = request.query.get("state")
        states = None if text is None else {s.strip() for s in text.split(",")}
        if states is not None and not states <= set(STATES):
            raise AdminError(f"state must be comma-separated, from {', '.join(STATES)}")
        with self.coord.lock:
            return _json([r.to_info() for r in self.coord.state.replications.values()
                          if states is None or r.state in states])

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.coord.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _integrity(self) -> str:
        """`ClusterState.check_integrity`, in steps (`check_integrity_steps`), the lock held during each step only:
        on a directory of millions of pages, the whole check under the lock stalled facts and lookups for seconds.
        Returns: "ok" or "violated: ..."."""
        coord = self.coord
        try:
            with coord.lock:
                steps = coord.state.check_integrity_steps()
                next(steps)
            while True:
                # (a sleep in the selector, not 0: it lets go of the GIL too, so the loop thread takes the lock)
                await asyncio.sleep(0.001)
                with coord.lock:
                    next(steps)
        except StopIteration:
            return "ok"
        except IntegrityError as exc:
            return f"violated: {exc}"

    async def status(self, request: web.Request) -> web.Response:
        coord = self.coord
        integrity = await self._integrity()
        with coord.lock:
            st = coord.state
            return _json({
                "integrity": integrity, "coordinator_id": st.coordinator_id, "endpoint": coord.endpoint,
                "policy": coord.policy.name, "mode": coord.mode,
                "num_workers": len(st.workers), "num_pages": st.directory.num_pages(),
                "num_host_pages": st.directory.host.num_pages(),
                "feed": {"epoch": st.directory.feed.epoch, "seq": st.directory.feed.seq},
                "send_relay": self.relay.status(time.monotonic()),
                "num_protocol_errors": st.num_protocol_errors, "num_refused_facts": dict(st.num_refused_facts),
                "num_tick_errors": coord.num_tick_errors, "num_critical_joined": coord.num_critical_joined,
                "num_critical_preempted": coord.num_critical_preempted, "num_decisions_held": coord.num_decisions_held,
                "num_recent_arrivals": len(st.arrivals),
                "num_recent_finishes": len(st.finishes), "num_live_hints": len(st.hints),
                "replicas": [{"worker": w, "replication_id": r, **v}
                             for (w, r), v in st.directory.replicas().items()],
                "sessions": coord.policy.session_stats(),
                "planner": getattr(coord.policy, "last_pass", None),
                "loop": coord.loop_stats.summary(),
                "ledger": st.ledger.status(time.monotonic()),
                "pull_ledger": st.pull_ledger.status(time.monotonic()),
                "plain_workers": [feed.stats() for feed in coord.plain_feeds],
                "demotions": {**coord.num_demotions, "recent": coord.recent_demotions[-20:]},
                "hints": [{"block_hash": b, **{k: round(v, 3) for k, v in t.items()},
                           "planner": [[round(when, 3), what] for when, what in
                                       coord.policy.hint_outcomes.get(b, [])]}
                          for b, t in list(st.hint_times.items())[-20:]],
                "shadow_decisions": coord.shadow_decisions[-100:]})

    # ------------------------------------------------------------------------------------------- the directory
    async def lookup(self, request: web.Request) -> web.Response:
        """`POST /directory/lookup` (`api.LookupRequest`)."""
        req = await _body(request, api.LookupRequest)
        coord = self.coord
        if req.page_hashes is not api.UNSET:  # the router's own hashes: nothing to parse or rehash
            page_size = api.page_size_of(req.page_size)
            with coord.lock:
                max_len = coord.state.config.max_prompt_tokens
            if len(req.page_hashes) * page_size > max_len:
                raise AdminError(f"page_hashes cover more than max_prompt_tokens={max_len}")
            with coord.lock:
                return _json(api.LookupAnswer(matched=coord.state.lookup_hashes(req.page_hashes, page_size)))
        if req.input_ids is api.UNSET:
            raise AdminError("input_ids must be a list of integers")
        return _json(api.LookupAnswer(matched=self._lookup(req.input_ids, api.namespace_of(req.cache_salt))))

    def _lookup(self, token_ids: list[int], namespace: str) -> dict[str, int]:
        """Checks and hashes the prompt without the lock, then matches it under the lock."""
        coord = self.coord
        with coord.lock:
            page_sizes, vocab_size, max_len = coord.state.lookup_params()
        check_token_ids(token_ids, vocab_size, max_len)
        hashed = hash_prompt(token_ids, namespace, page_sizes)
        with coord.lock:
            return coord.state.lookup_hashed(hashed)

    async def lookup_query(self, request: web.Request) -> web.Response:
        """`GET /directory/lookup?input_ids=1,2,3&cache_salt=s`."""
        text = request.query.get("input_ids", "")
        try:
            token_ids = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise AdminError("input_ids must be comma-separated integers") from None
        return _json(api.LookupAnswer(matched=self._lookup(token_ids, request.query.get("cache_salt", ""))))

    async def feed(self, request: web.Request) -> web.Response:
        """`GET /directory/feed?epoch=E&since=S&wait_s=W` (`api.DirectoryFeed`): the directory's holding changes
        after change S of epoch E (or a snapshot), answered at once when there are any, else when the first one
        happens or after W s (long poll, W <= 30)."""
        coord = self.coord
        q = request.query
        try:
            epoch, since = q.get("epoch", ""), int(q.get("since", "0"))
            wait_s = min(max(float(q.get("wait_s", "0")), 0.0), 30.0)
        except ValueError:
            raise AdminError("since must be an integer and wait_s a number") from None
        tiers = q.get("tiers", "0") == "1"  # (host-tier holdings too: `api.DirectoryFeed.host_snapshot`)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            self._changed.clear()
            with coord.lock:
                out = coord.state.directory.feed_since(epoch, since, tiers=tiers)
            left = deadline - loop.time()
            if "snapshot" in out or out["seq"] != since or left <= 0:
                break
            try:  # NOTE: cleared before reading, so a change in between still wakes us
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass
        return _json(api.DirectoryFeed(**out))

    def notify_changed(self) -> None:
        """Thread-safe: wakes the long polls of `/directory/feed` (the directory changed)."""
        loop, event = self._loop, self._changed
        if loop is not None and event is not None and loop.is_running():
            loop.call_soon_threadsafe(event.set)

    # ------------------------------------------------------------------------------------------------ demand
    async def arrivals(self, request: web.Request) -> web.Response:
        """`POST /arrivals` (`api.DemandBatch`): each report recorded, or dropped and named (`dropped`, `errors`)
        when it is malformed; only a body that is not a batch at all is a 400."""
        batch = await _body(request, api.DemandItems)
        if batch.arrivals is api.UNSET and batch.finishes is api.UNSET:
            raise AdminError('body must be {"arrivals": [{"input_ids", "cache_salt"?, "worker"?, "class"?, '
                             '...}], "finishes": [{"page_hashes", "page_size" | "input_ids", '
                             '"cache_salt"?, "worker"?, "stop"?, "class"?}]} (either list may be absent)')
        arrivals = [] if batch.arrivals is api.UNSET else batch.arrivals
        finishes = [] if batch.finishes is api.UNSET else batch.finishes
        now = time.monotonic()
        with self.coord.lock:
            num_a, num_f, errors = self.coord.state.record_demand(arrivals, finishes, now)
        if errors:
            log.warning("dropped %d malformed reports of a batch, the first: %s", len(errors), errors[0])
        return _json(api.DemandRecorded(recorded=num_a, finishes_recorded=num_f, dropped=len(errors),
                                        errors=[e[:500] for e in errors[:10]]))

    async def sends(self, request: web.Request) -> web.Response:
        """`POST /sends` (`api.SendBatch`): a router's send events, relayed to the other routers' feeds at once."""
        batch = await _body(request, api.SendBatch)
        now = time.monotonic()
        accepted = self.relay.post(batch, now)
        self._sent.set()
        return _json(api.SendsAccepted(accepted=accepted, routers=self.relay.routers(now)))

    async def sends_feed(self, request: web.Request) -> web.Response:
        """`GET /sends/feed?router=R&epoch=E&since=S&wait_s=W&serving=0|1` (`api.SendsFeed`): the other routers' send
        events after S, answered at once when there are any, else when the first one comes or after W s (long poll,
        W <= 30); `serving=0`: the caller has sent no request lately (it listens, it does not count as a router)."""
        router, epoch, since, wait_s, serving = parse_feed_query(request.query)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            self._sent.clear()
            out = self.relay.feed(router, epoch, since, time.monotonic(), serving)
            left = deadline - loop.time()
            if out.reset or out.events or out.seq < out.head or left <= 0:
                return _json(out)
            epoch, since = out.epoch, out.seq  # (only this router's own events since: wait past them)
            try:
                await asyncio.wait_for(self._sent.wait(), timeout=min(left, self.relay.router_gone_s / 2))
            except asyncio.TimeoutError:
                pass

    async def hints(self, request: web.Request) -> web.Response:
        req = await _body(request, api.HintRequest)
        now = time.monotonic()
        with self.coord.lock:
            rec = self.coord.state.record_hint(req, now)
        return _json(api.HintRecorded(recorded=1, kind=rec.kind, prefix_len=rec.prefix_len, ttl_s=rec.ttl_s))

    # ------------------------------------------------------------------------------------------------ acting
    async def replicate(self, request: web.Request) -> web.Response:
        return _json(self.coord.admin_replicate(await _body(request, api.ReplicateRequest)))

    async def replication_wait(self, request: web.Request) -> web.Response:
        """`POST /replications/wait` (`api.ReplicationWaitRequest`): a long poll (`pull.wait_replication`)."""
        return _json(await wait_replication(self.coord, await _body(request, api.ReplicationWaitRequest)))

    async def drop_replicas(self, request: web.Request) -> web.Response:
        req = await _body(request, api.DropReplicasRequest)
        return _json(api.ReplicasDropped(dropped=self.coord.drop_replicas(req.worker)))

    async def demote(self, request: web.Request) -> web.Response:
        return _json(self.coord.admin_demote(await _body(request, api.DemoteRequest)))

    async def policy(self, request: web.Request) -> web.Response:
        req = await _body(request, api.PolicyRequest)
        coord = self.coord
        with coord.lock:
            coord.set_policy(req.policy, coord.mode if req.mode is api.UNSET else req.mode, req.reset_demand)
            return _json(api.PolicySet(policy=coord.policy.name, mode=coord.mode))

    # ------------------------------------------------------------------------------------------------ serving
    def serve_forever(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._changed = asyncio.Event()
        self._sent = asyncio.Event()
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, self.sock).start())
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def shutdown(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)

    def server_close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
