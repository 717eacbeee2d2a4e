"""The wire protocol between worker agents, the coordinator and peer workers.

Every message is a tagged msgspec Struct encoded as MessagePack (no pickle anywhere). Facts are past tense and
flow worker -> coordinator; commands are imperative and flow coordinator -> worker; data-plane messages flow
worker -> worker. Each worker -> coordinator message carries the sender's sequence number so the coordinator can
detect gaps and ask for a resync.

Who uses it: `sglang_kvrep.agent` (worker side), `radix_sync.coordinator`, `sglang_kvrep.dataplane`.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

import msgspec
from msgspec import Meta

PROTOCOL_VERSION = 1

# ----------------------------------------------------------------------------------------------------------------
# bounds: every field a peer sends is range-checked by the decoder, so nothing out of range reaches the state
# ----------------------------------------------------------------------------------------------------------------
MAX_TOKEN_ID = 2 ** 31 - 1
"""Token ids are < 2**31 on every input (SGLang packs them as uint32 into page hashes; no vocabulary is larger).
The coordinator further refuses ids >= the fleet's `vocab_size` when the workers report it."""
MAX_PAGE_SIZE = 4096
MAX_PAGES_PER_MESSAGE = 16_384
"""Pages in one `PagesStored` / `PagesRemoved` (the agent sends at most 4,096 per message)."""
MAX_PREFIX_TOKENS = 2 ** 21
"""Tokens of one prefix on the wire (a command's or a transfer's token ids), and pages of one replica."""
MAX_TIMING_S = 3600.0
"""A reported duration (gather, send, receive, scatter, insert, iteration) outside [0, this] is refused: one
inf/NaN sample would poison the transfer cost model for good."""
MAX_TTL_S = 7 * 86400.0

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_PREFIX_TOKENS)]
PageHash = Annotated[int, Meta(ge=-2 ** 63, le=2 ** 63 - 1)]
PrefixHashes = Annotated[list[PageHash], Meta(max_length=MAX_PREFIX_TOKENS)]
Count = Annotated[int, Meta(ge=0, le=2 ** 62)]
Seq = Annotated[int, Meta(ge=0, le=2 ** 62)]
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_TIMING_S)]
Ttl = Annotated[float, Meta(ge=-MAX_TTL_S, le=MAX_TTL_S)]
"""A time to live; <= 0 (expired) decodes so that the coordinator can refuse it by name."""
WorkerId = Annotated[str, Meta(max_length=256)]
Namespace = Annotated[str, Meta(max_length=1024)]
ReplicationId = Annotated[str, Meta(max_length=128)]
Text = Annotated[str, Meta(max_length=4096)]
Url = Annotated[str, Meta(max_length=1024)]


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
    worker_id: WorkerId
    http_url: Url
    data_endpoint: Url
    fingerprint: Annotated[str, Meta(max_length=256)]
    fingerprint_fields: Annotated[dict[Annotated[str, Meta(max_length=128)], Text], Meta(max_length=128)]
    page_size: Annotated[int, Meta(ge=1, le=MAX_PAGE_SIZE)]
    pool_capacity_tokens: Count
    replica_budget_tokens: Count
    protocol_version: int = PROTOCOL_VERSION
    seq: Seq = 0
    vocab_size: Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID + 1)] = 0
    """The model's vocabulary size (0: not known): the coordinator refuses token ids >= it."""


class BlockFact(msgspec.Struct, array_like=True):
    """One stored page: its chained hash, its parent's hash (None at the root) and its token ids."""

    block_hash: PageHash
    parent_hash: Optional[PageHash]
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PAGE_SIZE)]


class PagesStored(_Msg, tag="PagesStored"):
    """Pages a worker stored, each with its token ids: the coordinator recomputes every page hash from them (and
    its parent's) and records no page it cannot verify."""

    worker_id: WorkerId
    seq: Seq
    namespace: Namespace
    blocks: Annotated[list[BlockFact], Meta(max_length=MAX_PAGES_PER_MESSAGE)]
    medium: Annotated[str, Meta(max_length=32)] = "GPU"


class PagesRemoved(_Msg, tag="PagesRemoved"):
    worker_id: WorkerId
    seq: Seq
    block_hashes: Annotated[list[PageHash], Meta(max_length=MAX_PAGES_PER_MESSAGE)]
    medium: Annotated[str, Meta(max_length=32)] = "GPU"
    """`GPU` (the device pool) or `CPU_PINNED` (the host-memory tier, `radix_sync.host_tier`), as `PagesStored`."""


class AllPagesCleared(_Msg, tag="AllPagesCleared"):
    worker_id: WorkerId
    seq: Seq


class PrefixHit(_Msg, tag="PrefixHit"):
    """A request matched `matched_len` tokens of its `key_len`-token prompt; `block_hash` names the prefix."""

    worker_id: WorkerId
    seq: Seq
    namespace: Namespace
    block_hash: Optional[PageHash]
    matched_len: Count
    key_len: Count


class LoadReported(_Msg, tag="LoadReported"):
    worker_id: WorkerId
    seq: Seq
    num_running_reqs: Count
    num_waiting_reqs: Count
    num_waiting_tokens: Count
    """Prompt tokens of the waiting requests this worker's tree does not hold (what their prefills compute; the
    policies' `waiting_new_tokens`), not their whole prompts."""
    available_tokens: Count
    evictable_tokens: Count
    replica_tokens: Count
    iteration_s: Seconds = 0.0
    """Recent length of one scheduler iteration while busy (EWMA), s: a command (a gather, a replica's install)
    runs between iterations, so on a busy worker it waits up to this long."""
    age_s: Seconds = 0.0
    """How long before it was sent the agent took this report, s: 0, or a heartbeat's repeat of the last one. The
    agent reports between scheduler iterations, so through a long prefill the last report (taken before it began,
    the prefill's request still waiting) stands: the coordinator takes the work it shows as done for its age."""
    demoted_chains: Count = 0
    """Chains demoted and still waiting to be evicted first."""
    demoted_tokens: Count = 0
    """Tokens of those chains (evicted before any replica or ordinary page: the planner's gate counts them as
    room a landing copy takes first)."""
    demoted_evicted_tokens: Count = 0
    """Tokens freed from demoted chains so far (cumulative)."""
    demotions_taken_back: Count = 0
    """Demoted chains a request used before they were evicted (cumulative)."""


class ReplicaStored(_Msg, tag="ReplicaStored"):
    """Target side: a replica landed. `block_hashes` are root-to-leaf; only `new_block_hashes` were written."""

    worker_id: WorkerId
    seq: Seq
    replication_id: ReplicationId
    namespace: Namespace
    block_hashes: PrefixHashes
    inserted_len: Count
    expires_in_s: Ttl
    """Time the replica has left when this is sent (a resync re-reports it with what is left, <= 0: expired)."""
    num_bytes: Count
    receive_s: Seconds
    scatter_s: Seconds
    insert_s: Seconds


class ReplicaPromoted(_Msg, tag="ReplicaPromoted"):
    worker_id: WorkerId
    seq: Seq
    replication_id: ReplicationId
    num_promoted_tokens: Count


class ReplicaExpired(_Msg, tag="ReplicaExpired"):
    worker_id: WorkerId
    seq: Seq
    replication_id: ReplicationId
    num_evicted_tokens: Count


class HintReported(_Msg, tag="HintReported"):
    """A request reached this worker with one of kvrep's actions in SGLang's `kv_hints` envelope
    (`radix_sync.kv_hints`): the hint, on the request's prompt, as `/kvrep/hints` takes it. `hint_id` (the
    envelope's message id and the action's id) makes it idempotent: the router that forwarded the request may have
    sent the same hint already."""

    worker_id: WorkerId
    seq: Seq
    namespace: Namespace
    token_ids: TokenIds
    kind: Literal["fanout", "keepalive", "end"]
    k: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    ttl_s: Annotated[float, Meta(gt=0, le=MAX_TTL_S)] = 60.0
    delay_s: Annotated[float, Meta(ge=0, le=60)] = 0.5
    hint_id: Annotated[str, Meta(max_length=600)] = ""


class ReplicaExpected(_Msg, tag="ReplicaExpected"):
    """Target side: ready to accept the transfer the coordinator announced with `ExpectReplica`."""

    worker_id: WorkerId
    seq: Seq
    replication_id: ReplicationId


class ReplicationFailed(_Msg, tag="ReplicationFailed"):
    """Either side: a replication could not complete. Nothing was written on the target."""

    worker_id: WorkerId
    seq: Seq
    replication_id: ReplicationId
    role: Literal["source", "target"]
    error: Text


class SourceSent(_Msg, tag="SourceSent"):
    worker_id: WorkerId
    seq: Seq
    replication_id: ReplicationId
    num_tokens: Count
    num_bytes: Count
    gather_s: Seconds
    send_s: Seconds


# ----------------------------------------------------------------------------------------------------------------
# coordinator -> worker: replies and commands
# ----------------------------------------------------------------------------------------------------------------
class HelloAck(_Msg, tag="HelloAck"):
    coordinator_id: Annotated[str, Meta(max_length=128)]
    protocol_version: int = PROTOCOL_VERSION


class ResyncRequested(_Msg, tag="ResyncRequested"):
    reason: Text


class ExpectReplica(_Msg, tag="ExpectReplica"):
    """To the target, before the source is told anything: the one transfer it may accept for this replication.

    The target refuses any transfer that does not carry `auth_token`, comes from another source, another
    namespace, or token ids whose page hashes are not a prefix of `block_hashes`.
    """

    replication_id: ReplicationId
    source_id: WorkerId
    namespace: Namespace
    page_size: Annotated[int, Meta(ge=1, le=MAX_PAGE_SIZE)]
    block_hashes: PrefixHashes
    auth_token: Annotated[str, Meta(max_length=128)]
    expires_in_s: Ttl
    critical: bool = False
    """A router's pull: a request waits for this copy. The target inserts it as ordinary cache (SGLang's LRU, as
    the prompt it stands for), not below all of it as a speculative replica: on a full pool a replica is the next
    allocation's first victim, and a pulled prefix was evicted before the request it was pulled for was admitted
    (docs/bench.md, "Fan-out after two fixes")."""
    ordinary: bool = False
    """A planner's copy that the coordinator's policy lands as ordinary cache (`kvrep_lru`), as a pull: LRU order
    from its landing, dropped at its TTL unless a request used it."""


class ReplicatePages(_Msg, tag="ReplicatePages"):
    """To the source: send the cached part of `token_ids` (in `namespace`) to the target's data endpoint."""

    replication_id: ReplicationId
    auth_token: Annotated[str, Meta(max_length=128)]
    token_ids: TokenIds
    namespace: Namespace
    target_id: WorkerId
    target_endpoint: Url
    target_fingerprint: Annotated[str, Meta(max_length=256)]
    ttl_s: Ttl


class DropReplica(_Msg, tag="DropReplica"):
    replication_id: ReplicationId


class WantReplica(_Msg, tag="WantReplica"):
    """To a copy's target: a request waits for this copy (a router holds it until the copy lands, or a pull joined
    it). The target lands it as ordinary cache, as a pull (`ExpectReplica.critical`), or raises it to that if it
    landed: evict-first, the next allocation there takes it before the request is admitted (stop 52: a held
    request's 3,056-token copy was evicted in the second it landed, and the request recomputed it all)."""

    replication_id: ReplicationId


class DemotePrefix(_Msg, tag="DemotePrefix"):
    """To a worker: its cached copy of `token_ids` (in `namespace`) is stale (a session's next turn went to another
    worker holding all of it); evict that chain before anything else when memory is short."""

    namespace: Namespace
    token_ids: TokenIds


class Error(_Msg, tag="Error"):
    error: Text
    in_reply_to: Annotated[str, Meta(max_length=64)] = ""


# ----------------------------------------------------------------------------------------------------------------
# worker -> worker: the data plane (a header, then payload frames, then the end marker)
# ----------------------------------------------------------------------------------------------------------------
class TransferHeader(_Msg, tag="TransferHeader"):
    """Everything a target checks before it buffers a single byte.

    The payload is `num_pages` pages in FlashInfer's paged layout, `buffer_shape` = (layers, pages, *page shape),
    sent as `num_chunks` chunks of `pages_per_chunk` pages (the last may be shorter); each chunk is itself laid
    out (layers, pages in the chunk, *page shape), so the source can send a chunk while it gathers the next.
    """

    transfer_id: Annotated[str, Meta(max_length=128)]
    replication_id: ReplicationId
    auth_token: Annotated[str, Meta(max_length=128)]
    source_id: WorkerId
    fingerprint: Annotated[str, Meta(max_length=256)]
    namespace: Namespace
    token_ids: TokenIds
    page_size: Annotated[int, Meta(ge=1, le=MAX_PAGE_SIZE)]
    num_pages: Count
    dtype: Annotated[str, Meta(max_length=64)]
    layout: Annotated[str, Meta(max_length=64)]
    buffer_shape: Annotated[list[Count], Meta(max_length=16)]
    num_bytes: Count
    pages_per_chunk: Count
    num_chunks: Count
    checksum_kind: Annotated[str, Meta(max_length=64)]
    ttl_s: Ttl
    transport: Annotated[str, Meta(max_length=32)] = "zmq"
    """How the chunks' payload moves: "zmq" (a payload frame after each `TransferChunk`) or a registered-memory
    transport ("nixl", "mooncake": the source writes each chunk into the target's staging buffer, whose address the
    target gives in `TransferReady`, and then sends its `TransferChunk` alone). A target refuses a transport it does not
    run."""


class TransferChunk(_Msg, tag="TransferChunk"):
    """Followed by one raw payload frame: pages [first_page, first_page + num_pages) of every layer. With a
    registered-memory transport, alone: the pages are already in the target's staging buffer (the source sends it
    once its write completed), and the checksum is taken there."""

    transfer_id: Annotated[str, Meta(max_length=128)]
    index: Count
    first_page: Count
    num_pages: Count
    num_bytes: Count
    checksum: int


class TransferEnd(_Msg, tag="TransferEnd"):
    transfer_id: Annotated[str, Meta(max_length=128)]


class TransferReady(_Msg, tag="TransferReady"):
    """Target -> source, registered-memory transports only: the transfer is admitted and its staging buffer is
    registered; write chunk k's pages of layer l at `address` + (l * pages + first page of k) * page bytes."""

    transfer_id: Annotated[str, Meta(max_length=128)]
    agent_name: Annotated[str, Meta(max_length=128)]
    agent_metadata: Annotated[bytes, Meta(max_length=1 << 20)]
    """The target's transport endpoint description (NIXL: `get_agent_metadata()`, with its registered memory;
    Mooncake: empty, the engines exchange descriptors in their own handshake; `agent_name` is its session)."""
    address: Annotated[int, Meta(ge=0, le=2 ** 63 - 1)]
    num_bytes: Count


class TransferAccepted(_Msg, tag="TransferAccepted"):
    transfer_id: Annotated[str, Meta(max_length=128)]
    inserted_len: Count


class TransferRefused(_Msg, tag="TransferRefused"):
    transfer_id: Annotated[str, Meta(max_length=128)]
    error: Text


WorkerToCoordinator = Union[
    Hello, PagesStored, PagesRemoved, AllPagesCleared, PrefixHit, LoadReported, ReplicaStored, ReplicaPromoted,
    ReplicaExpired, ReplicaExpected, ReplicationFailed, SourceSent, HintReported,
]
CoordinatorToWorker = Union[HelloAck, ResyncRequested, ExpectReplica, ReplicatePages, DropReplica, WantReplica,
                            DemotePrefix, Error]
DataPlane = Union[TransferHeader, TransferChunk, TransferEnd, TransferReady, TransferAccepted, TransferRefused]

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
