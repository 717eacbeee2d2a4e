"""Which tracked prefixes a planning pass offers to the planner: the one candidate rule.

A prefix is a copy candidate when its demand is repeated (two or more recent requests), announced (a fan-out or
keep-alive hint), or stuck behind busy holders (every worker holding it waits longer than the least-loaded
worker by at least the planner's minimum gain). One request on a prefix says nothing about the next (a session's
turn reuses its previous turn once, then moves on to a longer prefix), so it needs one of these before it is
worth a copy; the planner's load forecast only sees the candidates' demand.

Callers: the simulator (`radix_sync.sim.engine.Engine`, for every tracked node) and the live coordinator
(`radix_sync.coordinator.live_planner.LivePlanner`, for every prefix with demand, a hint or an open session).
Pure: worker views, `now` and a cost model in; a bitmask or a yes/no out.
"""

from __future__ import annotations

from typing import Sequence

from radix_sync.policy.cost import CostModel
from radix_sync.policy.forecast import queue_wait_s
from radix_sync.policy.snapshot import WorkerView


def busy_mask(cost: CostModel, workers: Sequence[WorkerView], now: float, min_gain_s: float) -> int:
    """Which workers are busy: queue wait (`queue_wait_s`) at least the least-loaded worker's plus `min_gain_s`.

    Args:
        cost: the planner's cost model.
        workers: every worker's view, in worker-index order.
        now: current time, s.
        min_gain_s: the planner's minimum gain (`PlannerConfig.min_gain_s`), s.
    Returns:
        a bitmask, bit i set when `workers[i]` is busy.
    """
    waits = [queue_wait_s(cost, v, now) for v in workers]
    floor = min(waits, default=0.0) + min_gain_s
    mask = 0
    for i, wait in enumerate(waits):
        if wait >= floor:
            mask |= 1 << i
    return mask


def all_busy(holder_bits: int, busy: int) -> bool:
    """Returns: whether the holders (a bitmask by worker index) are at least one and every one is in `busy`."""
    return bool(holder_bits) and not holder_bits & ~busy


def is_candidate(num_recent_hits: int, hinted: bool, holders_busy: bool) -> bool:
    """The candidate rule (see the module docstring).

    Args:
        num_recent_hits: requests on the prefix within the popularity window.
        hinted: a live fan-out or keep-alive hint names the prefix.
        holders_busy: every holder of the prefix is busy (`all_busy`), as far as the caller applies that test.
    Returns:
        whether the planner is offered the prefix.
    """
    return hinted or num_recent_hits >= 2 or holders_busy
