"""The router's configuration (built by `kvrep router` from its flags)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from radix_sync.policy.pull import PullConfig
from radix_sync.router.policy import RouterCosts


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
    pull: bool = False
    """Copy a prompt's missing prefix from its best holder on the request's path when that gives the lowest expected
    TTFT (the coordinator does the copy; the request waits for it, bounded by `pull_policy`, then falls back)."""
    pull_policy: PullConfig = field(default_factory=PullConfig)
    """A pull's deadline bounds and replica TTL."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} must be in [0, 65535]")
        if self.page_size < 1 or self.max_connections_per_worker < 1:
            raise ValueError(f"page_size={self.page_size!r} and max_connections_per_worker="
                             f"{self.max_connections_per_worker!r} must be >= 1")
        for name in ("connect_timeout_s", "read_timeout_s", "worker_cooldown_s", "shutdown_timeout_s",
                     "coordinator_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.max_wait_inflight_s < 0:
            raise ValueError(f"max_wait_inflight_s={self.max_wait_inflight_s!r} must be >= 0")
        for url in self.worker_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must be http(s)://host:port, got {url!r}")
        if self.coordinator_url is None and not self.worker_urls:
            raise ValueError("give --coordinator or at least one --worker")
