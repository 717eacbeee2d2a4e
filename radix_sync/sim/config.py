"""The simulator's run knobs that are not part of the cost profile (`EngineConfig`).

Read by the engine (`radix_sync.sim.engine`) and its workers (`radix_sync.sim.worker`); built by the command line
(`radix_sync.sim.cli.engine_config`) and by tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EngineConfig:
    """Simulation knobs that are not part of the cost profile."""

    num_workers: int = 16
    """Workers in the cluster."""
    duration_s: float = 600.0
    """No request is issued after this time (in-flight ones complete), s."""
    tick_s: float = 1.0
    """Planner period, s."""
    replica_budget_frac: float = 0.25
    """Largest share of a worker's KV pool that replicas may take."""
    overlap_lag: bool = False
    """True: the workers run SGLang's overlap scheduler on a device that computes synchronously (the CPU): an
    iteration's outputs (first tokens, finished requests) are streamed when the next iteration ends, or at once
    when none follows (`Scheduler.event_loop_overlap` processes batch N's results after launching batch N+1, and
    on the CPU launching is running)."""
    record_requests: bool = False
    """Keep one record per finished request in the result (`requests`; to compare with a live replay)."""
    eviction: str = "lru"
    """The workers' radix-cache eviction (`--radix-eviction-policy`): `lru` (SGLang's default) or `tlru`
    (Tail-Optimized LRU, with `tlru_threshold_tokens` and `tlru_next_prompt_tokens` as SGLang's
    `--radix-eviction-policy-config '{"threshold": ..., "next_prompt_estimate": ...}'`). Replicas and demoted
    copies still go first."""
    radix_nodes: bool = True
    """The workers evict as SGLang's radix cache does: a whole leaf node at a time (the pages one insert added, cut
    where a later match ended or a branch began), so a session's history goes whole once it is the least recently
    used leaf, not just the pages the allocation needs (SGLang 0.5.23, measured: `docs/bench.md`, "Whole radix
    nodes"). False: page by page (the model before, which kept most of a victim's prefix)."""
    tlru_threshold_tokens: int = 0
    """T-LRU: tokens a next prompt may leave uncached (the TTFT budget expressed in tokens)."""
    tlru_next_prompt_tokens: int = 0
    """T-LRU: tokens a conversation's next prompt is expected to add."""
    view_staleness_s: float = 0.2
    """Load reports are this far apart (each worker on its own phase), as live (the agent's 200 ms report
    interval); the router and the planner see the last report merged with the router's own sends since
    (`radix_sync.sim.views`). 0: exact views at every decision (the model before issue 16)."""
    hint_jitter: float = 0.25
    """A fan-out hint's error: its lead time and its number of branches are each off by a factor exp(jitter x N(0,1))
    (log-normal, drawn per request): an application announcing branches knows neither the trunk's decode time nor
    how many branches survive exactly. 0: exact hints."""
    endpoint_wait: bool = False
    """True: a copy starts only once the iterations in progress at its source and at its target are over (a live
    agent gathers and installs between scheduler iterations; on a CPU worker a prefill iteration lasts up to
    seconds, on a GPU up to a chunk of 8,192 tokens). Pair it with `PlannerConfig.endpoint_wait`, which makes the
    router and the planner price that wait. False: copies move without the schedulers (the model before)."""
    prompt_token_reports: bool = False
    """True: a worker's load report counts its waiting (not yet scheduled) requests' whole prompts as waiting
    tokens, cached prefix included, with no attention work, as the live agent reported SGLang's waiting queue
    until stop 40 (the sum of `origin_input_ids`); the router and the planner merge it with their own counts as
    live. Only with stale views (`view_staleness_s > 0`). False: the report carries the waiting requests' uncached
    tokens and attention work (the model before, and what the live agent reports since stop 40)."""
    door_sends_s: Optional[float] = None
    """With N > 1 front doors (`PolicyBundle.doors`): each door's router learns the other doors' sends, and their first
    outputs and ends, this long after they happened and merges them with its own, as it merges its own sends with the
    workers' last load reports: the live routers' send relay through the coordinator (`radix_sync.coordinator.relay`,
    `--peer-sends`, measured at 2-3 ms mean on loopback: docs/bench.md). None: never (live `--no-peer-sends`: a
    router knows its own sends, the others' only through the workers' next load reports)."""
    ledger_holdout: float = 0.0
    """The coordinator's copy ledger (`radix_sync.policy.ledger.CopyLedger`, the same object; live default
    `--ledger-holdout 0.2`): this share of the prefixes the planner decides on is held out (their copies not made),
    each finished request's time to first token is attributed to its deepest decided prefix, and while the copied
    group is shown slower the planner is paused (every new decision held out). 0: no holdout, never paused (the
    simulator before stop 58). Planner copies only; the live pull ledger is not modelled."""
    shared_cores: int = 0
    """0: every worker has its own accelerator. N > 0: the workers share N CPU cores (a local CPU cluster with
    more workers than cores): processor sharing, every iteration in progress (prefill or decode) runs at min(1, N/k)
    of its speed while k workers are busy, re-timed whenever k changes."""
    frontend_cpu_s: float = 0.0
    """With `shared_cores`: CPU seconds the processes other than the workers' schedulers spend per request (the
    front door, the coordinator, SGLang's HTTP/tokenizer and detokenizer processes, the client), run as one job on
    the shared cores from the request's arrival: while j such jobs run beside k busy workers, each runs at
    min(1, N/(k+j)). 0: not modelled (every core the workers do not use is idle)."""

    host_tier_ratio: float = 0.0
    """> 1: every worker has a host-memory KV tier, SGLang's hierarchical cache with `--hicache-ratio` set to this
    (its default when enabled: 2.0; host pool = ratio x the device pool), write-through: the pages its device pool
    evicts stay in host memory ((ratio - 1) x the device pool of them) and are loaded back when a request's prefix
    continues there (`radix_sync.sim.cache.HostTier`). 0: no host tier (SGLang's default)."""
    host_tier_priced: bool = True
    """The expected-TTFT router and the planner see the host tiers (`RequestView.host_len`, holders) and price a
    hit there at the load rate (SGLang publishes host-tier pages as KV events, medium `CPU_PINNED`). False: the
    workers use their host tiers but the policies do not know of them (the ablation)."""
    host_load_bytes_per_s: float = 25e9
    """Host-to-device load-back rate of the host tier, bytes/s, charged to the prefill iteration of the request
    that loads (not overlapped with its compute: harsh to the tier, as SGLang overlaps it layer by layer). 25 GB/s
    assumed: about half of what pinned host-to-device copies reach over PCIe Gen5 x16 (64 GB/s a direction), the
    rest left to HiCache's page gathers and the write-through traffic the other way. Not measured here."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers!r} must be >= 1")
        if self.duration_s <= 0 or self.tick_s <= 0:
            raise ValueError(f"duration_s={self.duration_s!r} and tick_s={self.tick_s!r} must be > 0")
        if not (self.view_staleness_s >= 0 and self.hint_jitter >= 0):
            raise ValueError(f"view_staleness_s={self.view_staleness_s!r}, hint_jitter={self.hint_jitter!r} must be >= 0")
        if self.door_sends_s is not None and not self.door_sends_s >= 0:
            raise ValueError(f"door_sends_s={self.door_sends_s!r} must be None or >= 0")
        if not 0.0 <= self.ledger_holdout <= 1.0:
            raise ValueError(f"ledger_holdout={self.ledger_holdout!r} must be in [0, 1]")
        if self.shared_cores < 0 or self.frontend_cpu_s < 0:
            raise ValueError(f"shared_cores={self.shared_cores!r}, frontend_cpu_s={self.frontend_cpu_s!r} "
                             "must be >= 0")
        if self.eviction not in ("lru", "tlru"):
            raise ValueError(f"eviction={self.eviction!r} must be 'lru' or 'tlru'")
        if self.tlru_threshold_tokens < 0 or self.tlru_next_prompt_tokens < 0:
            raise ValueError(f"tlru_threshold_tokens={self.tlru_threshold_tokens!r}, tlru_next_prompt_tokens="
                             f"{self.tlru_next_prompt_tokens!r} must be >= 0")
        if self.host_tier_ratio and not self.host_tier_ratio > 1.0:
            raise ValueError(f"host_tier_ratio={self.host_tier_ratio!r} must be 0 (none) or > 1")
        if not self.host_load_bytes_per_s > 0:
            raise ValueError(f"host_load_bytes_per_s={self.host_load_bytes_per_s!r} must be > 0")
        if not 0.0 <= self.replica_budget_frac <= 1.0:
            raise ValueError(f"replica_budget_frac={self.replica_budget_frac!r} must be in [0, 1]")
