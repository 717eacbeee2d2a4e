"""`ZmqTransport`, the default data plane (`--kvrep-transport zmq`): a ROUTER bound on each worker's data endpoint
receives, one DEALER per target sends; typed MessagePack control frames, zero-copy payload frames, a checksum per
chunk, atomic staging (the wire is described in `sglang_kvrep.dataplane`). Implements
`sglang_kvrep.dataplane.transport.Transport`; I/O thread only.

With keys (`--kvrep-keys`) both ends authenticate: the data ROUTER is a CURVE server that admits only the
allow-listed workers' keys (a ZAP handler on the I/O thread's context) and checks that a transfer's `source_id` is
the worker of the key it came with; a source connects only to a target whose allow-listed key the target proves
it holds. Every socket has a frame-size limit (`ZMQ_MAXMSGSIZE`): a larger frame disconnects the peer unread."""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Container, Optional

import torch
import zmq

from radix_sync import keys as k
from radix_sync import protocol as p
from sglang_kvrep.dataplane.staging import Incoming, Outgoing, StagingPool
from sglang_kvrep.dataplane.transport import (Admit, ChunkSent, OnEvent, Refusal, TransferFailed, TransferReceived,
                                              TransferSent, TransportSettings)
from sglang_kvrep.dataplane.wire import TokenBucket, chunk_frames

log = logging.getLogger("kvrep.agent")


def transport_refused(transport: str, accepts: tuple[str, ...], name: str) -> str:
    """The error a target answers a header naming a transport it does not run with (`is_transport_refusal`)."""
    return f"transfer over {transport!r}: this worker's data plane takes {', '.join(accepts)} (--kvrep-transport {name})"


def is_transport_refusal(error: str, transport: str) -> bool:
    """Whether a `TransferRefused.error` is `transport_refused` for `transport` (nothing was admitted)."""
    return error.startswith(f"transfer over {transport!r}:")


class ZmqTransport:
    """The ZeroMQ data plane: a ROUTER bound on this worker's data endpoint receives, one DEALER per target
    sends. Payload frames go zero-copy from the gathered tensors; the target checks each chunk's checksum on
    arrival and stages it in a reused buffer (`StagingPool`)."""

    name = "zmq"
    accepts: tuple[str, ...] = ("zmq",)
    """The `TransferHeader.transport` values this target serves (a header naming another is refused)."""

    def __init__(self, config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                 poller: zmq.Poller, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = config
        self.admit = admit
        self.on_event = on_event
        self.ctx = ctx
        self.poller = poller
        self.clock = clock
        self.keydir = k.load_dir(config.keys) if config.keys else None
        self.auth = None
        self.data = ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.RCVHWM, 64)  # bound what libzmq buffers ahead of staging (TCP pushes back)
        self.data.setsockopt(zmq.MAXMSGSIZE, config.max_data_msg_bytes)
        if self.keydir is not None:
            self.pair = self.keydir.pair(config.key_name)
            self.auth = k.start_authenticator(ctx, self.keydir.allow_list())
            k.curve_server(self.data, self.pair)
        elif not k.is_loopback_host(config.data_host):
            k.warn_insecure("data plane", config.data_host)
        addr = f"tcp://{config.data_host}"
        if config.data_port:
            self.data.bind(f"{addr}:{config.data_port}")
            port = config.data_port
        else:
            port = self.data.bind_to_random_port(addr)
        self.endpoint = f"{addr}:{port}"
        poller.register(self.data, zmq.POLLIN)
        self.peers: dict[str, zmq.Socket] = {}
        self.peer_keys: dict[str, bytes] = {}
        """Endpoint -> the public key its DEALER expects of the target (b"" without keys)."""
        self.incoming: dict[str, Incoming] = {}
        self.staging = StagingPool(config.staging_bytes)
        """Receive buffers (pageable; a GPU worker's pinned arena first, once `use_arena` gave one)."""
        self.outgoing: dict[str, Outgoing] = {}
        self.send_queue: collections.deque[str] = collections.deque()
        self.bucket = TokenBucket(config.send_rate_mbps * 1e6, config.chunk_bytes)
        self.bucket.t = clock()

    # ------------------------------------------------------------------------------------------ interface
    def send(self, header: p.TransferHeader, endpoint: str, peer_id: str = "") -> None:
        server_key = b""
        if self.keydir is not None:
            server_key = self.keydir.public_key_of(peer_id) or b""
            if not server_key:
                error = f"target {peer_id!r} has no key in the allow-list: not sending it anything"
                log.warning("kvrep: transfer %s: %s", header.transfer_id, error)
                self.on_event(TransferFailed(header.transfer_id, header.replication_id, "source", error))
                return
        sock = self.peers.get(endpoint)
        if sock is not None and self.peer_keys.get(endpoint) != server_key:  # another worker on that endpoint now
            self.poller.unregister(sock)
            sock.close(linger=0)
            sock = None
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # a short send queue keeps the wire honest: `send_s` then measures the link, not queueing in libzmq
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_control_msg_bytes)  # only replies come back
            if server_key:
                k.curve_client(sock, self.pair, server_key)  # no handshake unless the peer holds that key
            sock.connect(endpoint)
            self.peers[endpoint] = sock
            self.peer_keys[endpoint] = server_key
            self.poller.register(sock, zmq.POLLIN)
        now = self.clock()
        self.outgoing[header.transfer_id] = Outgoing(header, endpoint, now, last_progress_s=now)
        self.send_queue.append(header.transfer_id)

    def push_chunk(self, transfer_id: str, index: int, buffer: torch.Tensor, gather_s: float) -> None:
        out = self.outgoing.get(transfer_id)
        if out is not None:
            out.chunks.append((index, buffer))
            out.gather_s += gather_s

    def cancel(self, transfer_id: str, error: str) -> None:
        out = self.outgoing.get(transfer_id)
        if out is None or out.end_sent_s is not None:
            return  # ended and reported already, or all sent: the target's answer decides it
        del self.outgoing[transfer_id]  # `_pump_sends` drops it from the send queue
        log.warning("kvrep: transfer %s cancelled by its source: %s", transfer_id, error)
        # the target stops hearing from it and times out (as with a source that died mid-way)
        self.on_event(TransferFailed(transfer_id, out.header.replication_id, "source", error))

    def progress(self, ready: Container) -> float:
        if self.data in ready:
            for _ in range(256):
                try:
                    frames = self.data.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._on_data(frames)
                except Exception:  # a bad peer must not take the I/O thread down
                    log.exception("kvrep: error handling a data-plane message; dropping it")
        for sock in self.peers.values():
            if sock in ready:
                self._on_reply(sock)
        next_wait = min(self._pump_sends(), self._progress_more())
        self._check_timeouts(self.clock())
        return min(next_wait, 0.1 if (self.incoming or self.outgoing) else 0.5)

    def answer(self, incoming: Incoming, *, inserted_len: int = 0, error: Optional[str] = None) -> None:
        h = incoming.header
        self._release_staging(incoming, failed=False)  # the scheduler thread is done with it
        if error is not None:
            log.warning("kvrep: refused transfer %s: %s", h.transfer_id, error)
            reply = p.TransferRefused(transfer_id=h.transfer_id, error=error)
        else:
            reply = p.TransferAccepted(transfer_id=h.transfer_id, inserted_len=inserted_len)
        self.data.send_multipart([incoming.peer, p.encode(reply)])

    def close(self) -> None:
        for sock in (*self.peers.values(), self.data):
            try:
                self.poller.unregister(sock)
            except KeyError:
                pass
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.peers.clear()
        self.incoming.clear()
        self.outgoing.clear()
        self.send_queue.clear()

    # ------------------------------------------------------------------------------------------ receiving
    def _on_data(self, frames: list) -> None:
        peer, raw = frames[0].bytes, frames[1]
        try:
            msg = p.decode_data_plane(raw.buffer)
        except p.ProtocolError as exc:
            self.data.send_multipart([peer, p.encode(p.TransferRefused(transfer_id="", error=str(exc)))])
            return
        now = self.clock()
        if isinstance(msg, p.TransferHeader):
            if msg.transport not in self.accepts:
                # a negotiation, not a failed replication: nothing admitted or reserved, no one told; a source that
                # can fall back to a transport this worker takes sends the header again (`NixlTransport`)
                error = transport_refused(msg.transport, self.accepts, self.name)
                log.info("kvrep: transfer %s: %s", msg.transfer_id, error)
                self.data.send_multipart([peer, p.encode(p.TransferRefused(transfer_id=msg.transfer_id, error=error))])
                return
            refusal = None
            if self.keydir is not None and k.peer_id(raw) != msg.source_id:
                # an allow-listed worker speaking for another: not reported (it would fail that one's replication)
                refusal = Refusal(f"source_id {msg.source_id!r} is not the worker of this connection's key "
                                  f"({k.peer_id(raw)!r})", tell_coordinator=False)
            refusal = refusal or self.admit(msg)
            if refusal is None and msg.transfer_id in self.incoming:
                refusal = Refusal("duplicate transfer id")
            if refusal is None and msg.num_pages > 0:
                frame_bytes = msg.num_bytes // msg.num_pages * min(msg.pages_per_chunk, msg.num_pages)
                if frame_bytes > self.cfg.max_data_msg_bytes:
                    refusal = Refusal(f"chunks of {frame_bytes} bytes exceed this worker's frame limit "
                                      f"(--kvrep-max-data-msg-bytes {self.cfg.max_data_msg_bytes})")
            if refusal is not None:
                return self._refuse(peer, msg.transfer_id, msg.replication_id, refusal.error,
                                    refusal.tell_coordinator)
            try:
                storage = self.staging.acquire(msg.num_bytes)
            except Exception as exc:  # (a registered-memory engine refusing a new buffer: nothing admitted stays)
                log.exception("kvrep: transfer %s: no staging buffer", msg.transfer_id)
                return self._refuse(peer, msg.transfer_id, msg.replication_id, f"no staging buffer: {exc}")
            inc = Incoming(msg, peer, storage, now, now, pinned=self.staging.in_arena(storage))
            self.incoming[msg.transfer_id] = inc
            self._admitted(inc)
        elif isinstance(msg, p.TransferChunk):
            inc = self.incoming.get(msg.transfer_id)
            if inc is None or inc.peer != peer:
                return  # refused or timed out already, or another connection's transfer
            err = self._chunk_arrived(inc, msg, frames, now)
            if err is not None:
                del self.incoming[msg.transfer_id]
                self._release_staging(inc, failed=True)
                self._refuse(peer, msg.transfer_id, inc.header.replication_id, err)
        elif isinstance(msg, p.TransferEnd):
            inc = self.incoming.get(msg.transfer_id)
            if inc is None or inc.peer != peer:
                return
            del self.incoming[msg.transfer_id]
            err = inc.finish()
            if err is not None:
                self._release_staging(inc, failed=True)
                return self._refuse(peer, msg.transfer_id, inc.header.replication_id, err)
            inc.last_progress_s = now
            self.on_event(TransferReceived(inc))
        elif isinstance(msg, (p.TransferAccepted, p.TransferRefused, p.TransferReady)):
            pass  # replies arrive on the peer DEALERs, not here

    def use_arena(self, arena: torch.Tensor) -> None:
        """Receive into `arena` first: pinned host memory the scheduler thread allocated (a GPU worker's), so
        that a transfer uploads to the device asynchronously. Called before any transfer arrives."""
        self.staging = StagingPool(self.cfg.staging_bytes, arena=arena)

    # --------------------------------------------------------- what a registered-memory transport changes
    def _admitted(self, inc: Incoming) -> None:
        """A transfer was admitted and its staging buffer taken (ZMQ: its chunks simply follow)."""

    def _chunk_arrived(self, inc: Incoming, chunk: p.TransferChunk, frames: list, now: float) -> Optional[str]:
        """Verify and stage one chunk. Returns an error message (the transfer is then refused)."""
        if len(frames) != 3:
            return "chunk without payload frame"
        payload = frames[2].buffer if hasattr(frames[2], "buffer") else memoryview(frames[2])
        return inc.add_chunk(chunk, payload, now)

    def _release_staging(self, inc: Incoming, failed: bool) -> None:
        """The transfer ended (`failed`: before every chunk arrived): its staging buffer goes back to the pool."""
        self.staging.release(inc.storage)

    def _send_chunks(self, out: Outgoing, sock: zmq.Socket) -> Optional[float]:
        """Send the transfer's gathered chunks, in order, under the rate cap. Returns seconds to wait before
        trying again, or None once every gathered chunk is sent."""
        h = out.header
        while out.chunks:
            index, buffer = out.chunks[0]
            if not sock.poll(0, zmq.POLLOUT):
                return 0.005  # the peer's queue is full: come back when it drains
            wait = self.bucket.wait_s(buffer.numel() * buffer.element_size(), self.clock())
            if wait > 0:
                return wait
            sock.send_multipart(chunk_frames(h, index, buffer), copy=False)
            out.chunks.popleft()
            self._chunk_sent(out)
        return None

    def _chunk_sent(self, out: Outgoing) -> None:
        out.num_sent += 1
        out.last_progress_s = self.clock()
        self.on_event(ChunkSent(out.header.transfer_id, out.num_sent))

    def _on_ready(self, msg: p.TransferReady, sock: zmq.Socket) -> None:
        """A target's `TransferReady`, on the socket to that target (ZMQ never asks for one: ignored)."""

    def _retry_refused(self, out: Outgoing, msg: p.TransferRefused, sock: zmq.Socket) -> bool:
        """A target refused an outgoing transfer: True if the transport sends it again another way (ZMQ: never)."""
        return False

    def _progress_more(self) -> float:
        """A transport's own work on each `progress` call. Returns seconds until it needs the next call."""
        return 1.0

    def _refuse(self, peer, transfer_id: str, replication_id: str, error: str, tell_coordinator: bool = True) -> None:
        log.warning("kvrep: refused transfer %s: %s", transfer_id, error)
        self.data.send_multipart([peer, p.encode(p.TransferRefused(transfer_id=transfer_id, error=error))])
        self.on_event(TransferFailed(transfer_id, replication_id, "target", error, tell_coordinator))

    # -------------------------------------------------------------------------------------------- sending
    def _pump_sends(self) -> float:
        """Send what the bandwidth cap allows, oldest transfer first. Returns seconds until the next try."""
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
            wait = self._send_chunks(out, sock)
            if wait is not None:
                return wait
            if out.num_sent < h.num_chunks:
                return 1.0  # waiting for the scheduler thread to gather more
            if not sock.poll(0, zmq.POLLOUT):
                return 0.005
            sock.send(p.encode(p.TransferEnd(transfer_id=tid)))
            out.end_sent_s = self.clock()
            self.send_queue.popleft()
            self.on_event(TransferSent(h, out.gather_s, out.end_sent_s - out.started_s))
        return 1.0

    def _on_reply(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = p.decode_data_plane(frames[-1])
            except p.ProtocolError:
                continue
            if isinstance(msg, p.TransferReady):
                self._on_ready(msg, sock)
                continue
            tid = getattr(msg, "transfer_id", "")
            if isinstance(msg, p.TransferRefused) and tid in self.outgoing \
                    and self._retry_refused(self.outgoing[tid], msg, sock):
                continue
            out = self.outgoing.pop(tid, None)
            if out is not None and isinstance(msg, p.TransferRefused):
                log.warning("kvrep: target refused %s: %s", tid, msg.error)
                if out.end_sent_s is None:  # stop gathering and sending the rest; the target reports it
                    self.on_event(TransferFailed(tid, out.header.replication_id, "source", msg.error,
                                                 tell_coordinator=False))

    # ------------------------------------------------------------------------------------------- timeouts
    def _check_timeouts(self, now: float) -> None:
        limit = self.cfg.transfer_timeout_s
        for tid, inc in list(self.incoming.items()):
            if now - inc.last_progress_s > limit:
                del self.incoming[tid]
                self._release_staging(inc, failed=True)
                log.warning("kvrep: transfer %s timed out after %.1fs without progress", tid, limit)
                self.on_event(TransferFailed(
                    tid, inc.header.replication_id, "target",
                    f"transfer timed out: no data for {limit:g}s "
                    f"({inc.received_bytes}/{inc.header.num_bytes} bytes received; source dead?)"))
        for tid, out in list(self.outgoing.items()):
            if out.end_sent_s is not None:
                if now - out.end_sent_s > limit:
                    del self.outgoing[tid]  # the target never answered; it reports its own failure
            elif now - out.last_progress_s > limit:
                # the target stopped taking data (dead or stuck): give up, release the source's lock
                del self.outgoing[tid]
                self.on_event(TransferFailed(
                    tid, out.header.replication_id, "source",
                    f"send stalled for {limit:g}s ({out.num_sent}/{out.header.num_chunks} chunks sent)"))
