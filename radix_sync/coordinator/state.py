"""ClusterState: everything the coordinator knows, mutated only by facts and admin requests.

A thin facade over the owners, which it ties together:

    ClusterState
      |- directory     PrefixDirectory   (radix_sync.directory)  who holds which pages, as owner or replica
      |- _workers      WorkerRegistry    (workers.py)            hellos, socket ids, sequence numbers, loads
      |- _replications ReplicationBook   (replications.py)       copies asked for, their handshake and outcome
      `- demand        DemandLog         (demand.py)             hits, arrivals, finishes, hints

`handle()` takes one decoded worker message and returns the replies to send; `request_replication()` validates an
admin or policy request and returns the command for the target. Time is always passed in (`now_s`), so the whole
state machine is tested without sockets or sleeps. The server (`server.py`) owns the lock and the sockets.
"""
from __future__ import annotations

import logging
import uuid
from typing import Iterable, Iterator, Optional, Union

from radix_sync import api
from radix_sync import protocol as p
from radix_sync.api import AdminError
from radix_sync.coordinator.config import StateConfig
from radix_sync.policy.ledger import CopyLedger, LedgerConfig
from radix_sync.coordinator.demand import ArrivalRecord, DemandLog, FinishRecord, HintRecord
from radix_sync.coordinator.replications import (FAILED, DONE, PENDING, RUNNING, Replication, ReplicationBook,
                                                 check_token_ids)
from radix_sync.coordinator.workers import WorkerRecord, WorkerRegistry
from radix_sync.directory import PrefixDirectory
from radix_sync.hashing import page_hashes
from radix_sync.host_tier import HOST_MEDIUM
from radix_sync.integrity import IntegrityError
from radix_sync.policy.rules import HitRecord, RuleSnapshot, WorkerView
from radix_sync.policy.speed import SpeedCalibration

__all__ = ["AdminError", "ArrivalRecord", "ClusterState", "DONE", "FAILED", "FinishRecord", "HintRecord",
           "IntegrityError", "PENDING", "RUNNING", "Replication", "StateConfig", "WorkerRecord"]

log = logging.getLogger("kvrep.coordinator")


class ClusterState:
    def __init__(self, config: StateConfig = StateConfig(), coordinator_id: str = "") -> None:
        self.config = config
        self.coordinator_id = coordinator_id or uuid.uuid4().hex[:12]
        self.directory = PrefixDirectory()
        self._workers = WorkerRegistry()
        self._replications = ReplicationBook(config.replication_timeout_s)
        self.demand = DemandLog(config.max_demand_events)
        self.ledger, self.pull_ledger = (CopyLedger(LedgerConfig(holdout=config.ledger_holdout)) for _ in "ab")
        self.speed = SpeedCalibration()
        """Prefill speed from the requests routers saw run alone (`FinishReport.alone_*`; `LivePolicy.observe`)."""
        """Whether the planner's copies, and the routers' pulls (`pull.ledger_allows_pull`), pay, live (a holdout of
        prefixes each; `radix_sync.policy.ledger`)."""
        self.num_protocol_errors = 0
        self.num_refused_facts: dict[str, int] = {}
        """Facts refused after decoding, by type (unverifiable pages, a non-party's fact, an expired replica)."""

    # NOTE: the owners' collections, as the policies and the admin API read them (read-only views by contract:
    # every change goes through the methods below).
    @property
    def workers(self) -> dict[str, WorkerRecord]:
        return self._workers.records

    @property
    def replications(self) -> dict[str, Replication]:
        return self._replications.records

    hits = property(lambda self: self.demand.hits)
    arrivals = property(lambda self: self.demand.arrivals)
    finishes = property(lambda self: self.demand.finishes)
    hints = property(lambda self: self.demand.hints)
    hint_times = property(lambda self: self.demand.hint_times)
    """(`dict[int, dict[str, float]]`)"""
    demand_events = property(lambda self: self.demand.events)

    # ------------------------------------------------------------------------------------------ worker messages
    def handle(self, routing_id: bytes, msg, now_s: float) -> list[tuple[bytes, p._Msg]]:
        """Apply one worker message.

        Returns:
            (routing id, message) pairs to send back, e.g. HelloAck, ResyncRequested or Error.
        """
        if isinstance(msg, p.Hello):
            return self._on_hello(routing_id, msg, now_s)
        record = self._workers.sender(routing_id, msg)
        if record is None:
            return [(routing_id, p.ResyncRequested(reason="unknown worker: say hello first"))]
        record.last_seen_s = now_s
        if msg.seq != record.last_seq + 1:
            reason = f"sequence gap: expected {record.last_seq + 1}, got {msg.seq}"
            self._forget_pages(record.worker_id, reason)
            return [(routing_id, p.ResyncRequested(reason=reason))]
        record.last_seq = msg.seq
        try:
            return self._apply_fact(record, msg, now_s)
        except AdminError as exc:
            kind = type(msg).__name__
            self.num_refused_facts[kind] = self.num_refused_facts.get(kind, 0) + 1
            log.warning("refused %s from %s: %s", kind, record.worker_id, exc)
            return [(routing_id, p.Error(error=str(exc)[:4000], in_reply_to=kind))]

    def _on_hello(self, routing_id: bytes, hello: p.Hello, now_s: float) -> list[tuple[bytes, p._Msg]]:
        if hello.protocol_version != p.PROTOCOL_VERSION:
            return [(routing_id, p.Error(error=f"protocol version {hello.protocol_version} unsupported "
                                               f"(coordinator speaks {p.PROTOCOL_VERSION})", in_reply_to="Hello"))]
        if hello.page_size < 1:
            return [(routing_id, p.Error(error=f"bad page_size {hello.page_size}", in_reply_to="Hello"))]
        old = self._workers.get(hello.worker_id)
        if old is not None and old.plain and routing_id != old.routing_id:
            return [(routing_id, p.Error(error=f"worker id {hello.worker_id!r} is a configured plain worker",
                                         in_reply_to="Hello"))]
        if old is not None:
            # A re-hello (restart or resync) replaces everything the worker said before.
            self._forget_pages(hello.worker_id, "re-hello")
            if old.hello.fingerprint != hello.fingerprint:
                # new weights (a weight update re-announces): a copy in flight carries the old KV; end it now
                # rather than at its timeout (the target would refuse it anyway)
                self._replications.fail_involving(hello.worker_id, now_s, "changed its fingerprint")
        self._workers.add(hello, routing_id, now_s)
        return [(routing_id, p.HelloAck(coordinator_id=self.coordinator_id))]

    def _apply_fact(self, record: WorkerRecord, msg, now_s: float) -> list[tuple[bytes, p._Msg]]:
        """Raises AdminError for a fact refused (whole or in part; what was valid of it is applied)."""
        wid = record.worker_id
        d = self.directory
        if isinstance(msg, p.ReplicaExpected):
            pending = self._replications.expected(msg.replication_id, wid)
            if pending is not None:
                return [pending]
        elif isinstance(msg, p.PagesStored):
            if msg.medium in ("GPU", HOST_MEDIUM):
                self._pages_stored(record, msg, now_s)
        elif isinstance(msg, p.PagesRemoved):
            if msg.medium == HOST_MEDIUM:
                d.host.remove(wid, msg.block_hashes)
            elif msg.medium == "GPU":
                d.remove_pages(wid, msg.block_hashes)
        elif isinstance(msg, p.AllPagesCleared):
            d.drop_worker(wid)
        elif isinstance(msg, p.LoadReported):
            record.load, record.load_s = msg, now_s - msg.age_s
        elif isinstance(msg, p.PrefixHit):
            if msg.block_hash is not None and msg.matched_len > 0:
                self.demand.add_hit(HitRecord(now_s, wid, msg.namespace, msg.block_hash, msg.matched_len))
        elif isinstance(msg, p.ReplicaStored):
            self._replica_stored(record, msg, now_s)
        elif isinstance(msg, p.SourceSent):
            if self._replications.party(msg.replication_id, wid, ("source",)) is None:
                raise AdminError(f"{wid} is not the source of replication {msg.replication_id!r}")
            self._replications.sent(msg)
        elif isinstance(msg, p.ReplicaPromoted):
            d.promote(wid, msg.replication_id)  # (its own holdings only)
            if self._replications.party(msg.replication_id, wid, ("target",)) is not None:
                self._replications.promoted(msg)
        elif isinstance(msg, p.ReplicaExpired):
            d.promote(wid, msg.replication_id)  # what is left is ordinary cache: evicted pages go by PagesRemoved
        elif isinstance(msg, p.HintReported):
            # a hint is demand, not a fact about KV: checked and rate-limited as a router's (the worker's own
            # namespace, the prompt's tokens against the vocabulary); AdminError (429, 400) refuses it
            self.record_hint(api.HintRequest(kind=msg.kind, input_ids=list(msg.token_ids),
                                             cache_salt=msg.namespace or None, k=msg.k, ttl_s=msg.ttl_s,
                                             delay_s=msg.delay_s, hint_id=msg.hint_id), now_s)
        elif isinstance(msg, p.ReplicationFailed):
            if self._replications.party(msg.replication_id, wid, (msg.role,)) is None:
                raise AdminError(f"{wid} is not the {msg.role} of replication {msg.replication_id!r}")
            self._replications.fail(msg.replication_id, f"{msg.role} {wid}: {msg.error}", now_s)
        return []

    def _pages_stored(self, record: WorkerRecord, msg: p.PagesStored, now_s: float) -> None:
        """Records the pages whose hashes check out against their tokens (`PrefixDirectory.verify_blocks`), up to
        the worker's cap; raises AdminError naming the first refused page (the rest is recorded)."""
        wid, hello = record.worker_id, record.hello
        cap = min(self.config.max_pages_per_worker,
                  2 * (hello.pool_capacity_tokens // hello.page_size) + 64)
        blocks, vocab = ((b.block_hash, b.parent_hash, b.token_ids) for b in msg.blocks), hello.vocab_size
        if msg.medium == HOST_MEDIUM:  # (its host tier: the same cap, the same checks, `radix_sync.host_tier`)
            room = max(0, cap - self.directory.host.num_pages(wid))
            errors = self.directory.add_host_pages(wid, msg.namespace, blocks, hello.page_size,
                                                   vocab or self._workers.vocab_size(), max_new=room)[1]
        else:
            room = max(0, cap - self.directory.num_pages(wid))
            accepted, errors = self.directory.verify_blocks(wid, msg.namespace, blocks, hello.page_size,
                                                            vocab or self._workers.vocab_size(), max_new=room)
            self.directory.add_pages(wid, msg.namespace, accepted)
            self.demand.pages_stored((b[0] for b in accepted), now_s)
        if errors:
            raise AdminError(f"refused {len(errors)} of {len(msg.blocks)} pages: {errors[0]}")

    def _replica_stored(self, record: WorkerRecord, msg: p.ReplicaStored, now_s: float) -> None:
        """A replica landed (or is re-reported after a resync). Its pages are recorded from the tokens the
        coordinator granted, never from the fact alone; expiry is absolute: a re-report never extends it, and a
        replica past it is refused.

        Raises:
            AdminError: from a worker that is not the replication's target, for pages not granted, or expired.
        """
        wid = record.worker_id
        # NOTE: 0 s left is a replica the worker still holds past its TTL (kept for a request queued to use it),
        # re-reported by a resync: accepted as due now; it never extends a known expiry (below)
        if msg.expires_in_s < 0:
            raise AdminError(f"replica {msg.replication_id!r} has expired ({msg.expires_in_s:g}s left)")
        expires_at = now_s + min(msg.expires_in_s, self.config.max_replica_ttl_s)
        num_written = msg.inserted_len // record.hello.page_size
        rep = self._replications.records.get(msg.replication_id)
        if rep is not None:
            if rep.target != wid:
                raise AdminError(f"{wid} is not the target of replication {rep.id!r}")
            if rep.in_flight:
                new = self.directory.add_pages(wid, rep.namespace,
                                               self._replications.granted_blocks(msg, record.hello.page_size))
                if msg.inserted_len == 0 and new:  # (a copy of pages cached there that the directory had not seen)
                    log.info("replica %s landed nothing on %s: %d of its pages were unknown there", rep.id, wid, new)
                self._replications.stored(msg, now_s)
            elif rep.state == FAILED:
                raise AdminError(f"replication {rep.id!r} failed: {rep.error}")
            if rep.expires_at_s is not None:
                expires_at = min(expires_at, rep.expires_at_s)
            if expires_at <= now_s and msg.expires_in_s > 0:
                raise AdminError(f"replica {rep.id!r} expired {now_s - expires_at:.1f}s ago")
        # else: a replication of before a coordinator restart: only pages the worker re-reported with their tokens
        self.directory.mark_replica(wid, msg.block_hashes, num_written, expires_at, msg.replication_id)

    def _forget_pages(self, worker_id: str, reason: str) -> None:
        num = self.directory.drop_worker(worker_id)
        log.info("forgot %d pages of worker %s (%s)", num, worker_id, reason)

    def record_protocol_error(self) -> None:
        self.num_protocol_errors += 1

    # ------------------------------------------------------------------------------------------------ timers
    def tick(self, now_s: float) -> None:
        """Drop silent workers, time out replications, trim hit history."""
        for worker_id in self._workers.silent(now_s, self.config.worker_timeout_s):
            self._forget_pages(worker_id, "silent")
            self._workers.remove(worker_id)
            self._replications.fail_involving(worker_id, now_s)
        self._replications.time_out(now_s, self.config.replication_timeout_s)
        self.demand.trim(now_s, self.config.hit_window_s)
        self._replications.trim(self.config.max_replications_kept)

    # ------------------------------------------------------------------------------------------------- admin
    def request_replication(self, source: str, target: str, token_ids: list[int], namespace: str, ttl_s: float,
                            now_s: float, origin: str = "admin", block_hash: Optional[int] = None,
                            ordinary: bool = False) -> tuple[Replication, bytes, p.ExpectReplica]:
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
            if wid not in self._workers:
                raise AdminError(f"unknown worker {wid!r} (known: {sorted(self._workers)})", 404)
        src, dst = self.workers[source], self.workers[target]
        for rec in (src, dst):
            if rec.plain:
                raise AdminError(f"worker {rec.worker_id!r} runs without the kvrep plugin: it cannot send or "
                                 f"receive copies", 409)
        check_token_ids(token_ids, self._workers.vocab_size(), self.config.max_prompt_tokens)
        self._replications.check(src.hello, dst.hello, token_ids, ttl_s)
        # NOTE: only what the source holds is copied: a source that never held the prefix is refused (it would be
        # handed the one-time token and its bytes installed as the tenant's KV).
        held = self.directory.match(page_hashes(token_ids, src.hello.page_size, namespace)).get(source, 0)
        if held == 0:
            raise AdminError(f"source {source!r} holds no page of this prefix")
        token_ids = token_ids[:held * src.hello.page_size]
        rep, expect = self._replications.create(src.hello, dst.hello, src.routing_id, token_ids, namespace, ttl_s,
                                                now_s, origin, block_hash, ordinary)
        self._replications.trim(self.config.max_replications_kept)
        self.demand.copy_issued(block_hash, now_s)
        return rep, dst.routing_id, expect

    def _page_size(self, worker_id: str = "") -> int:
        """The page size of `worker_id`, else the smallest any worker uses (1 with no worker)."""
        return self._workers.page_size(worker_id)

    # ------------------------------------------------------------------------------------------------ demand
    # NOTE: the demand methods take the API's structs, or the JSON objects they decode from (tests, tools), which
    # are converted as the admin API decodes them.
    def record_arrival(self, report: Union[api.ArrivalReport, dict], now_s: float) -> ArrivalRecord:
        """Raises AdminError on a malformed arrival (nothing is recorded then)."""
        if isinstance(report, dict):
            report = api.convert(report, api.ArrivalReport)
        return self._record_arrival(self._parse_arrival(report), now_s)

    def record_demand(self, arrivals: list, finishes: list, now_s: float) -> tuple[int, int, list[str]]:
        """Records a router's batch, item by item: a bad item (not of its struct, or refused here) is dropped and
        named, the rest recorded (one tenant's bad report must not lose every tenant's demand signals).

        Args:
            arrivals, finishes: `api.ArrivalReport` / `api.FinishReport` structs, their decoded JSON (dicts), or
                their raw JSON (`msgspec.Raw`, as the admin API passes them).
        Returns:
            (arrivals recorded, finishes recorded, one error per dropped item, naming it).
        """
        parsed, errors = [], []
        for kind, items, type_, parse in (("arrivals", arrivals, api.ArrivalReport, self._parse_arrival),
                                          ("finishes", finishes, api.FinishReport, self._parse_finish)):
            for i, item in enumerate(items):
                try:
                    item = api.item_of(item, type_)
                    parsed.append((item.seq, kind, parse(item)))
                except AdminError as exc:
                    errors.append(f"{kind}[{i}]: {exc}")
        # NOTE: the router numbers its reports (`seq`) so a batch replays in the order things happened: a turn's
        # finish before its follow-up's arrival, a request's arrival before its own finish.
        parsed.sort(key=lambda x: x[0])  # stable: without seq, arrivals before finishes
        for _, kind, item in parsed:
            (self._record_arrival if kind == "arrivals" else self._record_finish)(item, now_s)
        num_a = sum(1 for _, kind, _ in parsed if kind == "arrivals")
        return num_a, len(parsed) - num_a, errors

    def check_prompt(self, token_ids: list[int]) -> None:
        """Raises AdminError (400) for a prompt longer than `max_prompt_tokens` or with a token id outside
        [0, 2**31) or >= the fleet's vocabulary size (when the workers said it)."""
        check_token_ids(token_ids, self._workers.vocab_size(), self.config.max_prompt_tokens)

    def _prompt_hashes(self, report, namespace: str) -> list[int]:
        """A report's prompt as page hashes: the router's own (checked against the worker's page size), or its
        token ids hashed at the worker's page size."""
        if report.page_hashes is not api.UNSET:  # the router's own hashes: nothing to rehash
            page_size = api.page_size_of(report.page_size)
            if len(report.page_hashes) * page_size > self.config.max_prompt_tokens:
                raise AdminError(f"page_hashes cover more than max_prompt_tokens={self.config.max_prompt_tokens}")
            record = self._workers.get(report.worker)
            if record is not None and record.hello.page_size != page_size:
                raise AdminError(f"page_size {page_size} is not worker {report.worker}'s "
                                 f"({record.hello.page_size})")
            return report.page_hashes
        if report.input_ids is api.UNSET:
            raise AdminError("input_ids must be a list of integers in [0, 2**31)")
        self.check_prompt(report.input_ids)
        return page_hashes(report.input_ids, self._page_size(report.worker), namespace)

    def _parse_arrival(self, report: api.ArrivalReport) -> tuple:
        namespace = api.namespace_of(report.cache_salt)
        hashes = self._prompt_hashes(report, namespace)
        if report.page_hashes is not api.UNSET:
            if report.prompt_len is api.UNSET:
                raise AdminError("prompt_len must be an integer >= 0 with page_hashes, got None")
            prompt_len = report.prompt_len
        else:
            prompt_len = len(report.input_ids)
        return hashes, prompt_len, namespace, report.worker, report.session_id or "", report.class_key or ""

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
        self.demand.add_arrival(rec, hashes, held, self._copies_ending_at(hashes, matched, worker_id))
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

    def _parse_finish(self, report: api.FinishReport) -> tuple:
        namespace = api.namespace_of(report.cache_salt)
        hashes = self._prompt_hashes(report, namespace)
        alone = ((report.alone_new_tokens, report.alone_cached_tokens)
                 if report.alone_new_tokens is not None and report.alone_cached_tokens is not None else None)
        return hashes, namespace, report.worker, report.stop, report.class_key or "", report.ttft_s, alone

    def _record_finish(self, parsed: tuple, now_s: float) -> FinishRecord:
        hashes, namespace, worker_id, stop, class_key, ttft_s, alone = parsed
        rec = FinishRecord(now_s, namespace, hashes[-1] if hashes else None, len(hashes), stop, class_key,
                           worker_id)
        self.demand.add_finish(rec, hashes)
        self.ledger.finished(hashes, ttft_s, now_s)
        self.pull_ledger.finished(hashes, ttft_s, now_s)
        if alone is not None and ttft_s is not None:
            self.speed.observe(alone[0], alone[1], ttft_s)
        return rec

    def record_hint(self, req: Union[api.HintRequest, dict], now_s: float) -> HintRecord:
        """Records a hint, its TTL capped to `max_hint_ttl_s`.

        Raises:
            AdminError: 400 for a bad prompt; 429 when its tenant sends hints faster than `hint_rate_per_s` or
                has `max_hints_per_namespace` live hints already (or all tenants `max_hints`).
        """
        if isinstance(req, dict):
            req = api.convert(req, api.HintRequest)
        self.check_prompt(req.input_ids)
        namespace = api.namespace_of(req.cache_salt)
        cfg, demand = self.config, self.demand
        seen = demand.seen_hint(namespace, req.hint_id, req.kind)
        if seen is not None:  # sent again (by the worker after the router, or retried): recorded once
            return seen
        if req.kind != "end" and (demand.hint_counts.get(namespace, 0) >= cfg.max_hints_per_namespace
                                  or len(demand.hints) >= cfg.max_hints):
            raise AdminError(f"too many live hints for this tenant (at most {cfg.max_hints_per_namespace})", 429)
        if not demand.take_hint_token(namespace, now_s, cfg.hint_rate_per_s, cfg.hint_burst):
            raise AdminError(f"hint rate limit: at most {cfg.hint_rate_per_s:g}/s per tenant", 429)
        page_size = self._page_size()
        hashes = page_hashes(req.input_ids, page_size, namespace)
        block_hash, prefix_len = (hashes[-1] if hashes else None), len(hashes) * page_size
        rec = HintRecord(now_s, req.kind, namespace, block_hash, prefix_len, req.k, min(req.ttl_s, cfg.max_hint_ttl_s),
                         req.delay_s)
        demand.remember_hint_id(namespace, req.hint_id, rec)
        if req.kind == "end":  # not a live hint: it ends those on its prefix
            demand.end_session(rec)
            return rec
        demand.add_hint(rec, block_hash is not None and self.directory.node(block_hash) is not None)
        return rec

    def reset_demand(self) -> None:
        """Forgets every demand signal (hits, arrivals, finishes, hints and their timelines)."""
        self.demand.clear()

    # ------------------------------------------------------------------------------------------------ queries
    def lookup(self, token_ids: list[int], namespace: str) -> dict[str, int]:
        """Tokens of `token_ids` each worker holds (as owner or replica), per the directory."""
        self.check_prompt(token_ids)
        return self.lookup_hashed(hash_prompt(token_ids, namespace, self._workers.page_sizes()))

    def lookup_params(self) -> tuple[set[int], int, int]:
        """(the workers' page sizes, the fleet's vocabulary size (0: unknown), max_prompt_tokens): what a caller
        needs to check and hash a prompt without the lock (`hash_prompt`, then `lookup_hashed`)."""
        return self._workers.page_sizes(), self._workers.vocab_size(), self.config.max_prompt_tokens

    def lookup_hashed(self, hashed: dict[int, list[int]]) -> dict[str, int]:
        """`lookup` from the prompt's page hashes at each page size (`hash_prompt`)."""
        out: dict[str, int] = {wid: 0 for wid in self.workers}
        for page_size, hashes in hashed.items():
            for wid, held in self.lookup_hashes(hashes, page_size).items():
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
            workers.append(WorkerView(wid, record.hello.fingerprint,
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
        in_flight = frozenset((r.block_hash, r.target) for r in self._replications.in_flight()
                              if r.block_hash is not None)
        return RuleSnapshot(tuple(self.hits), tuple(workers), held, in_flight)

    def check_integrity_steps(self, step: int = 8192) -> Iterator[None]:
        """Each owner, then what ties them (the directory holds pages only of known workers), in steps of the
        directory's (`PrefixDirectory.check_integrity_steps`): a caller that holds the lock during each step only
        never stalls the facts or the lookups on a large directory. Raises IntegrityError naming the first
        broken invariant (also under `python -O`)."""
        self._workers.check_integrity()
        self._replications.check_integrity()
        self.demand.check_integrity()
        for wid in self.directory.workers():
            if wid not in self._workers:
                raise IntegrityError(f"directory holds pages of unknown worker {wid}")
        yield
        yield from self.directory.check_integrity_steps(step)

    def check_integrity(self) -> None:
        """`check_integrity_steps` at once, the caller holding the lock throughout."""
        for _ in self.check_integrity_steps(step=1 << 62):
            pass


def hash_prompt(token_ids: list[int], namespace: str, page_sizes: Iterable[int]) -> dict[int, list[int]]:
    """A prompt's page hashes at each page size (checked first with `ClusterState.check_prompt`, or the
    `lookup_params` it took under the lock: this runs without it)."""
    return {ps: page_hashes(token_ids, ps, namespace) for ps in page_sizes}
