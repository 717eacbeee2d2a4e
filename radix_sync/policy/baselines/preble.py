"""Preble's E2 scheduling, `e2`: E2-like (exploit / explore after the paper; the numbers and the replication rule
are ours)."""

from __future__ import annotations

from collections import deque
from typing import Sequence

from radix_sync.policy.cost import CostModel
from radix_sync.policy.routers import ROUTERS, RouterPolicy
from radix_sync.policy.snapshot import RequestView, Route, WorkerView


@ROUTERS.register("e2")
class PrebleE2Router(RouterPolicy):
    """E2-like, after Preble's E2 scheduling (Srivatsa et al., ICLR'25, https://arxiv.org/abs/2407.00023,
    Section 4). From the paper: if the longest cached prefix covers more of the prompt than it misses, *exploit*:
    go to the holder with the lowest load; else *explore*: go to the worker with the least cost = recent compute
    load + eviction cost + the prefill of the missed tokens. Ours, not the paper's: the load is the prefill +
    decode time (profile formula) of the requests it got within `window_s`; the eviction cost is the prefill time
    of the tokens that do not fit in the worker's free KV; and a hot prefix whose lightest holder is overloaded
    (load > `imbalance_ratio` x the lightest worker's) is replicated by sending the request to the lightest worker,
    which recomputes the prefix (no KV copy; the paper rebalances by load instead). Ties: the lowest id."""

    uses_cached_len = True

    def __init__(self, cost: CostModel, window_s: float = 180.0, imbalance_ratio: float = 2.0, **_: object) -> None:
        if window_s <= 0 or imbalance_ratio < 1.0:
            raise ValueError(f"window_s={window_s!r} must be > 0 and imbalance_ratio={imbalance_ratio!r} >= 1")
        self.cost = cost
        self.window_s = window_s
        self.ratio = imbalance_ratio
        self._hist: list[deque] = []
        self._load: list[float] = []

    def _expire(self, now: float) -> None:
        for i, h in enumerate(self._hist):
            while h and h[0][0] < now - self.window_s:
                self._load[i] -= h.popleft()[1]

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        while len(self._hist) < len(workers):
            self._hist.append(deque())
            self._load.append(0.0)
        self._expire(now)
        n = len(workers)
        best_len = max(req.cached_len) if req.cached_len else 0
        loads = self._load
        lightest = min(range(n), key=lambda i: (loads[i], i))
        if best_len > req.prompt_len - best_len:
            holders = [i for i in range(n) if req.cached_len[i] == best_len]
            target = min(holders, key=lambda i: (loads[i], i))
            if loads[target] > self.ratio * loads[lightest] and loads[target] > 0:
                target = lightest
        else:
            def explore_cost(i: int) -> float:
                missed = req.prompt_len - req.cached_len[i]
                evict = max(0, missed + req.output_len - workers[i].free_tokens)
                return loads[i] + self.cost.prefill_s(evict, 0) * (evict > 0) + self.cost.prefill_s(missed,
                                                                                                    req.cached_len[i])
            target = min(range(n), key=lambda i: (explore_cost(i), i))
        missed = req.prompt_len - req.cached_len[target]
        work = self.cost.prefill_s(missed, req.cached_len[target]) + self.cost.decode_steps_s(
            max(0, req.output_len - 1), 1, req.prompt_len)
        self._hist[target].append((now, work))
        self._load[target] += work
        return Route(target)
