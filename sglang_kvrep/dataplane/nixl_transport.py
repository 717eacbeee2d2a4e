"""`NixlTransport` (`--kvrep-transport nixl`): the payload moves by NIXL (NVIDIA's inference transfer library,
PyPI `nixl`; the UCX backend: RDMA between hosts where the fabric has it, shared memory or TCP otherwise), the
way SGLang's own PD disaggregation moves KV with `--disaggregation-transfer-backend nixl`. Control stays on the
ZeroMQ data plane of `ZmqTransport` (this class extends it), so a transfer keeps every guarantee of the ZMQ path:
the owner's admission (grant, token, geometry, budget), CURVE authentication of the control messages with keys,
a checksum per chunk verified by the target, atomic hand-over only when every chunk verified, stall timeouts on
both sides, the per-link rate cap, and staging buffers that always return to their pool.

    source                                              target
    TransferHeader(transport="nixl")  ----- ZMQ ---->   admit; staging = pool.acquire() (registered with NIXL)
                                      <---- ZMQ -----   TransferReady(agent name, agent metadata, staging address)
    add_remote_agent(metadata) once per metadata
    per gathered chunk: WRITE of each layer's run of pages straight to its place in the staging buffer
    when the WRITE is DONE: TransferChunk(checksum) ZMQ ->  checksum the written pages in place (no copy)
    TransferEnd                       ----- ZMQ ---->   every chunk verified -> TransferReceived (owner installs)
                                      <---- ZMQ -----   TransferAccepted / TransferRefused

"DONE" of a NIXL WRITE means the bytes are in the target's memory: SGLang's NIXL connector relies on the same
(it tells the decode side that a room's KV landed once its handles are DONE). Unlike the ZMQ path the target
makes no staging copy: a chunk lands where it will be scattered from.

What the fabric must give: NIXL/UCX writes are not authenticated by our keys. With keys, everything that decides
what lands (header, token, grant, the checksums) comes over the CURVE channel from the allow-listed source and
only that source is told the staging address; a host that can reach the UCX endpoint and forge a write into
registered memory could still change staged bytes after their check. This is the trust model of SGLang's and
vLLM's NIXL KV transfer: a dedicated, trusted fabric (docs/security.md).

A staging buffer whose transfer failed mid-way (the source may still be writing into it) is kept out of the pool
for `transfer_timeout_s` before reuse; a source keeps each chunk's memory registered and alive until its WRITE
ended, whatever happened to the transfer.
"""
from __future__ import annotations

import collections
import importlib
import importlib.util
import logging
import time
import uuid
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

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
"""Where NIXL's Python API lives: `nixl` (the meta package, which picks the wheel of the CUDA it finds) or one of
its per-CUDA wheels installed alone (`nixl-cu13` is the one pinned here: torch of sglang 0.5.23 is built for
CUDA 13)."""


def nixl_missing() -> Optional[str]:
    """Returns: why `--kvrep-transport nixl` cannot run here (None: NIXL is installed). Cheap: imports nothing."""
    for name in _MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return None
    return "NIXL is not installed (pip install nixl, or nixl-cu13 next to a CUDA 13 torch)"


def load_nixl() -> Any:
    """Returns: NIXL's `_api` module (`nixl_agent`, `nixl_agent_config`).

    Raises:
        ImportError: NIXL is not installed (or none of its wheels loads here); the message says which failed.
    """
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("--kvrep-transport nixl: NIXL cannot be imported (" + "; ".join(errors) + ")")


@dataclass
class _Write:
    """One chunk's WRITE, in flight: its memory stays registered and referenced until the WRITE ended."""

    transfer_id: str
    index: int
    buffer: torch.Tensor
    meta: bytes
    """The chunk's `TransferChunk` (with the checksum of `buffer`), sent once the WRITE is DONE."""
    registration: Any
    handle: Any = None


def _mem_kind(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


class NixlTransport(ZmqTransport):
    """ZMQ control, NIXL payload (see the module docstring). I/O thread only; it also takes plain ZMQ transfers
    (a source running `--kvrep-transport zmq` can still replicate to it)."""

    name = "nixl"
    accepts = ("zmq", "nixl")

    def use_arena(self, arena) -> None:
        """Not here: NIXL writes into staging it registered (`StagingPool(on_new=register)`); a GPU worker's
        pinned arena is the ZeroMQ transport's. Its transfers upload in slices."""

    def __init__(self, config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                 poller: zmq.Poller, clock: Callable[[], float] = time.monotonic, backend: str = "UCX") -> None:
        api = load_nixl()  # before binding anything: a missing library leaves nothing open
        super().__init__(config, admit, on_event, ctx, poller, clock)
        if not k.is_loopback_host(config.data_host):
            log.warning("kvrep: --kvrep-transport nixl on %s: NIXL/UCX writes are not authenticated by the "
                        "workers' keys (control and checksums are); run it on a trusted fabric "
                        "(docs/security.md)", config.data_host)
        self.agent_name = f"kvrep-{uuid.uuid4().hex}"
        try:
            # no progress thread: NIXL's spins a core even when idle (measured: 0.75 CPU-s per s), which a serving
            # worker cannot give away; `_progress_more` drives UCX while a transfer is under way instead
            self.agent = api.nixl_agent(self.agent_name,
                                        api.nixl_agent_config(enable_prog_thread=False, backends=[backend]))
        except Exception:
            super().close()
            raise
        self._registered: dict[int, Any] = {}
        """Staging buffer address -> its NIXL registration."""
        self.staging = StagingPool(config.staging_bytes, on_new=self._register, on_drop=self._deregister)
        self.quarantine: list[tuple[float, torch.Tensor]] = []
        """(reusable after, buffer): staging of transfers that failed while their source may still write."""
        self.remote: dict[str, bytes] = {}
        """Peer agent name -> the metadata last added for it."""
        self.ready: dict[str, p.TransferReady] = {}
        self.writes: dict[str, collections.deque[_Write]] = {}
        """Transfer id -> its WRITEs in flight, in chunk order."""
        self.orphans: list[_Write] = []
        """WRITEs of transfers that ended (failed, cancelled) while they were in flight."""
        self.zmq_targets: set[str] = set()
        """Data endpoints that refused a NIXL transfer (workers on `--kvrep-transport zmq`): sent over ZMQ."""

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
                self.agent.deregister_memory(reg)
            except Exception:  # closing: nothing more to do about it
                pass
        self._registered.clear()
        super().close()

    # ------------------------------------------------------------------------------------------ target side
    def _register(self, buf: torch.Tensor) -> None:
        self._registered[buf.data_ptr()] = self.agent.register_memory(buf)

    def _deregister(self, buf: torch.Tensor) -> None:
        reg = self._registered.pop(buf.data_ptr(), None)
        if reg is not None:
            self.agent.deregister_memory(reg)

    def _admitted(self, inc: Incoming) -> None:
        if inc.header.transport != self.name:
            return
        ready = p.TransferReady(transfer_id=inc.header.transfer_id, agent_name=self.agent_name,
                                agent_metadata=self.agent.get_agent_metadata(), address=inc.storage.data_ptr(),
                                num_bytes=inc.header.num_bytes)
        self.data.send_multipart([inc.peer, p.encode(ready)])

    def _chunk_arrived(self, inc: Incoming, chunk: p.TransferChunk, frames: list, now: float) -> Optional[str]:
        if inc.header.transport != self.name:
            return super()._chunk_arrived(inc, chunk, frames, now)
        if len(frames) != 2:
            return "a nixl transfer's chunk came with a payload frame"
        err = inc.check_written(chunk, now)
        if err is None and len(inc.chunks) == inc.header.num_chunks:
            log.info("kvrep: nixl: replication %s (transfer %s): %d chunks, %d bytes written in place and verified",
                     inc.header.replication_id, inc.header.transfer_id, inc.header.num_chunks, inc.received_bytes)
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
        if self.remote.get(msg.agent_name) != msg.agent_metadata:
            # (loading it again updates it in place: a buffer the target registered since becomes writable, and
            # WRITEs in flight to that agent are left alone)
            try:
                name = self.agent.add_remote_agent(msg.agent_metadata)
            except Exception as exc:  # a peer's bad metadata fails that transfer, never the I/O thread
                return self._fail(out, f"nixl: target's agent metadata refused: {exc}")
            name = name.decode() if isinstance(name, bytes) else name
            if name != msg.agent_name:
                return self._fail(out, f"nixl: target says agent {msg.agent_name!r}, its metadata is {name!r}'s")
            self.remote[msg.agent_name] = msg.agent_metadata
        self.ready[msg.transfer_id] = msg
        out.last_progress_s = self.clock()

    def _retry_refused(self, out: Outgoing, msg: p.TransferRefused, sock: zmq.Socket) -> bool:
        h = out.header
        if h.transport != self.name or not is_transport_refusal(msg.error, self.name) \
                or out.num_sent or self.peers.get(out.endpoint) is not sock:
            return False
        # a worker of a mixed fleet that runs ZMQ only: nothing of this transfer was written or admitted there, so
        # it goes again, over ZMQ (its chunks are still queued), and so does every later one to that worker
        log.info("kvrep: %s takes no nixl transfers: sending %s and the next ones over zmq", out.endpoint,
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
                self._fail(out, f"nixl: WRITE of chunk {index} not posted: {exc}")
                return 0.0
            out.chunks.popleft()
        while queue:
            write = queue[0]
            state = self._state(write)
            if state == "ERR":
                self._fail(out, f"nixl: WRITE of chunk {write.index} failed")
                return 0.0
            if state != "DONE":
                return 0.0005  # NIXL has no descriptor to poll: come back soon while a WRITE is in flight
            if not sock.poll(0, zmq.POLLOUT):
                return 0.005
            sock.send(write.meta)
            queue.popleft()
            self._end_write(write)
            self._chunk_sent(out)
        if out.chunks:
            return self.bucket.wait_s(0, self.clock()) or 0.001
        return None

    def _post_write(self, h: p.TransferHeader, ready: p.TransferReady, index: int, buffer: torch.Tensor) -> _Write:
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
        kind, dev = _mem_kind(buffer)
        reg = self.agent.register_memory(buffer)
        write = _Write(h.transfer_id, index, buffer, meta, reg)
        try:
            base, row = buffer.data_ptr(), h.num_bytes // layers
            local = self.agent.get_xfer_descs([(base + layer * piece, piece, dev) for layer in range(layers)], kind)
            remote = self.agent.get_xfer_descs(
                [(ready.address + layer * row + first * (row // num_pages), piece, 0) for layer in range(layers)],
                "DRAM")
            write.handle = self.agent.initialize_xfer("WRITE", local, remote, ready.agent_name)
            if self.agent.transfer(write.handle) == "ERR":
                raise RuntimeError("transfer refused to start")
        except Exception:
            self._end_write(write)
            raise
        return write

    def _state(self, write: _Write) -> str:
        try:
            return self.agent.check_xfer_state(write.handle)
        except Exception:  # a state that cannot be read is a failed WRITE
            return "ERR"

    def _end_write(self, write: _Write) -> None:
        """Release the WRITE's handle and its memory's registration (the WRITE ended, or we are closing)."""
        try:
            if write.handle is not None:
                self.agent.release_xfer_handle(write.handle)
                write.handle = None
            if write.registration is not None:
                self.agent.deregister_memory(write.registration)
                write.registration = None
        except Exception:
            log.exception("kvrep: nixl: releasing chunk %d of %s", write.index, write.transfer_id)

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
                if self._state(write) in ("DONE", "ERR"):
                    self._end_write(write)
                else:
                    still.append(write)
            self.orphans = still
        receiving = any(inc.header.transport == self.name for inc in self.incoming.values())
        if receiving:
            try:
                self.agent.get_new_notifs()  # drives UCX's progress (its TCP transport needs the target's)
            except Exception:
                log.exception("kvrep: nixl progress")
        if receiving or any(self.writes.values()):
            return 0.0005  # a live transfer waits on NIXL, which has no descriptor to poll
        return 0.05 if (self.orphans or self.quarantine) else 1.0  # (a dead peer's WRITE may take long to fail)
