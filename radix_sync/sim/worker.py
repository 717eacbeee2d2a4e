"""Iteration-level model of one SGLang worker: FCFS waiting queue, chunked prefill (prefill has priority over
decode, SGLang's default), continuous batching of decodes, page-granular prefix cache with LRU.

Decode iterations between two batch changes are advanced in closed form (the batch's context grows by one token
per request per step), and such a stretch is cut at the next step boundary when a request arrives. Timing comes
from the `CostProfile` (ground truth of the simulation).

```
 time ─▶ | prefill chunk (≤ chunk len, several requests) | decode x k (closed form) | prefill … |
          first tokens at the end of the chunk that completes a prompt; finishes at decode boundaries
```
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Protocol

from radix_sync.policy.cost import CostProfile
from radix_sync.policy.snapshot import LoadsReport
from radix_sync.sim.cache import WorkerCache
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.workload import SimRequest

IDLE, PREFILL, DECODE = 0, 1, 2
GEN_WINDOW_STEPS = 40
"""SGLang's `decode_log_interval` (server_args default): `gen_throughput` is measured over this many decode steps."""
GEN_STALE_S = 30.0
"""`GEN_THROUGHPUT_STALENESS_SECONDS` (`metrics_reporter.py`): the reported throughput drops to 0 after this long
without a window ending."""
FIRST, DONE = 0, 1  # kinds of a request's outputs held back by `EngineConfig.overlap_lag`


class WorkerHost(Protocol):
    """What a `SimWorker` reports to: the engine (`radix_sync.sim.engine.Engine`), named here by its role so that
    the worker does not import the engine."""

    cfg: EngineConfig

    def schedule_iter_end(self, worker: "SimWorker", t: float) -> None:
        """The worker's iteration in progress ends at `t` (an earlier schedule of it is void)."""

    def core_speed(self) -> float:
        """Returns: the speed an iteration runs at now (`EngineConfig.shared_cores`; 1.0 otherwise)."""

    def on_busy_changed(self, now: float) -> None:
        """The worker started or stopped working (`EngineConfig.shared_cores` only)."""

    def on_boundary(self, worker: "SimWorker", now: float) -> None:
        """`worker` is between iterations, its arrivals queued, its next batch not formed yet."""

    def on_admit(self, worker: "SimWorker", req: SimRequest, matched_pages: int, now: float) -> None:
        """`req` was admitted on `worker` with `matched_pages` cached."""

    def on_reject(self, req: SimRequest, now: float) -> None:
        """`req` can never fit the worker's KV pool."""

    def on_first_token(self, req: SimRequest, now: float) -> None:
        """`req` streamed its first token."""

    def on_finish(self, req: SimRequest, now: float) -> None:
        """`req` finished."""


class SimWorker:
    """One worker. Owns its queue, running batch and `WorkerCache`; reports to the engine by callbacks."""

    def __init__(self, worker_id: int, profile: CostProfile, cache: WorkerCache, engine: WorkerHost) -> None:
        self.wid = worker_id
        self.p = profile
        self.cache = cache
        self.engine = engine
        self.waiting: deque[SimRequest] = deque()
        self.running: list[tuple[int, int, SimRequest]] = []  # heap of (finish_step, rid, req)
        self.num_admitted = 0  # admitted, still prefilling
        self.steps = 0
        self.sum_ctx = 0
        self.state = IDLE
        self.iter_start_s = 0.0
        self.iter_end_s = 0.0
        self.iteration_s = 0.0
        """Moving average of its iterations' durations, per scheduler step, as the live agent reports it
        (`LoadReported.iteration_s`: 0.8 x the last value + 0.2 x each step's)."""
        self.version = 0
        self._busy_memo = (-1, 0.0)  # (version, end of the decode step in progress) of the last busy_until_s
        self.lag = engine.cfg.overlap_lag
        self._out: list[tuple[int, SimRequest]] = []
        """`overlap_lag`: outputs (first tokens, finishes) of the last iteration, streamed when the next one ends."""
        # processor sharing (`EngineConfig.shared_cores`): the iteration in progress is `ps_total` seconds of work
        # at full speed, `ps_done` of them done at `ps_t`, running at `ps_speed` since
        self.shared = engine.cfg.shared_cores > 0
        self.ps_total = 0.0
        self.ps_done = 0.0
        self.ps_t = 0.0
        self.ps_speed = 1.0
        self._batch: list[tuple[SimRequest, int]] = []
        self._macro_k = 0
        self._macro_b = 0
        self._macro_ctx = 0
        # queue estimates for WorkerView
        self.waiting_new_tokens = 0
        self.waiting_cached_tokens = 0
        self.waiting_attn_pairs = 0.0
        self.num_rejected = 0
        # SGLang's `gen_throughput` (`LoadsReport`): decode tokens since the last window's end, when it ended
        self._gen_tokens = 0
        self._gen_tic_s = 0.0
        self._gen_throughput = 0.0

    # ---- queue ----
    def enqueue(self, req: SimRequest, now: float) -> None:
        """Queues a routed request (it may wait for a copy until `req.ready_s`). Its cached prefix is made recent, as
        SGLang refreshes its waiting requests' prefixes (`SchedulePolicy._touch_waiting_prefixes`; the plugin's
        agent under its `priority` eviction), so LRU does not take it while the request waits."""
        m = self.cache.match_len(req.pages)
        if m and self.cache.oracle_pages is None:
            self.cache.tree.refresh(req.pages[m - 1], now)
        cached = min(m * self.cache.page_len, req.prompt_len - 1)
        cached = max(cached, min(req.est_cached, req.prompt_len - 1))
        req.est_cached = cached
        req.est_new = req.prompt_len - cached
        req.est_pairs = req.est_new * cached + req.est_new * (req.est_new + 1) / 2.0
        self.waiting_new_tokens += req.est_new
        self.waiting_cached_tokens += cached
        self.waiting_attn_pairs += req.est_pairs
        req.worker = self.wid
        self.waiting.append(req)
        self.poke(now)

    def poke(self, now: float) -> None:
        """Something changed (arrival, copy landed): start an iteration if idle, or cut a decode stretch short."""
        if self.state == IDLE:
            self._start(now)
        elif self.state == DECODE and now < self.iter_end_s and self._macro_k > 1:
            k = self._steps_done_by(now)
            if k < self._macro_k:
                self._macro_k = k
                work = self.p.decode_steps_s(k, self._macro_b, self._macro_ctx)
                if self.shared:
                    self.ps_total = work
                    self.iter_end_s = now + max(0.0, work - self._elapsed(now)) / self.ps_speed
                else:
                    self.iter_end_s = self.iter_start_s + work
                self.version += 1
                self.engine.schedule_iter_end(self, self.iter_end_s)

    def _steps_done_by(self, now: float) -> int:
        """Smallest k >= 1 whose end is >= now (the step in progress at `now` completes)."""
        lo, hi = 1, self._macro_k
        b, c, t0 = self._macro_b, self._macro_ctx, self.iter_start_s
        if self.shared:  # in work seconds since the iteration started
            t0, now = 0.0, self._elapsed(now)
        p = self.p
        # Closed form first: t(k) = k per + a k(k-1)/2 with a = ctx cost x batch, per = cost of the first step;
        # the root of t(k) = now - t0 is exact up to rounding, so only its neighbours are checked.
        per = p.decode_step_s + p.decode_s_per_request * b + p.decode_s_per_ctx_token * c
        a = p.decode_s_per_ctx_token * b
        dt = now - t0
        if per > 0.0:
            if a > 0.0:
                bq = per - a / 2.0
                k = (-bq + (bq * bq + 2.0 * a * dt) ** 0.5) / a
            else:
                k = dt / per
            k = min(max(int(k), 1), hi)
            if t0 + p.decode_steps_s(k, b, c) >= now:
                if k == 1 or t0 + p.decode_steps_s(k - 1, b, c) < now:
                    return k
            elif k + 1 <= hi and t0 + p.decode_steps_s(k + 1, b, c) >= now:
                return k + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if t0 + self.p.decode_steps_s(mid, b, c) >= now:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # ---- iterations ----
    def _admit(self, req: SimRequest, now: float) -> bool:
        cache, page = self.cache, self.cache.page_len
        m = cache.match_len(req.pages)
        h = cache.host.match_from(req.pages, m) if cache.host is not None else 0
        cached = min((m + h) * page, req.prompt_len - 1)
        need = req.prompt_len - cached + req.output_len
        if need + h * page > cache.capacity_tokens:
            if need > cache.capacity_tokens or not h:
                return False
            h, cached = 0, min(m * page, req.prompt_len - 1)  # the host pages would not fit beside it: recompute
            need = req.prompt_len - cached + req.output_len
        lock = req.pages[m - 1] if m > 0 else None
        cache.lock(lock)
        if h:  # being loaded: out of the host tier's LRU, so the pages the room evicts cannot push them out
            cache.host.take(req.pages[m:m + h])
        if not cache.make_room(need + h * page):
            cache.unlock(lock)
            if h:
                cache.host.add_chain(req.pages[m:m + h])
            return False
        if h:  # SGLang's `init_load_back`: device pages for the host prefix, loaded before the prefill runs
            cache.insert(req.pages, m + h, now)
            cache.unlock(lock)
            m += h
            lock = req.pages[m - 1]
            cache.lock(lock)
            req.host_len = h * page
            req.load_s = h * page * self.p.kv_bytes_per_token / self.engine.cfg.host_load_bytes_per_s
        cache.reserved_tokens += need
        req.reserved = need
        req.lock_page = lock
        req.cached_len = cached
        req.remaining_new = req.prompt_len - cached
        req.admitted = True
        self.num_admitted += 1
        # replace the enqueue-time estimate by the actual
        pairs = req.remaining_new * cached + req.remaining_new * (req.remaining_new + 1) / 2.0
        self.waiting_new_tokens += req.remaining_new - req.est_new
        self.waiting_cached_tokens += cached - req.est_cached
        self.waiting_attn_pairs += pairs - req.est_pairs
        req.est_new, req.est_cached, req.est_pairs = req.remaining_new, cached, pairs
        if m > 0 and cache.oracle_pages is None:
            cache.tree.touch(lock, now)
        self.engine.on_admit(self, req, m, now)
        return True

    def _start(self, now: float) -> None:
        self.engine.on_boundary(self, now)
        p = self.p
        budget = p.chunked_prefill_len
        batch: list[tuple[SimRequest, int]] = []
        dur = 0.0
        num_rejected = 0
        for req in self.waiting:
            if budget <= 0:
                break
            if req.ready_s > now:
                continue
            if not req.admitted:
                if len(self.running) + self.num_admitted >= p.max_running_requests:
                    break
                if not self._admit(req, now):
                    if req.prompt_len + req.output_len > self.cache.capacity_tokens:
                        req.admitted = False
                        req.remaining_new = -1  # rejected: removed below
                        num_rejected += 1
                        continue
                    break
            take = min(req.remaining_new, budget)
            dur += p.prefill_piece_s(take, req.prompt_len - req.remaining_new) + req.load_s
            req.load_s = 0.0  # (paid once, by its first piece: the forward waits for the load)
            batch.append((req, take))
            budget -= take
        if num_rejected:
            self._drop_rejected(now)
        if batch:
            self.state = PREFILL
            self._batch = batch
            self._begin(now, p.prefill_overhead_s + dur)
        elif self.running:
            b = len(self.running)
            self.state = DECODE
            # outputs held back are streamed when the next step ends: run one step, not a stretch
            self._macro_k = 1 if self._out else max(1, self.running[0][0] - self.steps)
            self._macro_b = b
            self._macro_ctx = self.sum_ctx
            self._begin(now, p.decode_steps_s(self._macro_k, b, self.sum_ctx))
        else:
            self.state = IDLE
            if self._out:  # nothing runs next: the last iteration's outputs go out now
                out, self._out = self._out, []
                self._release(out, now)
            if self.shared:
                self.engine.on_busy_changed(now)
            return
        self.version += 1
        self.engine.schedule_iter_end(self, self.iter_end_s)
        if self.shared:
            self.engine.on_busy_changed(now)

    def _begin(self, now: float, work: float) -> None:
        """Starts an iteration of `work` seconds at full speed (state already set)."""
        self.iter_start_s = now
        if self.shared:
            self.ps_total, self.ps_done, self.ps_t = work, 0.0, now
            self.ps_speed = self.engine.core_speed()
            self.iter_end_s = now + work / self.ps_speed
        else:
            self.iter_end_s = now + work

    def _elapsed(self, now: float) -> float:
        """Work seconds of the iteration in progress done by `now` (processor sharing)."""
        return self.ps_done + (now - self.ps_t) * self.ps_speed

    def reshare(self, now: float, speed: float) -> None:
        """Processor sharing: the iteration in progress continues at `speed` from `now` (its end moves)."""
        self.ps_done = self._elapsed(now)
        self.ps_t, self.ps_speed = now, speed
        self.iter_end_s = now + max(0.0, self.ps_total - self.ps_done) / speed
        self.version += 1
        self.engine.schedule_iter_end(self, self.iter_end_s)

    def _drop_rejected(self, now: float) -> None:
        if any(r.remaining_new == -1 for r in self.waiting):
            keep = deque()
            for r in self.waiting:
                if r.remaining_new == -1:
                    self.num_rejected += 1
                    self.waiting_new_tokens -= r.est_new
                    self.waiting_cached_tokens -= r.est_cached
                    self.waiting_attn_pairs -= r.est_pairs
                    self.engine.on_reject(r, now)
                else:
                    keep.append(r)
            self.waiting = keep

    def on_iter_end(self, now: float) -> None:
        """Completes the iteration in progress and starts the next one."""
        held = None
        steps = self._macro_k if self.state == DECODE else 1
        if steps > 0 and self.state != IDLE:
            keep = 0.8 ** steps
            took = (now - self.iter_start_s) / steps
            self.iteration_s = took if self.iteration_s == 0.0 else keep * self.iteration_s + (1.0 - keep) * took
        if self._out:  # `overlap_lag`: the previous iteration's outputs are streamed now
            held, self._out = self._out, []
        if self.state == PREFILL:
            done = []
            for req, take in self._batch:
                before = req.prompt_len - req.remaining_new
                req.remaining_new -= take
                self.waiting_new_tokens -= take
                piece_pairs = take * before + take * (take + 1) / 2.0
                self.waiting_attn_pairs -= piece_pairs
                req.est_new -= take
                req.est_pairs -= piece_pairs
                if req.remaining_new == 0:
                    done.append(req)
            self._batch = []
            if done:
                ids = {id(r) for r in done}
                waiting = self.waiting
                k = 0
                while waiting and k < len(done) and id(waiting[0]) in ids:  # usually the head of the queue
                    waiting.popleft()
                    k += 1
                if k < len(done):
                    self.waiting = deque(r for r in waiting if id(r) not in ids)
                for req in done:
                    self._prefilled(req, now)
        elif self.state == DECODE:
            before = self.steps
            self.steps += self._macro_k
            self.sum_ctx += self._macro_k * self._macro_b
            self._gen_tokens += self._macro_k * self._macro_b
            if self.steps // GEN_WINDOW_STEPS > before // GEN_WINDOW_STEPS:  # a window ended within these steps
                self._gen_throughput = self._gen_tokens / max(now - self._gen_tic_s, 1e-9)
                self._gen_tic_s, self._gen_tokens = now, 0
            while self.running and self.running[0][0] <= self.steps:
                _, _, req = heapq.heappop(self.running)
                self.sum_ctx -= req.prompt_len + 1 + (self.steps - req.join_step)
                self._finish(req, now)
        self.state = IDLE
        if held:
            self._release(held, now)
        self._start(now)

    def _release(self, out: list[tuple[int, SimRequest]], now: float) -> None:
        for kind, req in out:
            if kind == FIRST:
                self._first_token(req, now)
            else:
                self._done(req, now)

    def _prefilled(self, req: SimRequest, now: float) -> None:
        cache, page = self.cache, self.cache.page_len
        self.num_admitted -= 1
        self.waiting_cached_tokens -= req.est_cached
        self.waiting_attn_pairs -= req.est_pairs  # ~0 left; clears float drift
        req.est_pairs = 0.0
        full = len(req.pages)
        if full:
            cache.insert(req.pages, full, now)
            if cache.oracle_pages is None:  # SGLang inserts each chunk as it is done: a node per chunk
                for end in range(max(req.cached_len, 0) + self.p.chunked_prefill_len, full * page,
                                 self.p.chunked_prefill_len):
                    cache.tree.split_at(req.pages[end // page - 1])
            cache.lock(req.pages[-1])
            cache.unlock(req.lock_page)
            req.lock_page = req.pages[-1]
            if cache.oracle_pages is None:
                cache.tree.touch(req.pages[-1], now)
        moved = max(0, full * page - max(req.cached_len, 0)) if full * page > req.cached_len else 0
        moved = min(moved, req.reserved - req.output_len)
        cache.reserved_tokens -= moved
        req.reserved -= moved
        if self.lag:
            self._out.append((FIRST, req))
        else:
            self._first_token(req, now)
        if req.output_len <= 1:
            self._finish(req, now)
        else:
            req.join_step = self.steps
            self.sum_ctx += req.prompt_len + 1
            heapq.heappush(self.running, (self.steps + req.output_len - 1, req.rid, req))

    def _first_token(self, req: SimRequest, now: float) -> None:
        req.first_token_s = now
        self.engine.on_first_token(req, now)

    def _finish(self, req: SimRequest, now: float) -> None:
        self.cache.reserved_tokens -= req.reserved
        req.reserved = 0
        self.cache.unlock(req.lock_page)
        req.lock_page = None
        if self.lag:
            self._out.append((DONE, req))
        else:
            self._done(req, now)

    def _done(self, req: SimRequest, now: float) -> None:
        req.finish_s = now
        self.engine.on_finish(req, now)

    # ---- views ----
    def busy_until_s(self, now: float) -> float:
        """When a request arriving now could start: the end of the prefill iteration in progress, or of the
        decode step in progress (a decode stretch is cut at the next step boundary); `now` when idle."""
        if self.state == PREFILL:
            return self.iter_end_s
        if self.state == DECODE and now < self.iter_end_s:
            # NOTE: asked for every worker at every arrival; time only moves forward, so while the iteration is the
            # same (`version`) and `now` has not passed the end found last time, that step is still in progress
            if self._busy_memo[0] == self.version and now <= self._busy_memo[1]:
                return self._busy_memo[1]
            k = self._steps_done_by(now)
            work = self.p.decode_steps_s(k, self._macro_b, self._macro_ctx)
            end = now + max(0.0, work - self._elapsed(now)) / self.ps_speed if self.shared else self.iter_start_s + work
            self._busy_memo = (self.version, end)
            return end
        return now

    def loads_report(self, now: float) -> LoadsReport:
        """Returns: what SGLang's `/v1/loads` would report of this worker now; token usage = (capacity - free -
        evictable) / capacity (`pool_stats_observer.py::_get_token_info`): the pages the admitted and running
        requests lock, and the reservations. Approximations: the uncached tokens
        count every prefilling request's rest (SGLang counts the chunked one's; an unchunked prompt in the batch
        running is in neither queue), and the window of `gen_throughput` ends with the macro step it ends in."""
        if now - self._gen_tic_s > GEN_STALE_S:
            self._gen_throughput = 0.0
        cache = self.cache
        nodes, locked = cache.tree.nodes, set()
        for req in itertools.chain((r for _, _, r in self.running), (r for r in self.waiting if r.admitted)):
            page = req.lock_page
            while page is not None and page not in locked and page in nodes:  # its pages, shared ones once
                locked.add(page)
                page = nodes[page].parent
        used = min(cache.capacity_tokens, len(locked) * cache.page_len + cache.reserved_tokens)
        return LoadsReport(len(self.running), len(self.waiting) - self.num_admitted, self.waiting_new_tokens,
                           used / cache.capacity_tokens, self._gen_throughput)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) - self.num_admitted

    @property
    def num_running(self) -> int:
        return len(self.running) + self.num_admitted
