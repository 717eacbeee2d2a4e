"""The worker agent's I/O thread: owns the DEALER to the coordinator and the data-plane `Transport` (with ZeroMQ:
the data ROUTER peers send pages to and a DEALER per target it sends pages to; see `sglang_kvrep.transport`).
Decides what a transfer may do (the coordinator's grants) and what a finished one means; the transport moves
the bytes. Talks to the scheduler thread only through the agent's queues and pipes (see `sglang_kvrep.agent`).
Never touches the radix tree, the allocator or the pool.
"""
from __future__ import annotations

import hmac
import logging
import os
import queue
import time
from array import array
from typing import TYPE_CHECKING, Optional

import msgspec
import zmq

from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from sglang_kvrep import events
from sglang_kvrep.dataplane import Incoming, check_header
from sglang_kvrep.transport import (ChunkSent, Refusal, TransferFailed, TransferReceived, TransferSent,
                                    TransportEvent, make_transport)

if TYPE_CHECKING:
    from sglang_kvrep.agent import WorkerAgent

log = logging.getLogger("kvrep.agent")


class IoLoop:
    """Owns the coordinator socket and the data-plane transport (every socket of the agent). I/O thread only."""

    def __init__(self, agent: "WorkerAgent") -> None:
        self.a = agent
        self.cfg = agent.config
        self.ctx = zmq.Context()
        self.coord = self.ctx.socket(zmq.DEALER)
        self.coord.setsockopt(zmq.LINGER, 0)
        self.coord.setsockopt(zmq.SNDHWM, 100_000)
        self.coord.connect(self.cfg.coordinator)
        self.poller = zmq.Poller()
        self.poller.register(self.coord, zmq.POLLIN)
        self.poller.register(agent._wake_r, zmq.POLLIN)
        self.expected: dict[str, tuple[p.ExpectReplica, float]] = {}  # replication id -> (grant, deadline)
        self.transport = make_transport(self.cfg.transport, self.cfg, self.admit, self.on_transport_event, self.ctx,
                                        self.poller)
        agent.data_endpoint = self.transport.endpoint
        self.seq = 0
        self.need_resync = False
        self.mirror: dict[int, tuple[Optional[int], list[int], str]] = {}
        self.replica_blocks: dict[str, tuple[str, list[int], bool]] = {}
        self.replica_facts: dict[str, p.ReplicaStored] = {}
        self.last_load: Optional[p.LoadReported] = None
        self.last_sent_s = 0.0
        agent._ready.set()

    # ------------------------------------------------------------------------------------------ coordinator
    def send_coord(self, msg) -> None:
        self.seq += 1
        msg.seq = self.seq
        try:
            self.coord.send(p.encode(msg), zmq.NOBLOCK)
            self.last_sent_s = time.monotonic()
        except zmq.Again:
            self.need_resync = True  # the coordinator is unreachable; say everything again once it is back

    def hello(self) -> None:
        a = self.a
        self.seq = 0
        msg = p.Hello(worker_id=self.cfg.worker_id, http_url=self.cfg.http_url, data_endpoint=a.data_endpoint,
                      fingerprint=a.fingerprint, fingerprint_fields=a.fingerprint_fields, page_size=a.page_size,
                      pool_capacity_tokens=a.capacity, replica_budget_tokens=a.replicas.budget_tokens, seq=0)
        try:
            self.coord.send(p.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.need_resync = True
            return
        self.need_resync = False
        # Resync: everything this worker holds, parents before children (dict order is insertion order).
        by_ns: dict[str, list[p.BlockFact]] = {}
        for h, (parent, tokens, ns) in self.mirror.items():
            by_ns.setdefault(ns, []).append(p.BlockFact(h, parent, tokens))
        for ns, blocks in by_ns.items():
            for i in range(0, len(blocks), 4096):
                self.send_coord(p.PagesStored(worker_id=self.cfg.worker_id, seq=0, namespace=ns,
                                              blocks=blocks[i:i + 4096]))
        for fact in self.replica_facts.values():
            self.send_coord(msgspec.structs.replace(fact))
        if self.last_load is not None:
            self.send_coord(msgspec.structs.replace(self.last_load))

    def on_coord(self, data: bytes) -> None:
        try:
            msg = p.decode_for_worker(data)
        except p.ProtocolError as exc:
            log.warning("kvrep: bad message from the coordinator: %s", exc)
            return
        if isinstance(msg, p.ResyncRequested):
            log.info("kvrep: coordinator asks for a resync (%s)", msg.reason)
            self.hello()
        elif isinstance(msg, p.ExpectReplica):
            self.expected[msg.replication_id] = (msg, time.monotonic() + msg.expires_in_s)
            self.send_coord(p.ReplicaExpected(worker_id=self.cfg.worker_id, seq=0, replication_id=msg.replication_id))
        elif isinstance(msg, (p.ReplicatePages, p.DropReplica)):
            kind = "replicate" if isinstance(msg, p.ReplicatePages) else "drop"
            self.to_sched((kind, msg if kind == "replicate" else msg.replication_id))
        elif isinstance(msg, p.DemotePrefix):
            self.to_sched(("demote", msg.namespace, msg.token_ids))
        elif isinstance(msg, p.Error):
            log.warning("kvrep: coordinator error: %s", msg.error)

    def to_sched(self, item: tuple) -> None:
        self.a.sched_q.put(item)
        try:
            os.write(self.a._bell_w, b"x")
        except OSError:
            pass

    # --------------------------------------------------------------------------------------- local events
    def drain_events(self) -> None:
        sink = events.SINK
        wid = self.cfg.worker_id
        while sink:
            fact = sink.popleft()
            if fact[0] == "stored":
                _, ns, blocks, medium = fact
                if medium != "GPU":
                    continue
                for h, parent, tokens in blocks:
                    self.mirror[h] = (parent, tokens, ns)
                self.send_coord(p.PagesStored(worker_id=wid, seq=0, namespace=ns, medium=medium,
                                              blocks=[p.BlockFact(h, par, t) for h, par, t in blocks]))
            elif fact[0] == "removed":
                _, hashes, medium = fact
                if medium != "GPU":
                    continue
                for h in hashes:
                    self.mirror.pop(h, None)
                self.send_coord(p.PagesRemoved(worker_id=wid, seq=0, block_hashes=hashes))
            elif fact[0] == "cleared":
                self.mirror.clear()
                self.send_coord(p.AllPagesCleared(worker_id=wid, seq=0))

    def on_hit(self, namespace: str, tokens: array, matched: int, key_len: int) -> None:
        hashes = page_hashes(tokens, self.a.page_size, namespace)
        if not hashes:
            return
        self.send_coord(p.PrefixHit(worker_id=self.cfg.worker_id, seq=0, namespace=namespace,
                                    block_hash=hashes[-1], matched_len=matched, key_len=key_len))
        hit = set(hashes)
        for rid, (ns, blocks, promoted) in list(self.replica_blocks.items()):
            if ns == namespace and not promoted and blocks and blocks[0] in hit:
                self.replica_blocks[rid] = (ns, blocks, True)
                self.replica_facts.pop(rid, None)
                self.to_sched(("promote", rid))
                num = sum(1 for b in blocks if b in hit) * self.a.page_size
                self.send_coord(p.ReplicaPromoted(worker_id=self.cfg.worker_id, seq=0, replication_id=rid,
                                                  num_promoted_tokens=num))

    # ------------------------------------------------------------------------------------------ data plane
    def admit(self, h: p.TransferHeader) -> Optional[Refusal]:
        """The transport asks before staging a byte: is this transfer authorized and can it land here?"""
        entry = self.expected.get(h.replication_id)
        if entry is None or not hmac.compare_digest(entry[0].auth_token, h.auth_token):
            # not reported: a stranger must not be able to fail someone else's replication
            return Refusal("transfer not authorized by the coordinator (unknown replication or bad token)",
                           tell_coordinator=False)
        err = self.check_grant(h, entry[0]) or check_header(h, self.a.geometry, self.a._free_replica_tokens)
        return None if err is None else Refusal(err)

    @staticmethod
    def check_grant(h: p.TransferHeader, grant: p.ExpectReplica) -> Optional[str]:
        """Does this authenticated transfer stay within what the coordinator authorized?"""
        if h.source_id != grant.source_id or h.namespace != grant.namespace or h.page_size != grant.page_size:
            return "transfer does not match its authorization (source, namespace or page size)"
        if h.num_pages > len(grant.block_hashes):
            return f"transfer of {h.num_pages} pages exceeds the {len(grant.block_hashes)} authorized"
        return None

    def on_transport_event(self, ev: TransportEvent) -> None:
        a = self.a
        if isinstance(ev, ChunkSent):
            a.sent_chunks[ev.transfer_id] = ev.num_sent
            self.ring_scheduler()  # it may gather the next chunks now
        elif isinstance(ev, TransferSent):
            h = ev.header
            a.sent_chunks.pop(h.transfer_id, None)
            self.send_coord(p.SourceSent(worker_id=self.cfg.worker_id, seq=0, replication_id=h.replication_id,
                                         num_tokens=len(h.token_ids), num_bytes=h.num_bytes,
                                         gather_s=ev.gather_s, send_s=ev.send_s))
        elif isinstance(ev, TransferReceived):
            self.on_received(ev.incoming)
        elif isinstance(ev, TransferFailed):
            if ev.role == "source":  # stop gathering and sending the rest, release the source's lock
                a.cancelled.add(ev.transfer_id)
                a.sent_chunks.pop(ev.transfer_id, None)
                self.ring_scheduler()
            if ev.tell_coordinator:
                self.report_failure(ev.replication_id, ev.role, ev.error)

    def on_received(self, inc: Incoming) -> None:
        """Every chunk arrived and verified: check the token ids against the grant, then hand it to the
        scheduler thread to install."""
        h = inc.header
        grant = self.expected.pop(h.replication_id, (None,))[0]
        hashes = page_hashes(h.token_ids, h.page_size, h.namespace)
        if grant is None or hashes != grant.block_hashes[:len(hashes)]:
            error = "token ids are not the prefix the coordinator authorized"
            self.transport.answer(inc, error=error)
            return self.report_failure(h.replication_id, "target", error)
        self.to_sched(("install", inc, hashes))

    def report_failure(self, replication_id: str, role: str, error: str) -> None:
        """Tell the coordinator; a target also consumes the transfer's grant."""
        if role == "target":
            self.expected.pop(replication_id, None)
        self.send_coord(p.ReplicationFailed(worker_id=self.cfg.worker_id, seq=0, replication_id=replication_id,
                                            role=role, error=error))

    def install_done(self, inc: Incoming, res, error: Optional[str], block_hashes: list[int]) -> None:
        h = inc.header
        if error is not None:
            self.transport.answer(inc, error=error)
            return self.report_failure(h.replication_id, "target", error)
        self.transport.answer(inc, inserted_len=res.inserted_len)
        fact = p.ReplicaStored(worker_id=self.cfg.worker_id, seq=0, replication_id=h.replication_id,
                               namespace=h.namespace, block_hashes=block_hashes, inserted_len=res.inserted_len,
                               expires_in_s=h.ttl_s, num_bytes=h.num_bytes,
                               receive_s=inc.last_progress_s - inc.started_s, scatter_s=res.scatter_s,
                               insert_s=res.insert_s)
        if res.inserted_len > 0:
            self.replica_blocks[h.replication_id] = (h.namespace, block_hashes, False)
            self.replica_facts[h.replication_id] = fact
        self.send_coord(msgspec.structs.replace(fact))

    def ring_scheduler(self) -> None:
        try:
            os.write(self.a._bell_w, b"x")
        except OSError:
            pass

    def expire_grants(self, now: float) -> None:
        for rid, (_, deadline) in list(self.expected.items()):
            if now > deadline:
                del self.expected[rid]

    # ------------------------------------------------------------------------------------------------ loop
    def run(self) -> None:
        try:
            self._run()
        finally:
            self.transport.close()

    def _run(self) -> None:
        self.hello()
        a = self.a
        next_wait = 0.5
        while not a._stop.is_set():
            ready = dict(self.poller.poll(max(1, int(min(next_wait, 0.5) * 1000))))
            if a._wake_r in ready:
                try:
                    os.read(a._wake_r, 65536)
                except BlockingIOError:
                    pass
            self.drain_events()
            while True:
                try:
                    item = a.io_q.get_nowait()
                except queue.Empty:
                    break
                kind = item[0]
                if kind == "coord":
                    if isinstance(item[1], p.LoadReported):
                        self.last_load = item[1]
                    self.send_coord(item[1])
                elif kind == "hit":
                    self.on_hit(*item[1:])
                elif kind == "send_begin":
                    cmd, header = item[1:]
                    self.transport.send(header, cmd.target_endpoint)
                elif kind == "send_chunk":
                    self.transport.push_chunk(*item[1:])
                elif kind == "install_done":
                    self.install_done(*item[1:])
                elif kind == "stop":
                    return
            if self.coord in ready:
                while True:
                    try:
                        self.on_coord(self.coord.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            next_wait = self.transport.progress(ready)
            now = time.monotonic()
            self.expire_grants(now)
            if now - self.last_sent_s > 1.0:  # heartbeat, and a retry of the hello after an outage
                if self.need_resync:
                    self.hello()
                elif self.last_load is not None:
                    self.send_coord(msgspec.structs.replace(self.last_load))
