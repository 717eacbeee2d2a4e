"""A copy on the request's critical path ("pull"): what it costs, when it wins, how long to wait for it.

The one rule the simulator's `kvrep_pull` and the live router (`kvrep router --pull`) both run: the expected-TTFT
router (`radix_sync.policy.routers.ExpectedTtftRouter`) prices, for every worker that lacks part of the prompt,
a copy of the missing part from the best holder (`best_holder`, `pull_ttft_s`) next to running as is and waiting
for a copy in flight, and picks the lowest expected TTFT; when that is a pull, `plan_pull` adds what only the live
system needs: the deadline after which the request stops waiting and falls back to the best option without a
copy (the holder's queue or a cold prefill).

Pure: `WorkerView`s, a `CostModel` and `now` in, seconds out; no clock, no socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from radix_sync.policy.cost import CostModel
from radix_sync.policy.snapshot import Route, WorkerView


@dataclass(frozen=True)
class PullConfig:
    """How long a request waits for its copy, and the copy's replica TTL (live only; the simulator's copies land
    when the network model says)."""

    min_wait_s: float = 0.25
    """The shortest deadline, s: covers what the estimate leaves out (the coordinator's handshake, a scheduler
    iteration at each end)."""
    max_wait_s: float = 2.0
    """The longest deadline, s, whatever the estimates say."""
    ttl_s: float = 30.0
    """TTL of the pulled replica, s (the waiting request's hit promotes it to ordinary cache at once)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_wait_s <= self.max_wait_s:
            raise ValueError(f"need 0 <= min_wait_s ({self.min_wait_s!r}) <= max_wait_s ({self.max_wait_s!r})")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s={self.ttl_s!r} must be > 0")


@dataclass(frozen=True)
class PullPlan:
    """A pull the router decided: copy the prompt's first `pull_len` tokens from `source` to `target`, then send
    the request to `target`; by `deadline_s` at the latest, send it to the best option without a copy."""

    source: Union[int, str]
    """The worker copied from: its index (`plan_pull`), or its URL in the live router's `Decision`."""
    target: Union[int, str]
    pull_len: int
    copy_eta_s: float
    """When the copy is expected to have landed (caller's clock)."""
    expected_ttft_s: float
    """Expected TTFT with the pull, s from the decision."""
    fallback_ttft_s: float
    """Expected TTFT of the best option without a copy, s from the decision."""
    deadline_s: float
    """Stop waiting then (caller's clock)."""


def best_holder(cached: Sequence[int]) -> tuple[int, int]:
    """Returns: (worker, tokens) of the worker holding the most of the prompt; ties to the lower id."""
    src = max(range(len(cached)), key=lambda i: (cached[i], -i))
    return src, cached[src]


def pull_eta_s(src: WorkerView, dst: WorkerView, num_bytes: float, cost: CostModel, now: float,
               endpoint_wait: bool = False) -> float:
    """When a copy of `num_bytes` from `src` to `dst` started now would land.

    Args:
        src, dst: the two workers (their links' backlogs and bandwidths; `busy_until_s` with `endpoint_wait`).
        num_bytes: payload.
        cost: the cost model.
        now: current time, s.
        endpoint_wait: the copy also waits for the iteration in progress at both ends (a live agent gathers and
            installs between scheduler iterations; the simulator's executor does not).
    Returns:
        the arrival time, s (>= now).
    """
    bw = min(src.nic_bandwidth_bytes_per_s, dst.nic_bandwidth_bytes_per_s)
    start = max(now, src.egress_busy_until_s, dst.ingress_busy_until_s)
    if endpoint_wait:
        start = max(start, src.busy_until_s, dst.busy_until_s)
    return start + cost.transfer_s(num_bytes, bw)


def pull_ttft_s(cost: CostModel, kv_bytes_per_token: int, workers: Sequence[WorkerView], target: int, source: int,
                source_len: int, local_len: int, queue_wait_s: float, prefill_after_s: float, now: float,
                endpoint_wait: bool = False) -> Optional[tuple[float, float]]:
    """The expected TTFT at `target` if the prompt's first `source_len` tokens are copied there from `source` first.

    The request queues at the target while the copy moves, so it starts at the later of the two.

    Args:
        cost, kv_bytes_per_token: the cost model and the KV size of a token.
        workers: every worker's load, indexed by worker id.
        target, source: the copy's ends.
        source_len: tokens of the prompt the source holds (what is copied up to).
        local_len: tokens of the prompt the target holds already (only the rest is priced).
        queue_wait_s: the target's expected queue wait (`forecast.queue_wait_s`).
        prefill_after_s: prefill of the prompt after `source_len` cached tokens, s.
        now: current time, s.
        endpoint_wait: see `pull_eta_s`.
    Returns:
        (expected TTFT s, the copy's arrival time), or None when no copy is possible (the target is the source,
        holds as much, or either end has no link).
    """
    dst = workers[target]
    if (source_len <= local_len or target == source or dst.nic_bandwidth_bytes_per_s <= 0
            or workers[source].nic_bandwidth_bytes_per_s <= 0):
        return None
    eta = pull_eta_s(workers[source], dst, (source_len - local_len) * kv_bytes_per_token, cost, now, endpoint_wait)
    return max(queue_wait_s, eta - now) + prefill_after_s, eta


def plan_pull(route: Route, fallback: Route, prefill_after_s: float, now: float,
              cfg: PullConfig = PullConfig()) -> Optional[PullPlan]:
    """The pull to start for a routing decision, with its deadline.

    The deadline is the break-even of the estimates: the copy may land up to `fallback.expected_ttft_s -
    prefill_after_s` from now and the pull still beats the fallback (that is the expected copy time plus the pull's
    expected margin), bounded to [`cfg.min_wait_s`, `cfg.max_wait_s`].

    Args:
        route: the router's choice (a pull when `route.pull_from` is set).
        fallback: the best choice without a copy (what the request gets on refusal, failure or deadline).
        prefill_after_s: the target's prefill after the pulled prefix, s (the part of `route.expected_ttft_s` that
            comes after the copy).
        now: current time, s.
        cfg: the deadline bounds.
    Returns:
        the plan, or None when `route` is no pull.
    """
    if route.pull_from is None or route.pull_eta_s is None:
        return None
    wait_s = min(cfg.max_wait_s, max(cfg.min_wait_s, fallback.expected_ttft_s - prefill_after_s))
    return PullPlan(route.pull_from, route.worker_id, route.pull_len, route.pull_eta_s, route.expected_ttft_s,
                    fallback.expected_ttft_s, now + wait_s)
