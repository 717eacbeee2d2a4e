"""Mean TTFT of a prefix's expected requests spread over its per-worker options, and the same with one worker's
option replaced: the planner's inner loop (`radix_sync.policy.scoring.best_candidate` asks it for every target
and depth).

The definition (`spread_s`) is a greedy simulation: `k` requests, each taking the option that starts it first, a
further request on a worker waiting for the previous one's prefill:

    options (first TTFT, service):  w0 (1.0, 0.5)  w1 (1.2, 0.5)  w2 (3.0, 0.5)        k = 4
    requests served at:             w0 1.0, w1 1.2, w0 1.5, w1 1.7        mean = 1.35

The k values taken are the k smallest of the multiset {t_w, t_w + s_w, (t_w + s_w) + s_w, ...} over workers, in
ascending order. `Spread` uses that to answer "option of worker t replaced by o" in O(k) instead of a heap
simulation over every worker: only the k smallest options can supply a value, and for a worker outside them the
other workers' k values are the base's own. NOTE: the results are bit for bit those of `spread_s` (same values,
added in the same ascending order), so the planner's decisions do not change with it; `tests/unit/
test_policy_spread.py` checks this on random options.

Pure: options and counts in, seconds out. Who calls it: `radix_sync.policy.planner`.
"""
from __future__ import annotations

import heapq
import math
import sys
from typing import Sequence

Option = tuple[float, float]
"""(TTFT of the first request at a worker, service time of each further one), s."""


def num_spread(count: float, max_spread: int) -> int:
    """Requests modelled individually: `count` rounded up, within [1, max_spread]."""
    return max(1, min(max_spread, math.ceil(count - 1e-9)))


def _taken(opts: Sequence[Option], k: int) -> list[float]:
    """The k values the greedy simulation takes, in the order it takes them (ascending)."""
    heap = list(opts)
    heapq.heapify(heap)
    out = []
    replace = heapq.heapreplace
    for _ in range(k):
        # (the smallest is taken and its next value put back: one `heapreplace`, the same values as a pop and a
        # push: each step takes the least (value, service) left, whatever the heap's inner order)
        t, svc = heap[0]
        out.append(t)
        replace(heap, (t + svc, svc))
    return out


if sys.version_info < (3, 12):
    def _mean(values: list[float], k: int) -> float:
        # NOTE: a plain left-to-right sum, as the simulation adds: CPython 3.11's `sum` of floats from a float
        # start is exactly that (a C double accumulator); from 3.12 on it compensates, hence the loop below
        return sum(values, 0.0) / k
else:
    def _mean(values: list[float], k: int) -> float:
        total = 0.0
        for v in values:  # NOTE: a plain left-to-right sum, as the simulation adds (not `sum`, which compensates)
            total += v
        return total / k


def spread_s(opts: Sequence[Option], k: int) -> float:
    """Mean TTFT of `k` requests spread greedily over `opts` (the definition; see the module docstring)."""
    if k == 1:
        return min(o[0] for o in opts)
    return _mean(_taken(opts, k), k)


class Spread:
    """`spread_s` of one option list, and of the same list with one option replaced, for many replacements."""

    def __init__(self, opts: Sequence[Option], k: int) -> None:
        self.opts = opts
        self.k = k
        # the k + 1 smallest options with their workers (ties: the lower worker first, as a stable sort; an index
        # sort keyed by the options is that order, several times faster than a heap over (option, worker) pairs)
        self._first = [(opts[i], i) for i in sorted(range(len(opts)), key=opts.__getitem__)[:k + 1]]
        self.inner = {i for _, i in self._first[:k]}
        """The workers of the k smallest options (the others' replacements merge into `base_taken`)."""
        self.base_taken = _taken([o for o, _ in self._first[:k]], k) if k > 1 else None
        self.base_s = spread_s(opts, k) if k == 1 else _mean(self.base_taken, k)
        self.last = self.base_taken[-1] if k > 1 else None
        """With k > 1, the largest value taken: `with_option` of a worker outside `inner` with an option starting
        at or after it is `base_s` (it takes none of that worker's values); None with k = 1."""
        self._memo: dict[tuple[Option, Option], float] = {}

    def with_option(self, worker: int, opt: Option) -> float:
        """`spread_s` of the options with `worker`'s replaced by `opt`. Depends on `worker` only through its option
        (equal options supply equal values), so answers are kept by (its option, `opt`)."""
        if self.last is not None and opt[0] >= self.last and worker not in self.inner:
            return self.base_s  # (`_with_option`'s first answer for a worker outside the k smallest, without a memo)
        key = (self.opts[worker], opt)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = self._with_option(worker, opt)
        return out

    def _with_option(self, worker: int, opt: Option) -> float:
        k = self.k
        if k == 1:
            other = next((o[0] for o, i in self._first if i != worker), math.inf)
            return min(other, opt[0])
        if worker in self.inner:
            # (the k smallest of the others, then the new one: still every option that can supply a value)
            rest = [o for o, i in self._first if i != worker][:k]
            return _mean(_taken(rest + [opt], k), k)
        return self.merged(opt)

    def merged(self, opt: Option) -> float:
        """The mean of the k smallest of the base's values and `opt`'s: `with_option` of a worker outside `inner`
        (k > 1), and, for any worker, no more than `with_option` of it (its other values are the base's or
        larger ones): a lower bound, added in the same ascending order, so one in floating point too."""
        k = self.k
        base = self.base_taken
        t, svc = opt
        if t >= base[-1]:
            return self.base_s  # (takes none of the new worker's values, or only values equal to the base's own)
        # the k smallest of the base's values and the new worker's t, t + svc, ..., ascending: those of its values
        # below the base's last (at most k; one equal to it would only stand for an equal value) sorted in
        last = base[-1]
        values = []
        while t < last and len(values) < k:
            values.append(t)
            t += svc
        values += base
        values.sort()
        del values[k:]
        return _mean(values, k)
