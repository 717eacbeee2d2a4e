"""The typed mailbox between the worker agent's two threads: every message the scheduler side
(`sglang_kvrep.agent.scheduler_side.WorkerAgent`) and the I/O side (`sglang_kvrep.agent.io_side.IoSide`) exchange,
one frozen struct per kind, and `Mailbox`, the two queues and two pipes that carry them. The two sides import
nothing of each other but this module.

    scheduler thread                  Mailbox                          I/O thread
    post_to_io(msg)        --->  to_io queue + wake pipe      --->  take_for_io()     (polls `io_wake_fd`)
    take_for_scheduler()   <---  to_scheduler queue + bell    <---  post_to_scheduler(msg)
    (SGLang's idle poller watches `scheduler_bell_fd`, so `--sleep-on-idle` wakes up for a command)

A full pipe means a wake-up is pending already: posting never blocks either thread. Messages carry objects by
reference (a staged transfer, a gathered chunk): the receiving side owns them from then on.
"""
from __future__ import annotations

import os
import queue
from array import array
from typing import Any, Optional, Union

import msgspec
import torch

from radix_sync import protocol as p
from sglang_kvrep.dataplane.checks import LocalGeometry
from sglang_kvrep.dataplane.staging import Incoming


class WorkerInfo(msgspec.Struct, frozen=True):
    """What the I/O side says about this worker in its Hello and checks incoming transfers against; fixed when the
    scheduler side starts."""

    fingerprint: str
    fingerprint_fields: dict[str, str]
    page_size: int
    pool_capacity_tokens: int
    replica_budget_tokens: int
    free_replica_tokens: int
    """At start; later values arrive as `ReplicaRoom`."""
    geometry: LocalGeometry
    vocab_size: int = 0
    """The model's vocabulary size (0: unknown), said in the Hello: the coordinator refuses token ids >= it."""
    staging_arena: Any = None
    """A GPU worker's pinned receive memory (`--kvrep-staging-bytes`), allocated by the scheduler thread and kept
    for the life of the process: the I/O thread receives into views of it (no CUDA call), and a transfer that
    landed there uploads in one asynchronous copy."""


# ================================================================================= scheduler -> I/O thread
class ToCoordinator(msgspec.Struct, frozen=True):
    """A fact for the coordinator (its `seq` is set by the I/O side when it goes out)."""

    message: Any
    """A `radix_sync.protocol` worker-to-coordinator struct."""


class PrefixMatched(msgspec.Struct, frozen=True):
    """A request's prompt matched `matched_len` cached tokens (hashed and reported by the I/O side)."""

    namespace: str
    token_ids: array
    """The matched tokens."""
    matched_len: int
    key_len: int
    """Tokens in the request's whole key."""


class StartSend(msgspec.Struct, frozen=True):
    """Source: a gather job began; open the transfer to the target. Its chunks follow as `ChunkGathered`."""

    header: p.TransferHeader
    target_endpoint: str


class ChunkGathered(msgspec.Struct, frozen=True):
    transfer_id: str
    index: int
    buffer: torch.Tensor
    """Contiguous CPU tensor (layers, pages of the chunk, page bytes); the I/O side keeps it until sent."""
    gather_s: float


class GatherFailed(msgspec.Struct, frozen=True):
    """Source: gathering a chunk of `transfer_id` (or copying it to the host) failed; the scheduler side already
    released the prefix's lock. End the transfer and report it failed."""

    transfer_id: str
    error: str


class Installed(msgspec.Struct, frozen=True):
    """Target: the transfer is in the pool and the tree (`inserted_len` tokens were new)."""

    incoming: Incoming
    block_hashes: list[int]
    inserted_len: int
    scatter_s: float
    insert_s: float


class InstallFailed(msgspec.Struct, frozen=True):
    """Target: the install failed; nothing was written or kept."""

    incoming: Incoming
    error: str


class ReplicaRoom(msgspec.Struct, frozen=True):
    """Tokens the replica budget has free now (incoming transfers are checked against it)."""

    free_tokens: int


class Reannounce(msgspec.Struct, frozen=True):
    """The worker's identity changed (its weights were updated in place): check transfers against `info` from now
    on and say hello again with its new fingerprint."""

    info: WorkerInfo


class Stop(msgspec.Struct, frozen=True):
    """End the I/O loop."""


class DeviceBusy(msgspec.Struct, frozen=True):
    """The scheduler side has copies on the device (or a chunk waiting for a host slot), or no longer has: while it
    does, the I/O side rings the scheduler every `DEVICE_POLL_S`, since a finished device copy wakes nobody."""

    busy: bool


ToIo = Union[ToCoordinator, PrefixMatched, StartSend, ChunkGathered, GatherFailed, Installed, InstallFailed,
             ReplicaRoom, Reannounce, DeviceBusy, Stop]


# ================================================================================= I/O -> scheduler thread
class IoStarted(msgspec.Struct, frozen=True):
    """The I/O side is up (always its first message, unless `IoDied`)."""

    data_endpoint: str


class IoDied(msgspec.Struct, frozen=True):
    """The I/O thread ended on an error: the agent disables itself and SGLang serves as usual."""


class Replicate(msgspec.Struct, frozen=True):
    """Source: the coordinator's command to copy a cached prefix."""

    command: p.ReplicatePages


class Install(msgspec.Struct, frozen=True):
    """Target: a transfer arrived, verified and matching its grant; write it as a replica, answer `Installed` or
    `InstallFailed`."""

    incoming: Incoming
    block_hashes: list[int]
    ordinary: bool = False
    """The coordinator's grant lands it as ordinary cache, not at a replica's priority: a pull (a request waits
    for it, `ExpectReplica.critical`) or a policy's copy made so (`ExpectReplica.ordinary`)."""


class Promote(msgspec.Struct, frozen=True):
    """A real request hit this replica: it is ordinary cache now."""

    replication_id: str


class Demote(msgspec.Struct, frozen=True):
    """The coordinator's command: the cached chain ending at `token_ids` goes first when room is needed."""

    namespace: str
    token_ids: list[int]


class Drop(msgspec.Struct, frozen=True):
    """The coordinator's command: evict this replica now."""

    replication_id: str


class Want(msgspec.Struct, frozen=True):
    """The coordinator's word: a request waits for this replica (`WantReplica`): raise it to ordinary cache."""

    replication_id: str


class ReplicaGone(msgspec.Struct, frozen=True):
    """SGLang evicted this replica's last page (its own eviction, or a cache flush): it holds no budget any more."""

    replication_id: str


class ChunksSent(msgspec.Struct, frozen=True):
    """Source: `num_sent` chunks of `transfer_id` are on the wire (the gatherer may run further ahead)."""

    transfer_id: str
    num_sent: int


class SendCancelled(msgspec.Struct, frozen=True):
    """Source: the transfer ended without landing (refused, stalled): stop gathering it, release its lock."""

    transfer_id: str


ToScheduler = Union[IoStarted, IoDied, Replicate, Install, Promote, Demote, Drop, Want, ReplicaGone, ChunksSent,
                    SendCancelled]
PROGRESS = (ChunksSent, SendCancelled)
"""Progress of running gathers, not commands: applied as they come, they do not count against the scheduler's
per-iteration command budget."""


# ==================================================================================================== mailbox
class Mailbox:
    """Two queues and two pipes between the scheduler thread and the I/O thread. Each side calls only its own
    half (`post_to_io`/`take_for_scheduler` on the scheduler thread, `post_to_scheduler`/`take_for_io` on the I/O
    thread)."""

    def __init__(self) -> None:
        self._to_io: "queue.SimpleQueue[ToIo]" = queue.SimpleQueue()
        self._to_scheduler: "queue.SimpleQueue[ToScheduler]" = queue.SimpleQueue()
        self._bell_r, self._bell_w = os.pipe()  # I/O -> scheduler doorbell
        self._wake_r, self._wake_w = os.pipe()  # scheduler -> I/O wake-up
        for fd in (self._bell_r, self._wake_r, self._bell_w, self._wake_w):
            os.set_blocking(fd, False)  # a full pipe means a wake-up is pending: never block a thread on it

    # ---------------------------------------------------------------------------------------- scheduler side
    @property
    def scheduler_bell_fd(self) -> int:
        """Readable when the I/O side posted something (register it with SGLang's idle poller)."""
        return self._bell_r

    def post_to_io(self, msg: ToIo) -> None:
        self._to_io.put(msg)
        self.wake_io()

    def wake_io(self) -> None:
        """Ring the I/O thread without a message (new KV events to drain)."""
        _ring(self._wake_w)

    def clear_bell(self) -> None:
        _drain(self._bell_r, 4096)

    def take_for_scheduler(self, timeout_s: Optional[float] = None) -> Optional[ToScheduler]:
        """The next message for the scheduler side, or None when there is none (within `timeout_s`, if given)."""
        try:
            if timeout_s is None:
                return self._to_scheduler.get_nowait()
            return self._to_scheduler.get(timeout=timeout_s)
        except queue.Empty:
            return None

    # ----------------------------------------------------------------------------------------------- I/O side
    @property
    def io_wake_fd(self) -> int:
        """Readable when the scheduler side posted something or rang (register it with the I/O poller)."""
        return self._wake_r

    def post_to_scheduler(self, msg: ToScheduler) -> None:
        self._to_scheduler.put(msg)
        self.ring_scheduler()

    def ring_scheduler(self) -> None:
        _ring(self._bell_w)

    def clear_wake(self) -> None:
        _drain(self._wake_r, 65536)

    def take_for_io(self) -> Optional[ToIo]:
        try:
            return self._to_io.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """Close the pipes (both threads are done with the mailbox)."""
        for fd in (self._bell_r, self._wake_r, self._bell_w, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _ring(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except OSError:
        pass  # the pipe is full (a wake-up is pending already) or closed


def _drain(fd: int, num_bytes: int) -> None:
    try:
        os.read(fd, num_bytes)
    except BlockingIOError:
        pass
