"""Router policies: pick the worker (and possibly a copy on the critical path) for one arriving request.

Here: the interface, the registry, `round_robin`, `least_load` and ours (`expected_ttft`). The baselines modelled
on published systems live in `radix_sync.policy.baselines`, one module per system, each rule cited on its class;
importing that package registers them. `CacheAwareConfig` stays here: the live router's fallback uses it too.

A router sees a `RequestView` and the workers' `WorkerView`s plus `now`; it may keep its own state (a round-robin
cursor, an approximate tree, in-flight requests) fed only by its own decisions and the `on_*` hooks. `uses_cached_len` tells the caller whether it must fill `RequestView.cached_len`
from the exact directory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from radix_sync.policy.cost import CostModel
from radix_sync.policy.forecast import queue_wait_s
from radix_sync.policy.pull import best_holder, pull_eta_s, pull_ttft_s
from radix_sync.policy.registry import Registry
from radix_sync.policy.snapshot import LoadsReport, RequestView, Route, WorkerView
from radix_sync.policy.speed import SpeedCalibration, runs_alone

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

    def on_first_token(self, worker_id: int, request_id: int, now: float) -> None:
        """Feeds the first output token (the end of prefill) of a request this router placed (default: nothing)."""

    def on_finished(self, worker_id: int, request_id: int, now: float) -> None:
        """Feeds the completion (or rejection) of a request this router placed (default: nothing)."""

    poll_period_s = 0.0
    """> 0: the router polls every worker's `LoadsReport` this often (the caller calls `on_poll`), first at
    `poll_phase_s`; 0: it does not poll."""
    poll_phase_s = 0.0

    def on_poll(self, reports: Sequence[LoadsReport], now: float) -> None:
        """Feeds one poll's reports, indexed by worker id (default: nothing)."""


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
    """sgl-model-gateway / smg `cache_aware` CLI defaults, the same in sglang-router 0.3.2 and smg 1.13.0 (`main.rs`:
    --cache-threshold 0.3, --balance-abs-threshold 64, --balance-rel-threshold 1.5, --eviction-interval 120,
    --max-tree-size 2^26; https://github.com/lightseekorg/smg docs/getting-started/load-balancing.md). 0.3.2 reads
    the thresholds as an imbalance test and the tree size per worker; smg 1.13 as a per-request spill gate and one
    budget shared by all workers (`radix_sync.policy.baselines.smg`)."""

    cache_threshold: float = 0.3
    """Minimum prefix match ratio (0..1) to route to the best-matching worker."""
    balance_abs_threshold: int = 64
    """Load difference (requests) above which the system counts as imbalanced (with the relative test)."""
    balance_rel_threshold: float = 1.5
    """Load ratio max/min above which the system counts as imbalanced (with the absolute test)."""
    max_tree_tokens: int = 2 ** 26 // 4
    """Approximate tree size limit, tokens (the gateway's 2^26 characters at ~4 characters/token)."""
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


_pull_eta_s = pull_eta_s  # (the name the baselines import)


def ttft_rank_key(expected_ttft_s: float, worker_id: int, workers: Sequence[WorkerView],
                  tie_start: int = 0, tie_draw: Optional[Sequence[float]] = None) -> tuple[float, float, float]:
    """The order of `ExpectedTtftRouter`'s options, best first (its choice is the lowest; `kvrep router` ranks
    its failover order by it too).

    Args:
        expected_ttft_s: the option's expected TTFT, s.
        worker_id: the option's worker (an index into `workers`).
        workers: every worker's load, indexed by worker id.
        tie_start: the worker a full tie goes to first (`next_tie_start`).
        tie_draw: a random number per worker (`tie_draws`), drawn for this decision by a router that shares the
            workers with other routers serving at the same time: ties on the expected TTFT then go by it alone.
    Returns:
        (expected TTFT rounded to 1 ns, the worker's outstanding requests, its distance from `tie_start` in
        cyclic id order): so ties go to fewer outstanding requests, then to the worker at or after `tie_start`;
        with `tie_draw`, (expected TTFT rounded to 1 ns, 0, the worker's draw).
    """
    if tie_draw is not None:
        return round(expected_ttft_s, 9), 0, tie_draw[worker_id]
    return round(expected_ttft_s, 9), _load(workers[worker_id]), (worker_id - tie_start) % max(1, len(workers))


def two_choices(ranked: list, workers: Sequence[WorkerView], ttft=lambda o: o[0],
                worker=lambda o: o[1]) -> list:
    """Power of two choices among the ties on the expected TTFT: `ranked` is ordered by `ttft_rank_key` with a
    `tie_draw` (so its first two, when they tie, are two tied workers drawn at random); returns it with those two
    swapped when the second has fewer requests outstanding. Each router thus keeps the load's information (of two
    tied workers, the less loaded; with two workers, the old rule's first key) without every router sending to the
    one least-loaded worker they all see. `ttft`, `worker`: how to read an item's expected TTFT and worker index."""
    if len(ranked) > 1 and round(ttft(ranked[0]), 9) == round(ttft(ranked[1]), 9) \
            and _load(workers[worker(ranked[1])]) < _load(workers[worker(ranked[0])]):
        return [ranked[1], ranked[0], *ranked[2:]]
    return ranked


def tie_draws(rng: random.Random, num_workers: int) -> list[float]:
    """Returns: a random number per worker, for one decision's ties on the expected TTFT (`ttft_rank_key`, then
    `two_choices`).

    For a router that is not alone: several routers in front of the same workers see the same shared load (the
    workers' reports, the other routers' sends relayed a few ms late). Ties on the expected TTFT are common (every
    idle worker holding a prompt's whole prefix ties), and broken by that shared load and a turn they all take alike,
    every router sent its share of a burst to the same worker before hearing of the others' sends. Measured in the
    simulator (shared-prefix bursts, 16 H200 workers, 4 routers relayed 3 ms late, stop 58): 53% of the requests
    went to a worker another router had sent one to in the last 3 ms (one router: 3%; seed 1), and the mean TTFT
    was 1.77x one router's. Drawn plainly (the first choice the lowest draw) it fell to 1.29x, but live on two CPU
    workers the plain draw's P99 was worse in 5 rounds of 6 (it ignores how loaded the two are); with
    `two_choices` (the less loaded of two drawn) 1.34x in the simulator. Alone, the shared load is this router's
    own and no draw is made. docs/bench.md, "Ties behind several routers"."""
    return [rng.random() for _ in range(num_workers)]


def full_tie(ranked: Sequence[tuple], workers: Sequence[WorkerView]) -> bool:
    """Whether the first two of `ranked` ((expected TTFT, worker id, ...), best first by `ttft_rank_key`) tie on
    time and load, so that only the tie rotation (`next_tie_start`) chose between them."""
    if len(ranked) < 2:
        return False
    (t0, w0), (t1, w1) = ranked[0][:2], ranked[1][:2]
    return round(t0, 9) == round(t1, 9) and _load(workers[w0]) == _load(workers[w1])


def next_tie_start(ranked: Sequence[tuple], workers: Sequence[WorkerView], tie_start: int) -> int:
    """Where the next full tie starts: after the worker that took this one if `ranked` starts with a full tie
    (`full_tie`), else `tie_start` unchanged.

    So ties rotate over the workers. They are mostly prompts no worker holds (new sessions, a tree's trunk) arriving
    while the workers are equally loaded; sent to the lowest id every time, worker 0 became most sessions' home (72%
    of agent requests on 2 workers, stop 48's saved runs) and more follow-ups found it busy and recomputed their
    history elsewhere (4-5% of requests; 2% with turns, stop 49's run).
    """
    return (ranked[0][1] + 1) % len(workers) if full_tie(ranked, workers) else tie_start


def count_pages(counts: dict[int, int], pages: Sequence[int], sign: int) -> None:
    """Adds (`sign` 1) or removes (-1) one request's `pages` to or from a page hash -> count map; a hash whose count
    falls to 0 leaves it (membership is what `ExpectedTtftRouter._own_len` reads)."""
    for h in pages:
        n = counts.get(h, 0) + sign
        if n:
            counts[h] = n
        else:
            del counts[h]


@ROUTERS.register("expected_ttft")
class ExpectedTtftRouter(RouterPolicy):
    """Ours (`kvrep` and `oracle`): the worker with the lowest expected TTFT = queue wait + prefill of the
    uncached part, counting copies in flight with their arrival time and, when `allow_pull`, a copy on the
    critical path from the best holder (as Mooncake does). Ties: fewer outstanding requests, then in turn.

    A request that waits for a copy (in flight, or its own pull) cannot start before the copy lands, and neither can
    the requests this router sent there earlier to wait for a copy: their prefill is not work the worker does while
    the copy travels. So an option that waits for a copy landing at `eta` starts at

        max(wait - gated, eta - now) + gated_before

    where `gated` is the prefill of this router's requests at the worker still waiting for a copy, and
    `gated_before` that of those whose copy lands no later than this one (they are ahead in the queue). Without
    it, a fan-out's branches all pile onto the first worker a replica is coming to (each one's wait hides under
    `max(wait, eta)`). State: its own decisions, dropped at the first token (`on_first_token`, `on_finished`).

    Likewise a prompt finds cached, at a worker, the prefix that this router's earlier requests there (not started
    yet) compute before it (`_own_len`), and the worker's load, which counts each of those as its whole uncached
    prompt, is over by what they will find cached (`_over`, taken off the wait). Without it the K candidates of one
    prompt (n > 1, best-of-K) each cost a whole prefill wherever they went, so each went to a different worker and
    recomputed the prompt (multi-candidate rate 20: 7.5 workers per job of 8, 2% of prompt tokens cached).

    Pulls are priced by `radix_sync.policy.pull`, the rule the live router's `--pull` runs too. `endpoint_wait`:
    a pull also waits for the iteration in progress at both ends (the live agents copy between scheduler
    iterations; off in the simulator, whose executor does not)."""

    uses_cached_len = True

    def __init__(self, cost: CostModel, kv_bytes_per_token: int, allow_pull: bool = True,
                 endpoint_wait: bool = False, page_len: int = 1, host_load_bytes_per_s: float = 0.0,
                 seed: int = 0, **_: object) -> None:
        self.cost = cost
        self.page_len = max(1, page_len)
        self._sent: dict[int, tuple[int, Sequence[int], float]] = {}
        """Request id -> (worker, its page hashes, the seconds its load over-counts): sent, no first token yet."""
        self._pages: dict[int, dict[int, int]] = {}
        """Worker -> page hash -> how many of this router's requests there, not yet started, hold it."""
        self._over: dict[int, float] = {}
        """Worker -> seconds of prefill its load counts for this router's requests that will find it cached."""
        self._external_pages = False
        """`_pages` is the caller's (`expect_pages`): read only."""
        self.count_sent = True
        """Whether what this router's requests sent and not started will compute counts as cached (`_own_len`);
        False: the directory alone (the live router's `--no-sent-pages`, before stop 53)."""

        self.kv_bytes_per_token = kv_bytes_per_token
        self.allow_pull = allow_pull
        self.endpoint_wait = endpoint_wait
        self._gated: dict[int, dict[int, tuple[float, float]]] = {}
        """Worker -> request id -> (when its copy lands, its prefill time, s): requests sent to wait for a copy."""
        self.host_load_bytes_per_s = host_load_bytes_per_s
        """Load-back rate of the workers' host tiers (`RequestView.host_len`), bytes/s; 0: not priced (none)."""
        self.speed: Optional[SpeedCalibration] = None
        """When set: the workers' prefill speed learned from the requests this router sent to a worker where they
        ran alone (`radix_sync.policy.speed`), which rescales `cost`'s prefill terms at each one's first token,
        as the live router's `--speed-calibration` does; None: the profile's times as they are."""
        self._alone: dict[int, tuple[int, int, float]] = {}
        """Request id -> (uncached, cached tokens, when sent) of the requests sent where they run alone."""
        self.tie_start = 0
        """The worker the next full tie goes to first (`next_tie_start`)."""
        self.tie_turns = True
        """Whether full ties take turns; False: the lowest id takes each (the live router's `--no-tie-turns`)."""
        self.peers = 0
        """Other routers serving the same workers at the same time whose sends this one hears of (simulated: the
        other front doors, when their sends are relayed, `EngineConfig.door_sends_s`; live: the send relay's
        routers less one). With any, a tie on the expected TTFT goes to the less loaded of two tied workers drawn
        at random (`tie_draws`, `two_choices`), not by the shared load and turn."""
        self.tie_draws = True
        """Whether ties are drawn with `peers` (False: by the shared load and turn whatever `peers` says, the live
        router's `--no-tie-draws`, as before stop 58)."""
        self.tie_draw: Optional[Sequence[float]] = None
        """The next decision's draw, when the caller drew it (the live router: one draw for its ranking and its
        puller); None: drawn here when `peers`."""
        self._rng = random.Random(seed)

    def expect_pages(self, pages: Mapping[int, Mapping[int, int]]) -> None:
        """Sets, per worker index, the page hashes of this router's requests sent there and not started (hash ->
        how many of them hold it), for a caller that keeps those counts itself: the live router, which ranks each
        request with a fresh instance (`radix_sync.router.policy.rank_by_ttft`). The mappings are read, never
        changed: `route` no longer adds the requests it routes to them (the caller does, when it sends one)."""
        self._pages = pages  # type: ignore[assignment]
        self._external_pages = True

    def expected_own_len(self, i: int, pages: Sequence[int], prompt_len: int) -> int:
        """Tokens of a prompt with page hashes `pages` that worker `i` will have computed for this router's
        requests sent there and not started before it starts (`_own_len`)."""
        return self._own_len(i, pages, prompt_len)

    def _own_len(self, i: int, pages: Sequence[int], prompt_len: int) -> int:
        """Tokens of a prompt with page hashes `pages` that this router's requests sent to worker `i` and not
        started yet will have computed before it starts (FCFS): the longest run of leading pages among theirs
        (chained hashes: a page's hash names its whole prefix, so membership is monotone and bisectable)."""
        own = self._pages.get(i)
        if not own or not pages or pages[0] not in own or not self.count_sent:
            return 0
        lo, hi = 1, len(pages)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if pages[mid - 1] in own:
                lo = mid
            else:
                hi = mid - 1
        return min(lo * self.page_len, prompt_len - 1)

    def over_s(self, i: int) -> float:
        """Seconds by which worker `i`'s load over-counts this router's requests there (`_remember`)."""
        return self._over.get(i, 0.0)

    def _start_s(self, i: int, wait: float, eta: float, now: float) -> float:
        """Seconds from `now` until a request waiting at worker `i` for a copy landing at `eta` can start."""
        gated = self._gated.get(i)
        if not gated:
            return max(wait, eta - now)
        total = before = 0.0
        for g_eta, work in gated.values():
            total += work
            if g_eta <= eta:
                before += work
        return max(wait - total, eta - now, 0.0) + before

    def _scan(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> list[tuple]:
        """Returns per worker (expected TTFT, worker id, kind, pull source, pull length, pull arrival); kind 0: as
        is, 1: wait for a copy in flight, 2: pull. Routes are built by the callers (only the winner's, in
        `route`)."""
        cached = req.cached_len
        best_src, best_len = best_holder(cached)
        inflight: dict[int, tuple[int, float]] = {}
        for h in req.inflight:
            if h.eta_s is not None and h.depth_len > inflight.get(h.worker_id, (0, 0.0))[0]:
                inflight[h.worker_id] = (h.depth_len, h.eta_s)
        cost, prompt_len = self.cost, req.prompt_len
        pull_bytes, endpoint_wait = self.kv_bytes_per_token, self.endpoint_wait
        prefill: dict[int, float] = {}  # cached length -> prefill time: workers mostly share a few lengths
        out = []
        pages = req.page_hashes
        host, host_s = req.host_len, (self.kv_bytes_per_token / self.host_load_bytes_per_s
                                      if self.host_load_bytes_per_s else 0.0)
        for w in workers:
            i = w.worker_id
            wait = max(0.0, queue_wait_s(cost, w, now) - self._over.get(i, 0.0))
            local = max(cached[i], self._own_len(i, pages, prompt_len))
            p = prefill.get(local)
            if p is None:
                p = prefill[local] = cost.prefill_s(prompt_len - local, local)
            if host_s and host and cached[i] + host[i] > local:  # the worker loads its host tier's part back first
                local = min(cached[i] + host[i], prompt_len - 1)
                p = (local - cached[i]) * host_s + cost.prefill_s(prompt_len - local, local)
            t_best, kind, pull_eta = wait + p, 0, None
            gate_eta, gate_work = 0.0, 0.0
            if i in inflight and inflight[i][0] > local:
                depth, eta = inflight[i]
                svc = cost.prefill_s(prompt_len - depth, depth)
                t = self._start_s(i, wait, eta, now) + svc
                if t < t_best:
                    t_best, kind, gate_eta, gate_work = t, 1, eta, svc
            if self.allow_pull and best_len > local:
                p = prefill.get(best_len)
                if p is None:
                    p = prefill[best_len] = cost.prefill_s(prompt_len - best_len, best_len)
                pulled = pull_ttft_s(cost, pull_bytes, workers, i, best_src, best_len, local, wait, p, now,
                                     endpoint_wait)
                if pulled is not None:
                    eta = pulled[1]
                    t = self._start_s(i, wait, eta, now) + p  # = pulled[0] with no request gated there
                    if t < t_best:
                        t_best, kind, pull_eta, gate_eta, gate_work = t, 2, eta, eta, p
            out.append((t_best, i, kind, best_src, best_len, pull_eta, gate_eta, gate_work))
        return out

    @staticmethod
    def _route(t: float, i: int, kind: int, src: int, length: int, eta: Optional[float], *_: float) -> Route:
        if kind == 1:
            return Route(i, wait_inflight=True, expected_ttft_s=t)
        if kind == 2:
            return Route(i, pull_from=src, pull_len=length, expected_ttft_s=t, pull_eta_s=eta)
        return Route(i, expected_ttft_s=t)

    def options(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> list[Route]:
        """Returns: the best option per worker, with its expected TTFT."""
        return [self._route(*o) for o in self._scan(req, workers, now)]

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        # the lowest `ttft_rank_key`; rounding is monotonic, so only options within a rounding step of the
        # fastest can tie with it (the rest need no key)
        opts = self._scan(req, workers, now)
        near = min(o[0] for o in opts) + 2e-9
        draw = self.tie_draw if self.tie_draw is not None else tie_draws(self._rng, len(workers)) \
            if self.peers and self.tie_draws else None
        ranked = sorted((o for o in opts if o[0] <= near),
                        key=lambda o: ttft_rank_key(o[0], o[1], workers, self.tie_start, draw))
        if draw is not None:
            ranked = two_choices(ranked, workers)
        best = ranked[0]
        if self.tie_turns and draw is None:
            self.tie_start = next_tie_start(ranked, workers, self.tie_start)
        if best[2]:  # waits for a copy: its prefill is gated until it lands
            self._gated.setdefault(best[1], {})[req.request_id] = (best[6], best[7])
        else:
            i = best[1]
            if self.speed is not None and not self._pages.get(i) and runs_alone(workers[i], now):
                cached = min(req.prompt_len, req.cached_len[i] if req.cached_len else 0)
                self._alone[req.request_id] = (req.prompt_len - cached, cached, now)
            if req.page_hashes:
                self._remember(req, i, runs_alone(workers[i], now))
        return self._route(*best)

    def _remember(self, req: RequestView, i: int, starts: bool = True) -> None:
        """Counts the part of `req`'s prefill worker `i`'s load over-counts (the load counts the prompt less what the
        directory says is cached there; it will also find cached what this router's earlier requests there compute
        first), and, when it `starts` at once (the worker is idle), its pages as coming to worker `i`: only then is
        its prefix computed before the next requests there start (SGLang batches requests waiting together, and
        none of a batch reuses another's prefix; counting every request sent put two cold branches of a fan-out
        tree in one batch at a busy worker, each priced as a hit on the other: stop 53)."""
        if self._external_pages:
            return
        dir_len = req.cached_len[i] if req.cached_len else 0
        local = max(dir_len, self._own_len(i, req.page_hashes, req.prompt_len))
        over = max(0.0, self.cost.prefill_s(req.prompt_len - dir_len, dir_len)
                   - self.cost.prefill_s(req.prompt_len - local, local))
        pages = req.page_hashes if starts else ()
        count_pages(self._pages.setdefault(i, {}), pages, +1)
        self._sent[req.request_id] = (i, pages, over)
        self._over[i] = self._over.get(i, 0.0) + over

    def on_first_token(self, worker_id: int, request_id: int, now: float) -> None:
        gated = self._gated.get(worker_id)
        if gated:
            gated.pop(request_id, None)
        alone = self._alone.pop(request_id, None)
        if alone is not None and self.speed is not None and self.speed.observe(alone[0], alone[1], now - alone[2]):
            self.cost.prefill_scale = self.speed.scale(self.cost.profile)
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            i, pages, over = sent
            count_pages(self._pages[i], pages, -1)
            self._over[i] -= over

    def on_finished(self, worker_id: int, request_id: int, now: float) -> None:
        self._alone.pop(request_id, None)  # (a request rejected before its first token tells nothing of speed)
        self.on_first_token(worker_id, request_id, now)


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
