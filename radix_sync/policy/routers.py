"""Router policies: pick the worker (and possibly a copy on the critical path) for one arriving request.

Each baseline is a model of a published rule, cited on its class. A router sees a `RequestView` and the workers'
`WorkerView`s plus `now`; it may keep its own state (a round-robin cursor, an approximate tree, a load history)
fed only by its own decisions. `uses_cached_len` tells the caller whether it must fill `RequestView.cached_len`
from the exact directory.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from radix_sync.policy.cost import CostModel
from radix_sync.policy.forecast import queue_wait_s
from radix_sync.policy.pagetree import PageTree
from radix_sync.policy.registry import Registry
from radix_sync.policy.snapshot import RequestView, Route, WorkerView

ROUTERS: Registry["RouterPolicy"] = Registry("router")


class RouterPolicy:
    """Interface: `route` one request; `on_finished` when a request it routed has finished."""

    uses_cached_len = False
    uses_worker_views = True
    """False: `route` only needs `len(workers)` (the caller may pass placeholders)."""

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        """Picks a worker.

        Args:
            req: the request (with `cached_len` filled when `uses_cached_len`).
            workers: every worker's load, indexed by worker id.
            now: current time, s.
        Returns:
            the decision.
        """
        raise NotImplementedError

    def on_finished(self, worker_id: int, request_id: int, now: float) -> None:
        """Feeds the completion of a request this router placed (default: nothing)."""


def _load(w: WorkerView) -> int:
    return w.num_running + w.num_waiting


@ROUTERS.register("round_robin")
class RoundRobinRouter(RouterPolicy):
    """Cyclic assignment: worker (k mod N) for the k-th request (sgl-model-gateway `round_robin`,
    https://github.com/sgl-project/sglang/tree/main/sgl-model-gateway)."""

    uses_worker_views = False

    def __init__(self, **_: object) -> None:
        self._next = 0

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        w = self._next % len(workers)
        self._next += 1
        return Route(w)


@ROUTERS.register("least_load")
class LeastLoadRouter(RouterPolicy):
    """Join-the-shortest-queue on outstanding requests (running + queued), lowest id on ties; the load
    fallback of sgl-model-gateway's `cache_aware` policy and vLLM production-stack's `loadaware` routing
    (https://docs.vllm.ai/projects/production-stack/)."""

    def __init__(self, **_: object) -> None:
        pass

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        return Route(min(range(len(workers)), key=lambda i: (_load(workers[i]), i)))


@dataclass(frozen=True)
class CacheAwareConfig:
    """sgl-model-gateway `cache_aware` defaults (https://github.com/lightseekorg/smg docs/getting-started/
    load-balancing.md: --cache-threshold 0.3, --balance-abs-threshold 64, --balance-rel-threshold 1.5)."""

    cache_threshold: float = 0.3
    """Minimum prefix match ratio (0..1) to route to the best-matching worker."""
    balance_abs_threshold: int = 64
    """Load difference (requests) above which the system counts as imbalanced (with the relative test)."""
    balance_rel_threshold: float = 1.5
    """Load ratio max/min above which the system counts as imbalanced (with the absolute test)."""
    max_tree_tokens: int = 2 ** 26 // 4
    """Approximate tree size limit per worker, tokens (the gateway's 2^26 characters at ~4 characters/token)."""
    eviction_interval_s: float = 120.0
    """How often the approximate tree is trimmed to `max_tree_tokens`, s."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold={self.cache_threshold!r} must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance thresholds ({self.balance_abs_threshold!r}, {self.balance_rel_threshold!r})"
                             " must be >= 0 and >= 1")
        if self.max_tree_tokens <= 0 or self.eviction_interval_s <= 0:
            raise ValueError(f"max_tree_tokens={self.max_tree_tokens!r}, eviction_interval_s="
                             f"{self.eviction_interval_s!r} must be > 0")


@ROUTERS.register("cache_aware")
class CacheAwareRouter(RouterPolicy):
    """sgl-model-gateway `cache_aware` (https://github.com/sgl-project/sglang/tree/main/sgl-model-gateway,
    README "Cache-Aware Load-Balancing"): if the load is imbalanced (max-min > abs threshold AND
    max > rel threshold x min), route to the least-loaded worker; otherwise route to the worker whose
    *approximate* tree (built from the router's own past decisions, not from the workers' caches) matches the
    longest prefix if the match ratio exceeds `cache_threshold`, else to the worker with the smallest tree.
    The chosen worker's tree gets the prompt. Trees are trimmed LRU to a size limit periodically."""

    def __init__(self, page_len: int = 1, cfg: CacheAwareConfig = CacheAwareConfig(), **_: object) -> None:
        self.cfg = cfg
        self.page_len = page_len
        self._trees: list[PageTree] = []
        self._next_trim_s = cfg.eviction_interval_s

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        while len(self._trees) < len(workers):
            self._trees.append(PageTree())
        loads = [_load(w) for w in workers]
        lo, hi = min(loads), max(loads)
        pages = req.page_hashes
        if hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo:
            target = loads.index(lo)
        else:
            best, best_len = 0, -1
            for i, tree in enumerate(self._trees[: len(workers)]):
                m = tree.match_len(pages)
                if m > best_len:
                    best, best_len = i, m
            ratio = best_len * self.page_len / req.prompt_len if req.prompt_len else 0.0
            if ratio > self.cfg.cache_threshold:
                target = best
            else:
                sizes = [len(t) for t in self._trees[: len(workers)]]
                target = sizes.index(min(sizes))
        tree = self._trees[target]
        tree.insert(pages, len(pages), now)
        if pages:
            tree.touch(pages[-1], now)
        if now >= self._next_trim_s:
            limit = self.cfg.max_tree_tokens // self.page_len
            for t in self._trees:
                if len(t) > limit:
                    t.evict(len(t) - limit)
            self._next_trim_s = now + self.cfg.eviction_interval_s
        return Route(target)


@ROUTERS.register("cost")
class DynamoCostRouter(RouterPolicy):
    """NVIDIA Dynamo KV router (https://docs.nvidia.com/dynamo/latest/router/README.html, "Cost Function"):
    cost = overlap_score_weight x potential prefill blocks + potential decode blocks, from an exact index
    fed by KV events; the lowest cost wins (temperature 0; ties broken at random).
    Potential prefill blocks = (input tokens - overlap blocks x block size) / block size; potential decode
    blocks = blocks of the requests already active on the worker plus this request's."""

    uses_cached_len = True

    def __init__(self, page_len: int = 1, overlap_score_weight: float = 1.0, seed: int = 0, **_: object) -> None:
        if overlap_score_weight < 0:
            raise ValueError(f"overlap_score_weight={overlap_score_weight!r} must be >= 0")
        self.page_len = page_len
        self.weight = overlap_score_weight
        self._rng = random.Random(seed)

    def cost(self, req: RequestView, w: WorkerView) -> float:
        """Returns: the Dynamo cost of placing `req` on `w`, in blocks."""
        prefill_blocks = (req.prompt_len - req.cached_len[w.worker_id]) / self.page_len
        active = w.running_ctx_tokens + w.waiting_new_tokens + w.waiting_cached_tokens
        decode_blocks = (active + req.prompt_len) / self.page_len
        return self.weight * prefill_blocks + decode_blocks

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        costs = [self.cost(req, w) for w in workers]
        best = min(costs)
        ties = [i for i, c in enumerate(costs) if c <= best + 1e-9]
        return Route(ties[0] if len(ties) == 1 else self._rng.choice(ties))


def _pull_eta_s(w_src: WorkerView, w_dst: WorkerView, num_bytes: float, cost: CostModel, now: float) -> float:
    bw = min(w_src.nic_bandwidth_bytes_per_s, w_dst.nic_bandwidth_bytes_per_s)
    start = max(now, w_src.egress_busy_until_s, w_dst.ingress_busy_until_s)
    return start + cost.transfer_s(num_bytes, bw)


@ROUTERS.register("pull")
class MooncakePullRouter(RouterPolicy):
    """Mooncake conductor, KVCache-centric scheduling (Qin et al., FAST'25, https://arxiv.org/abs/2407.00079,
    Algorithm 1): for every instance estimate TTFT = queue time + prefill of the uncached part, where an
    instance whose local prefix is shorter than the best holder's (by more than `balancing_threshold` x) first
    transfers the missing prefix from that holder; pick the lowest TTFT and, if so chosen, copy on the
    request's path. NOTE: in our model the copy overlaps the queueing (the request cannot start before both)."""

    uses_cached_len = True

    def __init__(self, cost: CostModel, kv_bytes_per_token: int, balancing_threshold: float = 1.0,
                 **_: object) -> None:
        if balancing_threshold < 1.0:
            raise ValueError(f"balancing_threshold={balancing_threshold!r} must be >= 1")
        self.cost = cost
        self.kv_bytes_per_token = kv_bytes_per_token
        self.threshold = balancing_threshold

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        best_src = max(range(len(workers)), key=lambda i: (req.cached_len[i], -i))
        best_len = req.cached_len[best_src]
        choice, choice_ttft = Route(0), float("inf")
        for w in workers:
            i = w.worker_id
            local = req.cached_len[i]
            wait = queue_wait_s(self.cost, w, now)
            ttft = wait + self.cost.prefill_s(req.prompt_len - local, local)
            route = Route(i, expected_ttft_s=ttft)
            if best_len > self.threshold * local and i != best_src and w.nic_bandwidth_bytes_per_s > 0:
                eta = _pull_eta_s(workers[best_src], w, (best_len - local) * self.kv_bytes_per_token, self.cost, now)
                t2 = max(wait, eta - now) + self.cost.prefill_s(req.prompt_len - best_len, best_len)
                if t2 < ttft:
                    ttft, route = t2, Route(i, pull_from=best_src, pull_len=best_len, expected_ttft_s=t2)
            if ttft < choice_ttft - 1e-12:
                choice, choice_ttft = route, ttft
        return choice


@ROUTERS.register("e2")
class PrebleE2Router(RouterPolicy):
    """Preble E2 scheduling (Srivatsa et al., ICLR'25, https://arxiv.org/abs/2407.00023, Section 4): if the
    longest cached prefix covers more of the prompt than it misses, *exploit*: go to the holder with the lowest
    load; else *explore*: go to the worker with the least cost = recent compute load (prefill + decode time of
    the requests it got within a window) + eviction cost + the prefill of the missed tokens. A hot prefix whose
    holders are overloaded (load > `imbalance_ratio` x the lightest worker's) is replicated by sending the
    request to the lightest worker, which recomputes the prefix (no KV copy)."""

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


def ttft_rank_key(expected_ttft_s: float, worker_id: int, workers: Sequence[WorkerView]) -> tuple[float, int, int]:
    """The order of `ExpectedTtftRouter`'s options, best first (its choice is the lowest; `kvrep router` ranks
    its failover order by it too).

    Args:
        expected_ttft_s: the option's expected TTFT, s.
        worker_id: the option's worker (an index into `workers`).
        workers: every worker's load, indexed by worker id.
    Returns:
        (expected TTFT rounded to 1 ns, the worker's outstanding requests, its id): so ties go to fewer
        outstanding requests, then to the lower id.
    """
    return round(expected_ttft_s, 9), _load(workers[worker_id]), worker_id


@ROUTERS.register("expected_ttft")
class ExpectedTtftRouter(RouterPolicy):
    """Ours (`kvrep` and `oracle`): the worker with the lowest expected TTFT = queue wait + prefill of the
    uncached part, counting copies in flight with their arrival time and, when `allow_pull`, a copy on the
    critical path from the best holder (as Mooncake does). Ties: fewer outstanding requests, then lower id."""

    uses_cached_len = True

    def __init__(self, cost: CostModel, kv_bytes_per_token: int, allow_pull: bool = True, **_: object) -> None:
        self.cost = cost
        self.kv_bytes_per_token = kv_bytes_per_token
        self.allow_pull = allow_pull

    def _scan(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> list[tuple]:
        """Returns per worker (expected TTFT, worker id, kind, pull source, pull length); kind 0: as is, 1: wait
        for a copy in flight, 2: pull. Routes are built by the callers (only the winner's, in `route`)."""
        cached = req.cached_len
        best_src = max(range(len(workers)), key=lambda i: (cached[i], -i))
        best_len = cached[best_src]
        inflight: dict[int, tuple[int, float]] = {}
        for h in req.inflight:
            if h.eta_s is not None and h.depth_len > inflight.get(h.worker_id, (0, 0.0))[0]:
                inflight[h.worker_id] = (h.depth_len, h.eta_s)
        cost, prompt_len = self.cost, req.prompt_len
        pull_bytes = self.kv_bytes_per_token
        prefill: dict[int, float] = {}  # cached length -> prefill time: workers mostly share a few lengths
        out = []
        for w in workers:
            i = w.worker_id
            wait = queue_wait_s(cost, w, now)
            local = cached[i]
            p = prefill.get(local)
            if p is None:
                p = prefill[local] = cost.prefill_s(prompt_len - local, local)
            t_best, kind = wait + p, 0
            if i in inflight and inflight[i][0] > local:
                depth, eta = inflight[i]
                t = max(wait, eta - now) + cost.prefill_s(prompt_len - depth, depth)
                if t < t_best:
                    t_best, kind = t, 1
            if self.allow_pull and best_len > local and i != best_src and w.nic_bandwidth_bytes_per_s > 0:
                eta = _pull_eta_s(workers[best_src], w, (best_len - local) * pull_bytes, cost, now)
                p = prefill.get(best_len)
                if p is None:
                    p = prefill[best_len] = cost.prefill_s(prompt_len - best_len, best_len)
                t = max(wait, eta - now) + p
                if t < t_best:
                    t_best, kind = t, 2
            out.append((t_best, i, kind, best_src, best_len))
        return out

    @staticmethod
    def _route(t: float, i: int, kind: int, src: int, length: int) -> Route:
        if kind == 1:
            return Route(i, wait_inflight=True, expected_ttft_s=t)
        if kind == 2:
            return Route(i, pull_from=src, pull_len=length, expected_ttft_s=t)
        return Route(i, expected_ttft_s=t)

    def options(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> list[Route]:
        """Returns: the best option per worker, with its expected TTFT."""
        return [self._route(*o) for o in self._scan(req, workers, now)]

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        # the lowest `ttft_rank_key`; rounding is monotonic, so only options within a rounding step of the
        # fastest can tie with it (the rest need no key)
        opts = self._scan(req, workers, now)
        near = min(o[0] for o in opts) + 2e-9
        best = min((o for o in opts if o[0] <= near), key=lambda o: ttft_rank_key(o[0], o[1], workers))
        return self._route(*best)


def make_router(name: str, *, cost: Optional[CostModel] = None, page_len: int = 1, kv_bytes_per_token: int = 0,
                seed: int = 0, **kwargs: object) -> RouterPolicy:
    """Builds a registered router with the shared context it may need.

    Args:
        name: registered router name.
        cost: the cost model (for routers that estimate times).
        page_len: tokens per page.
        kv_bytes_per_token: KV bytes per token (for routers that price copies).
        seed: seed for randomized tie-breaking.
    Returns:
        a fresh router.
    """
    return ROUTERS.create(name, cost=cost, page_len=page_len, kv_bytes_per_token=kv_bytes_per_token, seed=seed,
                          **kwargs)
