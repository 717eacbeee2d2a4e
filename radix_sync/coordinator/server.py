"""The coordinator process: a ZMQ ROUTER for worker agents, a JSON admin HTTP API, and the policy tick.

Threads: the control loop owns the ZMQ socket (ZMQ sockets are single-threaded); the admin API (`admin.py`, an
aiohttp event loop on its own thread) only touches `ClusterState` under `lock` and hands outgoing commands to the
loop through `_outbox` plus a wake pipe. A malformed message gets an `Error` reply and is counted; nothing a
worker sends can stop the loop. Metrics: `metrics.py`, served at `GET /metrics`.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

import zmq

from radix_sync import api
from radix_sync import keys as k
from radix_sync import protocol as p
from radix_sync.api import AdminError
from radix_sync.coordinator.admin import AdminServer
from radix_sync.coordinator.metrics import CoordinatorMetrics
from radix_sync.coordinator.plain import PlainFeed, PlainWorkerSpec
from radix_sync.coordinator.policies import LIVE_POLICIES, LivePolicy
from radix_sync.coordinator.pull import (check_critical, critical_prefix_hash, join_critical, ledger_allows_pull,
                                         room_for_critical)
from radix_sync.coordinator.replications import ORIGIN_PULL
from radix_sync.coordinator.state import ClusterState, StateConfig
from radix_sync.gc_pacing import GcPacer
from radix_sync.hashing import page_hashes
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
    admin_tokens: str = ""
    """JSON file of the admin API's bearer tokens (`{"read": ..., "write": ...}`); "": `<state_dir>/admin-tokens.json`,
    created (0600) when absent."""
    state_dir: str = ""
    """Where the coordinator creates its files ("": `$XDG_STATE_HOME/kvrep`, else `~/.local/state/kvrep`)."""
    # -- the workers' plane (CurveZMQ, bounds)
    keys: str = ""
    """Key directory (`kvrep keys`): CurveZMQ on the workers' socket, only allow-listed worker keys admitted, each
    bound to its worker id. "" = no keys, allowed only on a loopback `bind` (or with `insecure`)."""
    insecure: bool = False
    """Bind a non-loopback address without keys anyway (unauthenticated, unencrypted; logged loudly)."""
    max_msg_bytes: int = 16 << 20
    """Largest message frame a worker may send; a larger one disconnects it before it is buffered (ZMQ_MAXMSGSIZE)."""
    plain_workers: tuple[PlainWorkerSpec, ...] = ()
    """Workers without the plugin, followed through SGLang's own KV events (`plain.py`)."""
    gc_thorough_every_s: float = 0.0
    """> 0: pace the process's cycle collector (`radix_sync.gc_pacing.GcPacer`: what lives after each tick is
    frozen, the whole heap collected once this often). 0: leave the collector alone, the default of a coordinator
    made in a library or a test (freezing is the process's decision); `kvrep coordinator` runs with 300."""

    def __post_init__(self) -> None:
        if not 1 << 16 <= self.max_msg_bytes <= 1 << 30:
            raise ValueError(f"max_msg_bytes must be in [64 KiB, 1 GiB], got {self.max_msg_bytes}")
        if self.keys:
            keydir = k.load_dir(self.keys)  # raises KeysError (a ValueError) naming the bad file
            keydir.pair("coordinator")
            keydir.allow_list()
        elif not self.insecure and not k.is_loopback_endpoint(self.bind):
            raise ValueError(k.insecure_error("--bind", self.bind, "--keys", "--insecure"))
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (choose one of {', '.join(POLICIES)})")
        if self.mode not in ("active", "shadow"):
            raise ValueError(f"mode must be active or shadow, got {self.mode!r}")
        if not self.tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")
        if not 0 <= self.gc_thorough_every_s < float("inf"):
            raise ValueError(f"gc_thorough_every_s must be >= 0 and finite, got {self.gc_thorough_every_s}")
        ids = [w.worker_id for w in self.plain_workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"plain worker ids must be distinct, got {ids}")


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.state = ClusterState(config.state)
        self.lock = threading.Lock()
        self.mode = config.mode
        self.policy = self._make_policy(config.policy)
        self._learned_use = None
        """The last planner's `UseCalibration`, handed on to the next (`_carry_learned`)."""
        self.shadow_decisions: list[dict] = []
        self.num_demotions = {"sent": 0, "shadow": 0}
        self.recent_demotions: list[dict] = []
        """The last demotions decided or asked for: {time_s, worker, tokens, sent} (for `/status`)."""
        self._plan_now = False  # set by the ZMQ loop thread only
        self.num_tick_errors = 0
        """Policy ticks that raised (logged; the coordinator keeps serving)."""
        self.num_critical_joined = 0
        """Critical copies (pulls) answered with the copy of the same prefix already in flight to their target."""
        self.num_critical_preempted = 0
        self.num_decisions_held = 0
        """Planner copies not sent: the target held every page already (the directory's match)."""
        """Speculative replicas dropped to make room for a critical copy (`pull.room_for_critical`)."""
        self._dropping: dict[str, dict[str, int]] = {}
        """Target -> {replication id: tokens} dropped for critical copies, until the directory no longer holds them."""
        self.metrics = CoordinatorMetrics(self)
        self.loop_stats = self.metrics.loop
        self.gc_pacer = GcPacer(config.gc_thorough_every_s) if config.gc_thorough_every_s > 0 else None
        self.loop_stats.gc_pacer = self.gc_pacer
        self._outbox: "queue.Queue[tuple[bytes, p._Msg]]" = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self._ctx = zmq.Context()  # its own: the ZAP handler serves one context
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_msg_bytes)
        self.keyed = bool(config.keys)
        """Every message's worker id is checked against the key it came with (the ZAP User-Id)."""
        if self.keyed:
            keydir = k.load_dir(config.keys)
            self._auth = k.start_authenticator(self._ctx, keydir.allow_list())
            k.curve_server(self._sock, keydir.pair("coordinator"))
        elif not k.is_loopback_endpoint(config.bind):
            k.warn_insecure("coordinator --bind", config.bind)
        self._sock.bind(config.bind)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._http = AdminServer(self, config.admin_host, config.admin_port)
        self.admin_port = self._http.port
        self.plain_feeds = [PlainFeed(spec, self._apply_plain, config.max_msg_bytes) for spec in config.plain_workers]

    def _apply_plain(self, routing_id: bytes, msg: p._Msg, now: float) -> list:
        """A plain worker's fact (its feed's thread), applied as a plugin worker's is."""
        self.loop_stats.fact(type(msg).__name__)
        with self.lock:
            replies = self.state.handle(routing_id, msg, now)
        if isinstance(msg, p.PagesStored) and self.mode == "active" and self.state.hints:
            self._plan_now = True
        return replies

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
            old, self.policy = self.policy, self._make_policy(name)
            self._carry_learned(old, self.policy)
        if reset_demand:
            self.state.reset_demand()
            self.shadow_decisions.clear()
        self.mode = mode

    def _carry_learned(self, old: LivePolicy, new: LivePolicy) -> None:
        """What the planner learned of its bets' use (`planner.calibration`) outlives a policy switch or restart, as
        it would in a planner left running: demand is forgotten (`reset_demand`), how often each kind of prediction
        got used on this fleet is not (a coordinator restart still starts it afresh). Kept across policies without
        one (`kvrep` -> `none` -> `kvrep`: a benchmark's arms)."""
        cal = getattr(getattr(old, "planner", None), "calibration", None)
        if cal is not None:
            self._learned_use = cal
        planner = getattr(new, "planner", None)
        if self._learned_use is not None and getattr(planner, "calibration", None) is not None:
            planner.calibration = self._learned_use.learned()

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
        for feed in self.plain_feeds:
            feed.start()
        try:
            self._loop()
        finally:
            for feed in self.plain_feeds:
                feed.stop()
            self._http.shutdown()
            http_thread.join(5.0)  # its cleanup closes the listening socket's site before the socket goes
            self._http.server_close()
            self._sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self.gc_pacer is not None:
                self.gc_pacer.release()

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
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
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
                t0, c0 = time.monotonic(), time.thread_time()
                try:
                    self._tick()
                except Exception:  # NOTE: a policy bug or a state it did not expect must not stop the coordinator
                    self.num_tick_errors += 1
                    log.exception("policy tick failed (%d so far); serving goes on", self.num_tick_errors)
                self.loop_stats.tick(time.monotonic() - t0, time.thread_time() - c0)
                if self.gc_pacer is not None:  # NOTE: not in the tick's time; a thorough pass is reported apart
                    self.loop_stats.gc_pause(self.gc_pacer.settle())
                next_tick = time.monotonic() + self.config.tick_s
            seq = self.state.directory.feed.seq  # (an int read: no lock needed)
            if seq != notified:
                notified = seq
                self._http.notify_changed()

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        routing_id = frames[0].bytes
        if len(frames) != 2:
            with self.lock:
                self.state.record_protocol_error()
            self._sock.send_multipart([routing_id, p.encode(p.Error(error=f"expected 1 frame, got {len(frames) - 1}"))])
            return
        try:
            msg = p.decode_for_coordinator(frames[1].buffer)
        except p.ProtocolError as exc:
            with self.lock:
                self.state.record_protocol_error()
            log.warning("bad message from %r: %s", routing_id, exc)
            self._sock.send_multipart([routing_id, p.encode(p.Error(error=str(exc)))])
            return
        if self.keyed:
            refusal = self._identity_refusal(k.peer_id(frames[1]), msg)
            if refusal is not None:
                with self.lock:
                    self.state.record_protocol_error()
                log.warning("refused %s: %s", msg.describe(), refusal)
                self._sock.send_multipart([routing_id, p.encode(p.Error(error=refusal,
                                                                        in_reply_to=type(msg).__name__))])
                return
        self.loop_stats.fact(type(msg).__name__)
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

    def _identity_refusal(self, key_worker: str, msg) -> Optional[str]:
        """Why a message may not be applied, or None: with keys, every message names the worker of the key it came
        with. So no key can say hello as another worker (replacing a live one's URL and data endpoint and
        wiping what it holds), nor report facts in its name. A re-hello under the worker's own key (a restart)
        is accepted. NOTE: `kvrep keys` and the allow-list loader give each worker id exactly one key, so "another
        key for a live worker" and "a key of another worker" are the same case."""
        claimed = getattr(msg, "worker_id", None)
        if not key_worker:
            return "no worker key on this connection"
        if claimed != key_worker:
            return f"this connection's key belongs to worker {key_worker!r}, the message claims {claimed!r}"
        return None

    def _tick(self) -> None:
        now = time.monotonic()
        with self.lock:
            self.state.tick(now)
            for source, target, namespace, block_hash, prefix_len, ttl_s in self._decisions(now):
                tokens = self.state.directory.prefix_tokens(block_hash)
                if tokens is None:
                    continue
                # NOTE: a copy the target would land nothing of (it holds every page by now, as its own cache or
                # part of another copy: the planner sees a prefix's holders by its last page only) is not sent, as
                # the simulator does not start one (`Engine._plan`): live, 10-11 of 32-53 planner copies a round
                # had landed nothing
                page = self.state._page_size(target)
                if self.state.directory.match(page_hashes(tokens[:prefix_len], page, namespace)).get(
                        target, 0) * page >= prefix_len:
                    self.num_decisions_held += 1
                    continue
                if self.mode == "shadow":
                    self.shadow_decisions.append({"time_s": now, "policy": self.policy.name, "source": source,
                                                  "target": target, "namespace": namespace,
                                                  "prefix_len": prefix_len})
                    del self.shadow_decisions[:-1000]
                    continue
                # the copy ledger's holdout: some prefixes' copies are not made, to measure whether copies pay (and
                # none while they are shown to cost: the planner is paused)
                if not self.state.ledger.assign(block_hash, now):
                    continue
                try:
                    _, target_rid, expect = self.state.request_replication(
                        source, target, tokens[:prefix_len], namespace, ttl_s, now, origin=self.policy.name,
                        block_hash=block_hash, ordinary=self.policy.replicas_ordinary)
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
        if record is None or record.plain:  # (a plain worker has no agent to demote anything)
            return False
        if send:
            self.send(record.routing_id, p.DemotePrefix(namespace=namespace, token_ids=tokens))
        self.num_demotions["sent" if send else "shadow"] += 1
        self.recent_demotions.append({"time_s": round(time.monotonic(), 3), "worker": worker, "sent": send,
                                      "tokens": len(tokens)})
        del self.recent_demotions[:-100]
        return True

    # --------------------------------------------------------------------------------------------- admin API
    def admin_demote(self, req: api.DemoteRequest) -> api.Demoted:
        """`POST /demote`: the worker's cached chain ending at exactly these tokens becomes evict-first (what the
        kvrep policy does when a session's next turn moves away)."""
        with self.lock:
            self.state.check_prompt(req.input_ids)
            record = self.state.workers.get(req.worker)
            if record is not None and record.plain:
                raise AdminError(f"worker {req.worker!r} runs without the kvrep plugin: nothing to demote with", 409)
            if not self._demote(req.worker, api.namespace_of(req.cache_salt), req.input_ids, send=True):
                raise AdminError(f"unknown worker {req.worker!r}", 404)
        return api.Demoted(worker=req.worker, tokens=len(req.input_ids))

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

    def admin_replicate(self, req: api.ReplicateRequest) -> api.ReplicationInfo:
        """`POST /replicate`: copy a prefix from `req.source` to `req.target` (the target is told first); a
        `critical` one (a router's pull) is checked first (`pull.check_critical`) and recorded with origin `pull`."""
        ttl_s = self.config.rules.ttl_s if req.ttl_s is api.UNSET else req.ttl_s
        now = time.monotonic()
        with self.lock:
            block_hash, drops = None, []
            if req.critical:
                check_critical(self.state, req, self.mode)
                block_hash = critical_prefix_hash(self.state, req)
                joined = join_critical(self.state, req, block_hash)
                if joined is not None:  # the same pages are on their way there already: wait for that copy
                    self.num_critical_joined += 1
                    return joined.to_info()
                ledger_allows_pull(self.state, block_hash, now)
                drops = room_for_critical(self.state, req, self._dropping)
            rep, target_rid, expect = self.state.request_replication(
                req.source, req.target, req.input_ids, api.namespace_of(req.cache_salt), ttl_s, now,
                origin=ORIGIN_PULL if req.critical else "admin", block_hash=block_hash)
            out = rep.to_info()
            self.num_critical_preempted += len(drops)
        for rid in drops:  # before the copy's grant: the target frees the room first (one socket, in order)
            self.send(target_rid, p.DropReplica(replication_id=rid))
        self.send(target_rid, expect)
        return out
