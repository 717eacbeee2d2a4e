"""How the worker agent orders its copies against SGLang's own device work: `CopyOps`, one per worker.

The agent copies KV pages on SGLang's scheduler thread, between iterations, while the forward of the next
iteration may already run (overlap scheduling). On a GPU that is two streams: SGLang's forward stream and the
agent's own copy stream. The rules, as SGLang keeps them for its own KV copies (HiCache's `cache_controller.py`
waits on the forward stream before a device-to-host write and before a load into reclaimed pages;
`disaggregation/prefill.py` records an event before early sends):

- **fence**: before the copy stream reads pages (a source's gather: a forward may still be writing a cached
  prefix's last token; HiCache may still be loading host-tier pages back) or writes pages (a target's scatter into
  slots just freed: a late forward write may still land there), it waits for everything queued on the forward
  stream (and HiCache's load-back stream) so far. Later forwards still overlap.
- **record / query**: the copy's end is an event on the copy stream; the scheduler thread never waits on it, it
  asks (`done()`) at the next iteration. Until then the pages stay locked (source) or out of the tree (target),
  and the host memory stays with the copy.
- **host memory**: a gathered chunk goes device -> host in one asynchronous copy into pinned memory; the I/O
  thread gets it (and checksums it) only once its event is done. A target uploads its (pinned) staging buffer
  asynchronously and scatters it on the copy stream.

`SyncOps` is the CPU pool's: every copy is done when issued (what runs in CI and on CPU SGLang). `CudaOps` is the
GPU's. Tests inject their own `CopyOps` (an asynchronous fake that runs queued work only when told) to check the
ordering itself on the CPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional, Protocol

import torch


class CopyEvent(Protocol):
    def query(self) -> bool:
        """Is all the work issued before the event done? Never blocks."""


class CopyOps(Protocol):
    """The agent's copy stream on its pool's device."""

    device: torch.device
    is_async: bool
    """False: every copy is done when `record` returns (no polling needed)."""

    def fence(self) -> None:
        """The copy stream waits for the work queued on the forward stream so far."""

    def stream(self) -> ContextManager[Any]:
        """Work issued inside runs on the copy stream."""

    def record(self) -> CopyEvent:
        """An event after everything issued on the copy stream so far."""

    def host_buffer(self, num_bytes: int) -> torch.Tensor:
        """A uint8 host buffer (pinned where the device is a GPU: asynchronous copies need it)."""

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the bytes of the (contiguous) device tensor `src` into the host tensor `dst`, of as many bytes,
        on the copy stream."""

    def to_device(self, src: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`src` (host) on the pool's device (into `out`, a device tensor like it, when given), copied on the copy
        stream (the host memory must stay alive until an event recorded after this call is done)."""


class _Done:
    def query(self) -> bool:
        return True


DONE = _Done()


class SyncOps:
    """CPU pools: copies are plain memory copies on the scheduler thread, done when issued."""

    is_async = False

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device

    def fence(self) -> None:
        pass

    def stream(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def record(self) -> CopyEvent:
        return DONE

    def host_buffer(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        flat_bytes(dst).copy_(flat_bytes(src))

    def to_device(self, src: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return src if out is None else out.copy_(src)


class CudaOps:
    """A CUDA pool: the agent's own stream, fenced behind SGLang's forward stream (`forward_stream`; None: the
    device's current stream at construction, which is the forward stream without overlap scheduling)."""

    is_async = True

    def __init__(self, device: torch.device, forward_stream: Optional["torch.cuda.Stream"] = None,
                 other_streams: tuple = ()) -> None:
        """`other_streams`: more streams whose queued work a copy waits for (HiCache's load-back stream: its pages
        match as device prefix while they load)."""
        self.device = device
        self.forward_stream = forward_stream if forward_stream is not None else torch.cuda.current_stream(device)
        self.fenced = (self.forward_stream, *(s for s in other_streams if s is not None))
        self.copy_stream = torch.cuda.Stream(device=device)

    def fence(self) -> None:
        for stream in self.fenced:
            self.copy_stream.wait_stream(stream)

    def stream(self) -> ContextManager[Any]:
        return torch.cuda.stream(self.copy_stream)

    def record(self) -> CopyEvent:
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev

    def host_buffer(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy_stream):
            flat_bytes(dst).copy_(flat_bytes(src), non_blocking=True)

    def to_device(self, src: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        with torch.cuda.stream(self.copy_stream):
            if out is not None:
                return out.copy_(src, non_blocking=True)
            return src.to(self.device, non_blocking=True)


def _storage_users(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class HostSlots:
    """A source's host memory for gathered chunks: buffers of `slot_bytes` (pinned on a GPU), allocated on the
    scheduler thread (a GPU agent reserves them all when it starts, `reserve`: on an H200 the first 4K-token
    transfer's step that allocated 43 of them took 128 ms), at most `max_slots`, and never freed. A chunk's host
    buffer is a view of one; the I/O thread, the transport and pyzmq's zero-copy frames hold views, and a slot is
    taken again only once nothing but this pool uses its memory (the storage's use count back to what it was when
    allocated).

    Why: the I/O thread (and pyzmq's garbage-collector thread, which lets go of zero-copy frames) then makes no
    CUDA call at all: views dropped there free nothing. (Freeing a pinned block that an asynchronous copy used makes
    PyTorch's caching host allocator record an event on the copy stream. On an H200 with torch 2.11 that did not
    break a global-mode CUDA-graph capture on another thread, which SGLang runs after a weight update; a pinned
    allocation on another thread did: scripts/gpu_ordering.py, docs/gpu.md.) And the chunks' pinned memory is
    bounded over all jobs, allocated once."""

    def __init__(self, ops: CopyOps, slot_bytes: int, max_slots: int) -> None:
        self.ops, self.slot_bytes, self.max_slots = ops, slot_bytes, max(1, max_slots)
        self.slots: list[tuple[torch.Tensor, int]] = []  # (buffer, use count when only this pool held it)

    def take(self, num_bytes: int) -> Optional[torch.Tensor]:
        """A uint8 host buffer of `num_bytes` (a view of a free slot), or None while every slot is in use."""
        if num_bytes > self.slot_bytes:
            raise ValueError(f"a chunk of {num_bytes} bytes does not fit a slot of {self.slot_bytes}")
        for buf, idle in self.slots:
            if _storage_users(buf) == idle:
                return buf[:num_bytes]
        if len(self.slots) >= self.max_slots:
            return None
        buf = self.ops.host_buffer(self.slot_bytes)
        self.slots.append((buf, _storage_users(buf)))
        return buf[:num_bytes]

    def reserve(self) -> None:
        """Allocates every slot now."""
        while len(self.slots) < self.max_slots:
            buf = self.ops.host_buffer(self.slot_bytes)
            self.slots.append((buf, _storage_users(buf)))

    def in_use(self) -> int:
        return sum(_storage_users(buf) != idle for buf, idle in self.slots)


def host_copy(ops: CopyOps, src: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A host tensor shaped like `src`, filled from it on the copy stream (done once an event recorded after this
    call is): a device tensor's copy (into `out`, a uint8 host buffer of as many bytes, when given), or `src` itself
    when it is host memory and copies are synchronous."""
    if src.device.type == "cpu" and not ops.is_async:
        return src
    src = src.contiguous()
    if out is None:
        out = ops.host_buffer(src.numel() * src.element_size())
    host = out.view(src.dtype).view(src.shape)
    ops.to_host(src, host)
    return host


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def make_ops(device: torch.device, forward_stream: Optional[Any] = None, other_streams: tuple = ()) -> CopyOps:
    """The `CopyOps` for a pool on `device` (SGLang's forward stream, and its HiCache load-back stream, passed
    where it has them)."""
    if device.type == "cuda":
        return CudaOps(device, forward_stream, other_streams)
    return SyncOps(device)
