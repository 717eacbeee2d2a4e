"""The simulator's named policies: a router, and optionally the planner (active or shadow), demotion or free copies.

Ablations of ours, each adding one mechanism: `kvrep_route` (the expected-TTFT router alone: no copies, no
demotion, no planner), `kvrep_pull` (+ copies on the critical path), `kvrep_pull_demote` (+ demotion of a moved
session's old copies), `kvrep` (+ the predictive planner). `pull_demote` gives Mooncake's `pull` the same demotion,
so eviction and prediction are told apart. `free_copies` (formerly `oracle`) is a reference, not a bound.

The simulator's executor defers a copy until its source holds the pages, so its planners run with
`chain_sources=True` (chained / broadcast-tree replication).

`--policies` names are looked up in `POLICIES`; each entry builds a fresh `PolicyBundle` for one run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Optional

from radix_sync.policy.calibration import UseCalibrationConfig
from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.demotion import DemotionGateConfig
from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
from radix_sync.policy.predictor import DemandPredictor
from radix_sync.policy import baselines  # noqa: F401 (registers the baseline routers)
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
    """`free_copies`: every worker holds every prefix ever computed, at no cost, with unbounded memory. A reference,
    NOT a lower bound: it still routes by expected TTFT, with no look-ahead, so a policy may beat it."""
    demote_stale: bool = False
    """When a session's next turn (as the session tracker recognises it) is admitted on one worker, the other
    workers' copies of its history that go no further become evict-first, like replicas: the cluster keeps one
    live copy of each history instead of losing other sessions' only copies to LRU."""
    demotion_gate: Optional[DemotionGateConfig] = DemotionGateConfig()
    """With `demote_stale`: demote only while moved sessions seldom come back (`radix_sync.policy.demotion`); None:
    always (the `_ungated` ablations)."""
    use_calibration: Optional[UseCalibrationConfig] = UseCalibrationConfig()
    """With a planner: scale each kind of demand's predictions by how often its copies were used
    (`radix_sync.policy.calibration`); None: never (the `_uncalibrated` ablation)."""
    replicas_ordinary: bool = False
    """The planner's copies land as ordinary cache (least recently used order from their landing, as a pull's
    pages), an unused one dropped at its TTL; False: evict-first until a request uses it. Live: the coordinator's
    `kvrep_lru` policy, `ExpectReplica.ordinary`."""
    predictor: Optional[DemandPredictor] = None
    """Without a planner: the predictor of the session tracker that `demote_stale` needs (the tracker only
    recognises next turns; nothing is planned and no idle session is demoted on a prediction)."""
    doors: tuple[RouterPolicy, ...] = ()
    """N > 1 front doors: N routers of this policy, `router` the first, in front of the same workers, the k-th request
    through door k mod N (a load balancer spreading requests over a fleet's gateways). Each knows only what it sent
    itself (its own requests in flight and their prefixes, its own polls); the directory and the workers' load
    reports are shared (ours: the coordinator's feed). Empty: `router` alone."""


POLICIES: Registry[PolicyBundle] = Registry("policy")


def _ctx(profile: CostProfile, page_len: int, seed: int) -> dict:
    return dict(cost=CostModel(profile), page_len=page_len, kv_bytes_per_token=profile.kv_bytes_per_token, seed=seed)


def _simple(name: str) -> None:
    @POLICIES.register(name)
    def build(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
        return PolicyBundle(name, make_router(name, **_ctx(profile, page_len, seed)))


for _name in ("round_robin", "least_load", "cache_aware", "cache_aware_inflight", "cache_aware_v03", "cost", "pull",
              "sticky", "precise", "e2"):
    _simple(_name)


@POLICIES.register("pull_demote")
def _pull_demote(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Mooncake's `pull` + demotion of a moved session's old copies (no planner)."""
    return PolicyBundle("pull_demote", make_router("pull", **_ctx(profile, page_len, seed)), demote_stale=True,
                        predictor=DemandPredictor())


@POLICIES.register("kvrep_route")
def _kvrep_route(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: our expected-TTFT router alone (no copies, no demotion, no planner)."""
    return PolicyBundle("kvrep_route", make_router("expected_ttft", allow_pull=False, **_ctx(profile, page_len, seed)))


@POLICIES.register("kvrep_pull")
def _kvrep_pull(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep_route` + copies on the critical path (no demotion, no planner)."""
    return PolicyBundle("kvrep_pull", make_router("expected_ttft", allow_pull=True,
                                                  endpoint_wait=planner_cfg.endpoint_wait,
                                                  **_ctx(profile, page_len, seed)))


@POLICIES.register("kvrep_pull_demote")
def _kvrep_pull_demote(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep_pull` + demotion of a moved session's old copies (no planner)."""
    return PolicyBundle("kvrep_pull_demote",
                        make_router("expected_ttft", allow_pull=True, endpoint_wait=planner_cfg.endpoint_wait,
                                    **_ctx(profile, page_len, seed)),
                        demote_stale=True, predictor=DemandPredictor())


@POLICIES.register("kvrep")
def _kvrep(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    ctx = _ctx(profile, page_len, seed)
    planner = KvrepPlanner(ctx["cost"], DemandPredictor(), replace(planner_cfg, chain_sources=True))
    return PolicyBundle("kvrep", make_router("expected_ttft", allow_pull=planner_cfg.allow_pull,
                                             endpoint_wait=planner_cfg.endpoint_wait, **ctx), planner,
                        demote_stale=True)


@POLICIES.register("kvrep_keep")
def _kvrep_keep(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep` that leaves a moved session's old copies to plain LRU (no demotion)."""
    bundle = _kvrep(profile, page_len, seed, planner_cfg)
    return replace(bundle, name="kvrep_keep", demote_stale=False)


@POLICIES.register("kvrep_lru")
def _kvrep_lru(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """`kvrep` whose copies land as ordinary cache (`PolicyBundle.replicas_ordinary`): on a full pool an
    evict-first copy is the next allocation's first victim, before the request it was made for arrives."""
    return replace(_kvrep(profile, page_len, seed, planner_cfg), name="kvrep_lru", replicas_ordinary=True)


@POLICIES.register("kvrep_pull_demote_ungated")
def _kvrep_pull_demote_ungated(profile: CostProfile, page_len: int, seed: int,
                               planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep_pull_demote` demoting every moved session's old copies (no gate: before stop 33)."""
    return replace(_kvrep_pull_demote(profile, page_len, seed, planner_cfg), name="kvrep_pull_demote_ungated",
                   demotion_gate=None)


@POLICIES.register("kvrep_ungated")
def _kvrep_ungated(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep` demoting every moved session's old copies (no gate: before stop 33)."""
    return replace(_kvrep(profile, page_len, seed, planner_cfg), name="kvrep_ungated", demotion_gate=None)


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


@POLICIES.register("free_copies")
def _free_copies(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """A reference, not a bound: every worker holds every prefix ever computed, free and with unbounded memory,
    routed by expected TTFT (`kvrep_route`'s router). It is no lower bound on TTFT: the router is greedy and blind
    to what comes next (it can pile a burst onto the workers that look fastest now), so a policy can beat it, and
    the simulator has shown policies that do (fan-out P99, shared-prefix P50)."""
    return PolicyBundle("free_copies", make_router("expected_ttft", allow_pull=False,
                                                   **_ctx(profile, page_len, seed)), oracle=True)


@POLICIES.register("oracle")
def _oracle(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Deprecated alias of `free_copies` (it was never a lower bound)."""
    print("kvrep sim: policy 'oracle' is deprecated, running 'free_copies' (a reference, not a lower bound)",
          file=sys.stderr)
    return _free_copies(profile, page_len, seed, planner_cfg)


def build_policy(name: str, profile: CostProfile, page_len: int, seed: int,
                 planner_cfg: PlannerConfig = PlannerConfig(), front_doors: int = 1) -> PolicyBundle:
    """Returns: a fresh bundle for policy `name`, behind `front_doors` routers (`PolicyBundle.doors`; each one's
    random tie-breaks seeded apart)."""
    if front_doors < 1:
        raise ValueError(f"front_doors={front_doors!r} must be >= 1")
    bundle = POLICIES.create(name, profile, page_len, seed, planner_cfg)
    if front_doors == 1:
        return bundle
    more = [POLICIES.create(name, profile, page_len, seed + 7919 * k, planner_cfg).router
            for k in range(1, front_doors)]
    return replace(bundle, doors=(bundle.router, *more))


@POLICIES.register("kvrep_uncalibrated")
def _kvrep_uncalibrated(profile: CostProfile, page_len: int, seed: int, planner_cfg: PlannerConfig) -> PolicyBundle:
    """Ablation: `kvrep` taking every prediction as it is (no use calibration: before stop 34)."""
    return replace(_kvrep(profile, page_len, seed, planner_cfg), name="kvrep_uncalibrated", use_calibration=None)
