"""The coordinator's live policies: chosen by name through one `Registry`, called through one interface.

`Coordinator` builds its policy with `LIVE_POLICIES.create(name, rules=..., profile=...)` and calls it only
through `LivePolicy`; it never switches on a policy's name. Registered, in this order (the order error messages
list them in):
- `kvrep`: the predictive planner on the coordinator's state (`LivePlanner`);
- `kvrep_lru`: the same planner, its copies landing as ordinary cache (LRU from landing, dropped at their TTL
  unless used) instead of evict-first (the simulator's `kvrep_lru`);
- `kvrep_fixed`: the same planner pricing prefills at its profile's times, not at the speed the routers measure
  (`radix_sync.policy.speed`; how every planner priced before stop 46: the ablation of that calibration);
- `demote`: the planner's session tracking and demotion alone, no copies (the ablation step between reactive copies
  and prediction: `kvrep bench`'s `demote` arm, the simulator's `kvrep_pull_demote`);
- `rules`: the rule-based baseline (`radix_sync.policy.rules.RuleBasedPolicy`) on the state's rule snapshot;
- `none`: decides nothing (replication only on the admin API's request).

The pure policies live in `radix_sync.policy`; what is here only adapts them to `ClusterState`.
"""
from __future__ import annotations

from typing import Optional, Protocol

from radix_sync.coordinator.live_planner import LiveDecision, LivePlanner
from radix_sync.coordinator.state import ClusterState
from radix_sync.policy.registry import Registry
from radix_sync.policy.rules import RuleBasedPolicy, RuleConfig


class LivePolicy(Protocol):
    """What the coordinator calls on its policy, under the state lock."""

    name: str
    """The registered name (`/status`, the origin of the replications it asks for)."""
    replicas_ordinary: bool
    """Its copies land as ordinary cache (`ExpectReplica.ordinary`), not evict-first."""
    hint_outcomes: dict[int, list[tuple[float, str]]]
    """Hinted prefix -> what the policy made of it, each change with its time (for `/status`; empty if none)."""

    def decide(self, state: ClusterState, now_s: float) -> list[LiveDecision]:
        """Returns: the copies to make now (the coordinator sends them, or records them in shadow mode)."""

    def take_demotions(self) -> list[tuple[str, str, int]]:
        """Returns: (worker, namespace, block hash of the prefix's last page) decided since the last call."""

    def session_stats(self) -> Optional[dict]:
        """Returns: what the policy knows of sessions, for `/status` (None when it does not track them)."""


LIVE_POLICIES: Registry[LivePolicy] = Registry("policy")


class RulesPolicy:
    """`RuleBasedPolicy` on `ClusterState.rule_snapshot`."""

    name = "rules"
    replicas_ordinary = False

    def __init__(self, config: RuleConfig) -> None:
        self.rules = RuleBasedPolicy(config)
        self.hint_outcomes: dict[int, list[tuple[float, str]]] = {}

    def decide(self, state: ClusterState, now_s: float) -> list[LiveDecision]:
        return [LiveDecision(d.source, d.target, d.namespace, d.block_hash, d.prefix_len, d.ttl_s, 0.0)
                for d in self.rules.decide(state.rule_snapshot(now_s), now_s)]

    def take_demotions(self) -> list[tuple[str, str, int]]:
        return []

    def session_stats(self) -> Optional[dict]:
        return None


class NoPolicy:
    """Decides nothing: replications happen only when the admin API asks for them."""

    name = "none"
    replicas_ordinary = False

    def __init__(self) -> None:
        self.hint_outcomes: dict[int, list[tuple[float, str]]] = {}

    def decide(self, state: ClusterState, now_s: float) -> list[LiveDecision]:
        return []

    def take_demotions(self) -> list[tuple[str, str, int]]:
        return []

    def session_stats(self) -> Optional[dict]:
        return None


class DemotePolicy(LivePlanner):
    """`LivePlanner` without its planner: it follows sessions from the routers' arrivals and finishes exactly as
    `kvrep` does, and demotes a moved session's stale copies (`LivePlanner.consume`), but decides no copy. With a
    router that pulls (`kvrep router --pull`) it is the simulator's `kvrep_pull_demote`: reactive copies +
    demotion, so a results table separates what demotion gives from what prediction gives."""

    name = "demote"

    def decide(self, state: ClusterState, now_s: float) -> list[LiveDecision]:
        self.consume(state, now_s)
        self.last_pass = {"candidates": 0, "scored_pairs": 0, "deferred": 0}
        return []


@LIVE_POLICIES.register("kvrep")
def _kvrep(rules: RuleConfig, profile: str) -> LivePolicy:
    return LivePlanner(profile)


@LIVE_POLICIES.register("kvrep_lru")
def _kvrep_lru(rules: RuleConfig, profile: str) -> LivePolicy:
    planner = LivePlanner(profile)
    planner.name, planner.replicas_ordinary = "kvrep_lru", True
    return planner


@LIVE_POLICIES.register("kvrep_fixed")
def _kvrep_fixed(rules: RuleConfig, profile: str) -> LivePolicy:
    planner = LivePlanner(profile)
    planner.name, planner.speed_calibrated = "kvrep_fixed", False
    return planner


@LIVE_POLICIES.register("demote")
def _demote(rules: RuleConfig, profile: str) -> LivePolicy:
    return DemotePolicy(profile)


@LIVE_POLICIES.register("rules")
def _rules(rules: RuleConfig, profile: str) -> LivePolicy:
    return RulesPolicy(rules)


@LIVE_POLICIES.register("none")
def _none(rules: RuleConfig, profile: str) -> LivePolicy:
    return NoPolicy()
