"""Load forecast per worker: expected queue wait now, and at a later time given predicted extra work.

Used by the expected-TTFT router and the planner. Pure: a `WorkerView`, `now` and a `CostModel` in, seconds out.
"""

from __future__ import annotations

import bisect
from typing import Optional

from radix_sync.policy.cost import CostModel
from radix_sync.policy.snapshot import WorkerView


def queue_wait_s(cost: CostModel, w: WorkerView, now: float) -> float:
    """Expected wait before a request arriving now at `w` starts its prefill.

    Prefill has priority over decode (SGLang's default scheduler), so the wait is the rest of the iteration in
    progress plus the prefill of everything queued ahead.

    Args:
        cost: the cost model.
        w: the worker's reported load.
        now: current time, s.
    Returns:
        seconds >= 0.
    """
    p = cost.profile
    if w.num_waiting == 0 and w.waiting_new_tokens == 0:
        return max(0.0, w.busy_until_s - now)
    work = (w.num_waiting * p.prefill_overhead_s + w.waiting_new_tokens * p.prefill_s_per_token
            + w.waiting_attn_pairs * p.prefill_s_per_token_pair
            + w.waiting_cached_pairs * p.prefill_s_per_cached_pair)
    return max(0.0, w.busy_until_s - now) + cost.prefill_scale * work


def split_iteration(cost: CostModel, w: WorkerView, now: float, in_progress_s: Optional[float] = None) -> WorkerView:
    """`w` with its queued prefill work split into the iteration in progress and what queues behind it.

    A live router counts a request it sent as queued until its first token, so the prefill a worker is computing
    right now is part of `waiting_*`, and `busy_until_s` is only the decode step. What runs between two iterations
    (a gather at a copy's source, an install at its target) waits for the whole prefill iteration in progress,
    which takes up to one chunk (`chunked_prefill_len` tokens) of that work. This moves that much of the queued work
    (in seconds, the same share of every term) into `busy_until_s`: the worker's queue wait (`queue_wait_s`) is
    unchanged, and the iteration ends at the latest the one in progress can (it may have started before `now`: an
    upper bound, which is what a request waiting for a copy must not under-estimate). Measured live before this
    (agent sessions, 3 rounds of `kvrep bench`): about half the router's pulls were still pending at the busy source
    when their deadline passed.

    Args:
        cost: the cost model.
        w: a live worker view.
        now: current time, s.
        in_progress_s: prefill seconds of the queued work that may be in progress (the router's own requests not
            started; a worker's reported waiting queue is not running); None: all of it.
    Returns:
        `w` unchanged when nothing of it may be in progress; else with `busy_until_s` at the end of the prefill
        iteration in progress and the `waiting_*` terms and `num_waiting` scaled to the rest (floats).
    """
    work = queue_wait_s(cost, w, now) - max(0.0, w.busy_until_s - now)  # the queued prefill alone
    running = min(work, cost.prefill_s(cost.profile.chunked_prefill_len, 0),
                  work if in_progress_s is None else in_progress_s)
    if running <= 0.0:
        return w
    rest = 1.0 - running / work
    return w._replace(busy_until_s=max(w.busy_until_s, now) + running, num_waiting=w.num_waiting * rest,
                      waiting_new_tokens=w.waiting_new_tokens * rest, waiting_attn_pairs=w.waiting_attn_pairs * rest,
                      waiting_cached_pairs=w.waiting_cached_pairs * rest)


def own_prefill_s(cost: CostModel, tokens: float, attn_pairs: float, cached_pairs: float) -> float:
    """Prefill seconds of a router's own requests sent to a worker and not started (their uncached tokens and
    attention work): what may be in progress there (`split_iteration`'s `in_progress_s`)."""
    return queue_wait_s(cost, WorkerView(0, waiting_new_tokens=tokens, waiting_attn_pairs=attn_pairs,
                                         waiting_cached_pairs=cached_pairs), 0.0)


def drained(cost: CostModel, w: WorkerView, done_s: float, now: float) -> WorkerView:
    """`w` with `done_s` seconds of its queued prefill work already done (the same share of every term): a router's
    own requests at a worker that was idle when the first of them went there have been computing since
    (`radix_sync.router.pool.WorkerPool.alone_since` live, `radix_sync.sim.views.LoadViews` simulated)."""
    work = queue_wait_s(cost, w, now) - max(0.0, w.busy_until_s - now)
    if work <= 0.0 or done_s <= 0.0:
        return w
    rest = max(0.0, 1.0 - done_s / work)
    return w._replace(num_waiting=w.num_waiting * rest, waiting_new_tokens=w.waiting_new_tokens * rest,
                      waiting_attn_pairs=w.waiting_attn_pairs * rest,
                      waiting_cached_pairs=w.waiting_cached_pairs * rest)


class WaitForecast:
    """Per-worker queue-wait curve: the current backlog draining at rate 1, plus predicted work arriving later.

    Owned by one planning pass; `add_work` registers expected work (s) arriving at a time; `wait_at` answers the
    expected wait of a request arriving at `t` (work arriving before `t` is served first, FCFS).
    """

    def __init__(self, cost: CostModel, workers: tuple[WorkerView, ...], now: float) -> None:
        self.now = now
        self.base_s = [queue_wait_s(cost, w, now) for w in workers]
        self._times: list[list[float]] = [[] for _ in workers]
        self._work: list[list[float]] = [[] for _ in workers]
        self._after: list[list[float]] = [[] for _ in workers]
        """Per worker, the backlog just after each predicted arrival (the recurrence of `wait_at`), its first
        `_valid` kept while the arrivals before them do not change: a wait is then a bisection, not a walk over
        the arrivals before it."""
        self._valid: list[int] = [0] * len(workers)
        self._changed: list[int] = []
        """The workers whose work changed, in order (what `waits_at` takes again)."""
        self._waits: dict[float, tuple[list[float], int]] = {}
        """Arrival time -> (every worker's `wait_at` it, how many changes of `_changed` they include)."""

    def add_work(self, worker_id: int, at_s: float, work_s: float) -> None:
        """Registers `work_s` seconds of prefill expected to arrive at `worker_id` at `at_s`."""
        i = bisect.bisect_right(self._times[worker_id], at_s)
        self._times[worker_id].insert(i, at_s)
        self._work[worker_id].insert(i, work_s)
        if i < self._valid[worker_id]:
            self._valid[worker_id] = i
        self._changed.append(worker_id)

    def add_all(self, entries) -> None:
        """`add_work` of each (worker, at_s, work_s) of `entries`, in order."""
        times, work, valid, changed = self._times, self._work, self._valid, self._changed
        after = bisect.bisect_right
        for worker_id, at_s, work_s in entries:
            wt = times[worker_id]
            i = after(wt, at_s)
            wt.insert(i, at_s)
            work[worker_id].insert(i, work_s)
            if i < valid[worker_id]:
                valid[worker_id] = i
            changed.append(worker_id)

    def remove_work(self, worker_id: int, at_s: float, work_s: float) -> None:
        """Removes one entry registered with `add_work` (same arguments)."""
        times, work = self._times[worker_id], self._work[worker_id]
        i = bisect.bisect_left(times, at_s)
        while i < len(times) and times[i] == at_s:
            if work[i] == work_s:
                # (the last of a run of equal entries goes: the same arrivals left, and the backlogs before it
                # stay as they were: predicted work alike at one time, a thousand popular prefixes, is common)
                end = bisect.bisect_right(times, at_s, i)
                if work[i:end].count(work_s) == end - i:
                    i = end - 1  # (every one left at that time is alike)
                else:
                    while i + 1 < end and work[i + 1] == work_s:
                        i += 1
                del times[i]
                del work[i]
                if i < self._valid[worker_id]:
                    self._valid[worker_id] = i
                self._changed.append(worker_id)
                return
            i += 1
        raise ValueError(f"no work {work_s!r} at {at_s!r} on worker {worker_id}")

    def wait_at(self, worker_id: int, t: float) -> float:
        """Expected wait (s) of a request arriving at `worker_id` at time `t`.

        Simulates the single FCFS server: backlog at `now`, then each predicted arrival up to `t`.
        """
        times = self._times[worker_id]
        n = bisect.bisect_right(times, t)
        if n == 0:
            return max(0.0, self.base_s[worker_id] - max(0.0, t - self.now))
        after = self._after[worker_id]
        if self._valid[worker_id] < len(times) or len(after) != len(times):
            after = self._backlogs(worker_id)
        return max(0.0, after[n - 1] - max(0.0, t - times[n - 1]))

    def waits_at(self, t: float) -> list[float]:
        """Every worker's `wait_at(worker, t)`, in worker order (read-only: kept for the next call at `t`, which
        takes again only the workers whose work changed since)."""
        kept = self._waits.get(t)
        changed = self._changed
        if kept is None:
            # (`wait_at`, with the case of no arrival up to `t` inline: most workers, most passes)
            lead = max(0.0, t - self.now)
            waits = [max(0.0, base - lead) if not times or times[0] > t else self.wait_at(w, t)
                     for w, (base, times) in enumerate(zip(self.base_s, self._times))]
        elif kept[1] == len(changed):
            return kept[0]
        else:
            waits = list(kept[0])
            for w in set(changed[kept[1]:]):
                waits[w] = self.wait_at(w, t)
        self._waits[t] = (waits, len(changed))
        return waits

    def _backlogs(self, worker_id: int) -> list[float]:
        """The backlog just after each predicted arrival at `worker_id`: FCFS, the backlog at `now` first (those
        after the arrivals that did not change since they were taken are taken again, from the last of those on:
        the same recurrence, the same values)."""
        times, out, valid = self._times[worker_id], self._after[worker_id], self._valid[worker_id]
        del out[valid:]
        if valid:
            backlog, clock = out[-1], times[valid - 1]
        else:
            backlog, clock = self.base_s[worker_id], self.now
        for at_s, work_s in zip(times[valid:], self._work[worker_id][valid:]):
            backlog = max(0.0, backlog - (at_s - clock)) + work_s
            clock = at_s
            out.append(backlog)
        self._valid[worker_id] = len(times)
        return out
