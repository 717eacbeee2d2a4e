"""`WrittenTransport`: what every registered-memory transport shares (`NixlTransport`, `MooncakeTransport`): the
payload is WRITTEN by a transfer engine straight into the target's registered staging buffer, the way SGLang's
own PD disaggregation moves KV (`--disaggregation-transfer-backend nixl|mooncake`). Control stays on the ZeroMQ
data plane of `ZmqTransport` (this class extends it), so a transfer keeps every guarantee of the ZMQ path: the
owner's admission (grant, token, geometry, budget), CURVE authentication of the control messages with keys, a
checksum per chunk verified by the target, atomic hand-over only when every chunk verified, stall timeouts on
both sides, the per-link rate cap, and staging buffers that always return to their pool.

    source                                              target
    TransferHeader(transport=NAME)    ----- ZMQ ---->   admit; staging = pool.acquire() (registered with the engine)
                                      <---- ZMQ -----   TransferReady(peer name, peer metadata, staging address)
    `_accept_peer` (NIXL: add the peer's metadata once; Mooncake: the session is the target's own host)
    per gathered chunk: WRITE of each layer's run of pages straight to its place in the staging buffer
    when the WRITE is DONE: TransferChunk(checksum) ZMQ ->  checksum the written pages in place (no copy)
    TransferEnd                       ----- ZMQ ---->   every chunk verified -> TransferReceived (owner installs)
                                      <---- ZMQ -----   TransferAccepted / TransferRefused

"DONE" means the bytes are in the target's memory (both engines report a WRITE complete only then; SGLang's
connectors rely on the same). Unlike the ZMQ path the target makes no staging copy: a chunk lands where it will
be scattered from.

What the fabric must give: the engines' writes are not authenticated by our keys. With keys, everything that
decides what lands (header, token, grant, the checksums) comes over the CURVE channel from the allow-listed source
and only that source is told the staging address; a host that can reach the engine's endpoint and forge a write
into registered memory could still change staged bytes after their check. This is the trust model of SGLang's
and vLLM's NIXL and Mooncake KV transfers: a dedicated, trusted fabric (docs/security.md).

A staging buffer whose transfer failed mid-way (the source may still be writing into it) is kept out of the pool
for `transfer_timeout_s` before reuse; a source keeps each chunk's memory registered and alive until its WRITE
ended, whatever happened to the transfer.

A subclass supplies the engine (`_engine_*` methods): open it, register and deregister memory, what the target
tells a source about itself, accept what a target told, post a chunk's WRITE, read a WRITE's state, release it.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgspec
import torch
import zmq

from radix_sync import keys as k
from radix_sync import protocol as p
from sglang_kvrep.dataplane.staging import Incoming, Outgoing, StagingPool
from sglang_kvrep.dataplane.transport import Admit, OnEvent, TransferFailed, TransportSettings
from sglang_kvrep.dataplane.wire import chunk_meta
from sglang_kvrep.dataplane.zmq_transport import ZmqTransport, is_transport_refusal

log = logging.getLogger("kvrep.agent")

DONE, ERR, PROC, LOST = "DONE", "ERR", "PROC", "LOST"
"""A WRITE's state (`_engine_state`): landed, failed, in flight, failed while the engine may still use its memory
(timed out: the transfer fails, the chunk stays registered and referenced until the engine lets go)."""


@dataclass
class Write:
    """One chunk's WRITE, in flight: its memory stays registered and referenced until the WRITE ended."""

    transfer_id: str
    index: int
    buffer: torch.Tensor
    meta: bytes
    """The chunk's `TransferChunk` (with the checksum of `buffer`), sent once the WRITE is DONE."""
    registration: Any
    handle: Any = None


class WrittenTransport(ZmqTransport):
    """ZMQ control, an engine's WRITEs for the payload (see the module docstring). I/O thread only; it also takes
    plain ZMQ transfers (a source running `--kvrep-transport zmq` can still replicate to it)."""

    name = "written"

    def use_arena(self, arena) -> None:
        """Not here: the engine writes into staging it registered (`StagingPool(on_new=register)`); a GPU worker's
        pinned arena is the ZeroMQ transport's. Its transfers upload in slices."""

    def __init__(self, config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                 poller: zmq.Poller, clock: Callable[[], float] = time.monotonic) -> None:
        self._load_engine()  # before binding anything: a missing library leaves nothing open
        super().__init__(config, admit, on_event, ctx, poller, clock)
        if not k.is_loopback_host(config.data_host):
            log.warning("kvrep: --kvrep-transport %s on %s: the engine's writes are not authenticated by the "
                        "workers' keys (control and checksums are); run it on a trusted fabric "
                        "(docs/security.md)", self.name, config.data_host)
        try:
            self._open_engine(config)
        except Exception:
            super().close()
            raise
        self._registered: dict[int, Any] = {}
        """Staging buffer address -> its registration."""
        self.staging = StagingPool(config.staging_bytes, on_new=self._register, on_drop=self._deregister)
        self.quarantine: list[tuple[float, torch.Tensor]] = []
        """(reusable after, buffer): staging of transfers that failed while their source may still write."""
        self.ready: dict[str, p.TransferReady] = {}
        self.writes: dict[str, collections.deque[Write]] = {}
        """Transfer id -> its WRITEs in flight, in chunk order."""
        self.orphans: list[Write] = []
        """WRITEs of transfers that ended (failed, cancelled) while they were in flight."""
        self.zmq_targets: set[str] = set()
        """Data endpoints that refused this transport (workers on another `--kvrep-transport`): sent over ZMQ."""

    # ------------------------------------------------------------------------------------------ the engine
    def _load_engine(self) -> None:
        """Import the engine's library (raises ImportError saying what is missing)."""
        raise NotImplementedError

    def _open_engine(self, config: TransportSettings) -> None:
        raise NotImplementedError

    def _close_engine(self) -> None:
        """Closing: every WRITE and registration is released already."""

    def _engine_register(self, buf: torch.Tensor) -> Any:
        raise NotImplementedError

    def _engine_deregister(self, registration: Any) -> None:
        raise NotImplementedError

    def _engine_peer(self) -> tuple[str, bytes]:
        """What a target tells its source about itself: (name, metadata) of `TransferReady`."""
        raise NotImplementedError

    def _accept_peer(self, msg: p.TransferReady, out: Outgoing) -> Optional[str]:
        """Source: make the target of `msg` writable (None) or say why it is not."""
        raise NotImplementedError

    def _engine_write(self, ready: p.TransferReady, pieces: list[tuple[int, int, int]], buffer: torch.Tensor) -> Any:
        """Post WRITEs of `pieces` ((local address in `buffer`, remote address, bytes)); returns the handle. Raises
        when nothing was posted; a handle whose WRITEs were partly posted reports ERR once those ended."""
        raise NotImplementedError

    def _engine_state(self, write: Write) -> str:
        """DONE, ERR, PROC or LOST (an exception: ERR). May be asked again after any answer (a failed transfer's
        WRITEs are watched until each ended: DONE or ERR); after DONE or ERR, the same answer."""
        raise NotImplementedError

    def _engine_release(self, write: Write) -> None:
        """Release a WRITE's handle (it ended, or we are closing)."""

    def _engine_progress(self, receiving: bool) -> None:
        """Drive the engine while a transfer is under way (NIXL's UCX needs the target's progress)."""

    # ------------------------------------------------------------------------------------------ interface
    def send(self, header: p.TransferHeader, endpoint: str, peer_id: str = "") -> None:
        if endpoint not in self.zmq_targets:
            header = msgspec.structs.replace(header, transport=self.name)
        super().send(header, endpoint, peer_id)

    def close(self) -> None:
        for write in [w for q in self.writes.values() for w in q] + self.orphans:
            self._end_write(write)
        self.writes.clear()
        self.orphans.clear()
        for reg in self._registered.values():
            try:
                self._engine_deregister(reg)
            except Exception:  # closing: nothing more to do about it
                pass
        self._registered.clear()
        try:
            self._close_engine()
        finally:
            super().close()

    # ------------------------------------------------------------------------------------------ target side
    def _register(self, buf: torch.Tensor) -> None:
        self._registered[buf.data_ptr()] = self._engine_register(buf)

    def _deregister(self, buf: torch.Tensor) -> None:
        reg = self._registered.pop(buf.data_ptr(), None)
        if reg is not None:
            self._engine_deregister(reg)

    def _admitted(self, inc: Incoming) -> None:
        if inc.header.transport != self.name:
            return
        name, metadata = self._engine_peer()
        ready = p.TransferReady(transfer_id=inc.header.transfer_id, agent_name=name, agent_metadata=metadata,
                                address=inc.storage.data_ptr(), num_bytes=inc.header.num_bytes)
        self.data.send_multipart([inc.peer, p.encode(ready)])

    def _chunk_arrived(self, inc: Incoming, chunk: p.TransferChunk, frames: list, now: float) -> Optional[str]:
        if inc.header.transport != self.name:
            return super()._chunk_arrived(inc, chunk, frames, now)
        if len(frames) != 2:
            return f"a {self.name} transfer's chunk came with a payload frame"
        err = inc.check_written(chunk, now)
        if err is None and len(inc.chunks) == inc.header.num_chunks:
            log.info("kvrep: %s: replication %s (transfer %s): %d chunks, %d bytes written in place and verified",
                     self.name, inc.header.replication_id, inc.header.transfer_id, inc.header.num_chunks,
                     inc.received_bytes)
        return err

    def _release_staging(self, inc: Incoming, failed: bool) -> None:
        if failed and inc.header.transport == self.name:
            self.quarantine.append((self.clock() + self.cfg.transfer_timeout_s, inc.storage))
        else:
            super()._release_staging(inc, failed)

    # ------------------------------------------------------------------------------------------ source side
    def _on_ready(self, msg: p.TransferReady, sock: zmq.Socket) -> None:
        out = self.outgoing.get(msg.transfer_id)
        if out is None or out.header.transport != self.name or self.peers.get(out.endpoint) is not sock \
                or msg.transfer_id in self.ready:
            return  # not ours, not from that transfer's target, or a repeat
        if msg.num_bytes != out.header.num_bytes:
            return self._fail(out, f"target's staging is {msg.num_bytes} bytes, the transfer {out.header.num_bytes}")
        try:
            err = self._accept_peer(msg, out)
        except Exception as exc:  # a peer's bad answer fails that transfer, never the I/O thread
            err = f"target's endpoint refused: {exc}"
        if err is not None:
            return self._fail(out, f"{self.name}: {err}")
        self.ready[msg.transfer_id] = msg
        out.last_progress_s = self.clock()

    def _retry_refused(self, out: Outgoing, msg: p.TransferRefused, sock: zmq.Socket) -> bool:
        h = out.header
        if h.transport != self.name or not is_transport_refusal(msg.error, self.name) \
                or out.num_sent or self.peers.get(out.endpoint) is not sock:
            return False
        # a worker of a mixed fleet that runs another transport: nothing of this transfer was written or admitted
        # there, so it goes again, over ZMQ (its chunks are still queued), and so does every later one to it
        log.info("kvrep: %s takes no %s transfers: sending %s and the next ones over zmq", out.endpoint, self.name,
                 h.transfer_id)
        self.zmq_targets.add(out.endpoint)
        out.header = msgspec.structs.replace(h, transport="zmq")
        out.header_sent = False
        self.ready.pop(h.transfer_id, None)
        if h.transfer_id not in self.send_queue:
            self.send_queue.append(h.transfer_id)
        return True

    def _send_chunks(self, out: Outgoing, sock: zmq.Socket) -> Optional[float]:
        h = out.header
        if h.transport != self.name:
            return super()._send_chunks(out, sock)
        ready = self.ready.get(h.transfer_id)
        if ready is None:
            return 1.0  # the target's TransferReady wakes the poller
        queue = self.writes.setdefault(h.transfer_id, collections.deque())
        while out.chunks:
            index, buffer = out.chunks[0]
            wait = self.bucket.wait_s(buffer.numel() * buffer.element_size(), self.clock())
            if wait > 0:
                break
            try:
                queue.append(self._post_write(h, ready, index, buffer))
            except Exception as exc:
                self._fail(out, f"{self.name}: WRITE of chunk {index} not posted: {exc}")
                return 0.0
            out.chunks.popleft()
        while queue:
            write = queue[0]
            state = self._state(write)
            if state in (ERR, LOST):
                self._fail(out, f"{self.name}: WRITE of chunk {write.index} " + ("failed" if state == ERR else
                                                                                 "timed out"))
                return 0.0
            if state != DONE:
                return 0.0005  # the engines have no descriptor to poll: come back soon while a WRITE is in flight
            if not sock.poll(0, zmq.POLLOUT):
                return 0.005
            sock.send(write.meta)
            queue.popleft()
            self._end_write(write)
            self._chunk_sent(out)
        if out.chunks:
            return self.bucket.wait_s(0, self.clock()) or 0.001
        return None

    def _post_write(self, h: p.TransferHeader, ready: p.TransferReady, index: int, buffer: torch.Tensor) -> Write:
        """Post chunk `index`'s WRITE: each layer's run of the chunk's pages to its place in the target's staging."""
        buffer = buffer.contiguous()
        layers, num_pages = h.buffer_shape[0], h.num_pages
        first = index * h.pages_per_chunk
        count = min(h.pages_per_chunk, h.num_pages - first)
        piece = count * (h.num_bytes // (layers * num_pages))  # one layer's pages of this chunk
        if buffer.numel() * buffer.element_size() != piece * layers:
            raise ValueError(f"chunk {index} is {buffer.numel() * buffer.element_size()} bytes, expected "
                             f"{piece * layers}")
        meta = p.encode(chunk_meta(h, index, buffer))
        write = Write(h.transfer_id, index, buffer, meta, self._engine_register(buffer))
        try:
            base, row = buffer.data_ptr(), h.num_bytes // layers
            pieces = [(base + layer * piece, ready.address + layer * row + first * (row // num_pages), piece)
                      for layer in range(layers)]
            write.handle = self._engine_write(ready, pieces, buffer)
        except Exception:
            self._end_write(write)
            raise
        return write

    def _state(self, write: Write) -> str:
        try:
            return self._engine_state(write)
        except Exception:  # a state that cannot be read is a failed WRITE
            return ERR

    def _end_write(self, write: Write) -> None:
        """Release the WRITE's handle and its memory's registration (the WRITE ended, or we are closing)."""
        try:
            if write.handle is not None:
                self._engine_release(write)
                write.handle = None
            if write.registration is not None:
                self._engine_deregister(write.registration)
                write.registration = None
        except Exception:
            log.exception("kvrep: %s: releasing chunk %d of %s", self.name, write.index, write.transfer_id)

    def _fail(self, out: Outgoing, error: str) -> None:
        """End an outgoing transfer on the source: reported once; its target times out (as with a dead source)."""
        tid = out.header.transfer_id
        if self.outgoing.pop(tid, None) is None:
            return
        log.warning("kvrep: transfer %s failed on its source: %s", tid, error)
        self.on_event(TransferFailed(tid, out.header.replication_id, "source", error))

    # ------------------------------------------------------------------------------------- either side
    def _progress_more(self) -> float:
        now = self.clock()
        if self.quarantine:
            due = [buf for until, buf in self.quarantine if until <= now]
            self.quarantine = [(until, buf) for until, buf in self.quarantine if until > now]
            for buf in due:
                self.staging.release(buf)
        for tid in [t for t in self.writes if t not in self.outgoing]:  # ended while WRITEs were in flight
            self.orphans.extend(self.writes.pop(tid))
            self.ready.pop(tid, None)
        for tid in [t for t in self.ready if t not in self.outgoing]:
            del self.ready[tid]
        if self.orphans:
            still = []
            for write in self.orphans:
                if self._state(write) in (DONE, ERR):
                    self._end_write(write)
                else:
                    still.append(write)
            self.orphans = still
        receiving = any(inc.header.transport == self.name for inc in self.incoming.values())
        try:
            self._engine_progress(receiving)
        except Exception:
            log.exception("kvrep: %s progress", self.name)
        if receiving or any(self.writes.values()):
            return 0.0005  # a live transfer waits on the engine, which has no descriptor to poll
        return 0.05 if (self.orphans or self.quarantine) else 1.0  # (a dead peer's WRITE may take long to fail)
