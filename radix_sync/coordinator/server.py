"""The coordinator process: a ZMQ ROUTER for worker agents, a JSON admin HTTP API, and the policy tick.

Threads: the control loop owns the ZMQ socket (ZMQ sockets are single-threaded); HTTP handler threads only touch
`ClusterState` under `lock` and hand outgoing commands to the loop through `_outbox` plus a wake pipe. A malformed
message gets an `Error` reply and is counted; nothing a worker sends can stop the loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qs

import zmq
from aiohttp import web

from radix_sync.fastjson import dumps as _dumps, loads as _loads
from radix_sync import protocol as p
from radix_sync.coordinator.policies import LIVE_POLICIES, LivePolicy
from radix_sync.coordinator.state import AdminError, ClusterState, StateConfig, _token_ids, parse_page_hashes
from radix_sync.policy.rules import RuleConfig


log = logging.getLogger("kvrep.coordinator")
POLICIES = tuple(LIVE_POLICIES.names())


@dataclass(frozen=True)
class CoordinatorConfig:
    bind: str = "tcp://127.0.0.1:5600"
    """ZMQ endpoint the worker agents connect to."""
    admin_host: str = "127.0.0.1"
    admin_port: int = 5680
    """Port of the JSON admin API (0 picks a free one)."""
    policy: str = "rules"
    """`kvrep` (the predictive planner), `rules` (the rule-based baseline) or `none` (admin-driven only)."""
    profile: str = "cpu-local"
    """Cost profile the `kvrep` planner starts from (a name in radix_sync/profiles/ or a JSON path)."""
    mode: str = "active"
    """`active` sends the policy's commands; `shadow` only records them."""
    tick_s: float = 0.25
    """Seconds between policy and timer ticks."""
    rules: RuleConfig = RuleConfig()
    state: StateConfig = StateConfig()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (choose one of {', '.join(POLICIES)})")
        if self.mode not in ("active", "shadow"):
            raise ValueError(f"mode must be active or shadow, got {self.mode!r}")
        if not self.tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")


class _LoopStats:
    """How long the ZMQ loop spends planning and handling worker messages (the loop does both on one thread:
    a slow tick delays every worker fact behind it). Written by the loop thread, read under no lock."""

    def __init__(self, keep: int = 256) -> None:
        self.tick_s: deque[float] = deque(maxlen=keep)
        self.batch_s: deque[float] = deque(maxlen=keep)
        self.num_ticks = 0
        self.num_messages = 0
        self.max_tick_s = 0.0
        self.max_batch_s = 0.0

    def tick(self, seconds: float) -> None:
        self.tick_s.append(seconds)
        self.num_ticks += 1
        self.max_tick_s = max(self.max_tick_s, seconds)

    def batch(self, n: int, seconds: float) -> None:
        self.batch_s.append(seconds)
        self.num_messages += n
        self.max_batch_s = max(self.max_batch_s, seconds)

    def summary(self) -> dict:
        def ms(xs: list[float], q: float) -> float:
            return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else 0.0
        ticks, batches = list(self.tick_s), list(self.batch_s)
        return {"ticks": self.num_ticks, "messages": self.num_messages,
                "tick_ms": {"p50": ms(ticks, 0.5), "p99": ms(ticks, 0.99), "max": round(self.max_tick_s * 1e3, 2)},
                "batch_ms": {"p50": ms(batches, 0.5), "p99": ms(batches, 0.99),
                             "max": round(self.max_batch_s * 1e3, 2)}}


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.state = ClusterState(config.state)
        self.lock = threading.Lock()
        self.mode = config.mode
        self.policy = self._make_policy(config.policy)
        self.shadow_decisions: list[dict] = []
        self.num_demotions = {"sent": 0, "shadow": 0}
        self.recent_demotions: list[dict] = []
        """The last demotions decided or asked for: {time_s, worker, tokens, sent} (for `/status`)."""
        self._plan_now = False  # set by the ZMQ loop thread only
        self.loop_stats = _LoopStats()
        self._outbox: "queue.Queue[tuple[bytes, p._Msg]]" = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(config.bind)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._http = _AdminServer(config.admin_host, config.admin_port, _AdminApi(self))
        self.admin_port = self._http.port

    def _make_policy(self, name: str) -> LivePolicy:
        return LIVE_POLICIES.create(name, rules=self.config.rules, profile=self.config.profile)

    def set_policy(self, name: str, mode: str, reset_demand: bool = False) -> None:
        """Switch policy and mode at run time (admin `POST /policy`). Caller holds the lock.

        `reset_demand`: also forget the demand signals seen so far (hits, arrivals, hints, shadow decisions) and
        start the policy afresh, so a switch to active does not act on what was seen before it (a benchmark's
        earlier arm, say). The directory, the workers and the replications are kept.
        """
        if name not in POLICIES:
            raise AdminError(f"unknown policy {name!r} (choose one of {', '.join(POLICIES)})")
        if mode not in ("active", "shadow"):
            raise AdminError(f"mode must be active or shadow, got {mode!r}")
        if self.policy.name != name or reset_demand:
            self.policy = self._make_policy(name)
        if reset_demand:
            self.state.hits.clear()
            self.state.arrivals.clear()
            self.state.hints.clear()
            self.state.hint_times.clear()
            self.state.finishes.clear()
            self.state.demand_events.clear()
            self.shadow_decisions.clear()
        self.mode = mode

    def _decisions(self, now: float) -> list[tuple[str, str, str, int, int, float]]:
        """(source, target, namespace, block hash, prefix tokens, ttl) from whichever policy runs."""
        return [(d.source, d.target, d.namespace, d.block_hash, d.depth_len, d.ttl_s)
                for d in self.policy.decide(self.state, now)]

    # ------------------------------------------------------------------------------------------------- running
    def serve_forever(self) -> None:
        http_thread = threading.Thread(target=self._http.serve_forever, name="kvrep-admin", daemon=True)
        http_thread.start()
        log.info("coordinator %s: workers on %s, admin on http://%s:%d", self.state.coordinator_id,
                 self.endpoint, self.config.admin_host, self.admin_port)
        try:
            self._loop()
        finally:
            self._http.shutdown()
            self._http.server_close()
            self._sock.close(0)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def stop(self) -> None:
        self._stop.set()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def send(self, routing_id: bytes, msg: p._Msg) -> None:
        """Thread-safe: queue a message for a worker."""
        self._outbox.put((routing_id, msg))
        self._wake()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic()
        notified = -1
        while not self._stop.is_set():
            timeout_ms = max(0.0, (next_tick - time.monotonic()) * 1000)
            events = dict(poller.poll(timeout_ms))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            if self._sock in events:
                t0 = time.monotonic()
                n = 0
                while n < 1000:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
                    n += 1
                self.loop_stats.batch(n, time.monotonic() - t0)
            while True:
                try:
                    routing_id, msg = self._outbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    data = p.encode(msg)
                except (OverflowError, TypeError, ValueError) as exc:  # never let one message stop the loop
                    log.error("dropped an unencodable %s: %s", type(msg).__name__, exc)
                    continue
                self._sock.send_multipart([routing_id, data])
            if time.monotonic() >= next_tick or self._plan_now:
                # NOTE: new pages while a hint waits: plan now, not at the next tick. A fan-out's branches follow
                # the trunk's answer within a fraction of a second; its pages reach the directory only after its
                # prefill (the agent flushes SGLang's KV events every scheduler iteration).
                self._plan_now = False
                t0 = time.monotonic()
                self._tick()
                self.loop_stats.tick(time.monotonic() - t0)
                next_tick = time.monotonic() + self.config.tick_s
            seq = self.state.directory.feed.seq  # (an int read: no lock needed)
            if seq != notified:
                notified = seq
                self._http.notify_changed()

    def _on_frames(self, frames: list[bytes]) -> None:
        routing_id = frames[0]
        if len(frames) != 2:
            with self.lock:
                self.state.record_protocol_error()
            self._sock.send_multipart([routing_id, p.encode(p.Error(error=f"expected 1 frame, got {len(frames) - 1}"))])
            return
        try:
            msg = p.decode_for_coordinator(frames[1])
        except p.ProtocolError as exc:
            with self.lock:
                self.state.record_protocol_error()
            log.warning("bad message from %r: %s", routing_id, exc)
            self._sock.send_multipart([routing_id, p.encode(p.Error(error=str(exc)))])
            return
        now = time.monotonic()
        try:
            with self.lock:
                replies = self.state.handle(routing_id, msg, now)
        except Exception as exc:  # a bug must not take the coordinator down
            log.exception("error handling %s", msg.describe())
            replies = [(routing_id, p.Error(error=f"internal error: {exc}", in_reply_to=type(msg).__name__))]
        for rid, reply in replies:
            self._sock.send_multipart([rid, p.encode(reply)])
        if isinstance(msg, p.PagesStored) and self.mode == "active" and self.state.hints:
            self._plan_now = True

    def _tick(self) -> None:
        now = time.monotonic()
        with self.lock:
            self.state.tick(now)
            for source, target, namespace, block_hash, prefix_len, ttl_s in self._decisions(now):
                if self.mode == "shadow":
                    self.shadow_decisions.append({"time_s": now, "policy": self.policy.name, "source": source,
                                                  "target": target, "namespace": namespace,
                                                  "prefix_len": prefix_len})
                    del self.shadow_decisions[:-1000]
                    continue
                tokens = self.state.directory.prefix_tokens(block_hash)
                if tokens is None:
                    continue
                try:
                    _, target_rid, expect = self.state.request_replication(
                        source, target, tokens[:prefix_len], namespace, ttl_s, now, origin=self.policy.name,
                        block_hash=block_hash)
                except AdminError as exc:
                    log.info("policy decision refused: %s", exc)
                    continue
                self._outbox.put((target_rid, expect))
            for worker, namespace, block_hash in self.policy.take_demotions():
                tokens = self.state.directory.prefix_tokens(block_hash)
                if tokens is not None:
                    self._demote(worker, namespace, tokens, send=self.mode == "active")

    def _demote(self, worker: str, namespace: str, tokens: list[int], send: bool) -> bool:
        """Caller holds the lock. Sends `DemotePrefix` to `worker` (or, `send` False, shadow mode, only counts
        it). Returns: False for an unknown worker."""
        record = self.state.workers.get(worker)
        if record is None:
            return False
        if send:
            self.send(record.routing_id, p.DemotePrefix(namespace=namespace, token_ids=tokens))
        self.num_demotions["sent" if send else "shadow"] += 1
        self.recent_demotions.append({"time_s": round(time.monotonic(), 3), "worker": worker, "sent": send,
                                      "tokens": len(tokens)})
        del self.recent_demotions[:-100]
        return True

    # --------------------------------------------------------------------------------------------- admin API
    def admin_demote(self, body: dict) -> dict:
        """`POST /demote` `{"worker", "input_ids", "cache_salt"?}`: the worker's cached chain ending at exactly
        these tokens becomes evict-first (what the kvrep policy does when a session's next turn moves away)."""
        worker = body.get("worker")
        if not isinstance(worker, str):
            raise AdminError("worker must be a worker id")
        token_ids = _token_ids(body)
        if not token_ids:
            raise AdminError("input_ids must not be empty")
        namespace = body.get("cache_salt") or ""
        if not isinstance(namespace, str):
            raise AdminError("cache_salt must be a string")
        with self.lock:
            if not self._demote(worker, namespace, token_ids, send=True):
                raise AdminError(f"unknown worker {worker!r}", 404)
        return {"worker": worker, "tokens": len(token_ids)}

    def drop_replicas(self, worker: Optional[str] = None) -> int:
        """Tells the holders of live (unpromoted) replicas, of `worker` or of all workers, to evict them now; the
        directory forgets them when the workers confirm (`ReplicaExpired`). Returns: replicas asked to go."""
        with self.lock:
            if worker is not None and worker not in self.state.workers:
                raise AdminError(f"unknown worker {worker!r}", 404)
            todo = [(self.state.workers[w].routing_id, rid) for (w, rid) in self.state.directory.replicas(worker)
                    if w in self.state.workers]
        for routing_id, rid in todo:
            self.send(routing_id, p.DropReplica(replication_id=rid))
        return len(todo)

    def admin_replicate(self, body: dict) -> dict:
        for key in ("source", "target", "input_ids"):
            if key not in body:
                raise AdminError(f"missing field {key!r}")
        token_ids = body["input_ids"]
        if not isinstance(token_ids, list):
            raise AdminError("input_ids must be a list of token ids")
        namespace = body.get("cache_salt") or ""
        if not isinstance(namespace, str):
            raise AdminError("cache_salt must be a string")
        try:
            ttl_s = float(body.get("ttl_s", self.config.rules.ttl_s))
        except (TypeError, ValueError):
            raise AdminError(f"ttl_s must be a number, got {body.get('ttl_s')!r}") from None
        now = time.monotonic()
        with self.lock:
            rep, target_rid, expect = self.state.request_replication(str(body["source"]), str(body["target"]),
                                                                     token_ids, namespace, ttl_s, now)
            out = rep.to_json()
        self.send(target_rid, expect)
        return out


class _AdminApi:
    """The admin API's routes, transport-free: (method, path, query, raw body) -> a JSON-able answer; AdminError for
    a request it refuses. Runs on the admin server's event loop thread; state is touched under `coord.lock`."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def handle(self, method: str, path: str, query: dict, raw: bytes) -> tuple[int, object]:
        try:
            return 200, self.route(method, path, query, raw)
        except AdminError as exc:
            return exc.status, {"error": str(exc)}
        except Exception as exc:
            log.exception("admin %s %s", method, path)
            return 500, {"error": f"internal error: {exc}"}

    def route(self, method: str, path: str, query: dict, raw: bytes):
        coord = self.coord
        if method == "GET" and path == "/workers":
            with coord.lock:
                return [w.to_json() for w in coord.state.workers.values()]
        if path == "/directory/lookup" and method in ("GET", "POST"):
            if method == "POST":
                body = _json_body(raw)
                if "page_hashes" in body:  # the router's own hashes: nothing to parse or rehash
                    hashes, page_size = parse_page_hashes(body)
                    with coord.lock:
                        return {"matched": coord.state.lookup_hashes(hashes, page_size)}
                token_ids, namespace = body.get("input_ids"), body.get("cache_salt") or ""
            else:
                text = (query.get("input_ids") or [""])[0]
                try:
                    token_ids = [int(t) for t in text.split(",") if t.strip()]
                except ValueError:
                    raise AdminError("input_ids must be comma-separated integers") from None
                namespace = (query.get("cache_salt") or [""])[0]
            if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
                raise AdminError("input_ids must be a list of integers")
            with coord.lock:
                return {"matched": coord.state.lookup(token_ids, namespace)}
        if method == "POST" and path == "/replicas/drop":
            worker = _json_body(raw).get("worker")
            if worker is not None and not isinstance(worker, str):
                raise AdminError("worker must be a worker id or absent (all workers)")
            return {"dropped": coord.drop_replicas(worker)}
        if method == "POST" and path == "/demote":
            return coord.admin_demote(_json_body(raw))
        if method == "POST" and path == "/replicate":
            return coord.admin_replicate(_json_body(raw))
        if method == "POST" and path == "/arrivals":
            body = _json_body(raw)
            arrivals, finishes = body.get("arrivals", []), body.get("finishes", [])
            if not isinstance(arrivals, list) or not isinstance(finishes, list) \
                    or not ("arrivals" in body or "finishes" in body):
                raise AdminError('body must be {"arrivals": [{"input_ids", "cache_salt"?, "worker"?, "class"?, '
                                 '...}], "finishes": [{"page_hashes", "page_size" | "input_ids", '
                                 '"cache_salt"?, "worker"?, "stop"?, "class"?}]} (either list may be absent)')
            now = time.monotonic()
            with coord.lock:
                num_a, num_f = coord.state.record_demand(arrivals, finishes, now)
            return {"recorded": num_a, "finishes_recorded": num_f}
        if method == "POST" and path == "/hints":
            now = time.monotonic()
            with coord.lock:
                rec = coord.state.record_hint(_json_body(raw), now)
            return {"recorded": 1, "kind": rec.kind, "prefix_len": rec.prefix_len}
        if method == "POST" and path == "/policy":
            body = _json_body(raw)
            with coord.lock:
                reset = body.get("reset_demand", False)
                if not isinstance(reset, bool):
                    raise AdminError("reset_demand must be true or false")
                coord.set_policy(str(body.get("policy", "")), str(body.get("mode", coord.mode)), reset)
                return {"policy": coord.policy.name if coord.policy else "none", "mode": coord.mode}
        if method == "GET" and path == "/replications":
            with coord.lock:
                return [r.to_json() for r in coord.state.replications.values()]
        if method == "GET" and path == "/status":
            with coord.lock:
                st = coord.state
                try:
                    st.check_integrity()
                    integrity = "ok"
                except AssertionError as exc:
                    integrity = f"violated: {exc}"
                return {"integrity": integrity, "coordinator_id": st.coordinator_id, "endpoint": coord.endpoint,
                        "policy": coord.policy.name if coord.policy else "none", "mode": coord.mode,
                        "num_workers": len(st.workers), "num_pages": st.directory.num_pages(),
                        "feed": {"epoch": st.directory.feed.epoch, "seq": st.directory.feed.seq},
                        "num_protocol_errors": st.num_protocol_errors,
                        "num_recent_arrivals": len(st.arrivals),
                        "num_recent_finishes": len(st.finishes), "num_live_hints": len(st.hints),
                        "replicas": [{"worker": w, "replication_id": r, **v}
                                     for (w, r), v in st.directory.replicas().items()],
                        "sessions": (coord.policy.session_stats()
                                     if hasattr(coord.policy, "session_stats") else None),
                        "loop": coord.loop_stats.summary(),
                        "demotions": {**coord.num_demotions, "recent": coord.recent_demotions[-20:]},
                        "hints": [{"block_hash": b, **{k: round(v, 3) for k, v in t.items()},
                                   "planner": [[round(when, 3), what] for when, what in
                                               getattr(coord.policy, "hint_outcomes", {}).get(b, [])]}
                                  for b, t in list(st.hint_times.items())[-20:]],
                        "shadow_decisions": coord.shadow_decisions[-100:]}
        if method == "GET" and path == "/health":
            return {"ok": True}
        raise AdminError(f"no such endpoint: {method} {path}", 404)


def _json_body(raw: bytes) -> dict:
    try:
        body = _loads(raw or b"{}")
    except ValueError as exc:  # json.JSONDecodeError and orjson.JSONDecodeError are ValueErrors
        raise AdminError(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise AdminError("body must be a JSON object")
    return body


class _AdminServer:
    """The admin API over HTTP/1.1 keep-alive: one aiohttp event loop on its own thread.

    NOTE: it was a stdlib ThreadingHTTPServer (a thread per connection, Python-level header parsing); at ~1,000
    router lookups/s on 2 cores that thread churn, not the directory, set the latency. The socket is bound here, in
    the constructor, so the port is known (port 0 picks one) before `serve_forever`; the listen backlog is 1,024
    (the default 5 refused connections under a router's burst, and a refused connection makes a router back off
    the directory altogether).
    """

    def __init__(self, host: str, port: int, api: _AdminApi) -> None:
        self.api = api
        self.sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._changed: Optional[asyncio.Event] = None
        self._ready = threading.Event()

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path == "/directory/feed" and request.method == "GET":
            return await self._feed(request)
        raw = await request.read()
        status, obj = self.api.handle(request.method, request.path, parse_qs(request.query_string), raw)
        return web.Response(body=_dumps(obj), status=status, content_type="application/json")

    async def _feed(self, request: web.Request) -> web.Response:
        """`GET /directory/feed?epoch=E&since=S&wait_s=W`: the directory's holding changes after change S of epoch
        E (or a snapshot), answered at once when there are any, else when the first one happens or after W s
        (long poll, W <= 30)."""
        coord = self.api.coord
        q = request.query
        try:
            epoch, since = q.get("epoch", ""), int(q.get("since", "0"))
            wait_s = min(max(float(q.get("wait_s", "0")), 0.0), 30.0)
        except ValueError:
            return web.Response(body=_dumps({"error": "since must be an integer and wait_s a number"}), status=400,
                                content_type="application/json")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            self._changed.clear()
            with coord.lock:
                out = coord.state.directory.feed_since(epoch, since)
            left = deadline - loop.time()
            if "snapshot" in out or out["changes"] or left <= 0:
                break
            try:  # NOTE: cleared before reading, so a change in between still wakes us
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass
        return web.Response(body=_dumps(out), content_type="application/json")

    def notify_changed(self) -> None:
        """Thread-safe: wakes the long polls of `/directory/feed` (the directory changed)."""
        loop, event = self._loop, self._changed
        if loop is not None and event is not None and loop.is_running():
            loop.call_soon_threadsafe(event.set)

    def serve_forever(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._changed = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
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
