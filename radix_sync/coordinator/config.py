"""The coordinator state's configuration (`StateConfig`: timeouts, history and every bound on what workers and
admin callers may make it hold). Re-exported by `state.py`, where it is used."""
from __future__ import annotations

from dataclasses import dataclass

from radix_sync import protocol as p


@dataclass(frozen=True)
class StateConfig:
    worker_timeout_s: float = 5.0
    """A worker silent for this long is dropped with all it holds."""
    replication_timeout_s: float = 60.0
    """A replication not finished after this long is marked failed."""
    hit_window_s: float = 120.0
    """How much prefix-hit history is kept for policies."""
    max_replications_kept: int = 10_000
    """Replication records kept (the oldest are forgotten first, also between ticks)."""
    max_demand_events: int = 100_000
    """Arrivals and finishes (with their page hashes) kept for the policy to consume; the oldest go first when a
    policy that does not consume them runs."""
    max_pages_per_worker: int = 1 << 20
    """Pages one worker may hold in the directory (also never more than twice its pool's pages): store facts
    beyond it are refused."""
    max_prompt_tokens: int = 262_144
    """Longest prompt (tokens, or pages x page size) any admin input may carry: a lookup, an arrival, a hint, a
    replication, a demotion; longer is a 400 before any hashing or lock."""
    max_hint_ttl_s: float = 600.0
    """A hint's `ttl_s` is capped to this, s."""
    max_hints_per_namespace: int = 1000
    """Live hints one tenant (namespace) may have; beyond it a hint is refused (429)."""
    max_hints: int = 20_000
    """Live hints of all tenants together."""
    hint_rate_per_s: float = 50.0
    """Hints per second one tenant may send (a token bucket of `hint_burst`); beyond it: 429."""
    hint_burst: int = 200
    max_replica_ttl_s: float = 3600.0
    """A replica fact is never believed to live longer than this, s."""
    ledger_holdout: float = 0.2
    """Fraction of the prefixes the planner decides on whose copies are not made, so the copy ledger can tell
    whether copies pay (`radix_sync.policy.ledger`; 0: no holdout, no verdict, never paused); the same for
    the prefixes routers ask to pull (the pull ledger, `radix_sync.coordinator.pull.ledger_allows_pull`)."""

    def __post_init__(self) -> None:
        for name in ("worker_timeout_s", "replication_timeout_s", "hit_window_s", "max_hint_ttl_s",
                     "hint_rate_per_s", "max_replica_ttl_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        for name in ("max_demand_events", "max_replications_kept", "max_pages_per_worker", "max_prompt_tokens",
                     "max_hints_per_namespace", "max_hints", "hint_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.ledger_holdout <= 1.0:
            raise ValueError(f"ledger_holdout must be in [0, 1], got {self.ledger_holdout}")
        if self.max_prompt_tokens > p.MAX_PREFIX_TOKENS:
            raise ValueError(f"max_prompt_tokens must be <= {p.MAX_PREFIX_TOKENS}, got {self.max_prompt_tokens}")
