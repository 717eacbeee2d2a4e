"""The worker side of the data plane: transfer state on the receiving end and the sending end, the checks a
target makes before it writes anything, and a small blocking client (used by tests and tools).

Wire: a ZMQ ROUTER on each worker's data endpoint; senders connect a DEALER. A transfer is
`TransferHeader`, then `num_chunks` x (`TransferChunk`, raw payload frame), then `TransferEnd`; the target answers
`TransferAccepted` or `TransferRefused`. Payload frames are sent zero-copy from the gathered buffer. A transfer
is atomic for the target: bytes are staged and only handed to the scheduler thread once complete and verified.
Runs on the agent's I/O thread; nothing here touches SGLang.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import zmq

from radix_sync import protocol as p
from kvrep_kernels import payload_checksum

DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16, "torch.float32": torch.float32,
          "torch.uint8": torch.uint8, "torch.float8_e4m3fn": torch.uint8, "torch.float8_e5m2": torch.uint8}


@dataclass(frozen=True)
class LocalGeometry:
    """What a target compares an incoming header against."""

    fingerprint: str
    page_size: int
    dtype: str
    layout: str
    page_shape: tuple[int, ...]
    """Shape of one page of one layer in the buffer, e.g. (2, ps, H, D) for MHA NHD."""
    num_layers: int
    itemsize: int

    def buffer_shape(self, num_pages: int) -> list[int]:
        return [self.num_layers, num_pages, *self.page_shape]

    def num_bytes(self, num_pages: int) -> int:
        return math.prod(self.buffer_shape(num_pages)) * self.itemsize


def check_header(h: p.TransferHeader, local: LocalGeometry, free_replica_tokens: int) -> Optional[str]:
    """Returns an error message, or None when the transfer may proceed. Checked before a byte is buffered."""
    if h.fingerprint != local.fingerprint:
        return f"fingerprint mismatch: source {h.fingerprint} != target {local.fingerprint}"
    if h.page_size != local.page_size:
        return f"page size mismatch: {h.page_size} != {local.page_size}"
    if h.dtype != local.dtype or h.layout != local.layout:
        return f"dtype/layout mismatch: {h.dtype}/{h.layout} != {local.dtype}/{local.layout}"
    if h.num_pages < 1 or len(h.token_ids) != h.num_pages * h.page_size:
        return f"{len(h.token_ids)} token ids do not fill {h.num_pages} pages of {h.page_size}"
    if any((not isinstance(t, int)) or t < 0 for t in h.token_ids):
        return "token ids must be non-negative integers"
    if list(h.buffer_shape) != local.buffer_shape(h.num_pages):
        return f"buffer shape {list(h.buffer_shape)} != expected {local.buffer_shape(h.num_pages)}"
    if h.num_bytes != local.num_bytes(h.num_pages):
        return f"payload size {h.num_bytes} != expected {local.num_bytes(h.num_pages)}"
    if not 1 <= h.num_chunks <= h.num_bytes // 1024 + 1:  # chunks of at least 1 KiB, but the last
        return f"bad chunk count {h.num_chunks}"
    if not h.ttl_s > 0:
        return f"bad ttl {h.ttl_s}"
    if len(h.token_ids) > free_replica_tokens:
        return f"replica budget exceeded: {len(h.token_ids)} tokens > {free_replica_tokens} free"
    return None


class StagingPool:
    """Reused receive buffers. A fresh multi-MB tensor per transfer costs a page fault per 4 KiB on first touch
    (measured in docs/transport.md: it dominated receive time); buffers returned here are reused, best fit first,
    up to `max_bytes` cached in total. I/O thread only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []

    def cached_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    def acquire(self, num_bytes: int) -> torch.Tensor:
        fits = [b for b in self._free if b.numel() >= num_bytes]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not buf]
            return buf
        return torch.empty(num_bytes, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        if buf.numel() > self.max_bytes:
            return
        self._free.append(buf)
        while self.cached_bytes() > self.max_bytes:
            smallest = min(self._free, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not smallest]


@dataclass
class Incoming:
    """A transfer being received: staged bytes plus bookkeeping."""

    header: p.TransferHeader
    peer: bytes
    storage: torch.Tensor
    """The staging buffer (may be larger than the payload; see `buffer`)."""
    started_s: float
    last_progress_s: float
    chunks: set[int] = field(default_factory=set)
    received_bytes: int = 0

    @property
    def buffer(self) -> torch.Tensor:
        return self.storage[:self.header.num_bytes]

    def add_chunk(self, chunk: p.TransferChunk, payload: memoryview, now_s: float) -> Optional[str]:
        h = self.header
        if not 0 <= chunk.index < h.num_chunks or chunk.index in self.chunks:
            return f"bad or repeated chunk index {chunk.index}"
        if chunk.num_bytes != len(payload) or chunk.offset < 0 or chunk.offset + chunk.num_bytes > h.num_bytes:
            return f"chunk {chunk.index} out of bounds ({chunk.offset}+{len(payload)} of {h.num_bytes})"
        self.buffer[chunk.offset:chunk.offset + chunk.num_bytes].copy_(torch.frombuffer(payload, dtype=torch.uint8))
        self.chunks.add(chunk.index)
        self.received_bytes += chunk.num_bytes
        self.last_progress_s = now_s
        return None

    def finish(self) -> Optional[str]:
        h = self.header
        if len(self.chunks) != h.num_chunks or self.received_bytes != h.num_bytes:
            return f"incomplete: {len(self.chunks)}/{h.num_chunks} chunks, {self.received_bytes}/{h.num_bytes} bytes"
        got = payload_checksum(self.buffer, h.checksum_kind)
        if got != h.checksum:
            return f"checksum mismatch: payload {got:#x} != header {h.checksum:#x}"
        return None


class TokenBucket:
    """Caps a link's replication bytes/s so copies never starve online traffic. rate 0 = unlimited."""

    def __init__(self, rate_bytes_s: float, burst_bytes: int) -> None:
        self.rate = rate_bytes_s
        self.burst = burst_bytes
        self.tokens = float(burst_bytes)
        self.t = time.monotonic()

    def wait_s(self, num_bytes: int, now_s: float) -> float:
        """Seconds until `num_bytes` may go (0: now; the bytes are then taken)."""
        if self.rate <= 0:
            return 0.0
        self.tokens = min(float(max(self.burst, num_bytes)), self.tokens + (now_s - self.t) * self.rate)
        self.t = now_s
        if self.tokens >= num_bytes:
            self.tokens -= num_bytes
            return 0.0
        return (num_bytes - self.tokens) / self.rate


@dataclass
class Outgoing:
    header: p.TransferHeader
    endpoint: str
    payload: memoryview
    keepalive: torch.Tensor
    chunk_bytes: int
    started_s: float
    gather_s: float
    header_sent: bool = False
    next_chunk: int = 0
    end_sent_s: Optional[float] = None

    def frames_for(self, index: int) -> list:
        offset = index * self.chunk_bytes
        size = min(self.chunk_bytes, self.header.num_bytes - offset)
        chunk = p.TransferChunk(transfer_id=self.header.transfer_id, index=index, offset=offset, num_bytes=size)
        return [p.encode(chunk), self.payload[offset:offset + size]]


def payload_view(buffer: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    flat = buffer.contiguous().view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy()).cast("B")


def send_transfer(endpoint: str, header: p.TransferHeader, payload: bytes | memoryview, *,
                  chunk_bytes: int = 1 << 20, timeout_s: float = 30.0, stop_after_chunks: Optional[int] = None):
    """Blocking client: send one transfer and return the target's reply (TransferAccepted / TransferRefused), or
    None on timeout. `stop_after_chunks` leaves the transfer unfinished (to test a sender dying mid-way)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    try:
        sock.send(p.encode(header))
        view = memoryview(payload).cast("B")
        for i in range(header.num_chunks):
            if stop_after_chunks is not None and i >= stop_after_chunks:
                return None
            offset = i * chunk_bytes
            part = view[offset:offset + chunk_bytes]
            sock.send_multipart([p.encode(p.TransferChunk(header.transfer_id, i, offset, len(part))), part],
                                copy=False)
        sock.send(p.encode(p.TransferEnd(transfer_id=header.transfer_id)))
        if sock.poll(int(timeout_s * 1000)):
            return p.decode_data_plane(sock.recv_multipart()[-1])
        return None
    finally:
        sock.close()
