"""The worker side of the data plane: transfer state on the receiving end and the sending end, the checks a
target makes before it writes anything, and a small blocking client (used by tests and tools).

Wire: a ZMQ ROUTER on each worker's data endpoint; senders connect a DEALER. A transfer is `TransferHeader`, then
`num_chunks` x (`TransferChunk`, raw payload frame), then `TransferEnd`; the target answers `TransferAccepted` or
`TransferRefused`. A chunk is a run of whole pages of every layer, checksummed on its own, so the source sends a
chunk while it gathers the next and the target verifies each chunk on arrival:

    staging buffer, viewed (layers, pages, page bytes):     chunk k (pages [a, b)), viewed (layers, b - a, page bytes)
      layer 0: | p0 | p1 | ... | pa ... pb | ... |   <----   | pa ... pb |   (layer 0 rows of the chunk)
      layer 1: | p0 | p1 | ... | pa ... pb | ... |   <----   | pa ... pb |   (layer 1 rows)

A transfer is atomic for the target: bytes are staged and handed to the scheduler thread only once every chunk
arrived and verified. The sockets are driven by `sglang_kvrep.transport.ZmqTransport` (the default `Transport`)
on the agent's I/O thread; this module holds the state and checks any transport shares. Nothing here touches
SGLang.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import zmq

from radix_sync import protocol as p
from kvrep_kernels import CHECKSUM_KINDS, payload_checksum

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
    if h.pages_per_chunk < 1 or h.num_chunks != -(-h.num_pages // h.pages_per_chunk):
        return f"bad chunking: {h.num_chunks} chunks of {h.pages_per_chunk} pages for {h.num_pages} pages"
    if not h.ttl_s > 0:
        return f"bad ttl {h.ttl_s}"
    if h.checksum_kind not in CHECKSUM_KINDS:
        return f"unknown checksum kind {h.checksum_kind!r} (known: {', '.join(CHECKSUM_KINDS)})"
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

    def _pages_view(self) -> torch.Tensor:
        h = self.header
        layers, num_pages = h.buffer_shape[0], h.num_pages
        return self.buffer.view(layers, num_pages, h.num_bytes // (layers * num_pages))

    def add_chunk(self, chunk: p.TransferChunk, payload: memoryview, now_s: float) -> Optional[str]:
        """Verify one chunk and stage it. Returns an error message (the transfer is then refused)."""
        h = self.header
        if not 0 <= chunk.index < h.num_chunks or chunk.index in self.chunks:
            return f"bad or repeated chunk index {chunk.index}"
        first = chunk.index * h.pages_per_chunk
        count = min(h.pages_per_chunk, h.num_pages - first)
        page_bytes = h.num_bytes // h.num_pages
        if chunk.first_page != first or chunk.num_pages != count or chunk.num_bytes != count * page_bytes \
                or len(payload) != chunk.num_bytes:
            return (f"chunk {chunk.index} malformed: pages {chunk.first_page}+{chunk.num_pages}, "
                    f"{len(payload)} bytes (expected pages {first}+{count}, {count * page_bytes} bytes)")
        data = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        got = payload_checksum(data, h.checksum_kind)
        if got != chunk.checksum:
            return f"checksum mismatch in chunk {chunk.index}: payload {got:#x} != announced {chunk.checksum:#x}"
        view = self._pages_view()
        view[:, first:first + count].copy_(data.view(view.shape[0], count, view.shape[2]))
        self.chunks.add(chunk.index)
        self.received_bytes += chunk.num_bytes
        self.last_progress_s = now_s
        return None

    def finish(self) -> Optional[str]:
        h = self.header
        if len(self.chunks) != h.num_chunks or self.received_bytes != h.num_bytes:
            return f"incomplete: {len(self.chunks)}/{h.num_chunks} chunks, {self.received_bytes}/{h.num_bytes} bytes"
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
    """A transfer being sent: the header, then chunks as the scheduler thread gathers them."""

    header: p.TransferHeader
    endpoint: str
    started_s: float
    chunks: "collections.deque[tuple[int, torch.Tensor]]" = field(default_factory=collections.deque)
    """Gathered chunks waiting to be sent (index, buffer)."""
    header_sent: bool = False
    num_sent: int = 0
    last_progress_s: float = 0.0
    gather_s: float = 0.0
    end_sent_s: Optional[float] = None


def chunk_frames(header: p.TransferHeader, index: int, buffer: torch.Tensor) -> list:
    """The two frames of chunk `index` (its metadata and its payload, zero-copy), checksummed here."""
    first = index * header.pages_per_chunk
    count = min(header.pages_per_chunk, header.num_pages - first)
    payload = payload_view(buffer)
    meta = p.TransferChunk(transfer_id=header.transfer_id, index=index, first_page=first, num_pages=count,
                           num_bytes=len(payload), checksum=payload_checksum(buffer, header.checksum_kind))
    return [p.encode(meta), payload]


def payload_view(buffer: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    flat = buffer.contiguous().view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy()).cast("B")


def split_pages(header: p.TransferHeader, payload: bytes | memoryview, index: int) -> torch.Tensor:
    """Chunk `index` of a whole payload in the buffer layout (what a source gathers for that chunk)."""
    layers, num_pages = header.buffer_shape[0], header.num_pages
    whole = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(layers, num_pages, -1)
    first = index * header.pages_per_chunk
    return whole[:, first:first + header.pages_per_chunk].contiguous()


def send_transfer(endpoint: str, header: p.TransferHeader, payload: bytes | memoryview, *, timeout_s: float = 30.0,
                  stop_after_chunks: Optional[int] = None, corrupt_chunk: Optional[int] = None,
                  skip_chunk: Optional[int] = None):
    """Blocking client: send one transfer of a whole payload (in the buffer layout) and return the target's reply
    (TransferAccepted / TransferRefused), or None on timeout. Faults, for tests: `stop_after_chunks` leaves it
    unfinished (a sender dying mid-way); `corrupt_chunk` flips a payload byte of that chunk after its checksum was
    taken (damage in transit); `skip_chunk` never sends that chunk but still ends the transfer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    try:
        sock.send(p.encode(header))
        for i in range(header.num_chunks):
            if stop_after_chunks is not None and i >= stop_after_chunks:
                return None
            if i == skip_chunk:
                continue
            frames = chunk_frames(header, i, split_pages(header, payload, i))
            if i == corrupt_chunk:
                damaged = bytearray(frames[1])
                damaged[len(damaged) // 2] ^= 0xFF
                frames[1] = bytes(damaged)
            sock.send_multipart(frames, copy=False)
        sock.send(p.encode(p.TransferEnd(transfer_id=header.transfer_id)))
        if sock.poll(int(timeout_s * 1000)):
            return p.decode_data_plane(sock.recv_multipart()[-1])
        return None
    finally:
        sock.close()
