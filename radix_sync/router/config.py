"""The router's configuration (built by `kvrep router` from its flags)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from radix_sync.policy.pull import PullConfig
from radix_sync.router.policy import RouterCosts

MAX_TOKEN_ID = 2**31 - 1
"""The largest token id accepted when no vocabulary size is known (SGLang keeps ids in int32/int64 tensors)."""


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """HTTP port (0: any free port; the chosen one is printed)."""
    coordinator_url: Optional[str] = None
    """Coordinator admin API, e.g. http://127.0.0.1:5680 (None: route from the router's own view only)."""
    worker_urls: tuple[str, ...] = ()
    """Static workers, in addition to those the coordinator knows (needed when it is down at start)."""
    tenants_path: Optional[str] = None
    """JSON or TOML tenants file (None: no auth, everyone in the default namespace)."""
    tokenizer: Optional[str] = None
    """Model directory or hub id of the workers' tokenizer; `auto`: ask a worker's /model_info; None: none
    (text prompts are then routed by load only)."""
    page_size: int = 16
    """Page size used to hash prompts for the router's own view when no worker has reported one."""
    costs: RouterCosts = field(default_factory=RouterCosts)
    profile: Optional[str] = None
    """A cost profile (name or JSON path, as the coordinator's `--profile`): when set, the TTFT rule uses it
    instead of `costs` (prefill with its cached-context term, KV bytes per token, link bandwidth)."""
    connect_timeout_s: float = 2.0
    """Connecting to a worker; past it the next choice is tried."""
    read_timeout_s: float = 600.0
    """Longest silence from a worker while it answers (between stream chunks), s."""
    max_connections_per_worker: int = 256
    """Connection pool bound per worker; requests beyond it wait for a free connection."""
    worker_keepalive_s: float = 4.0
    """An idle connection to a worker is closed after this, s: below the workers' own keep-alive (SGLang serves
    with uvicorn, keep-alive `SGLANG_TIMEOUT_KEEP_ALIVE` = 5 s, `sglang/srt/environ.py`), so the router does not
    write into a connection the worker is closing (aiohttp keeps one 15 s by default)."""
    worker_cooldown_s: float = 5.0
    """A worker that refused a connection is tried last for this long."""
    max_wait_inflight_s: float = 2.0
    """Longest a request is held for a replica in flight to its chosen worker, s."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM/SIGINT, in-flight requests get this long to finish."""
    coordinator_timeout_s: float = 0.5
    directory_feed: bool = True
    """Mirror the coordinator's directory from its change feed and match prompts locally (False: one lookup
    call to the coordinator per request)."""
    # ------------------------------------------------------------------------------------- credentials
    state_dir: str = "~/.local/state/kvrep/router"
    """Where the router creates the files it was not given (`router-tokens.json`, `tenant-secret`), 0600."""
    admin_tokens_path: Optional[str] = None
    """`{"read", "write"}` bearer tokens of the admin routes (`radix_sync.keys`); None: `<state_dir>/router-tokens.json`,
    created when absent (its path is logged)."""
    tenant_secret_path: Optional[str] = None
    """The cluster's tenant secret (hex): namespaces are HMAC-SHA256(secret, tenant); every router of a cluster
    reads the same file. None: `<state_dir>/tenant-secret`, created when absent. Read only with a tenants file."""
    worker_api_key_path: Optional[str] = None
    """The workers' SGLang `--api-key` (hex file): sent as `Authorization: Bearer` on every call to a worker
    (None: no key sent)."""
    coordinator_tokens_path: Optional[str] = None
    """The coordinator's `admin-tokens.json`: its "write" token goes on every call to it (None: none sent)."""
    # ------------------------------------------------------------------------------------------ bounds
    vocab_size: Optional[int] = None
    """Token ids must be in [0, vocab_size); None: the tokenizer's (its model config's `vocab_size`, else its
    length); with neither, ids are only checked to be in [0, 2^31)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body (aiohttp `client_max_size`; larger: 413)."""
    max_prompt_tokens: int = 262_144
    """Longest prompt in token ids (longer: 413), checked before any worker sees it."""
    max_prompt_chars: int = 2 * 1024 * 1024
    """Longest prompt text (all of a chat's message contents together) before tokenizing (longer: 413)."""
    max_batch_prompts: int = 256
    """Most prompts in one batched request (more: 413)."""
    max_messages: int = 4096
    """Most messages in one chat request (more: 413)."""
    tokenize_threads: int = 2
    """Threads that tokenize text prompts (off the event loop)."""
    hints_per_s: float = 20.0
    """Per-tenant hint rate (token bucket refill, hints/s; over it: 429)."""
    hints_burst: int = 40
    """Per-tenant hint bucket size."""
    pull: bool = False
    """Copy a prompt's missing prefix from its best holder on the request's path when that gives the lowest expected
    TTFT (the coordinator does the copy; the request waits for it, bounded by `pull_policy`, then falls back)."""
    pull_policy: PullConfig = field(default_factory=PullConfig)
    """A pull's deadline bounds and replica TTL."""
    speed_calibration: bool = True
    """Learn the workers' prefill speed from the requests that ran alone (`radix_sync.policy.speed`): the TTFT rule's
    prefill terms scaled by it, and each such request reported to the coordinator with its finish (its planner's
    scale). False: the profile's times as they are."""
    tie_turns: bool = True
    """Full ties (equal expected TTFT and load) take turns over the workers
    (`radix_sync.policy.routers.next_tie_start`); False: the lowest id takes every one, as before stop 49 (kept for
    the ablation's `shadow-lowid` arm)."""
    tie_draws: bool = True
    """While other routers serve the same workers (the send relay's count), a tie on the expected TTFT goes to the
    less loaded of two tied workers this router draws at random (`radix_sync.policy.routers.tie_draws`,
    `two_choices`), not to the one least-loaded worker all the routers see; False: as alone, as before stop 58 (kept
    for the ablation's `shadow-nodraw` arm)."""
    sent_pages: bool = True
    """A prompt prefix that this router's requests sent to a worker and not started will compute there counts as
    cached there for the next decisions (`rank_by_ttft`'s `sent_pages`, as the simulated router prices it); False:
    only the directory counts, as before stop 53 (kept for the A/B)."""
    peer_sends: bool = True
    """Relay this router's sends to the other routers in front of the same workers, and count theirs as its own,
    through the coordinator (`radix_sync.coordinator.relay`); inert while this router is the only one. False: each
    router learns the others' sends from the workers' next load reports only (as before stop 57)."""
    host_load_bytes_per_s: float = 0.0
    """The workers run SGLang's hierarchical cache (`--enable-hierarchical-cache`): a prompt prefix in a worker's
    host-memory tier (the directory feed's host-tier holdings) is priced as loaded back at this rate, bytes/s.
    0: not priced (no worker has a host tier)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} must be in [0, 65535]")
        if self.page_size < 1 or self.max_connections_per_worker < 1:
            raise ValueError(f"page_size={self.page_size!r} and max_connections_per_worker="
                             f"{self.max_connections_per_worker!r} must be >= 1")
        for name in ("connect_timeout_s", "read_timeout_s", "worker_cooldown_s", "shutdown_timeout_s",
                     "coordinator_timeout_s", "worker_keepalive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("max_body_bytes", "max_prompt_tokens", "max_prompt_chars", "max_batch_prompts", "max_messages",
                     "tokenize_threads", "hints_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if not self.hints_per_s > 0:
            raise ValueError(f"hints_per_s={self.hints_per_s!r} must be > 0")
        if self.vocab_size is not None and not 1 <= self.vocab_size <= MAX_TOKEN_ID + 1:
            raise ValueError(f"vocab_size={self.vocab_size!r} must be in [1, {MAX_TOKEN_ID + 1}]")
        if not self.host_load_bytes_per_s >= 0:
            raise ValueError(f"host_load_bytes_per_s={self.host_load_bytes_per_s!r} must be >= 0")
        if self.max_wait_inflight_s < 0:
            raise ValueError(f"max_wait_inflight_s={self.max_wait_inflight_s!r} must be >= 0")
        for url in self.worker_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must be http(s)://host:port, got {url!r}")
        if self.coordinator_url is None and not self.worker_urls:
            raise ValueError("give --coordinator or at least one --worker")
