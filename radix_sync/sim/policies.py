"""The simulator's named policies: a router, and optionally the planner (active or shadow) or the oracle cache.

The simulator's executor defers a copy until its source holds the pages, so its planners run with
`chain_sources=True` (chained / broadcast-tree replication).

`--policies` names are looked up in `POLICIES`; each entry builds a fresh `PolicyBundle` for one run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
from radix_sync.policy.predictor import DemandPredictor
from radix_sync.policy.registry import Registry
from radix_sync.policy.routers import RouterPolicy, make_router


@dataclass
class PolicyBundle:
    """What one simulated policy runs with."""

    name: str
    router: RouterPolicy
    planner: Optional[KvrepPlanner] = None
    shadow: bool = False
    """Planner decisions are accounted, never executed (and the router never copies)."""
    oracle: bool = False
    """Every worker holds every prefix ever computed, at no cost (the lower bound)."""
    demote_stale: bool = False
    """When a session's next turn (as the planner's tracker recognises it) is admitted on one worker, the other
    workers' copies of its history that go no further become evict-first, like replicas: the cluster keeps one
    live copy of each history instead of losing other sessions' only copies to LRU."""


POLICIES: Registry[PolicyBundle] = Registry("policy")


def _ctx(profile: CostProfile, page_len: int, seed: int) -> dict:
    return dict(cost=CostModel(profile), page_len=page_len, kv_bytes_per_token=profile.kv_bytes_per_token, seed=seed)


def _simple(name: str) -> None:
    @POLICIES.register(name)
    def build(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
        return PolicyBundle(name, make_router(name, **_ctx(profile, page_len, seed)))


for _name in ("round_robin", "least_load", "cache_aware", "cost", "pull", "e2"):
    _simple(_name)


@POLICIES.register("kvrep")
def _kvrep(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    ctx = _ctx(profile, page_len, seed)
    planner = KvrepPlanner(ctx["cost"], DemandPredictor(), replace(planner_cfg, chain_sources=True))
    return PolicyBundle("kvrep", make_router("expected_ttft", allow_pull=planner_cfg.allow_pull, **ctx), planner,
                        demote_stale=True)


@POLICIES.register("kvrep_keep")
def _kvrep_keep(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep` that leaves a moved session's old copies to plain LRU (no demotion)."""
    bundle = _kvrep(profile, page_len, seed, planner_cfg)
    return replace(bundle, name="kvrep_keep", demote_stale=False)


@POLICIES.register("kvrep_nopull")
def _kvrep_nopull(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep` whose router never copies on the critical path (only planned copies move KV)."""
    ctx = _ctx(profile, page_len, seed)
    cfg = replace(planner_cfg, allow_pull=False, chain_sources=True)
    planner = KvrepPlanner(ctx["cost"], DemandPredictor(), cfg)
    return PolicyBundle("kvrep_nopull", make_router("expected_ttft", allow_pull=False, **ctx), planner,
                        demote_stale=True)


@POLICIES.register("kvrep_shadow")
def _kvrep_shadow(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    ctx = _ctx(profile, page_len, seed)
    planner = KvrepPlanner(ctx["cost"], DemandPredictor(), replace(planner_cfg, chain_sources=True))
    return PolicyBundle("kvrep_shadow", make_router("expected_ttft", allow_pull=False, **ctx), planner, shadow=True)


@POLICIES.register("oracle")
def _oracle(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    return PolicyBundle("oracle", make_router("expected_ttft", allow_pull=False, **_ctx(profile, page_len, seed)),
                        oracle=True)


def build_policy(name: str, profile: CostProfile, page_len: int, seed: int,
                 planner_cfg: PlannerConfig = PlannerConfig()) -> PolicyBundle:
    """Returns: a fresh bundle for policy `name`."""
    return POLICIES.create(name, profile, page_len, seed, planner_cfg)
