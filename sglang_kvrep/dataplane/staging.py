"""Transfer state on both ends of the data plane, any transport's: `Incoming` (a transfer being received and
verified chunk by chunk into a staging buffer), `Outgoing` (one being sent as the scheduler thread gathers it),
`StagingPool` (the receive buffers, reused) and `StagingLedger` (the replica budget held by the transfers being
received, so that concurrent grants together stay within it). I/O thread only; nothing here touches SGLang."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kvrep_kernels import payload_checksum, pieces_checksum
from radix_sync import protocol as p


ARENA_ALIGN = 4096
"""Arena buffers start on page boundaries."""


class StagingPool:
    """Reused receive buffers. A fresh multi-MB tensor per transfer costs a page fault per 4 KiB on first touch
    (measured in docs/transport.md: it dominated receive time); buffers returned here are reused, best fit first,
    up to `max_bytes` cached in total. I/O thread only."""

    def __init__(self, max_bytes: int, on_new: Optional[Callable[[torch.Tensor], None]] = None,
                 on_drop: Optional[Callable[[torch.Tensor], None]] = None,
                 arena: Optional[torch.Tensor] = None) -> None:
        """`on_new(buf)` / `on_drop(buf)`: called when a buffer is allocated / let go for good (a registered-memory
        transport registers and deregisters it there). Buffers are pageable host memory: pinning one is a CUDA call,
        which the I/O thread must not make (docs/gpu.md). `arena`: pinned host memory the scheduler thread allocated
        (a GPU worker's: a transfer received there uploads asynchronously); buffers are carved out of it first, as
        views (never freed here), and pageable ones made only for what does not fit."""
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []
        self._on_new = on_new
        self._on_drop = on_drop
        self.arena = arena
        self._holes: list[tuple[int, int]] = [(0, arena.numel())] if arena is not None else []
        """Free byte ranges of the arena, [start, end), sorted and merged."""
        self._lent: dict[int, tuple[int, int]] = {}
        """data_ptr of an arena view lent out -> its range."""

    def in_arena(self, buf: torch.Tensor) -> bool:
        return buf.data_ptr() in self._lent

    def arena_free_bytes(self) -> int:
        return sum(end - start for start, end in self._holes)

    def _carve(self, num_bytes: int) -> Optional[torch.Tensor]:
        size = -(-max(1, num_bytes) // ARENA_ALIGN) * ARENA_ALIGN
        for i, (start, end) in enumerate(self._holes):
            if end - start >= size:
                self._holes[i:i + 1] = [(start + size, end)] if end - start > size else []
                view = self.arena[start:start + size]
                self._lent[view.data_ptr()] = (start, start + size)
                return view
        return None

    def _give_back(self, buf: torch.Tensor) -> None:
        start, end = self._lent.pop(buf.data_ptr())
        holes = sorted(self._holes + [(start, end)])
        merged: list[tuple[int, int]] = []
        for a, b in holes:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self._holes = merged

    def cached_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    def acquire(self, num_bytes: int) -> torch.Tensor:
        if self.arena is not None:
            view = self._carve(num_bytes)
            if view is not None:
                return view
        fits = [b for b in self._free if b.numel() >= num_bytes]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not buf]
            return buf
        buf = torch.empty(num_bytes, dtype=torch.uint8)
        if self._on_new is not None:
            self._on_new(buf)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        if self.in_arena(buf):
            return self._give_back(buf)
        if buf.numel() > self.max_bytes:
            return self._drop(buf)
        self._free.append(buf)
        while self.cached_bytes() > self.max_bytes:
            smallest = min(self._free, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not smallest]
            self._drop(smallest)

    def _drop(self, buf: torch.Tensor) -> None:
        if self._on_drop is not None:
            self._on_drop(buf)


class StagingLedger:
    """Replica-budget tokens held by the transfers a target admitted and has not ended yet (staging, or lent to
    the scheduler thread to install). Each admission is checked against the budget left after all of them, so
    concurrent grants together never stage more than the replica budget (each alone would fit). I/O thread only.
    """

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def held_tokens(self) -> int:
        return sum(self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    def reserve(self, transfer_id: str, num_tokens: int, free_tokens: int) -> Optional[str]:
        """Hold `num_tokens` for `transfer_id` if they fit in `free_tokens` (the budget not taken by installed
        replicas) beside what the others hold. Returns an error message instead when they do not."""
        if transfer_id in self._held:
            return f"duplicate transfer id {transfer_id}"
        held = self.held_tokens()
        if num_tokens > free_tokens - held:
            return (f"replica budget exceeded: {num_tokens} tokens > {max(0, free_tokens - held)} free "
                    f"({free_tokens} not installed, {held} held by {len(self._held)} transfer(s) being received)")
        self._held[transfer_id] = num_tokens
        return None

    def release(self, transfer_id: str) -> None:
        """The transfer ended (installed, refused, failed): its tokens are free again. Unknown ids are ignored."""
        self._held.pop(transfer_id, None)


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
    pinned: bool = False
    """`storage` is pinned host memory (a GPU worker's staging arena): it uploads in one asynchronous copy."""

    @property
    def buffer(self) -> torch.Tensor:
        return self.storage[:self.header.num_bytes]

    def _pages_view(self) -> torch.Tensor:
        h = self.header
        layers, num_pages = h.buffer_shape[0], h.num_pages
        return self.buffer.view(layers, num_pages, h.num_bytes // (layers * num_pages))

    def _span(self, chunk: p.TransferChunk, num_bytes: int) -> tuple[int, int] | str:
        """The pages [first, first + count) chunk `chunk.index` must carry, or why `chunk` (of `num_bytes` payload
        bytes) does not fit them."""
        h = self.header
        if not 0 <= chunk.index < h.num_chunks or chunk.index in self.chunks:
            return f"bad or repeated chunk index {chunk.index}"
        first = chunk.index * h.pages_per_chunk
        count = min(h.pages_per_chunk, h.num_pages - first)
        page_bytes = h.num_bytes // h.num_pages
        if chunk.first_page != first or chunk.num_pages != count or chunk.num_bytes != count * page_bytes \
                or num_bytes != chunk.num_bytes:
            return (f"chunk {chunk.index} malformed: pages {chunk.first_page}+{chunk.num_pages}, "
                    f"{num_bytes} bytes (expected pages {first}+{count}, {count * page_bytes} bytes)")
        return first, count

    def _took(self, chunk: p.TransferChunk, now_s: float) -> None:
        self.chunks.add(chunk.index)
        self.received_bytes += chunk.num_bytes
        self.last_progress_s = now_s

    def add_chunk(self, chunk: p.TransferChunk, payload: memoryview, now_s: float) -> Optional[str]:
        """Verify one chunk and stage it. Returns an error message (the transfer is then refused)."""
        h = self.header
        span = self._span(chunk, len(payload))
        if isinstance(span, str):
            return span
        first, count = span
        data = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        got = payload_checksum(data, h.checksum_kind)
        if got != chunk.checksum:
            return f"checksum mismatch in chunk {chunk.index}: payload {got:#x} != announced {chunk.checksum:#x}"
        view = self._pages_view()
        view[:, first:first + count].copy_(data.view(view.shape[0], count, view.shape[2]))
        self._took(chunk, now_s)
        return None

    def check_written(self, chunk: p.TransferChunk, now_s: float) -> Optional[str]:
        """A registered-memory transport's chunk: its pages were written in place (each layer's run of pages at
        its spot in the staging buffer) before this announcement came; verify them there. Returns an error
        message (the transfer is then refused)."""
        span = self._span(chunk, chunk.num_bytes)
        if isinstance(span, str):
            return span
        first, count = span
        view = self._pages_view()
        got = pieces_checksum([view[layer, first:first + count] for layer in range(view.shape[0])],
                              self.header.checksum_kind)
        if got != chunk.checksum:
            return f"checksum mismatch in chunk {chunk.index}: written {got:#x} != announced {chunk.checksum:#x}"
        self._took(chunk, now_s)
        return None

    def finish(self) -> Optional[str]:
        h = self.header
        if len(self.chunks) != h.num_chunks or self.received_bytes != h.num_bytes:
            return f"incomplete: {len(self.chunks)}/{h.num_chunks} chunks, {self.received_bytes}/{h.num_bytes} bytes"
        return None


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
