"""ClusterState: everything the coordinator knows, mutated only by facts and admin requests.

`handle()` takes one decoded worker message and returns the replies to send; `request_replication()` validates an
admin or policy request and returns the command for the source. Time is always passed in (`now_s`), so the whole
state machine is tested without sockets or sleeps. The server (`server.py`) owns the lock and the sockets.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from radix_sync import protocol as p
from radix_sync.directory import PrefixDirectory
from radix_sync.hashing import page_hashes
from radix_sync.policy.rules import HitRecord, RuleSnapshot, WorkerView

log = logging.getLogger("kvrep.coordinator")

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"


@dataclass
class WorkerRecord:
    hello: p.Hello
    routing_id: bytes
    last_seen_s: float
    last_seq: int = 0
    load: Optional[p.LoadReported] = None

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def to_json(self) -> dict:
        load = self.load
        return {
            "id": self.worker_id,
            "url": self.hello.http_url,
            "data_endpoint": self.hello.data_endpoint,
            "fingerprint": self.hello.fingerprint,
            "fingerprint_fields": self.hello.fingerprint_fields,
            "page_size": self.hello.page_size,
            "pool_capacity_tokens": self.hello.pool_capacity_tokens,
            "replica_budget_tokens": self.hello.replica_budget_tokens,
            "load": None if load is None else {
                "num_running_reqs": load.num_running_reqs,
                "num_waiting_reqs": load.num_waiting_reqs,
                "num_waiting_tokens": load.num_waiting_tokens,
                "available_tokens": load.available_tokens,
                "evictable_tokens": load.evictable_tokens,
                "replica_tokens": load.replica_tokens,
                "demoted_chains": load.demoted_chains,
                "demoted_evicted_tokens": load.demoted_evicted_tokens,
                "demotions_taken_back": load.demotions_taken_back,
            },
        }


@dataclass
class Replication:
    id: str
    source: str
    target: str
    namespace: str
    num_tokens: int
    ttl_s: float
    origin: str
    """`admin` or the name of the policy that decided it."""
    created_s: float
    block_hash: Optional[int] = None
    state: str = PENDING
    error: str = ""
    started_s: Optional[float] = None
    finished_s: Optional[float] = None
    num_bytes: int = 0
    inserted_len: int = 0
    promoted_tokens: int = 0
    """Tokens of the replica a real request hit (its target promoted them to ordinary cache): > 0 = useful."""
    timings_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "id": self.id, "source": self.source, "target": self.target, "namespace": self.namespace,
            "num_tokens": self.num_tokens, "ttl_s": self.ttl_s, "origin": self.origin, "state": self.state,
            "error": self.error or None, "bytes": self.num_bytes, "inserted_len": self.inserted_len,
            "promoted_tokens": self.promoted_tokens,
            "created_s": self.created_s, "started_s": self.started_s, "finished_s": self.finished_s,
            "total_s": (self.finished_s - self.created_s) if self.finished_s is not None else None,
            "timings_s": dict(self.timings_s),
        }


@dataclass(frozen=True)
class ArrivalRecord:
    """A request the router saw (the earliest demand signal): where it went and what prefix it carried."""

    time_s: float
    namespace: str
    block_hash: Optional[int]
    """Hash of the deepest page of the prompt some worker held when it arrived (the prefix it reuses); None when
    no worker held any of it (no reuse to predict from)."""
    prompt_len: int
    worker_id: str
    session_id: str = ""
    class_key: str = ""
    """Tenant/workload class the router put the request in (gap distributions are learned per class)."""


@dataclass(frozen=True)
class FinishRecord:
    """A response the router saw end: the session-continuation signal (the next turn of a session extends this
    prompt, after a gap that depends on how the response ended)."""

    time_s: float
    namespace: str
    block_hash: Optional[int]
    """Hash of the prompt's deepest full page (None: shorter than a page)."""
    num_pages: int
    stop: Optional[str]
    """How the response ended, normalised by the router: `tool_use` (a tool call), `stop`, `length`, ...;
    None when the router could not tell."""
    class_key: str
    worker_id: str


@dataclass(frozen=True)
class HintRecord:
    """An explicit demand hint: `fanout` (k branches will extend this prefix) or `keepalive` (a session's next
    turn is expected within ttl_s)."""

    time_s: float
    kind: str
    namespace: str
    block_hash: Optional[int]
    prefix_len: int
    k: int
    ttl_s: float
    delay_s: float = 0.5
    """Fan-out: the branches follow the trunk's answer after about this long (the client's estimate; default
    0.5 s, a short answer plus client work). The branches cannot come before the trunk is computed."""


class AdminError(ValueError):
    """An admin request the coordinator refuses; the message says why (HTTP 400/404)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class StateConfig:
    worker_timeout_s: float = 5.0
    """A worker silent for this long is dropped with all it holds."""
    replication_timeout_s: float = 60.0
    """A replication not finished after this long is marked failed."""
    hit_window_s: float = 120.0
    """How much prefix-hit history is kept for policies."""
    max_replications_kept: int = 10_000
    max_demand_events: int = 100_000
    """Arrivals and finishes (with their page hashes) kept for the policy to consume; the oldest go first when a
    policy that does not consume them runs."""

    def __post_init__(self) -> None:
        for name in ("worker_timeout_s", "replication_timeout_s", "hit_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_demand_events < 1:
            raise ValueError(f"max_demand_events must be >= 1, got {self.max_demand_events}")


class ClusterState:
    def __init__(self, config: StateConfig = StateConfig(), coordinator_id: str = "") -> None:
        self.config = config
        self.coordinator_id = coordinator_id or uuid.uuid4().hex[:12]
        self.directory = PrefixDirectory()
        self.workers: dict[str, WorkerRecord] = {}
        self._by_routing: dict[bytes, str] = {}
        self.replications: dict[str, Replication] = {}
        self.hits: deque[HitRecord] = deque()
        self.arrivals: deque[ArrivalRecord] = deque()
        self.hints: deque[HintRecord] = deque()
        self.finishes: deque[FinishRecord] = deque()
        self.demand_events: deque[tuple[str, object, list[int], int, tuple[int, list[str]]]] = deque(
            maxlen=config.max_demand_events)
        """(kind, record, the prompt's page hashes, pages held somewhere at arrival, (pages the worker it was
        routed to held, the other workers holding exactly as much)) of each arrival (`arrival`) and finish
        (`finish`) in the order recorded; the predictive planner drains it (`LivePlanner`)."""
        self.hint_times: dict[int, dict[str, float]] = {}
        """Live hinted prefix -> `hint_s` (the hint came), `stored_s` (its pages reached the directory: the
        trunk's prefill is done) and `copy_s` (the first copy of it was issued): when a fan-out's branches are
        due, and, in `/status`, whether its copies could have landed in time."""
        self.num_protocol_errors = 0
        # replication id -> (source routing id, command), held until the target says it expects the transfer
        self._awaiting_target: dict[str, tuple[bytes, p.ReplicatePages]] = {}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------------------------------ worker messages
    def handle(self, routing_id: bytes, msg, now_s: float) -> list[tuple[bytes, p._Msg]]:
        """Apply one worker message.

        Returns:
            (routing id, message) pairs to send back, e.g. HelloAck, ResyncRequested or Error.
        """
        if isinstance(msg, p.Hello):
            return self._on_hello(routing_id, msg, now_s)
        worker_id = self._by_routing.get(routing_id)
        if worker_id is None or getattr(msg, "worker_id", None) != worker_id:
            return [(routing_id, p.ResyncRequested(reason="unknown worker: say hello first"))]
        record = self.workers[worker_id]
        record.last_seen_s = now_s
        if msg.seq != record.last_seq + 1:
            reason = f"sequence gap: expected {record.last_seq + 1}, got {msg.seq}"
            self._forget_worker(worker_id, reason)
            return [(routing_id, p.ResyncRequested(reason=reason))]
        record.last_seq = msg.seq
        return self._apply_fact(record, msg, now_s)

    def _on_hello(self, routing_id: bytes, hello: p.Hello, now_s: float) -> list[tuple[bytes, p._Msg]]:
        if hello.protocol_version != p.PROTOCOL_VERSION:
            return [(routing_id, p.Error(error=f"protocol version {hello.protocol_version} unsupported "
                                               f"(coordinator speaks {p.PROTOCOL_VERSION})", in_reply_to="Hello"))]
        if hello.page_size < 1:
            return [(routing_id, p.Error(error=f"bad page_size {hello.page_size}", in_reply_to="Hello"))]
        old = self.workers.get(hello.worker_id)
        if old is not None:
            # A re-hello (restart or resync) replaces everything the worker said before.
            self._forget_worker(hello.worker_id, "re-hello")
            self._by_routing.pop(old.routing_id, None)
        self.workers[hello.worker_id] = WorkerRecord(hello, routing_id, now_s, last_seq=hello.seq)
        self._by_routing[routing_id] = hello.worker_id
        return [(routing_id, p.HelloAck(coordinator_id=self.coordinator_id))]

    def _apply_fact(self, record: WorkerRecord, msg, now_s: float) -> list[tuple[bytes, p._Msg]]:
        wid = record.worker_id
        d = self.directory
        if isinstance(msg, p.ReplicaExpected):
            pending = self._awaiting_target.pop(msg.replication_id, None)
            rep = self.replications.get(msg.replication_id)
            if pending is not None and rep is not None and rep.state == PENDING and rep.target == wid:
                return [pending]
        elif isinstance(msg, p.PagesStored):
            if msg.medium == "GPU":
                d.add_pages(wid, msg.namespace, ((b.block_hash, b.parent_hash, b.token_ids) for b in msg.blocks))
                if self.hint_times:
                    for b in msg.blocks:
                        times = self.hint_times.get(b.block_hash)
                        if times is not None:
                            times.setdefault("stored_s", now_s)
        elif isinstance(msg, p.PagesRemoved):
            d.remove_pages(wid, msg.block_hashes)
        elif isinstance(msg, p.AllPagesCleared):
            d.drop_worker(wid)
        elif isinstance(msg, p.LoadReported):
            record.load = msg
        elif isinstance(msg, p.PrefixHit):
            if msg.block_hash is not None and msg.matched_len > 0:
                self.hits.append(HitRecord(now_s, wid, msg.namespace, msg.block_hash, msg.matched_len))
        elif isinstance(msg, p.ReplicaStored):
            num_written = msg.inserted_len // record.hello.page_size
            d.mark_replica(wid, msg.namespace, msg.block_hashes, num_written, now_s + msg.expires_in_s,
                           msg.replication_id)
            rep = self.replications.get(msg.replication_id)
            if rep is not None and rep.state in (PENDING, RUNNING):
                rep.state, rep.finished_s = DONE, now_s
                rep.inserted_len = msg.inserted_len
                rep.num_bytes = rep.num_bytes or msg.num_bytes
                rep.timings_s.update(receive_s=msg.receive_s, scatter_s=msg.scatter_s, insert_s=msg.insert_s)
        elif isinstance(msg, p.SourceSent):
            rep = self.replications.get(msg.replication_id)
            if rep is not None:
                rep.num_bytes = msg.num_bytes
                rep.timings_s.update(gather_s=msg.gather_s, send_s=msg.send_s)
                if rep.state == PENDING:
                    rep.state = RUNNING
        elif isinstance(msg, p.ReplicaPromoted):
            d.promote(wid, msg.replication_id)
            rep = self.replications.get(msg.replication_id)
            if rep is not None:
                rep.promoted_tokens = max(rep.promoted_tokens, msg.num_promoted_tokens)
        elif isinstance(msg, p.ReplicaExpired):
            d.remove_replica(wid, msg.replication_id)
        elif isinstance(msg, p.ReplicationFailed):
            self._fail(msg.replication_id, f"{msg.role} {wid}: {msg.error}", now_s)
        return []

    def _fail(self, replication_id: str, error: str, now_s: float) -> None:
        rep = self.replications.get(replication_id)
        self._awaiting_target.pop(replication_id, None)
        if rep is not None and rep.state in (PENDING, RUNNING):
            rep.state, rep.error, rep.finished_s = FAILED, error, now_s

    def _forget_worker(self, worker_id: str, reason: str) -> None:
        num = self.directory.drop_worker(worker_id)
        log.info("forgot %d pages of worker %s (%s)", num, worker_id, reason)

    def record_protocol_error(self) -> None:
        self.num_protocol_errors += 1

    # ------------------------------------------------------------------------------------------------ timers
    def tick(self, now_s: float) -> None:
        """Drop silent workers, time out replications, trim hit history."""
        for worker_id, record in list(self.workers.items()):
            if now_s - record.last_seen_s > self.config.worker_timeout_s:
                self._forget_worker(worker_id, "silent")
                self._by_routing.pop(record.routing_id, None)
                del self.workers[worker_id]
                for rep in self.replications.values():
                    if worker_id in (rep.source, rep.target):
                        self._fail(rep.id, f"worker {worker_id} went silent", now_s)
        for rep in self.replications.values():
            if rep.state in (PENDING, RUNNING) and now_s - rep.created_s > self.config.replication_timeout_s:
                self._fail(rep.id, f"timed out after {self.config.replication_timeout_s:g}s", now_s)
        for log in (self.hits, self.arrivals, self.finishes):
            while log and now_s - log[0].time_s > self.config.hit_window_s:
                log.popleft()
        while self.hints and now_s - self.hints[0].time_s > max(self.hints[0].ttl_s, self.config.hit_window_s):
            self.hints.popleft()
        if len(self.hint_times) > len(self.hints):
            live = {h.block_hash for h in self.hints}
            self.hint_times = {b: t for b, t in self.hint_times.items() if b in live}
        while len(self.replications) > self.config.max_replications_kept:
            oldest = next(iter(self.replications))
            del self.replications[oldest]

    # ------------------------------------------------------------------------------------------------- admin
    def request_replication(self, source: str, target: str, token_ids: list[int], namespace: str, ttl_s: float,
                            now_s: float, origin: str = "admin",
                            block_hash: Optional[int] = None) -> tuple[Replication, bytes, p.ExpectReplica]:
        """Validate a replication and create its record.

        The target is told first (`ExpectReplica`, with a one-time token); the source gets `ReplicatePages` only
        once the target has answered `ReplicaExpected`, so a target never sees a transfer it was not told about.

        Returns:
            the record, the target's routing id and the message to send it.
        Raises:
            AdminError: unknown worker, same worker, incompatible fingerprints, empty or unheld prefix.
        """
        if source == target:
            raise AdminError(f"source and target are the same worker {source!r}")
        for wid in (source, target):
            if wid not in self.workers:
                raise AdminError(f"unknown worker {wid!r} (known: {sorted(self.workers)})", 404)
        src, dst = self.workers[source].hello, self.workers[target].hello
        if src.fingerprint != dst.fingerprint:
            diff = {k: (src.fingerprint_fields.get(k), dst.fingerprint_fields.get(k))
                    for k in set(src.fingerprint_fields) | set(dst.fingerprint_fields)
                    if src.fingerprint_fields.get(k) != dst.fingerprint_fields.get(k)}
            raise AdminError(f"fingerprint mismatch between {source} and {target}: {diff}")
        if not ttl_s > 0:
            raise AdminError(f"ttl_s must be > 0, got {ttl_s}")
        _token_ids({"input_ids": token_ids})
        page_size = src.page_size
        num_tokens = (len(token_ids) // page_size) * page_size
        if num_tokens == 0:
            raise AdminError(f"prefix of {len(token_ids)} tokens is shorter than one page ({page_size})")
        rep = Replication(id=f"r{next(self._ids)}-{uuid.uuid4().hex[:6]}", source=source, target=target,
                          namespace=namespace, num_tokens=num_tokens, ttl_s=ttl_s, origin=origin,
                          created_s=now_s, block_hash=block_hash)
        rep.started_s = now_s
        self.replications[rep.id] = rep
        if block_hash in self.hint_times:
            self.hint_times[block_hash].setdefault("copy_s", now_s)
        prefix = list(token_ids[:num_tokens])
        auth_token = secrets.token_hex(16)
        cmd = p.ReplicatePages(replication_id=rep.id, auth_token=auth_token, token_ids=prefix, namespace=namespace,
                               target_id=target, target_endpoint=dst.data_endpoint,
                               target_fingerprint=dst.fingerprint, ttl_s=ttl_s)
        self._awaiting_target[rep.id] = (self.workers[source].routing_id, cmd)
        expect = p.ExpectReplica(replication_id=rep.id, source_id=source, namespace=namespace, page_size=page_size,
                                 block_hashes=page_hashes(prefix, page_size, namespace), auth_token=auth_token,
                                 expires_in_s=self.config.replication_timeout_s)
        return rep, self.workers[target].routing_id, expect

    def _page_size(self, worker_id: str = "") -> int:
        """The page size of `worker_id`, else the smallest any worker uses (1 with no worker)."""
        if worker_id in self.workers:
            return self.workers[worker_id].hello.page_size
        return min((w.hello.page_size for w in self.workers.values()), default=1)

    def record_arrival(self, body: dict, now_s: float) -> ArrivalRecord:
        """Raises AdminError on a malformed arrival (nothing is recorded then)."""
        return self._record_arrival(self._parse_arrival(body), now_s)

    def record_demand(self, arrivals: list, finishes: list, now_s: float) -> tuple[int, int]:
        """Records a router's batch: all of it, or (AdminError naming the bad item) none of it.

        Returns:
            (arrivals recorded, finishes recorded).
        """
        parsed = []
        for kind, items, parse in (("arrivals", arrivals, self._parse_arrival),
                                   ("finishes", finishes, self._parse_finish)):
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise AdminError(f"{kind}[{i}] must be an object")
                order = item.get("seq", 0)
                if not isinstance(order, (int, float)) or isinstance(order, bool):
                    raise AdminError(f"{kind}[{i}]: seq must be a number")
                try:
                    parsed.append((order, kind, parse(item)))
                except AdminError as exc:
                    raise AdminError(f"{kind}[{i}]: {exc}") from None
        # NOTE: the router numbers its reports (`seq`) so a batch replays in the order things happened: a turn's
        # finish before its follow-up's arrival, a request's arrival before its own finish.
        parsed.sort(key=lambda x: x[0])  # stable: without seq, arrivals before finishes
        for _, kind, item in parsed:
            (self._record_arrival if kind == "arrivals" else self._record_finish)(item, now_s)
        num_a = sum(1 for _, kind, _ in parsed if kind == "arrivals")
        return num_a, len(parsed) - num_a

    def _parse_arrival(self, body: dict) -> tuple:
        namespace, worker_id = _namespace(body), str(body.get("worker", ""))
        if "page_hashes" in body:  # the router's own hashes: nothing to rehash
            hashes = self._parse_hashes(body, worker_id)
            prompt_len = body.get("prompt_len")
            if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 0:
                raise AdminError(f"prompt_len must be an integer >= 0 with page_hashes, got {prompt_len!r}")
        else:
            token_ids = _token_ids(body)
            hashes, prompt_len = page_hashes(token_ids, self._page_size(worker_id), namespace), len(token_ids)
        return hashes, prompt_len, namespace, worker_id, _short_str(body, "session_id", 256), \
            _short_str(body, "class", 128)

    def _parse_hashes(self, body: dict, worker_id: str) -> list[int]:
        hashes, page_size = parse_page_hashes(body)
        if worker_id in self.workers and self.workers[worker_id].hello.page_size != page_size:
            raise AdminError(f"page_size {page_size} is not worker {worker_id}'s "
                             f"({self.workers[worker_id].hello.page_size})")
        return hashes

    def _record_arrival(self, parsed: tuple, now_s: float) -> ArrivalRecord:
        hashes, prompt_len, namespace, worker_id, session_id, class_key = parsed
        # The demand an arrival shows is for the part of its prompt already held somewhere (what it reuses; a
        # fan-out branch counts for its trunk, a session's turn for the previous turn's context), not for its
        # own new prompt, which nobody asked for twice yet. A prompt nothing holds shows no reuse: it counts for
        # nothing (a one-off prompt must not be copied; a trunk announces itself with a fan-out hint).
        matched = self.directory.match(hashes)
        held = max(matched.values(), default=0)
        block_hash = hashes[held - 1] if held > 0 else None
        rec = ArrivalRecord(now_s, namespace, block_hash, prompt_len, worker_id, session_id, class_key)
        self.arrivals.append(rec)
        self.demand_events.append(("arrival", rec, hashes, held, self._copies_ending_at(hashes, matched, worker_id)))
        return rec

    def _copies_ending_at(self, hashes: list[int], matched: dict[str, int], worker_id: str) -> tuple[int, list[str]]:
        """At an arrival routed to `worker_id`: (the pages it holds of the prompt, the other workers that hold
        exactly as much: the page where its match ends and not the next). Taken now, before the request's own
        pages reach the directory."""
        n = matched.get(worker_id, 0)
        if n <= 0:
            return 0, []
        further = self.directory.holders(hashes[n]) if n < len(hashes) else {}
        return n, [w for w in self.directory.holders(hashes[n - 1]) if w != worker_id and w not in further]

    def _parse_finish(self, body: dict) -> tuple:
        namespace, worker_id = _namespace(body), str(body.get("worker", ""))
        if "page_hashes" in body:
            hashes = self._parse_hashes(body, worker_id)
        else:
            hashes = page_hashes(_token_ids(body), self._page_size(worker_id), namespace)
        stop = body.get("stop")
        if stop is not None and (not isinstance(stop, str) or len(stop) > 64):
            raise AdminError("stop must be a string of at most 64 characters or null")
        return hashes, namespace, worker_id, stop, _short_str(body, "class", 128)

    def _record_finish(self, parsed: tuple, now_s: float) -> FinishRecord:
        hashes, namespace, worker_id, stop, class_key = parsed
        rec = FinishRecord(now_s, namespace, hashes[-1] if hashes else None, len(hashes), stop, class_key,
                           worker_id)
        self.finishes.append(rec)
        if hashes:
            self.demand_events.append(("finish", rec, hashes, len(hashes), (0, [])))
        return rec

    def record_hint(self, body: dict, now_s: float) -> HintRecord:
        kind = body.get("kind")
        if kind not in ("fanout", "keepalive"):
            raise AdminError(f"hint kind must be fanout or keepalive, got {kind!r}")
        token_ids, namespace = _token_ids(body), _namespace(body)
        try:
            k, ttl_s = int(body.get("k", 1)), float(body.get("ttl_s", 60.0))
            delay_s = float(body.get("delay_s", 0.5))
        except (TypeError, ValueError):
            raise AdminError("k must be an integer, ttl_s and delay_s numbers") from None
        if k < 1 or not ttl_s > 0 or not 0 <= delay_s <= 60:
            raise AdminError(f"need k >= 1, ttl_s > 0 and 0 <= delay_s <= 60, got k={k} ttl_s={ttl_s} "
                             f"delay_s={delay_s}")
        page_size = self._page_size()
        hashes = page_hashes(token_ids, page_size, namespace)
        block_hash, prefix_len = (hashes[-1] if hashes else None), len(hashes) * page_size
        rec = HintRecord(now_s, kind, namespace, block_hash, prefix_len, k, ttl_s, delay_s)
        self.hints.append(rec)
        if block_hash is not None:
            times = self.hint_times.setdefault(block_hash, {"hint_s": now_s})
            if self.directory.node(block_hash) is not None:
                times.setdefault("stored_s", now_s)  # computed before the hint came
        return rec

    def lookup(self, token_ids: list[int], namespace: str) -> dict[str, int]:
        """Tokens of `token_ids` each worker holds (as owner or replica), per the directory."""
        out: dict[str, int] = {wid: 0 for wid in self.workers}
        for page_size in {w.hello.page_size for w in self.workers.values()}:
            for wid, held in self.lookup_hashes(page_hashes(token_ids, page_size, namespace), page_size).items():
                out[wid] = max(out[wid], held)
        return out

    def lookup_hashes(self, block_hashes: list[int], page_size: int) -> dict[str, int]:
        """Like `lookup`, from a prompt's page hashes (namespace included in them) at `page_size`; workers with
        another page size read 0."""
        matched = self.directory.match(block_hashes)
        return {wid: (matched.get(wid, 0) * page_size if rec.hello.page_size == page_size else 0)
                for wid, rec in self.workers.items()}

    def rule_snapshot(self, now_s: float) -> RuleSnapshot:
        workers = []
        for wid, record in self.workers.items():
            load = record.load
            replica_tokens = load.replica_tokens if load else 0
            workers.append(WorkerView(
                wid, record.hello.fingerprint,
                load.num_waiting_reqs if load else 0, load.num_running_reqs if load else 0,
                max(0, record.hello.replica_budget_tokens - replica_tokens)))
        held: dict[tuple[int, str], int] = {}
        for hit in self.hits:
            node = self.directory.node(hit.block_hash)
            if node is None:
                continue
            for wid in node.holders:
                held[(hit.block_hash, wid)] = node.depth * self.workers[wid].hello.page_size \
                    if wid in self.workers else 0
        in_flight = frozenset((r.block_hash, r.target) for r in self.replications.values()
                              if r.state in (PENDING, RUNNING) and r.block_hash is not None)
        return RuleSnapshot(tuple(self.hits), tuple(workers), held, in_flight)

    def check_integrity(self) -> None:
        self.directory.check_integrity()
        for routing_id, wid in self._by_routing.items():
            assert self.workers[wid].routing_id == routing_id, wid
        assert len(self._by_routing) == len(self.workers)
        for wid in self.directory.workers():
            assert wid in self.workers, f"directory holds pages of unknown worker {wid}"


def _token_ids(body: dict) -> list[int]:
    token_ids = body.get("input_ids")
    if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63 for t in token_ids):
        raise AdminError("input_ids must be a list of integers in [0, 2**63)")
    return token_ids


def parse_page_hashes(body: dict) -> tuple[list[int], int]:
    """`body["page_hashes"]`, `body["page_size"]` as a router sends them (SGLang's signed 64-bit block hashes of a
    prompt's full pages). Raises AdminError when malformed."""
    hashes, page_size = body.get("page_hashes"), body.get("page_size")
    if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                               and -2 ** 63 <= h < 2 ** 63 for h in hashes):
        raise AdminError("page_hashes must be a list of signed 64-bit integers (SGLang's block hashes)")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise AdminError(f"page_size must be an integer >= 1 with page_hashes, got {page_size!r}")
    return hashes, page_size


def _short_str(body: dict, key: str, limit: int) -> str:
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > limit:
        raise AdminError(f"{key} must be a string of at most {limit} characters")
    return value


def _namespace(body: dict) -> str:
    namespace = body.get("cache_salt") or ""
    if not isinstance(namespace, str):
        raise AdminError("cache_salt must be a string")
    return namespace
