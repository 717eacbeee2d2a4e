"""The coordinator's admin HTTP API (what the router and the tools send and get back), as msgspec structs.

Both sides use this one module: the coordinator's admin server (`radix_sync.coordinator.admin`) decodes each
request body into its struct and encodes each answer from one; the router's client
(`radix_sync.router.coordinator_link`) encodes its requests and decodes the answers with the same structs. The JSON
is the same as when these were untyped dicts: same field names, same optional fields, same limits. A body that does
not fit its struct is refused with HTTP 400 and msgspec's message, which names the bad field
(``Expected `int` >= 0 - at `$.arrivals[1].input_ids[3]` ``). Checks that involve two fields, or the
coordinator's state (a page size that must match a worker's), stay with the code that does them.

Endpoints (all JSON; errors are `{"error": ...}` with 400, or 404 for an unknown worker or endpoint):

    GET  /health                 -> Health
    GET  /workers                -> [WorkerInfo]
    GET  /replications           -> [ReplicationInfo]
    GET  /status                 -> a JSON object (for people and tests: policy-specific parts vary)
    GET  /metrics                -> Prometheus text
    GET  /directory/lookup?input_ids=1,2,3&cache_salt=s -> LookupAnswer
    POST /directory/lookup       LookupRequest      -> LookupAnswer
    GET  /directory/feed?epoch=E&since=S&wait_s=W   -> DirectoryFeed
    POST /arrivals               DemandBatch        -> DemandRecorded
    POST /hints                  HintRequest        -> HintRecorded
    POST /replicate              ReplicateRequest   -> ReplicationInfo
    POST /replications/wait      ReplicationWaitRequest -> ReplicationInfo
    POST /replicas/drop          DropReplicasRequest -> ReplicasDropped
    POST /demote                 DemoteRequest      -> Demoted
    POST /policy                 PolicyRequest      -> PolicySet
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypeVar, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType, field

T = TypeVar("T")

# NOTE: token ids are hashed as uint32 and travel on to the workers; SGLang's block hashes are signed 64-bit: both
# are bounded here so that nothing out of range gets into the state (the coordinator also checks ids against the
# fleet's vocabulary and lengths against its `max_prompt_tokens`).
MAX_TOKEN_ID = 2 ** 31 - 1
MAX_LIST = 2 ** 21
"""Longest token or page-hash list any body may carry (the coordinator's own `max_prompt_tokens` is lower)."""
MAX_BATCH = 100_000
"""Most reports in one `POST /arrivals`."""
MAX_TTL_S = 7 * 86400.0
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_LIST)]
PageHash = Annotated[int, Meta(ge=-2 ** 63, le=2 ** 63 - 1)]
PageHashes = Annotated[list[PageHash], Meta(max_length=MAX_LIST)]
CacheSalt = Annotated[str, Meta(max_length=1024)]
WorkerName = Annotated[str, Meta(max_length=256)]
SessionId = Annotated[str, Meta(max_length=256)]
ClassKey = Annotated[str, Meta(max_length=128)]
StopReason = Annotated[str, Meta(max_length=64)]
ReportSeq = Union[Annotated[int, Meta(ge=-2 ** 62, le=2 ** 62)], Annotated[float, Meta(ge=-1e18, le=1e18)]]


class AdminError(ValueError):
    """A request the coordinator refuses; the message says why. `status`: the HTTP status (400, 404 for an
    unknown worker or endpoint, 429 over a rate limit or cap)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Body(Struct, frozen=True, omit_defaults=True):
    """A request body: unknown fields are ignored (an older or newer peer), absent optional ones are not sent."""


# ------------------------------------------------------------------------------------------------------ requests
class LookupRequest(_Body):
    """`POST /directory/lookup`: how much of a prompt each worker holds. Either the router's own page hashes of
    it (namespace already in them; `page_size` required) or its token ids (`cache_salt`: the namespace)."""

    page_hashes: Union[PageHashes, UnsetType] = UNSET
    page_size: Union[int, UnsetType] = UNSET
    input_ids: Union[TokenIds, UnsetType] = UNSET
    cache_salt: Optional[CacheSalt] = None


class ArrivalReport(_Body):
    """A request the router sent to `worker`: its prompt as page hashes (+ `page_size`, `prompt_len`) or as
    token ids. `seq` orders it among the router's reports."""

    input_ids: Union[TokenIds, UnsetType] = UNSET
    page_hashes: Union[PageHashes, UnsetType] = UNSET
    page_size: Union[int, UnsetType] = UNSET
    prompt_len: Union[Annotated[int, Meta(ge=0, le=MAX_LIST)], UnsetType] = UNSET
    cache_salt: Optional[CacheSalt] = None
    worker: WorkerName = ""
    session_id: Optional[SessionId] = None
    class_key: Optional[ClassKey] = field(default=None, name="class")
    seq: ReportSeq = 0


class FinishReport(_Body):
    """A response that ended: its prompt (as page hashes + `page_size`, or token ids) and how it ended (`stop`:
    `tool_use`, `stop`, `length`, ...; None: unknown)."""

    input_ids: Union[TokenIds, UnsetType] = UNSET
    page_hashes: Union[PageHashes, UnsetType] = UNSET
    page_size: Union[int, UnsetType] = UNSET
    cache_salt: Optional[CacheSalt] = None
    worker: WorkerName = ""
    stop: Optional[StopReason] = None
    class_key: Optional[ClassKey] = field(default=None, name="class")
    seq: ReportSeq = 0
    ttft_s: Optional[Annotated[float, Meta(ge=0, le=86400)]] = None
    """Time to first token the router measured (from its decision, a pull's wait included): the copy ledger's
    evidence (`radix_sync.policy.ledger`)."""
    alone_new_tokens: Optional[Annotated[int, Meta(ge=0, le=MAX_LIST)]] = None
    """Set (with `alone_cached_tokens` and `ttft_s`) when the request ran alone at its worker (nothing else running
    or queued there when the router sent it): its uncached prompt tokens. The coordinator's speed calibration
    (`radix_sync.policy.speed`) learns the workers' prefill speed from such requests."""
    alone_cached_tokens: Optional[Annotated[int, Meta(ge=0, le=MAX_LIST)]] = None
    """The cached prompt tokens of that request (see `alone_new_tokens`)."""


class DemandBatch(_Body):
    """`POST /arrivals`: a router's batch of reports (either list may be absent, not both)."""

    arrivals: Union[list[ArrivalReport], UnsetType] = UNSET
    finishes: Union[list[FinishReport], UnsetType] = UNSET


class DemandItems(_Body):
    """`POST /arrivals` as the coordinator decodes it: each report is decoded on its own (`item_of`), so one bad
    report is dropped and named, not the batch."""

    arrivals: Union[Annotated[list[msgspec.Raw], Meta(max_length=MAX_BATCH)], UnsetType] = UNSET
    finishes: Union[Annotated[list[msgspec.Raw], Meta(max_length=MAX_BATCH)], UnsetType] = UNSET


MAX_SEND_EVENTS = 4096
"""Most send events in one `POST /sends` batch and in one `GET /sends/feed` answer."""
RouterName = Annotated[str, Meta(min_length=1, max_length=128)]


class SendEvent(_Body):
    """One event of a router's request at a worker, relayed to the other routers in front of the same workers
    (`POST /sends`, `GET /sends/feed`; `radix_sync.coordinator.relay`): `sent` (placed there: `new_tokens` uncached
    and `cached_tokens` cached prompt tokens queued), `started` (its first output came: no longer queued work),
    `done` (it ended, whatever the outcome), `gone` (the coordinator's: `router` stopped polling; its requests are
    forgotten). `rid` numbers the request within its router; `at`: the router's wall clock when it happened (the
    receivers' relay-lag measure)."""

    kind: Literal["sent", "started", "done", "gone"]
    rid: Annotated[int, Meta(ge=0, le=2 ** 62)] = 0
    worker: WorkerName = ""
    new_tokens: Annotated[int, Meta(ge=0, le=MAX_LIST)] = 0
    cached_tokens: Annotated[int, Meta(ge=0, le=MAX_LIST)] = 0
    at: Annotated[float, Meta(ge=0, le=1e11)] = 0.0
    router: Union[RouterName, Literal[""]] = ""
    """Set by the coordinator to the poster's name (what a router posts here is ignored)."""


class SendBatch(_Body):
    """`POST /sends`: a router's events since its last batch, in order."""

    router: RouterName
    events: Annotated[list[SendEvent], Meta(max_length=MAX_SEND_EVENTS)] = []


class HintRequest(_Body):
    """`POST /hints`: `fanout` (k branches will extend this prefix after about `delay_s`), `keepalive` (a
    session's next turn is expected within `ttl_s`) or `end` (no turn extends this prefix again: its live hints
    are dropped and its open session closed). The router sends them for `/kvrep/hints` and for the actions of
    SGLang's `kv_hints` envelope (`radix_sync.kv_hints`)."""

    kind: Literal["fanout", "keepalive", "end"]
    input_ids: TokenIds
    cache_salt: Optional[CacheSalt] = None
    k: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    ttl_s: Annotated[float, Meta(gt=0, le=MAX_TTL_S)] = 60.0
    """Capped to the coordinator's `max_hint_ttl_s`."""
    delay_s: Annotated[float, Meta(ge=0, le=60)] = 0.5
    hint_id: Annotated[str, Meta(max_length=600)] = ""
    """Makes the hint idempotent (per namespace, within the coordinator's hit window): a `kv_hints` action's
    envelope message id and action id, which the router and the worker both see and may both send."""


class ReplicateRequest(_Body):
    """`POST /replicate`: copy the pages of this prefix from `source` to `target` (`ttl_s` absent: the rule
    policy's TTL). `critical`: a copy on a waiting request's path (the router's pull): refused (409) unless the
    coordinator is in active mode, the source holds the whole prefix now and the target's replica budget has room
    for it (`radix_sync.coordinator.pull`)."""

    source: WorkerName
    target: WorkerName
    input_ids: TokenIds
    cache_salt: Optional[CacheSalt] = None
    ttl_s: Union[Annotated[float, Meta(gt=0, le=MAX_TTL_S)], UnsetType] = UNSET
    critical: bool = False


class ReplicationWaitRequest(_Body):
    """`POST /replications/wait`: answer the replication `id` once it is done or failed, or after `wait_s` (long
    poll; the answer's `state` says which)."""

    id: Annotated[str, Meta(min_length=1, max_length=64)]
    wait_s: Annotated[float, Meta(ge=0, le=30)] = 1.0
    want: bool = False
    """A request waits for this copy (a router holds it until the copy lands): a speculative copy's target lands it,
    or raises it if it landed, as ordinary cache (`WantReplica`), as a pull's; an admin's wait leaves it as it is."""


class DropReplicasRequest(_Body):
    """`POST /replicas/drop`: evict the live replicas of `worker` (None: of every worker) now."""

    worker: Optional[WorkerName] = None


class DemoteRequest(_Body):
    """`POST /demote`: the worker's cached chain ending at exactly these tokens becomes evict-first."""

    worker: WorkerName
    input_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_LIST)]
    cache_salt: Optional[CacheSalt] = None


class PolicyRequest(_Body):
    """`POST /policy`: switch policy (and mode; absent: keep it); `reset_demand` forgets the demand seen."""

    policy: Annotated[str, Meta(max_length=64)] = ""
    mode: Union[Annotated[str, Meta(max_length=64)], UnsetType] = UNSET
    reset_demand: bool = False


# ------------------------------------------------------------------------------------------------------- answers
class _Answer(Struct, frozen=True):
    """An answer body: every field is written, None as null."""


class Health(_Answer):
    ok: bool = True


class ErrorAnswer(_Answer):
    error: str


class WorkerLoad(_Answer):
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_tokens: int
    available_tokens: int
    evictable_tokens: int
    replica_tokens: int
    demoted_chains: int = 0
    demoted_evicted_tokens: int = 0
    demotions_taken_back: int = 0


class WorkerInfo(_Answer):
    """One worker of `GET /workers`: its hello and its last load report (None before the first)."""

    id: str
    url: str
    data_endpoint: str
    fingerprint: str
    fingerprint_fields: dict[str, str]
    page_size: int
    pool_capacity_tokens: int
    replica_budget_tokens: int
    load: Optional[WorkerLoad] = None
    plain: bool = False
    """A worker without the plugin (its pages from SGLang's own KV events): routed to, never a copy's end."""


class ReplicationInfo(_Answer):
    """One replication of `GET /replications` (and the answer to `POST /replicate`). `state`: pending, running,
    done or failed; `total_s`: created to finished (None while not finished)."""

    id: str
    source: str
    target: str
    namespace: str
    num_tokens: int
    ttl_s: float
    origin: str
    state: str
    error: Optional[str]
    num_bytes: int = field(name="bytes")
    inserted_len: int = 0
    promoted_tokens: int = 0
    created_s: float = 0.0
    started_s: Optional[float] = None
    finished_s: Optional[float] = None
    total_s: Optional[float] = None
    timings_s: dict[str, float] = {}


class LookupAnswer(_Answer):
    """Tokens of the prompt each worker holds (as owner or replica), per the exact directory."""

    matched: dict[str, int]


class DirectoryFeed(_Answer):
    """`GET /directory/feed`: the holding changes after `since` (`changes`: [op (+1 stored, -1 removed), worker,
    page hash]; `seq`: the last one included, call again while below `head`), or a `snapshot` (worker -> page
    hashes) for a caller of another epoch or too far behind."""

    epoch: str
    seq: int
    head: int
    changes: Union[list[tuple[int, str, int]], UnsetType] = UNSET
    snapshot: Union[dict[str, list[int]], UnsetType] = UNSET
    host_snapshot: Union[dict[str, list[int]], UnsetType] = UNSET
    """With `tiers=1`: worker -> the page hashes its host-memory tier holds (changes then also carry ops +2 / -2,
    host-tier page stored / removed: `radix_sync.host_tier`)."""


class DemandRecorded(_Answer):
    recorded: int
    finishes_recorded: int = 0
    """(Absent from the answers of a coordinator that did not record finishes yet.)"""
    dropped: int = 0
    """Reports dropped as malformed or refused (the others were recorded)."""
    errors: list[str] = []
    """Why, for the first few dropped, each naming its item (`arrivals[3]: ...`)."""


class SendsAccepted(_Answer):
    accepted: int
    routers: int
    """Routers that served requests within the relay's `router_gone_s` (posted, or polled saying so), the poster
    included: a router posts only while there are two or more."""


class SendsFeed(_Answer):
    """`GET /sends/feed?router=R&epoch=E&since=S&wait_s=W&serving=0|1`: the other routers' send events after `since`
    (`routers`: as `SendsAccepted.routers`; `seq`: the
    last one covered, call again while below `head`); `reset`: events were lost to this caller (another epoch: the
    coordinator restarted; or too far behind): what it was told before no longer adds up, forget it."""

    epoch: str
    seq: int
    head: int
    routers: int
    reset: bool = False
    events: list[SendEvent] = []


class HintRecorded(_Answer):
    recorded: int
    kind: str
    prefix_len: int
    ttl_s: Union[float, UnsetType] = UNSET
    """The TTL recorded (the one asked, capped to the coordinator's `max_hint_ttl_s`; absent from older
    coordinators' answers)."""


class ReplicasDropped(_Answer):
    dropped: int


class Demoted(_Answer):
    worker: str
    tokens: int


class PolicySet(_Answer):
    policy: str
    mode: str


# --------------------------------------------------------------------------------------------------------- codec
_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder] = {}


def encode(obj: Any) -> bytes:
    """JSON of a struct (or of plain dicts and lists, as `/status` is)."""
    return _encoder.encode(obj)


def decode(raw: bytes, type_: type[T]) -> T:
    """A request or answer body as `type_`.

    Raises:
        AdminError (400): not JSON, or not of that shape (msgspec's message, naming the field).
    """
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        return dec.decode(raw)
    except msgspec.ValidationError as exc:
        raise AdminError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise AdminError(f"body is not JSON: {exc}") from None


def convert(obj: Any, type_: type[T]) -> T:
    """Like `decode`, from decoded JSON (dicts and lists), e.g. a body the router assembled as a dict."""
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as exc:
        raise AdminError(str(exc)) from None


def item_of(item: Any, type_: type[T]) -> T:
    """One report of a batch as `type_`: from its raw JSON (`msgspec.Raw`), its decoded JSON (a dict) or the
    struct itself. Raises AdminError (400) naming the bad field."""
    if isinstance(item, type_):
        return item
    if isinstance(item, msgspec.Raw):
        return decode(bytes(item), type_)
    return convert(item, type_)


def to_builtins(obj: Any) -> Any:
    """A struct as the dicts and lists its JSON decodes to (field names as on the wire, UNSET fields left out)."""
    return msgspec.to_builtins(obj)


def page_size_of(page_size: Union[int, UnsetType]) -> int:
    """Returns: the `page_size` that must come with a body's `page_hashes`. Raises AdminError when it is absent or
    < 1."""
    if page_size is UNSET or page_size < 1:
        got = None if page_size is UNSET else page_size
        raise AdminError(f"page_size must be an integer >= 1 with page_hashes, got {got!r}")
    return page_size


def namespace_of(cache_salt: Optional[str]) -> str:
    """The namespace a body names (`cache_salt`; absent or null: the default namespace "")."""
    return cache_salt or ""

