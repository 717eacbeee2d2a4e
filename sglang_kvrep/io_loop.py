"""The worker agent's I/O thread: owns every socket of the agent (the DEALER to the coordinator, the data ROUTER
peers send pages to, a DEALER per target it sends pages to). Talks to the scheduler thread only through the
agent's queues and pipes (see `sglang_kvrep.agent`). Never touches the radix tree, the allocator or the pool.
"""
from __future__ import annotations

import collections
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
from sglang_kvrep.dataplane import Incoming, Outgoing, StagingPool, TokenBucket, check_header, chunk_frames

if TYPE_CHECKING:
    from sglang_kvrep.agent import WorkerAgent

log = logging.getLogger("kvrep.agent")


class IoLoop:
    """Owns every socket of the agent. Runs on the I/O thread only."""

    def __init__(self, agent: "WorkerAgent") -> None:
        self.a = agent
        self.cfg = agent.config
        self.ctx = zmq.Context()
        self.coord = self.ctx.socket(zmq.DEALER)
        self.coord.setsockopt(zmq.LINGER, 0)
        self.coord.setsockopt(zmq.SNDHWM, 100_000)
        self.coord.connect(self.cfg.coordinator)
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.RCVHWM, 64)  # bound what libzmq buffers ahead of staging (TCP pushes back)
        addr = f"tcp://{self.cfg.data_host}"
        if self.cfg.data_port:
            self.data.bind(f"{addr}:{self.cfg.data_port}")
            port = self.cfg.data_port
        else:
            port = self.data.bind_to_random_port(addr)
        agent.data_endpoint = f"{addr}:{port}"
        self.peers: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        for s in (self.coord, self.data):
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(agent._wake_r, zmq.POLLIN)
        self.seq = 0
        self.need_resync = False
        self.mirror: dict[int, tuple[Optional[int], list[int], str]] = {}
        self.replica_blocks: dict[str, tuple[str, list[int], bool]] = {}
        self.replica_facts: dict[str, p.ReplicaStored] = {}
        self.incoming: dict[str, Incoming] = {}
        self.staging = StagingPool(self.cfg.staging_bytes)
        self.expected: dict[str, tuple[p.ExpectReplica, float]] = {}  # replication id -> (grant, deadline)
        self.outgoing: dict[str, Outgoing] = {}
        self.send_queue: collections.deque[str] = collections.deque()
        self.bucket = TokenBucket(self.cfg.send_rate_mbps * 1e6, self.cfg.chunk_bytes)
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
    def on_data(self, frames: list) -> None:
        peer, raw = frames[0], frames[1]
        try:
            msg = p.decode_data_plane(raw.bytes if hasattr(raw, "bytes") else raw)
        except p.ProtocolError as exc:
            self.data.send_multipart([peer, p.encode(p.TransferRefused(transfer_id="", error=str(exc)))])
            return
        now = time.monotonic()
        if isinstance(msg, p.TransferHeader):
            entry = self.expected.get(msg.replication_id)
            if entry is None or not hmac.compare_digest(entry[0].auth_token, msg.auth_token):
                # not reported: a stranger must not be able to fail someone else's replication
                return self.refuse(peer, msg.transfer_id, msg.replication_id, "transfer not authorized by the "
                                   "coordinator (unknown replication or bad token)", report=False)
            err = self.check_grant(msg, entry[0]) or check_header(msg, self.a.geometry, self.a._free_replica_tokens)
            if err is None and msg.transfer_id in self.incoming:
                err = "duplicate transfer id"
            if err is not None:
                return self.refuse(peer, msg.transfer_id, msg.replication_id, err)
            self.incoming[msg.transfer_id] = Incoming(msg, peer, self.staging.acquire(msg.num_bytes), now, now)
        elif isinstance(msg, p.TransferChunk):
            inc = self.incoming.get(msg.transfer_id)
            if inc is None:
                return  # refused or timed out already
            if len(frames) != 3:
                err = "chunk without payload frame"
            else:
                payload = frames[2].buffer if hasattr(frames[2], "buffer") else memoryview(frames[2])
                err = inc.add_chunk(msg, payload, now)
            if err is not None:
                del self.incoming[msg.transfer_id]
                self.staging.release(inc.storage)
                self.refuse(peer, msg.transfer_id, inc.header.replication_id, err)
        elif isinstance(msg, p.TransferEnd):
            inc = self.incoming.pop(msg.transfer_id, None)
            if inc is None:
                return
            err = inc.finish()
            if err is not None:
                self.staging.release(inc.storage)
                return self.refuse(peer, msg.transfer_id, inc.header.replication_id, err)
            h = inc.header
            grant = self.expected.pop(h.replication_id, (None,))[0]
            hashes = page_hashes(h.token_ids, h.page_size, h.namespace)
            if grant is None or hashes != grant.block_hashes[:len(hashes)]:
                self.staging.release(inc.storage)
                return self.refuse(peer, msg.transfer_id, h.replication_id,
                                   "token ids are not the prefix the coordinator authorized")
            inc.last_progress_s = now
            self.to_sched(("install", inc, hashes))
        elif isinstance(msg, (p.TransferAccepted, p.TransferRefused)):
            pass  # replies arrive on the peer DEALERs, not here

    @staticmethod
    def check_grant(h: p.TransferHeader, grant: p.ExpectReplica) -> Optional[str]:
        """Does this authenticated transfer stay within what the coordinator authorized?"""
        if h.source_id != grant.source_id or h.namespace != grant.namespace or h.page_size != grant.page_size:
            return "transfer does not match its authorization (source, namespace or page size)"
        if h.num_pages > len(grant.block_hashes):
            return f"transfer of {h.num_pages} pages exceeds the {len(grant.block_hashes)} authorized"
        return None

    def refuse(self, peer: bytes, transfer_id: str, replication_id: str, error: str, report: bool = True) -> None:
        """Answer the sender; for an authorized transfer also consume its grant and tell the coordinator."""
        log.warning("kvrep: refused transfer %s: %s", transfer_id, error)
        self.data.send_multipart([peer, p.encode(p.TransferRefused(transfer_id=transfer_id, error=error))])
        if not report:
            return
        self.expected.pop(replication_id, None)
        self.send_coord(p.ReplicationFailed(worker_id=self.cfg.worker_id, seq=0, replication_id=replication_id,
                                            role="target", error=error))

    def install_done(self, inc: Incoming, res, error: Optional[str], block_hashes: list[int]) -> None:
        h = inc.header
        self.staging.release(inc.storage)  # the scheduler thread is done with it
        if error is not None:
            return self.refuse(inc.peer, h.transfer_id, h.replication_id, error)
        self.data.send_multipart([inc.peer, p.encode(p.TransferAccepted(transfer_id=h.transfer_id,
                                                                        inserted_len=res.inserted_len))])
        fact = p.ReplicaStored(worker_id=self.cfg.worker_id, seq=0, replication_id=h.replication_id,
                               namespace=h.namespace, block_hashes=block_hashes, inserted_len=res.inserted_len,
                               expires_in_s=h.ttl_s, num_bytes=h.num_bytes,
                               receive_s=inc.last_progress_s - inc.started_s, scatter_s=res.scatter_s,
                               insert_s=res.insert_s)
        if res.inserted_len > 0:
            self.replica_blocks[h.replication_id] = (h.namespace, block_hashes, False)
            self.replica_facts[h.replication_id] = fact
        self.send_coord(msgspec.structs.replace(fact))

    def begin_send(self, cmd: p.ReplicatePages, header: p.TransferHeader) -> None:
        sock = self.peers.get(cmd.target_endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # a short send queue keeps the wire honest: `send_s` then measures the link, not queueing in libzmq
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.connect(cmd.target_endpoint)
            self.peers[cmd.target_endpoint] = sock
            self.poller.register(sock, zmq.POLLIN)
        now = time.monotonic()
        self.outgoing[header.transfer_id] = Outgoing(header, cmd.target_endpoint, now, last_progress_s=now)
        self.send_queue.append(header.transfer_id)

    def pump_sends(self, now: float) -> float:
        """Send what the bandwidth cap allows, oldest transfer first. Returns seconds until the next try."""
        a = self.a
        while self.send_queue:
            tid = self.send_queue[0]
            out = self.outgoing.get(tid)
            if out is None or out.end_sent_s is not None:
                self.send_queue.popleft()
                continue
            sock = self.peers[out.endpoint]
            h = out.header
            if not out.header_sent:
                if not sock.poll(0, zmq.POLLOUT):
                    return 0.005
                sock.send(p.encode(h))
                out.header_sent = True
            while out.chunks:
                index, buffer = out.chunks[0]
                if not sock.poll(0, zmq.POLLOUT):
                    return 0.005  # the peer's queue is full: come back when it drains
                wait = self.bucket.wait_s(buffer.numel() * buffer.element_size(), time.monotonic())
                if wait > 0:
                    return wait
                sock.send_multipart(chunk_frames(h, index, buffer), copy=False)
                out.chunks.popleft()
                out.num_sent += 1
                out.last_progress_s = time.monotonic()
                a.sent_chunks[tid] = out.num_sent
                self.ring_scheduler()  # it may gather the next chunks now
            if out.num_sent < h.num_chunks:
                return 1.0  # waiting for the scheduler thread to gather more
            if not sock.poll(0, zmq.POLLOUT):
                return 0.005
            sock.send(p.encode(p.TransferEnd(transfer_id=tid)))
            out.end_sent_s = time.monotonic()
            self.send_queue.popleft()
            a.sent_chunks.pop(tid, None)
            self.send_coord(p.SourceSent(worker_id=self.cfg.worker_id, seq=0, replication_id=h.replication_id,
                                         num_tokens=len(h.token_ids), num_bytes=h.num_bytes,
                                         gather_s=out.gather_s, send_s=out.end_sent_s - out.started_s))
        return 1.0

    def ring_scheduler(self) -> None:
        try:
            os.write(self.a._bell_w, b"x")
        except OSError:
            pass

    def on_peer_reply(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = p.decode_data_plane(frames[-1])
            except p.ProtocolError:
                continue
            tid = getattr(msg, "transfer_id", "")
            out = self.outgoing.pop(tid, None)
            if out is not None and isinstance(msg, p.TransferRefused):
                log.warning("kvrep: target refused %s: %s", tid, msg.error)
                if out.end_sent_s is None:  # stop gathering and sending the rest
                    self.a.cancelled.add(tid)
                    self.a.sent_chunks.pop(tid, None)
                    self.ring_scheduler()

    def check_timeouts(self, now: float) -> None:
        limit = self.cfg.transfer_timeout_s
        for rid, (_, deadline) in list(self.expected.items()):
            if now > deadline:
                del self.expected[rid]
        for tid, inc in list(self.incoming.items()):
            if now - inc.last_progress_s > limit:
                del self.incoming[tid]
                self.staging.release(inc.storage)
                log.warning("kvrep: transfer %s timed out after %.1fs without progress", tid, limit)
                self.send_coord(p.ReplicationFailed(
                    worker_id=self.cfg.worker_id, seq=0, replication_id=inc.header.replication_id, role="target",
                    error=f"transfer timed out: no data for {limit:g}s "
                          f"({inc.received_bytes}/{inc.header.num_bytes} bytes received; source dead?)"))
        for tid, out in list(self.outgoing.items()):
            if out.end_sent_s is not None:
                if now - out.end_sent_s > limit:
                    del self.outgoing[tid]  # the target never answered; it reports its own failure
            elif now - out.last_progress_s > limit:
                # the target stopped taking data (dead or stuck): give up, release the source's lock
                del self.outgoing[tid]
                self.a.cancelled.add(tid)
                self.a.sent_chunks.pop(tid, None)
                self.ring_scheduler()
                self.send_coord(p.ReplicationFailed(
                    worker_id=self.cfg.worker_id, seq=0, replication_id=out.header.replication_id, role="source",
                    error=f"send stalled for {limit:g}s ({out.num_sent}/{out.header.num_chunks} chunks sent)"))

    # ------------------------------------------------------------------------------------------------ loop
    def run(self) -> None:
        self.hello()
        a = self.a
        next_wait = 1.0
        while not a._stop.is_set():
            timeout = min(next_wait, 0.1 if (self.incoming or self.outgoing) else 0.5)
            ready = dict(self.poller.poll(max(1, int(timeout * 1000))))
            now = time.monotonic()
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
                    self.begin_send(*item[1:])
                elif kind == "send_chunk":
                    _, tid, index, buffer, gather_s = item
                    out = self.outgoing.get(tid)
                    if out is not None:
                        out.chunks.append((index, buffer))
                        out.gather_s += gather_s
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
            if self.data in ready:
                for _ in range(256):
                    try:
                        frames = self.data.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self.on_data(frames)
                    except Exception:  # a bad peer must not take the I/O thread down
                        log.exception("kvrep: error handling a data-plane message; dropping it")
            for sock in self.peers.values():
                if sock in ready:
                    self.on_peer_reply(sock)
            next_wait = self.pump_sends(time.monotonic())
            now = time.monotonic()
            self.check_timeouts(now)
            if now - self.last_sent_s > 1.0:  # heartbeat, and a retry of the hello after an outage
                if self.need_resync:
                    self.hello()
                elif self.last_load is not None:
                    self.send_coord(msgspec.structs.replace(self.last_load))
