"""The worker agent's I/O side: `IoSide`, the part of the extension on its own thread ("kvrep-io"). It owns every
socket of the agent: the DEALER to the coordinator and the data-plane `Transport` (with ZeroMQ: the data ROUTER
peers send pages to and a DEALER per target it sends pages to; see `sglang_kvrep.dataplane`). It decides what a
transfer may do (the coordinator's grants) and what a finished one means; the transport moves the bytes. It talks
to the scheduler side only through the typed mailbox (`sglang_kvrep.agent.mailbox`) and never touches the radix
tree, the allocator or the pool.
"""
from __future__ import annotations

import ctypes
import hmac
import logging
import time
from typing import Optional

import msgspec
import zmq

from radix_sync import keys as k
from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from radix_sync.host_tier import HOST_MEDIUM
from radix_sync.keys import load_dir
from sglang_kvrep import events
from sglang_kvrep.address import advertised_endpoint, is_wildcard, routable_host
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.config import KvrepConfig
from sglang_kvrep.dataplane.checks import check_grant, check_header, finite_s
from sglang_kvrep.dataplane.registry import make_transport
from sglang_kvrep.dataplane.staging import Incoming, StagingLedger
from sglang_kvrep.dataplane.transport import (ChunkSent, Refusal, TransferFailed, TransferReceived, TransferSent,
                                              TransportEvent)

log = logging.getLogger("kvrep.agent")

COORD_SNDHWM = 10_000
"""Messages libzmq may hold for a live coordinator link; past that a send fails and the worker resyncs instead."""
HELLO_RETRY_S = 0.25
HELLO_ACK_TIMEOUT_S = 10.0
"""A hello unanswered this long was lost (the link dropped right after it): say it again."""
REFUSED_RETRY_S = 10.0
"""After the coordinator refused a hello (wrong key, version): try again this much later, loudly."""
MAX_BLOCKS_PER_MESSAGE = 4096
"""Pages per `PagesStored`: keeps every message far below the coordinator's frame limit."""
MAX_SEND_TARGETS = 4096
DEVICE_POLL_S = 0.001
"""While the scheduler side has copies on the device, the I/O side rings it this often (an idle scheduler sleeps
in its poller in between, and the GIL is free for this thread)."""


def run_io_thread(config: KvrepConfig, info: m.WorkerInfo, mailbox: m.Mailbox) -> None:
    """The I/O thread's body: build the I/O side and run it until `Stop`. If it dies, the scheduler side is told
    (`IoDied`) and the worker keeps serving as plain SGLang."""
    _name_thread("kvrep-io")
    try:
        IoSide(config, info, mailbox).run()
    except Exception:
        log.exception("kvrep I/O thread died; the worker keeps serving as plain SGLang")
        mailbox.post_to_scheduler(m.IoDied())


def _name_thread(name: str) -> None:
    """Give the OS thread a name (visible in /proc/<pid>/task/*/comm) so tests can see it exists."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class IoSide:
    """Owns the coordinator socket and the data-plane transport (every socket of the agent). I/O thread only.
    Built on the I/O thread; says `IoStarted` once its sockets are up."""

    def __init__(self, config: KvrepConfig, info: m.WorkerInfo, mailbox: m.Mailbox) -> None:
        self.cfg = config
        self.info = info
        self.mailbox = mailbox
        self.free_replica_tokens = info.free_replica_tokens
        """As the scheduler side last said (`ReplicaRoom`)."""
        self.ctx = zmq.Context()
        self.keydir = load_dir(config.keys) if config.keys else None
        self.coord = self._coordinator_socket()
        self.poller = zmq.Poller()
        self.poller.register(self.coord, zmq.POLLIN)
        self.poller.register(mailbox.io_wake_fd, zmq.POLLIN)
        self.expected: dict[str, tuple[p.ExpectReplica, float]] = {}  # replication id -> (grant, deadline)
        self.staged = StagingLedger()
        """The replica budget held by transfers admitted and not ended (`admit` checks each against the rest)."""
        self._refused_now: Optional[str] = None
        """The transfer `admit` just refused: its `TransferFailed` follows at once and held nothing."""
        self.transport = make_transport(self.cfg.transport, self.cfg, self.admit, self.on_transport_event, self.ctx,
                                        self.poller, arena=info.staging_arena)
        host = self.cfg.advertise_host or (routable_host(self.cfg.coordinator) if is_wildcard(self.cfg.data_host)
                                           else "")
        self.data_endpoint = advertised_endpoint(self.transport.endpoint, host, self.cfg.data_advertise_port)
        """What peers connect to (the transport binds `data_host`; a wildcard is not an address)."""
        self.send_targets: dict[str, str] = {}
        """Replication id -> target worker id, from `ReplicatePages` until its `StartSend` (the transport checks
        the target's key against it)."""
        self.seq = 0
        self.mirror: dict[int, tuple[Optional[int], list[int], str]] = {}
        self.host_mirror: dict[int, tuple[Optional[int], list[int], str]] = {}
        """The pages SGLang's host-memory tier holds (KV events of medium `CPU_PINNED`), as `mirror`."""
        self.replica_blocks: dict[str, tuple[str, list[int]]] = {}
        """Live unpromoted replicas: namespace and page hashes (a hit on the first page promotes one: forgotten then;
        it was kept, marked, for the worker's life)."""
        self.replica_facts: dict[str, tuple[p.ReplicaStored, float]] = {}
        """Live unpromoted replicas: their fact and when they expire (monotonic s), for a resync."""
        self.last_load: Optional[p.LoadReported] = None
        self.last_load_s = 0.0
        """When `last_load` came from the scheduler side (monotonic s): a repeat says its age (`age_s`)."""
        self.last_sent_s = 0.0
        # -- the coordinator link (see `send_coord`)
        self.need_resync = True
        """Say hello and everything held again before any other fact (start, outage, refused send)."""
        self.next_hello_s = 0.0
        self.awaiting_ack_since: Optional[float] = None
        """When the last hello went out, until its `HelloAck`: a `ResyncRequested` meanwhile answers a message
        sent before that hello, so the resync already under way covers it."""
        self.coordinator_id = ""
        """The coordinator instance of the last `HelloAck` (another one: it restarted; the same: a reconnect)."""
        self.stats = {"hellos": 0, "dropped_facts": 0, "coordinator_restarts": 0, "stale_resync_requests": 0}
        self.device_busy = False
        """The scheduler side has copies on the device (`DeviceBusy`): ring it every `DEVICE_POLL_S`."""
        mailbox.post_to_scheduler(m.IoStarted(self.data_endpoint))

    # ------------------------------------------------------------------------------------------ coordinator
    def _coordinator_socket(self) -> zmq.Socket:
        """The DEALER to the coordinator. NOTE: `IMMEDIATE`: with no live connection a send fails at once instead of
        queueing, so an outage leaves no backlog of stale facts (which, replayed to a restarted coordinator, each
        asked for a full resync); what happened meanwhile is in the mirror and goes out in one resync."""
        cfg = self.cfg
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, COORD_SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_control_msg_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # a coordinator host gone without a FIN is noticed in seconds
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if self.keydir is not None:
            k.curve_client(sock, self.keydir.pair(cfg.key_name), self.keydir.coordinator.public)
        elif not k.is_loopback_endpoint(cfg.coordinator):
            k.warn_insecure("--kvrep-coordinator", cfg.coordinator)
        sock.connect(cfg.coordinator)
        return sock

    def send_coord(self, msg) -> None:
        """Send a fact, or drop it while a resync is due: the resync says what is held now, and a stale fact
        (a hit, a load, a removal long past) is worth nothing to a coordinator that comes back later."""
        if self.need_resync:
            self.stats["dropped_facts"] += 1
            return
        self.seq += 1
        msg.seq = self.seq
        try:
            self.coord.send(p.encode(msg), zmq.NOBLOCK)
            self.last_sent_s = time.monotonic()
        except zmq.Again:  # no live link (or a full one): say everything again once it is back
            self.need_resync = True
            self.stats["dropped_facts"] += 1

    def hello(self, now: Optional[float] = None) -> None:
        """Say hello, then everything this worker holds (its replicas with the TTL they have left)."""
        now = time.monotonic() if now is None else now
        info = self.info
        self.seq = 0
        msg = p.Hello(worker_id=self.cfg.worker_id, http_url=self.cfg.http_url,
                      data_endpoint=self.data_endpoint, fingerprint=info.fingerprint,
                      fingerprint_fields=info.fingerprint_fields, page_size=info.page_size,
                      pool_capacity_tokens=info.pool_capacity_tokens,
                      replica_budget_tokens=info.replica_budget_tokens, seq=0, vocab_size=info.vocab_size)
        try:
            self.coord.send(p.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.need_resync = True
            self.next_hello_s = now + HELLO_RETRY_S
            return
        self.need_resync = False
        self.awaiting_ack_since = now
        self.last_sent_s = now
        self.stats["hellos"] += 1
        # Resync: everything this worker holds, parents before children (dict order is insertion order), the device
        # pool's pages before the host tier's (whose parents may be on the device).
        for medium, mirror in (("GPU", self.mirror), (HOST_MEDIUM, self.host_mirror)):
            by_ns: dict[str, list[p.BlockFact]] = {}
            for h, (parent, tokens, ns) in mirror.items():
                by_ns.setdefault(ns, []).append(p.BlockFact(h, parent, tokens))
            for ns, blocks in by_ns.items():
                for i in range(0, len(blocks), MAX_BLOCKS_PER_MESSAGE):
                    self.send_coord(p.PagesStored(worker_id=self.cfg.worker_id, seq=0, namespace=ns, medium=medium,
                                                  blocks=blocks[i:i + MAX_BLOCKS_PER_MESSAGE]))
        # NOTE: the replicas still held (an expired one left `replica_facts` with its `ReplicaExpired`), with the
        # TTL they have left, not the one they started with; one past its TTL but kept for a queued request that
        # wants it is still here, due now.
        for fact, expires_s in self.replica_facts.values():
            self.send_coord(msgspec.structs.replace(fact, expires_in_s=max(0.0, expires_s - now)))
        if self.last_load is not None:
            self.send_coord(self.repeat_load(now))

    def on_hello_ack(self, ack: p.HelloAck) -> None:
        self.awaiting_ack_since = None
        if self.coordinator_id and ack.coordinator_id != self.coordinator_id:
            self.stats["coordinator_restarts"] += 1
            log.info("kvrep: coordinator restarted (%s -> %s); resynced", self.coordinator_id, ack.coordinator_id)
        self.coordinator_id = ack.coordinator_id

    def on_coord(self, data: bytes) -> None:
        try:
            msg = p.decode_for_worker(data)
        except p.ProtocolError as exc:
            log.warning("kvrep: bad message from the coordinator: %s", exc)
            return
        if isinstance(msg, p.HelloAck):
            self.on_hello_ack(msg)
        elif isinstance(msg, p.ResyncRequested):
            if self.awaiting_ack_since is not None:
                self.stats["stale_resync_requests"] += 1  # answers a fact sent before the hello now under way
                return
            log.info("kvrep: coordinator asks for a resync (%s)", msg.reason)
            self.hello()
        elif isinstance(msg, p.ExpectReplica):
            self.expected[msg.replication_id] = (msg, time.monotonic() + msg.expires_in_s)
            self.send_coord(p.ReplicaExpected(worker_id=self.cfg.worker_id, seq=0, replication_id=msg.replication_id))
        elif isinstance(msg, p.ReplicatePages):
            self.send_targets[msg.replication_id] = msg.target_id
            while len(self.send_targets) > MAX_SEND_TARGETS:  # commands whose gather never started
                del self.send_targets[next(iter(self.send_targets))]
            self.to_sched(m.Replicate(msg))
        elif isinstance(msg, p.DropReplica):
            fact = self.replica_facts.get(msg.replication_id)
            if fact is not None:  # a pull the coordinator made room for may arrive before the scheduler has dropped
                self.free_replica_tokens += fact[0].inserted_len  # (it answers the true room after the drop)
            self.to_sched(m.Drop(msg.replication_id))
        elif isinstance(msg, p.WantReplica):
            grant = self.expected.get(msg.replication_id)
            if grant is not None:  # not received yet: it lands as ordinary cache
                self.expected[msg.replication_id] = (msgspec.structs.replace(grant[0], ordinary=True), grant[1])
            else:  # installing or landed (or gone): the scheduler raises it
                self.to_sched(m.Want(msg.replication_id))
        elif isinstance(msg, p.DemotePrefix):
            self.to_sched(m.Demote(msg.namespace, msg.token_ids))
        elif isinstance(msg, p.Error):
            if msg.in_reply_to == "Hello":
                log.error("kvrep: the coordinator refused this worker's hello: %s (retrying in %.0fs)", msg.error,
                          REFUSED_RETRY_S)
                self.awaiting_ack_since = None
                self.need_resync = True
                self.next_hello_s = time.monotonic() + REFUSED_RETRY_S
            else:
                log.warning("kvrep: coordinator error: %s", msg.error)

    def to_sched(self, msg: m.ToScheduler) -> None:
        self.mailbox.post_to_scheduler(msg)

    # --------------------------------------------------------------------------------------- local events
    def drain_events(self) -> None:
        sink = events.SINK
        wid = self.cfg.worker_id
        while sink:
            fact = sink.popleft()
            if isinstance(fact, events.KvStored):
                ns, blocks, medium = fact.namespace, fact.blocks, fact.medium
                if medium not in ("GPU", HOST_MEDIUM):  # (the device pool and SGLang's host tier)
                    continue
                mirror = self.mirror if medium == "GPU" else self.host_mirror
                for h, parent, tokens in blocks:
                    mirror[h] = (parent, tokens, ns)
                for i in range(0, len(blocks), MAX_BLOCKS_PER_MESSAGE):
                    self.send_coord(p.PagesStored(worker_id=wid, seq=0, namespace=ns, medium=medium, blocks=[
                        p.BlockFact(h, par, t) for h, par, t in blocks[i:i + MAX_BLOCKS_PER_MESSAGE]]))
            elif isinstance(fact, events.KvRemoved):
                if fact.medium == HOST_MEDIUM:
                    for h in fact.block_hashes:
                        self.host_mirror.pop(h, None)
                    for i in range(0, len(fact.block_hashes), 4096):
                        self.send_coord(p.PagesRemoved(worker_id=wid, seq=0, medium=HOST_MEDIUM,
                                                       block_hashes=fact.block_hashes[i:i + 4096]))
                if fact.medium != "GPU":
                    continue
                hashes = fact.block_hashes
                for h in hashes:
                    self.mirror.pop(h, None)
                for i in range(0, len(hashes), 4096):
                    self.send_coord(p.PagesRemoved(worker_id=wid, seq=0, block_hashes=hashes[i:i + 4096]))
                self.replicas_gone(set(hashes))
            elif isinstance(fact, events.KvCleared):
                self.mirror.clear()
                self.host_mirror.clear()
                self.send_coord(p.AllPagesCleared(worker_id=wid, seq=0))
                self.replicas_gone(None)

    def replicas_gone(self, removed: Optional[set]) -> None:
        """SGLang evicted pages (`removed`; None: its whole cache, a flush): a replica whose last page went is gone
        (SGLang evicts leaf nodes first, a replica's pages are one node), so it holds no replica budget any more.
        Before, the scheduler counted it until its TTL (30-250 s): seen live, the budget of a worker whose replicas
        SGLang had evicted under memory pressure, or whose cache a flush had emptied, stayed full of replicas that
        no longer existed and refused the pulls (docs/bench.md, "Pulls before bets")."""
        for rid, (_, blocks) in list(self.replica_blocks.items()):
            if blocks and (removed is None or blocks[-1] in removed):
                del self.replica_blocks[rid]
                self.replica_facts.pop(rid, None)
                self.to_sched(m.ReplicaGone(rid))

    def on_hit(self, hit: m.PrefixMatched) -> None:
        namespace, matched, key_len = hit.namespace, hit.matched_len, hit.key_len
        hashes = page_hashes(hit.token_ids, self.info.page_size, namespace)
        if not hashes:
            return
        self.send_coord(p.PrefixHit(worker_id=self.cfg.worker_id, seq=0, namespace=namespace,
                                    block_hash=hashes[-1], matched_len=matched, key_len=key_len))
        hit_hashes = set(hashes)
        for rid, (ns, blocks) in list(self.replica_blocks.items()):
            if ns == namespace and blocks and blocks[0] in hit_hashes:
                del self.replica_blocks[rid]
                self.replica_facts.pop(rid, None)
                self.to_sched(m.Promote(rid))
                num = sum(1 for b in blocks if b in hit_hashes) * self.info.page_size
                self.send_coord(p.ReplicaPromoted(worker_id=self.cfg.worker_id, seq=0, replication_id=rid,
                                                  num_promoted_tokens=num))

    # ------------------------------------------------------------------------------------------ data plane
    def admit(self, h: p.TransferHeader) -> Optional[Refusal]:
        """The transport asks before staging a byte: is this transfer authorized and can it land here?"""
        entry = self.expected.get(h.replication_id)
        if entry is None or not hmac.compare_digest(entry[0].auth_token, h.auth_token):
            # not reported: a stranger must not be able to fail someone else's replication
            self._refused_now = h.transfer_id
            return Refusal("transfer not authorized by the coordinator (unknown replication or bad token)",
                           tell_coordinator=False)
        err = check_grant(h, entry[0]) or check_header(h, self.info.geometry, self.free_replica_tokens) \
            or self.staged.reserve(h.transfer_id, len(h.token_ids), self.free_replica_tokens)
        if err is not None:
            self._refused_now = h.transfer_id
            return Refusal(err)
        return None

    def on_transport_event(self, ev: TransportEvent) -> None:
        if isinstance(ev, ChunkSent):
            self.to_sched(m.ChunksSent(ev.transfer_id, ev.num_sent))  # it may gather the next chunks now
        elif isinstance(ev, TransferSent):
            h = ev.header
            self.send_coord(p.SourceSent(worker_id=self.cfg.worker_id, seq=0, replication_id=h.replication_id,
                                         num_tokens=len(h.token_ids), num_bytes=h.num_bytes,
                                         gather_s=finite_s(ev.gather_s), send_s=finite_s(ev.send_s)))
        elif isinstance(ev, TransferReceived):
            self.on_received(ev.incoming)
        elif isinstance(ev, TransferFailed):
            if ev.role == "target":
                if ev.transfer_id == self._refused_now:
                    self._refused_now = None  # refused by `admit`: it held nothing (and may share a live id)
                else:
                    self.staged.release(ev.transfer_id)  # its staging buffer is back in the transport's pool
            if ev.role == "source":  # stop gathering and sending the rest, release the source's lock
                self.to_sched(m.SendCancelled(ev.transfer_id))
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
            self.answer(inc, error=error)
            return self.report_failure(h.replication_id, "target", error)
        self.to_sched(m.Install(inc, hashes, grant.critical or grant.ordinary))

    def report_failure(self, replication_id: str, role: str, error: str) -> None:
        """Tell the coordinator; a target also consumes the transfer's grant."""
        if role == "target":
            self.expected.pop(replication_id, None)
        self.send_coord(p.ReplicationFailed(worker_id=self.cfg.worker_id, seq=0, replication_id=replication_id,
                                            role=role, error=error))

    def answer(self, inc: Incoming, *, inserted_len: int = 0, error: Optional[str] = None) -> None:
        """End a received transfer (the transport takes its staging buffer back) and free what it held."""
        self.staged.release(inc.header.transfer_id)
        self.transport.answer(inc, inserted_len=inserted_len, error=error)

    def install_failed(self, done: m.InstallFailed) -> None:
        self.answer(done.incoming, error=done.error)
        self.report_failure(done.incoming.header.replication_id, "target", done.error)

    def installed(self, done: m.Installed) -> None:
        inc, block_hashes = done.incoming, done.block_hashes
        h = inc.header
        self.answer(inc, inserted_len=done.inserted_len)
        fact = p.ReplicaStored(worker_id=self.cfg.worker_id, seq=0, replication_id=h.replication_id,
                               namespace=h.namespace, block_hashes=block_hashes, inserted_len=done.inserted_len,
                               expires_in_s=h.ttl_s, num_bytes=h.num_bytes,
                               receive_s=finite_s(inc.last_progress_s - inc.started_s),
                               scatter_s=finite_s(done.scatter_s), insert_s=finite_s(done.insert_s))
        if done.inserted_len > 0:
            self.replica_blocks[h.replication_id] = (h.namespace, block_hashes)
            self.replica_facts[h.replication_id] = (fact, time.monotonic() + h.ttl_s)
        self.send_coord(msgspec.structs.replace(fact))

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
            # NOTE: the coordinator socket and the context too (facts still queued get half a second): left open,
            # the process's exit hung in ZeroMQ's context teardown until it was killed (a keyed stub worker: 20 s)
            self.ctx.destroy(linger=500)

    def _run(self) -> None:
        self.hello()
        next_wait = 0.5
        while True:
            ready = dict(self.poller.poll(max(1, int(min(next_wait, 0.5) * 1000))))
            if self.mailbox.io_wake_fd in ready:
                self.mailbox.clear_wake()
            self.drain_events()
            while True:
                msg = self.mailbox.take_for_io()
                if msg is None:
                    break
                if isinstance(msg, m.Stop):
                    return
                self.on_message(msg)
            if self.coord in ready:
                while True:
                    try:
                        self.on_coord(self.coord.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            next_wait = self.transport.progress(ready)
            if self.device_busy:
                self.mailbox.ring_scheduler()
                next_wait = min(next_wait, DEVICE_POLL_S)
            now = time.monotonic()
            self.expire_grants(now)
            self.keep_link(now)

    def keep_link(self, now: float) -> None:
        """Retry the hello while the coordinator is unreachable (at most one per `HELLO_RETRY_S`); otherwise a
        heartbeat (the last load) after a second of silence."""
        if self.awaiting_ack_since is not None and now - self.awaiting_ack_since > HELLO_ACK_TIMEOUT_S:
            self.awaiting_ack_since = None
            self.need_resync = True
        if self.need_resync:
            if now >= self.next_hello_s:
                self.next_hello_s = now + HELLO_RETRY_S
                self.hello(now)
        elif now - self.last_sent_s > 1.0 and self.last_load is not None:
            self.send_coord(self.repeat_load(now))

    def repeat_load(self, now: float) -> p.LoadReported:
        """The last load report again, with its age (the worker's state when it was taken)."""
        return msgspec.structs.replace(self.last_load, age_s=min(p.MAX_TIMING_S, max(0.0, now - self.last_load_s)))

    def on_message(self, msg: m.ToIo) -> None:
        if isinstance(msg, m.ToCoordinator):
            if isinstance(msg.message, p.LoadReported):
                self.last_load, self.last_load_s = msg.message, time.monotonic()
            elif isinstance(msg.message, (p.ReplicaExpired, p.ReplicaPromoted)):
                # gone, or ordinary cache now (extended by a later request): a resync must not send it as a replica
                self.replica_facts.pop(msg.message.replication_id, None)
                self.replica_blocks.pop(msg.message.replication_id, None)
            self.send_coord(msg.message)
        elif isinstance(msg, m.PrefixMatched):
            self.on_hit(msg)
        elif isinstance(msg, m.StartSend):
            target_id = self.send_targets.pop(msg.header.replication_id, "")
            self.transport.send(msg.header, msg.target_endpoint, target_id)
        elif isinstance(msg, m.ChunkGathered):
            self.transport.push_chunk(msg.transfer_id, msg.index, msg.buffer, msg.gather_s)
        elif isinstance(msg, m.GatherFailed):  # reported as the transport's TransferFailed(role="source")
            self.transport.cancel(msg.transfer_id, msg.error)
        elif isinstance(msg, m.Installed):
            self.installed(msg)
        elif isinstance(msg, m.InstallFailed):
            self.install_failed(msg)
        elif isinstance(msg, m.ReplicaRoom):
            self.free_replica_tokens = msg.free_tokens
        elif isinstance(msg, m.DeviceBusy):
            self.device_busy = msg.busy
        elif isinstance(msg, m.Reannounce):  # new weights: a new identity, said as a new hello
            self.info = msg.info
            self.hello()
