"""The coordinator's replications: each copy asked for, its handshake and its outcome.

`ReplicationBook` owns the records and the commands held back until a target says it expects the transfer. It is
told the workers' hellos by `ClusterState` (`state.py`), which calls it under the coordinator's lock; it never
reads the directory.

Lifecycle (`state`):

    pending --SourceSent--> running --ReplicaStored--> done
       |                       |
       +------- failed <-------+   (ReplicationFailed, a party went silent, or the timeout)

A replication's facts are taken only from its parties: `SourceSent` from its source, `ReplicaExpected`,
`ReplicaStored` and `ReplicaPromoted` from its target, `ReplicationFailed` from either (`party`). A target's
`ReplicaStored` must name a prefix of the pages it was granted, in the granted namespace.
"""
from __future__ import annotations

import itertools
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Optional

from radix_sync import api
from radix_sync import protocol as p
from radix_sync.api import AdminError
from radix_sync.hashing import page_digests, digest_to_int64
from radix_sync.integrity import IntegrityError

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
STATES = (PENDING, RUNNING, DONE, FAILED)
ORIGIN_PULL = "pull"
"""The origin of a router's copy on the critical path (`POST /replicate` with `critical`)."""


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
    expires_at_s: Optional[float] = None
    """When the replica expires on the coordinator's clock (set when it landed; absolute: a re-report after a
    resync never extends it)."""
    num_waiting: int = 0
    """Routers waiting for it now (`POST /replications/wait`: a pull, or a request held for the copy since stop 52)."""
    num_abandoned: int = 0
    """Waits that ended at their router's deadline with the copy still in flight: that request went elsewhere."""
    wanted: bool = False
    """Its target was told a request waits for it (`WantReplica`: land it, or raise it, as ordinary cache)."""

    @property
    def in_flight(self) -> bool:
        return self.state in (PENDING, RUNNING)

    def to_info(self) -> api.ReplicationInfo:
        """The record as `GET /replications` lists it."""
        return api.ReplicationInfo(
            id=self.id, source=self.source, target=self.target, namespace=self.namespace,
            num_tokens=self.num_tokens, ttl_s=self.ttl_s, origin=self.origin, state=self.state,
            error=self.error or None, num_bytes=self.num_bytes, inserted_len=self.inserted_len,
            promoted_tokens=self.promoted_tokens, created_s=self.created_s, started_s=self.started_s,
            finished_s=self.finished_s,
            total_s=(self.finished_s - self.created_s) if self.finished_s is not None else None,
            timings_s=dict(self.timings_s))

    def to_json(self) -> dict:
        return api.to_builtins(self.to_info())


def check_token_ids(token_ids: list[int], vocab_size: int = 0, max_len: Optional[int] = None) -> None:
    """Raises AdminError unless `token_ids` is a list of at most `max_len` ints in [0, 2**31), each below
    `vocab_size` when it is known (> 0)."""
    limit = min(p.MAX_TOKEN_ID + 1, vocab_size) if vocab_size > 0 else p.MAX_TOKEN_ID + 1
    if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in token_ids):
        raise AdminError(f"input_ids must be a list of integers in [0, {limit})")
    if max_len is not None and len(token_ids) > max_len:
        raise AdminError(f"input_ids holds {len(token_ids)} tokens, more than max_prompt_tokens={max_len}")


class ReplicationBook:
    """Replication id -> record, in creation order (the oldest are forgotten first)."""

    def __init__(self, expect_timeout_s: float) -> None:
        self.expect_timeout_s = expect_timeout_s
        """How long a target waits for a transfer it was told to expect (the replication timeout)."""
        self.records: dict[str, Replication] = {}
        self._granted: dict[str, tuple[list[int], list[bytes]]] = {}
        """In-flight replication id -> (the prefix's token ids, their page digests): what its target may report
        as landed (and the tokens its pages are recorded with)."""
        # replication id -> (source routing id, command), held until the target says it expects the transfer
        self._awaiting_target: dict[str, tuple[bytes, p.ReplicatePages]] = {}
        self._ids = itertools.count(1)

    def check(self, src: p.Hello, dst: p.Hello, token_ids: list[int], ttl_s: float) -> None:
        """Raises AdminError unless a replication of `token_ids` from `src` to `dst` could be made (same worker,
        fingerprints, TTL, token ids, at least one page)."""
        source, target = src.worker_id, dst.worker_id
        if source == target:
            raise AdminError(f"source and target are the same worker {source!r}")
        if src.fingerprint != dst.fingerprint:
            diff = {k: (src.fingerprint_fields.get(k), dst.fingerprint_fields.get(k))
                    for k in set(src.fingerprint_fields) | set(dst.fingerprint_fields)
                    if src.fingerprint_fields.get(k) != dst.fingerprint_fields.get(k)}
            raise AdminError(f"fingerprint mismatch between {source} and {target}: {diff}")
        if not 0 < ttl_s <= p.MAX_TTL_S:
            raise AdminError(f"ttl_s must be in (0, {p.MAX_TTL_S:g}], got {ttl_s}")
        check_token_ids(token_ids, min((v for v in (src.vocab_size, dst.vocab_size) if v > 0), default=0),
                        p.MAX_PREFIX_TOKENS)
        page_size = src.page_size
        num_tokens = (len(token_ids) // page_size) * page_size
        if num_tokens == 0:
            raise AdminError(f"prefix of {len(token_ids)} tokens is shorter than one page ({page_size})")

    def create(self, src: p.Hello, dst: p.Hello, src_routing_id: bytes, token_ids: list[int], namespace: str,
               ttl_s: float, now_s: float, origin: str, block_hash: Optional[int],
               ordinary: bool = False) -> tuple[Replication, p.ExpectReplica]:
        """Validates a replication from `src` to `dst` and records it; the source's command is held until the
        target answers `ReplicaExpected` (`expected`). `ordinary`: the target lands it as ordinary cache
        (`ExpectReplica.ordinary`; a pull always is).

        Returns:
            the record and the message for the target.
        Raises:
            AdminError: same worker, incompatible fingerprints, bad TTL, bad or shorter-than-a-page prefix.
        """
        self.check(src, dst, token_ids, ttl_s)
        source, target = src.worker_id, dst.worker_id
        page_size = src.page_size
        num_tokens = (len(token_ids) // page_size) * page_size
        rep = Replication(id=f"r{next(self._ids)}-{uuid.uuid4().hex[:6]}", source=source, target=target,
                          namespace=namespace, num_tokens=num_tokens, ttl_s=ttl_s, origin=origin,
                          created_s=now_s, block_hash=block_hash)
        rep.started_s = now_s
        self.records[rep.id] = rep
        prefix = list(token_ids[:num_tokens])
        auth_token = secrets.token_hex(16)
        cmd = p.ReplicatePages(replication_id=rep.id, auth_token=auth_token, token_ids=prefix, namespace=namespace,
                               target_id=target, target_endpoint=dst.data_endpoint,
                               target_fingerprint=dst.fingerprint, ttl_s=ttl_s)
        self._awaiting_target[rep.id] = (src_routing_id, cmd)
        digests = page_digests(prefix, page_size, namespace)
        self._granted[rep.id] = (prefix, digests)
        expect = p.ExpectReplica(replication_id=rep.id, source_id=source, namespace=namespace, page_size=page_size,
                                 block_hashes=[digest_to_int64(d) for d in digests], auth_token=auth_token,
                                 expires_in_s=self.expect_timeout_s, critical=origin == ORIGIN_PULL,
                                 ordinary=ordinary)
        return rep, expect

    def party(self, replication_id: str, worker_id: str, roles: tuple[str, ...]) -> Optional[Replication]:
        """The replication, when `worker_id` is its `source` or `target` as `roles` allow; None otherwise (an
        unknown replication, or a worker that is not the party that may say this)."""
        rep = self.records.get(replication_id)
        if rep is None:
            return None
        if ("source" in roles and rep.source == worker_id) or ("target" in roles and rep.target == worker_id):
            return rep
        return None

    def granted_blocks(self, msg: p.ReplicaStored, page_size: int) -> list[tuple]:
        """The pages a target's `ReplicaStored` may record, with their tokens and digests, parents first.

        Raises:
            AdminError: the fact names another namespace, or pages that are not a prefix of those granted.
        """
        rep = self.records[msg.replication_id]
        tokens, digests = self._granted.get(msg.replication_id, ([], []))
        if msg.namespace != rep.namespace:
            raise AdminError(f"replica of {rep.id} reported in another namespace than granted")
        n = len(msg.block_hashes)
        if n > len(digests) or any(digest_to_int64(d) != h for d, h in zip(digests, msg.block_hashes)):
            raise AdminError(f"replica of {rep.id} names pages that are not a prefix of those granted")
        if msg.inserted_len > n * page_size:
            raise AdminError(f"replica of {rep.id} inserted {msg.inserted_len} tokens of {n} pages")
        out, parent = [], None
        for i in range(n):
            out.append((msg.block_hashes[i], parent, tokens[i * page_size:(i + 1) * page_size], digests[i]))
            parent = msg.block_hashes[i]
        return out

    # ------------------------------------------------------------------------------------------------- facts
    def expected(self, replication_id: str, worker_id: str) -> Optional[tuple[bytes, p.ReplicatePages]]:
        """The target `worker_id` expects the transfer: the held (source routing id, command), once; None when
        there is none or `worker_id` is not the pending replication's target."""
        pending = self._awaiting_target.pop(replication_id, None)
        rep = self.records.get(replication_id)
        if pending is not None and rep is not None and rep.state == PENDING and rep.target == worker_id:
            return pending
        return None

    def sent(self, msg: p.SourceSent) -> None:
        rep = self.records.get(msg.replication_id)
        if rep is not None:
            rep.num_bytes = msg.num_bytes
            rep.timings_s.update(gather_s=msg.gather_s, send_s=msg.send_s)
            if rep.state == PENDING:
                rep.state = RUNNING

    def stored(self, msg: p.ReplicaStored, now_s: float) -> None:
        rep = self.records.get(msg.replication_id)
        if rep is not None and rep.in_flight:
            self._granted.pop(rep.id, None)
            rep.state, rep.finished_s = DONE, now_s
            rep.expires_at_s = now_s + min(msg.expires_in_s, rep.ttl_s)
            rep.inserted_len = msg.inserted_len
            rep.num_bytes = rep.num_bytes or msg.num_bytes
            rep.timings_s.update(receive_s=msg.receive_s, scatter_s=msg.scatter_s, insert_s=msg.insert_s)

    def promoted(self, msg: p.ReplicaPromoted) -> None:
        rep = self.records.get(msg.replication_id)
        if rep is not None:
            rep.promoted_tokens = max(rep.promoted_tokens, msg.num_promoted_tokens)

    def fail(self, replication_id: str, error: str, now_s: float) -> None:
        rep = self.records.get(replication_id)
        self._awaiting_target.pop(replication_id, None)
        self._granted.pop(replication_id, None)
        if rep is not None and rep.in_flight:
            rep.state, rep.error, rep.finished_s = FAILED, error, now_s

    # ------------------------------------------------------------------------------------------------ timers
    def fail_involving(self, worker_id: str, now_s: float, why: str = "went silent") -> None:
        """Fails the replications `worker_id` is a party of (it went silent, or its weights changed)."""
        for rep in self.records.values():
            if worker_id in (rep.source, rep.target):
                self.fail(rep.id, f"worker {worker_id} {why}", now_s)

    def time_out(self, now_s: float, timeout_s: float) -> None:
        for rep in self.records.values():
            if rep.in_flight and now_s - rep.created_s > timeout_s:
                self.fail(rep.id, f"timed out after {timeout_s:g}s", now_s)

    def trim(self, max_kept: int) -> None:
        """Forgets the oldest records beyond `max_kept` (with their held commands and grants)."""
        while len(self.records) > max_kept:
            rid = next(iter(self.records))
            del self.records[rid]
            self._awaiting_target.pop(rid, None)
            self._granted.pop(rid, None)

    def in_flight(self) -> list[Replication]:
        return [r for r in self.records.values() if r.in_flight]

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every record is filed under its id, in a known state, finished exactly
        when it is done or failed (failed with a reason), and every held command is for its own replication."""
        for rid, rep in self.records.items():
            if rep.id != rid:
                raise IntegrityError(f"replication {rid!r} holds the record of {rep.id!r}")
            if rep.state not in STATES:
                raise IntegrityError(f"replication {rid!r} in unknown state {rep.state!r}")
            if (rep.finished_s is not None) != (rep.state in (DONE, FAILED)):
                raise IntegrityError(f"replication {rid!r} is {rep.state} with finished_s={rep.finished_s}")
            if (rep.state == FAILED) != bool(rep.error):
                raise IntegrityError(f"replication {rid!r} is {rep.state} with error {rep.error!r}")
        for rid, (_, cmd) in self._awaiting_target.items():
            if cmd.replication_id != rid:
                raise IntegrityError(f"the command held for {rid!r} is for {cmd.replication_id!r}")
        for rid in self._granted:
            rep = self.records.get(rid)
            if rep is None or not rep.in_flight:
                raise IntegrityError(f"a grant is kept for replication {rid!r}, which is not in flight")
