"""The snapshot a policy consumes and the decisions it returns.

Everything here is a frozen value. The live coordinator builds a `ClusterSnapshot` from its directory and load
reports; the simulator (`radix_sync.sim.engine`) builds the same structures from its model. Policies never see
either side's internals. Lengths are tokens, times are seconds on the caller's clock (the policy never reads a
clock itself), sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Optional, Sequence

OWNER = "owner"
REPLICA = "replica"


class WorkerView(NamedTuple):
    """One worker's load and capacity, as last reported.

    NOTE: a NamedTuple, not a frozen dataclass like the other views: the simulator builds one per worker for every
    arrival, and a frozen dataclass's `__init__` (one `object.__setattr__` per field) made that ~20% of a kvrep run;
    a NamedTuple is as immutable and ten times cheaper to build."""

    worker_id: int
    """Dense worker index, 0..N-1."""
    fingerprint: str = ""
    """Compatibility fingerprint; copies only go between workers with equal fingerprints."""
    num_running: int = 0
    """Requests in decode (or admitted and prefilling)."""
    num_waiting: int = 0
    """Requests queued for prefill."""
    waiting_new_tokens: int = 0
    """Uncached prompt tokens still to prefill for the queued and prefilling requests."""
    waiting_cached_tokens: int = 0
    """Cached (prefix-hit) prompt tokens of the queued requests."""
    waiting_attn_pairs: float = 0.0
    """Attention work still to do for the queued requests: sum of new*cached + new*(new+1)/2 (token pairs)."""
    running_ctx_tokens: int = 0
    """Sum of context lengths (tokens) of the running requests: the decode load."""
    busy_until_s: float = 0.0
    """When the iteration in progress ends (<= now when idle)."""
    free_tokens: int = 0
    """KV tokens free without evicting anything."""
    replica_budget_tokens: int = 0
    """KV tokens this worker may still accept as replicas."""
    egress_busy_until_s: float = 0.0
    """When the worker's outgoing link finishes the transfers already queued on it."""
    ingress_busy_until_s: float = 0.0
    """When the worker's incoming link finishes the transfers already queued on it."""
    nic_bandwidth_bytes_per_s: float = 0.0
    """Usable bandwidth of the worker's link, bytes/s (0: no copies possible)."""
    waiting_cached_pairs: float = 0.0
    """Sum of cached*(cached+1)/2 over the queued requests: the work a backend that recomputes attention over the
    cached prefix (`CostProfile.prefill_s_per_cached_pair`) still has to do (0 where the caller does not track it)."""
    replica_tokens: int = -1
    """KV tokens the worker holds as replicas (copied in, not yet hit), which its eviction takes before any ordinary
    page; -1: not reported (then the planner does not check what a copy would displace)."""
    demoted_tokens: int = 0
    """KV tokens of demoted chains that the eviction takes before the replicas; 0 where not reported. Only pages with
    nothing live below them: a demoted chain that a later prefill extended (a page on top of it that is not demoted)
    goes only after that page, as ordinary cache, and is no evict-first room (the simulator:
    `PageTree.num_evict_first_stale_pages`; it counted every demoted page before issue 16 round 5, and the gate saw
    room where a landing copy evicts wanted replicas)."""
    # ---- the planner's gate (`radix_sync.policy.gate`); control-plane knowledge, 0 where not known ----
    egress_pending_bytes: int = 0
    """Bytes of copies already decided out of this worker that are not booked on its link yet (a chained copy
    whose source gets the pages later): they will queue on its egress (`egress_busy_until_s` counts booked ones)."""
    ingress_pending_bytes: int = 0
    """The same for copies into this worker (its ingress)."""
    incoming_tokens: int = 0
    """KV tokens of every copy to this worker not landed yet (booked or pending, speculative or on a request's
    path): memory they take when they land, before a new copy does."""
    waited_evict_first_tokens: int = 0
    """KV tokens of evict-first pages (replicas, demoted chains) on this worker that requests routed to it and not
    yet admitted will use (the router knows its own sends): a copy landing must not evict them."""
    egress_pull_rate_per_s: float = 0.0
    """Copies on a request's critical path (pulls) leaving this worker's link per second, recently: the requests a
    speculative copy on its egress delays."""
    ingress_pull_rate_per_s: float = 0.0
    """The same for pulls into this worker."""


class LoadsReport(NamedTuple):
    """What SGLang's `GET /v1/loads` reports of one worker (`load_inquirer.py::get_loads`, sglang 0.5.23): the fields
    a router that polls it reads (smg 1.13's load monitor, `radix_sync.policy.baselines.smg`)."""

    num_running: int = 0
    """`num_running_reqs`: requests in the running (decode) batch."""
    num_waiting: int = 0
    """`num_waiting_reqs`: requests in the waiting queue."""
    waiting_uncached_tokens: int = 0
    """`num_waiting_uncached_tokens`: prompt tokens the queued (and the chunked) requests still have to prefill."""
    token_usage: float = 0.0
    """`token_usage`: KV tokens held by requests (not evictable cache) / the pool's capacity."""
    gen_throughput: float = 0.0
    """`gen_throughput`: decode tokens/s over the last `decode_log_interval` (40) decode steps, wall time since the
    previous such window; 0 once no window ended for 30 s (`metrics_reporter.py`)."""


@dataclass(frozen=True, slots=True)
class HolderView:
    """A worker holding (or receiving) the first `depth_len` tokens of a prefix."""

    worker_id: int
    role: str = OWNER
    """`owner` (ordinary cache) or `replica` (copied in, evicted first, expires)."""
    depth_len: int = 0
    """Tokens of the prefix held (page-aligned)."""
    expires_at_s: Optional[float] = None
    """Replica expiry time; None for owners."""
    eta_s: Optional[float] = None
    """Arrival time of a copy still in flight; None once it has landed."""


@dataclass(frozen=True, slots=True)
class PrefixView:
    """A prefix node the coordinator tracks: the whole prompt of a finished request, or a shared trunk."""

    node_id: int
    """The node's id: the page hash of its deepest page (chained hashes name a whole prefix)."""
    token_len: int
    """Length of the prefix, tokens (page-aligned)."""
    namespace: int = 0
    """Tenant namespace; part of every key."""
    class_key: str = ""
    """Tenant/workload class used to learn gap distributions."""
    holders: tuple[HolderView, ...] = ()
    """Workers holding part or all of the prefix, including copies in flight."""
    recent_hit_times_s: tuple[float, ...] = ()
    """Times of recent requests that hit this prefix (oldest first)."""
    last_finish_s: Optional[float] = None
    """When the last request whose prompt is this prefix finished (session continuation signal)."""
    last_stop: Optional[str] = None
    """How that response ended: `tool_use`, `end_turn`, ... (None if unknown)."""
    expected_new_len: int = 0
    """Tokens a follow-up request is expected to add after the prefix (0: unknown)."""
    fanout_hint: int = 0
    """Explicit hint: this many branches will be requested over the prefix (0: no hint)."""
    hint_at_s: Optional[float] = None
    """Expected time of the hinted requests (None: as soon as possible)."""
    keepalive_until_s: Optional[float] = None
    """Explicit hint: keep the prefix reachable until then (a tool call in progress)."""


@dataclass(frozen=True, slots=True)
class LinkView:
    """An explicit per-pair link estimate, overriding the two workers' NIC figures."""

    src: int
    dst: int
    bandwidth_bytes_per_s: float
    busy_until_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """What a planner sees at one tick."""

    workers: tuple[WorkerView, ...]
    prefixes: tuple[PrefixView, ...] = ()
    links: tuple[LinkView, ...] = ()
    page_len: int = 1
    """Tokens per page; replica depths are multiples of it."""
    kv_bytes_per_token: int = 0
    """KV cache bytes per token across all layers (and all tensor-parallel ranks)."""
    carried: Mapping[int, int] = field(default_factory=dict)
    """Prefixes (node ids) earlier passes left unscored, their scoring budget spent (`KvrepPlanner.deferred`),
    with how many passes in a row each has waited: this pass scores the longest waiting first (read-only)."""
    worker_keys: tuple = ()
    """What the planner's `UseCalibration` knows each worker by, by index (live: its worker id, stable across
    ticks; empty: the index itself, as the simulator records it)."""


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a router sees of one arriving request."""

    request_id: int
    prompt_len: int
    output_len: int = 0
    """Requested output tokens (a hint; routers may ignore it)."""
    namespace: int = 0
    page_hashes: Sequence[int] = field(default=())
    """Chained page hashes of the prompt's full pages (read-only)."""
    cached_len: tuple[int, ...] = ()
    """Per worker, tokens of the prompt that worker holds now (exact directory match); empty if not computed."""
    inflight: tuple[HolderView, ...] = ()
    """Copies in flight that cover a prefix of this prompt, with their arrival time."""
    class_key: str = ""
    host_len: tuple[int, ...] = ()
    """Per worker, tokens of the prompt past `cached_len` that the worker's host-memory tier holds (SGLang's
    hierarchical cache loads them back before the prefill); empty when no worker has one."""


@dataclass(frozen=True, slots=True)
class Replicate:
    """Command: copy the first `depth_len` tokens of prefix `node_id` from `source` to `target`."""

    node_id: int
    source: int
    target: int
    depth_len: int
    ttl_s: float
    """The replica expires this long after it lands unless a real hit promotes it."""
    gain_s: float = 0.0
    """Expected TTFT seconds saved, net of costs (for logs and shadow accounting)."""
    kind: str = ""
    """The demand it was planned for (`Demand.source`: `session`, `hint`, `popularity`)."""
    expected_count: float = 0.0
    """The requests that demand predicted, before calibration (`radix_sync.policy.calibration`)."""
    tier: str = "device"
    """Where the copy lands on the target: `device` (its KV pool, evict-first) or `host` (its host-memory tier,
    SGLang's hierarchical cache, loaded back by SGLang on a hit; only when the planner was given the tier's load
    rate, `KvrepPlanner.host_load_bytes_per_s`: the simulator's host tiers; never live yet)."""


@dataclass(frozen=True, slots=True)
class Route:
    """Decision: serve the request on `worker_id`, optionally pulling a prefix first (copy on the critical path)."""

    worker_id: int
    pull_from: Optional[int] = None
    """Worker to copy the prefix from before prefill (None: no copy)."""
    pull_len: int = 0
    """Tokens of the prompt to copy from `pull_from`."""
    wait_inflight: bool = False
    """Hold the request until a copy in flight to `worker_id` has landed."""
    expected_ttft_s: float = 0.0
    """The router's estimate, for logs."""
    pull_eta_s: Optional[float] = None
    """When the pulled prefix is expected to have landed (with `pull_from`; None where the router does not say)."""
