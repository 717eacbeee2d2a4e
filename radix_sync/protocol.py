"""The wire protocol between worker agents, the coordinator and peer workers.

Every message is a tagged msgspec Struct encoded as MessagePack (no pickle anywhere). Facts are past tense and
flow worker -> coordinator; commands are imperative and flow coordinator -> worker; data-plane messages flow
worker -> worker. Each worker -> coordinator message carries the sender's sequence number so the coordinator can
detect gaps and ask for a resync.

Who uses it: `sglang_kvrep.agent` (worker side), `radix_sync.coordinator`, `sglang_kvrep.dataplane`.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, omit_defaults=False):
    def describe(self) -> str:
        """A one-line summary for logs (never the payload)."""
        fields = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, (list, tuple)) and len(value) > 4:
                value = f"[{len(value)} items]"
            fields.append(f"{name}={value}")
        return f"{type(self).__name__}({', '.join(fields)})"


# ----------------------------------------------------------------------------------------------------------------
# worker -> coordinator: hello and facts
# ----------------------------------------------------------------------------------------------------------------
class Hello(_Msg, tag="Hello"):
    worker_id: str
    http_url: str
    data_endpoint: str
    fingerprint: str
    fingerprint_fields: dict[str, str]
    page_size: int
    pool_capacity_tokens: int
    replica_budget_tokens: int
    protocol_version: int = PROTOCOL_VERSION
    seq: int = 0


class BlockFact(msgspec.Struct, array_like=True):
    """One stored page: its chained hash, its parent's hash (None at the root) and its token ids."""

    block_hash: int
    parent_hash: Optional[int]
    token_ids: list[int]


class PagesStored(_Msg, tag="PagesStored"):
    worker_id: str
    seq: int
    namespace: str
    blocks: list[BlockFact]
    medium: str = "GPU"


class PagesRemoved(_Msg, tag="PagesRemoved"):
    worker_id: str
    seq: int
    block_hashes: list[int]


class AllPagesCleared(_Msg, tag="AllPagesCleared"):
    worker_id: str
    seq: int


class PrefixHit(_Msg, tag="PrefixHit"):
    """A request matched `matched_len` tokens of its `key_len`-token prompt; `block_hash` names the prefix."""

    worker_id: str
    seq: int
    namespace: str
    block_hash: Optional[int]
    matched_len: int
    key_len: int


class LoadReported(_Msg, tag="LoadReported"):
    worker_id: str
    seq: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_tokens: int
    available_tokens: int
    evictable_tokens: int
    replica_tokens: int
    iteration_s: float = 0.0
    """Recent length of one scheduler iteration while busy (EWMA), s: a command (a gather, a replica's install)
    runs between iterations, so on a busy worker it waits up to this long."""
    demoted_chains: int = 0
    """Chains demoted and still waiting to be evicted first."""
    demoted_evicted_tokens: int = 0
    """Tokens freed from demoted chains so far (cumulative)."""
    demotions_taken_back: int = 0
    """Demoted chains a request used before they were evicted (cumulative)."""


class ReplicaStored(_Msg, tag="ReplicaStored"):
    """Target side: a replica landed. `block_hashes` are root-to-leaf; only `new_block_hashes` were written."""

    worker_id: str
    seq: int
    replication_id: str
    namespace: str
    block_hashes: list[int]
    inserted_len: int
    expires_in_s: float
    num_bytes: int
    receive_s: float
    scatter_s: float
    insert_s: float


class ReplicaPromoted(_Msg, tag="ReplicaPromoted"):
    worker_id: str
    seq: int
    replication_id: str
    num_promoted_tokens: int


class ReplicaExpired(_Msg, tag="ReplicaExpired"):
    worker_id: str
    seq: int
    replication_id: str
    num_evicted_tokens: int


class ReplicaExpected(_Msg, tag="ReplicaExpected"):
    """Target side: ready to accept the transfer the coordinator announced with `ExpectReplica`."""

    worker_id: str
    seq: int
    replication_id: str


class ReplicationFailed(_Msg, tag="ReplicationFailed"):
    """Either side: a replication could not complete. Nothing was written on the target."""

    worker_id: str
    seq: int
    replication_id: str
    role: str  # "source" | "target"
    error: str


class SourceSent(_Msg, tag="SourceSent"):
    worker_id: str
    seq: int
    replication_id: str
    num_tokens: int
    num_bytes: int
    gather_s: float
    send_s: float


# ----------------------------------------------------------------------------------------------------------------
# coordinator -> worker: replies and commands
# ----------------------------------------------------------------------------------------------------------------
class HelloAck(_Msg, tag="HelloAck"):
    coordinator_id: str
    protocol_version: int = PROTOCOL_VERSION


class ResyncRequested(_Msg, tag="ResyncRequested"):
    reason: str


class ExpectReplica(_Msg, tag="ExpectReplica"):
    """To the target, before the source is told anything: the one transfer it may accept for this replication.

    The target refuses any transfer that does not carry `auth_token`, comes from another source, another
    namespace, or token ids whose page hashes are not a prefix of `block_hashes`.
    """

    replication_id: str
    source_id: str
    namespace: str
    page_size: int
    block_hashes: list[int]
    auth_token: str
    expires_in_s: float


class ReplicatePages(_Msg, tag="ReplicatePages"):
    """To the source: send the cached part of `token_ids` (in `namespace`) to the target's data endpoint."""

    replication_id: str
    auth_token: str
    token_ids: list[int]
    namespace: str
    target_id: str
    target_endpoint: str
    target_fingerprint: str
    ttl_s: float


class DropReplica(_Msg, tag="DropReplica"):
    replication_id: str


class DemotePrefix(_Msg, tag="DemotePrefix"):
    """To a worker: its cached copy of `token_ids` (in `namespace`) is stale (a session's next turn went to another
    worker holding all of it); evict that chain before anything else when memory is short."""

    namespace: str
    token_ids: list[int]


class Error(_Msg, tag="Error"):
    error: str
    in_reply_to: str = ""


# ----------------------------------------------------------------------------------------------------------------
# worker -> worker: the data plane (a header, then payload frames, then the end marker)
# ----------------------------------------------------------------------------------------------------------------
class TransferHeader(_Msg, tag="TransferHeader"):
    """Everything a target checks before it buffers a single byte.

    The payload is `num_pages` pages in FlashInfer's paged layout, `buffer_shape` = (layers, pages, *page shape),
    sent as `num_chunks` chunks of `pages_per_chunk` pages (the last may be shorter); each chunk is itself laid
    out (layers, pages in the chunk, *page shape), so the source can send a chunk while it gathers the next.
    """

    transfer_id: str
    replication_id: str
    auth_token: str
    source_id: str
    fingerprint: str
    namespace: str
    token_ids: list[int]
    page_size: int
    num_pages: int
    dtype: str
    layout: str
    buffer_shape: list[int]
    num_bytes: int
    pages_per_chunk: int
    num_chunks: int
    checksum_kind: str
    ttl_s: float


class TransferChunk(_Msg, tag="TransferChunk"):
    """Followed by one raw payload frame: pages [first_page, first_page + num_pages) of every layer."""

    transfer_id: str
    index: int
    first_page: int
    num_pages: int
    num_bytes: int
    checksum: int


class TransferEnd(_Msg, tag="TransferEnd"):
    transfer_id: str


class TransferAccepted(_Msg, tag="TransferAccepted"):
    transfer_id: str
    inserted_len: int


class TransferRefused(_Msg, tag="TransferRefused"):
    transfer_id: str
    error: str


WorkerToCoordinator = Union[
    Hello, PagesStored, PagesRemoved, AllPagesCleared, PrefixHit, LoadReported, ReplicaStored, ReplicaPromoted,
    ReplicaExpired, ReplicaExpected, ReplicationFailed, SourceSent,
]
CoordinatorToWorker = Union[HelloAck, ResyncRequested, ExpectReplica, ReplicatePages, DropReplica, DemotePrefix,
                            Error]
DataPlane = Union[TransferHeader, TransferChunk, TransferEnd, TransferAccepted, TransferRefused]

_encoder = msgspec.msgpack.Encoder()
_to_coordinator = msgspec.msgpack.Decoder(WorkerToCoordinator)
_to_worker = msgspec.msgpack.Decoder(CoordinatorToWorker)
_data_plane = msgspec.msgpack.Decoder(DataPlane)


class ProtocolError(ValueError):
    """A message that is not valid MessagePack or not one of the expected tagged structs."""


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes | memoryview, direction: str):
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {direction} message: {exc}") from None


def decode_for_coordinator(data: bytes | memoryview) -> WorkerToCoordinator:
    return _decode(_to_coordinator, data, "worker->coordinator")


def decode_for_worker(data: bytes | memoryview) -> CoordinatorToWorker:
    return _decode(_to_worker, data, "coordinator->worker")


def decode_data_plane(data: bytes | memoryview) -> DataPlane:
    return _decode(_data_plane, data, "data-plane")
