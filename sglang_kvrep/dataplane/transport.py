"""The worker-to-worker data plane behind one interface: `Transport` (what the agent's I/O thread needs to move a
transfer's pages), the facts a transport reports and the settings it reads. Implementations are picked by name
in `sglang_kvrep.dataplane.registry` (`--kvrep-transport`); `ZmqTransport` is the default, `NixlTransport` and
`MooncakeTransport` write into the target's registered memory (`sglang_kvrep.dataplane.written`).
Called by `sglang_kvrep.agent.io_side.IoSide` on the I/O thread only; nothing here touches SGLang.

Who decides what: a transport moves and verifies bytes (framing, checksums, staging, the rate cap, stalls); its
owner decides whether a transfer may land at all (`admit`: the coordinator's grant, the local geometry and
replica budget) and what a finished one means (page hashes against the grant, install, facts to the
coordinator).

    owner (IoSide)                      source transport          target transport        owner (IoSide)
    send(header, endpoint)         -->  header ------------------> admit(header) ------->  None | Refusal
    push_chunk(tid, k, buf) x N    -->  chunk k ----------------->  verify, stage
    ChunkSent(tid, n)              <--  (per chunk on the wire)
    TransferSent(header, ...)      <--  end --------------------->  all chunks verified --> TransferReceived(inc)
                                                                    answer(inc, ...)   <--  install, then answer
                                        (reply consumed)       <--  Accepted / Refused
    TransferFailed(role=...)       <--  on either side when a transfer ends without landing: refused, corrupt,
                                        stalled; the target's staging is already freed when it is reported

To add an implementation: write a class with the `Transport` methods whose constructor takes
`(settings, admit, on_event, ctx, poller)`, and `registry.register_transport("name", TheClass)` before the agent
starts (`KvrepConfig.transport` is checked against the registry). A transport whose engine writes into
registered memory extends `WrittenTransport` and supplies the engine's calls (docs/transport.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container, Optional, Protocol, Union, runtime_checkable

import torch
import zmq

from radix_sync import protocol as p
from sglang_kvrep.dataplane.staging import Incoming


# ------------------------------------------------------------------------------------- facts and answers
@dataclass(frozen=True)
class ChunkSent:
    """Source: chunk number `num_sent` of `transfer_id` went to the wire (the gatherer may run further ahead)."""

    transfer_id: str
    num_sent: int


@dataclass(frozen=True)
class TransferSent:
    """Source: every chunk and the end marker left; the target's answer is still to come."""

    header: p.TransferHeader
    gather_s: float
    """Scheduler-thread time spent gathering this transfer's chunks."""
    send_s: float
    """From `send` to the end marker leaving."""


@dataclass(frozen=True)
class TransferReceived:
    """Target: every chunk arrived and passed its checksum. `incoming` (and its staging buffer) is lent to the
    owner until it calls `Transport.answer`, which the owner must do exactly once."""

    incoming: Incoming


@dataclass(frozen=True)
class TransferFailed:
    """Either side: the transfer ended without landing; nothing of it is kept (a target's staging buffer is
    already back in its pool). A source's owner stops gathering it."""

    transfer_id: str
    replication_id: str
    role: str
    """"source" or "target": which side saw it fail."""
    error: str
    tell_coordinator: bool = True
    """False when someone else reports it, or no one should: a target refusing a transfer it could not
    authenticate (a stranger must not fail someone else's replication), a source learning of a refusal the
    target reports itself."""


TransportEvent = Union[ChunkSent, TransferSent, TransferReceived, TransferFailed]


@dataclass(frozen=True)
class Refusal:
    """An owner's answer to `admit`: the transfer may not land. The source is told `error`."""

    error: str
    tell_coordinator: bool = True


Admit = Callable[[p.TransferHeader], Optional[Refusal]]
"""Called once per incoming header before a byte is staged: None admits it."""
OnEvent = Callable[[TransportEvent], None]
"""Receives every fact, synchronously, on the I/O thread (so the owner sees them in wire order)."""


# ------------------------------------------------------------------------------------------- interface
@runtime_checkable
class Transport(Protocol):
    """Moves transfers' pages between worker agents. I/O thread only.

    A peer's fault (garbage, corruption, a wrong token, silence) never raises out of a method: it is answered on
    the wire and reported as `TransferFailed`. Every method returns quickly (no blocking I/O).
    """

    name: str
    endpoint: str
    """This worker's data endpoint, advertised in the Hello; sources pass it to `send`."""

    def send(self, header: p.TransferHeader, endpoint: str, peer_id: str = "") -> None:
        """Start a transfer to the target at `endpoint`, worker `peer_id` (with keys, the transport sends only to
        a peer that proves it holds that worker's allow-listed key). Its chunks follow through `push_chunk`; the
        transfer fails (`TransferFailed(role="source")`) if it makes no progress for `config.transfer_timeout_s`."""

    def push_chunk(self, transfer_id: str, index: int, buffer: torch.Tensor, gather_s: float) -> None:
        """Queue gathered chunk `index` of `transfer_id`: a contiguous CPU tensor (layers, pages of the chunk,
        page bytes) that the transport keeps alive until sent. Chunks leave in the order pushed, under the
        per-link rate cap (`config.send_rate_mbps`). Ignored for a transfer that already ended."""

    def cancel(self, transfer_id: str, error: str) -> None:
        """Source: end an outgoing transfer now (its gather failed): nothing more of it is sent, and it is reported
        as `TransferFailed(role="source", error)`. Ignored for a transfer that already ended (it was reported)."""

    def progress(self, ready: Container) -> float:
        """Do the I/O that is possible now: receive (`ready` is what the owner's poller returned), send, check
        stalls; facts go to `on_event` as they happen. Returns seconds until the next call is due at the latest."""

    def answer(self, incoming: Incoming, *, inserted_len: int = 0, error: Optional[str] = None) -> None:
        """End a `TransferReceived` transfer: tell its source it was accepted (`inserted_len` tokens inserted) or
        refused (`error`), and take its staging buffer back. The owner reports a refusal itself."""

    def close(self) -> None:
        """Close every socket; pending transfers are dropped without answers. The transport is unusable after."""


class TransportSettings(Protocol):
    """What a transport reads of the worker's configuration (`sglang_kvrep.config.KvrepConfig` has it all; the
    interface names it here so that the data plane does not depend on the config module)."""

    data_host: str
    """Address the data-plane socket binds to and advertises."""
    data_port: int
    """Data-plane TCP port; 0 picks a free port."""
    transfer_timeout_s: float
    """A transfer with no progress for this long fails."""
    chunk_bytes: int
    """Payload frame size on the wire."""
    staging_bytes: int
    """Receive buffers kept for reuse between transfers."""
    send_rate_mbps: float
    """Per-link cap on outgoing replication bytes, in MB/s; 0 means no cap."""
    keys: str
    """Key directory (`radix_sync.keys`); "" for none (loopback only)."""
    key_name: str
    """This worker's key pair in `keys`."""
    max_data_msg_bytes: int
    """Largest frame the data port accepts (ZMQ_MAXMSGSIZE)."""
    max_control_msg_bytes: int
    """Largest reply frame a sending socket accepts."""


TransportFactory = Callable[[TransportSettings, Admit, OnEvent, zmq.Context, zmq.Poller], Transport]
"""A transport's constructor: it binds its sockets and registers them with the poller."""
