"""How a transfer goes on the wire: the frames of a chunk (metadata and a zero-copy payload, checksummed at the
source), the per-link rate cap, and a small blocking client that sends a whole transfer (used by tests and
tools). See `sglang_kvrep.dataplane` for the frame sequence."""
from __future__ import annotations

import time
from typing import Optional

import torch
import zmq

from kvrep_kernels import payload_checksum
from radix_sync import protocol as p
from radix_sync.keys import KeyPair, curve_client


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


def chunk_meta(header: p.TransferHeader, index: int, buffer: torch.Tensor) -> p.TransferChunk:
    """Chunk `index`'s `TransferChunk`: its pages, size and the checksum of `buffer` (taken here)."""
    first = index * header.pages_per_chunk
    count = min(header.pages_per_chunk, header.num_pages - first)
    return p.TransferChunk(transfer_id=header.transfer_id, index=index, first_page=first, num_pages=count,
                           num_bytes=buffer.numel() * buffer.element_size(),
                           checksum=payload_checksum(buffer, header.checksum_kind))


def chunk_frames(header: p.TransferHeader, index: int, buffer: torch.Tensor) -> list:
    """The two frames of chunk `index` (its metadata and its payload, zero-copy), checksummed here."""
    return [p.encode(chunk_meta(header, index, buffer)), payload_view(buffer)]


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
                  skip_chunk: Optional[int] = None, curve: Optional[tuple[KeyPair, bytes]] = None):
    """Blocking client: send one transfer of a whole payload (in the buffer layout) and return the target's reply
    (TransferAccepted / TransferRefused), or None on timeout. Faults, for tests: `stop_after_chunks` leaves it
    unfinished (a sender dying mid-way); `corrupt_chunk` flips a payload byte of that chunk after its checksum was
    taken (damage in transit); `skip_chunk` never sends that chunk but still ends the transfer. `curve`: (this
    sender's key pair, the target's public key) for a target with keys."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)  # replies only
    if curve is not None:
        curve_client(sock, *curve)
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
