"""Shepherd Model Gateway (smg) and its predecessor sglang-router: `cache_aware` (smg 1.13), `cache_aware_v03`
(sglang-router 0.3.2) and `sticky` (smg `prefix_hash`).

smg's in-flight count is the router's own counter (+1 when it sends, -1 when the request ends: `worker.rs`
`load_counter`); `cache_aware` and `sticky` keep it themselves from their decisions and `on_finished`. smg 1.13's
`cache_aware` also polls the workers' `/v1/loads` every 10 s and scores an expected wait from the last poll
(`SmgCacheAwareRouter`); the simulator calls its `on_poll`.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from radix_sync.policy.pagetree import PageTree
from radix_sync.policy.routers import ROUTERS, CacheAwareConfig, RouterPolicy, _load
from radix_sync.policy.snapshot import LoadsReport, RequestView, Route, WorkerView

MATCHED_TENANTS_CAP = 8
"""smg returns at most this many holders of the matched node (`crates/kv_index/src/common.rs`)."""
MIN_ABSOLUTE_MARGIN = 4.0
"""smg 1.13's floor of the spill gate's adaptive absolute margin, requests (`cache_aware.rs` l.150)."""
LOAD_MONITOR_INTERVAL_S = 10.0
"""smg 1.13's `--load-monitor-interval` default, s (`main.rs`; `config/types.rs` l.604)."""
MEAN_PREFILL_TOKENS = 1024
DEFAULT_THROUGHPUT = 2000.0
KV_PRESSURE_WEIGHT = 0.15
"""The expected-wait scorer's fixed parameters inside `cache_aware` (`LeastLoadPolicy::new()`,
`worker/expected_wait.rs` l.7-11): tokens credited per request sent (HTTP text is not tokenized), the drain rate
of a worker reporting no generation (tokens/s), the weight of KV pressure (seconds)."""
OVERLOAD_WAITING = 8
OVERLOAD_TOKEN_USAGE = 0.8
"""smg 1.13's worker overload protection defaults (`main.rs` l.430-461): a worker reporting this many waiting
requests, or this token usage, is not eligible until a poll says otherwise."""


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class _InFlight(RouterPolicy):
    """Keeps smg's per-worker load: requests sent and not yet finished."""

    uses_worker_views = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._loads: list[int] = []
        self._where: dict[int, int] = {}

    def _grow(self, n: int) -> None:
        while len(self._loads) < n:
            self._loads.append(0)

    def _sent(self, request_id: int, worker_id: int) -> None:
        old = self._where.pop(request_id, None)
        if old is not None:
            self._loads[old] -= 1
        self._where[request_id] = worker_id
        self._loads[worker_id] += 1

    def on_finished(self, worker_id: int, request_id: int, now: float) -> None:
        w = self._where.pop(request_id, None)
        if w is not None:
            self._loads[w] -= 1


@ROUTERS.register("cache_aware")
class SmgCacheAwareRouter(_InFlight):
    """smg 1.13.0 `cache_aware`, HTTP (approximate-tree) path, with its defaults (PyPI sdist `smg==1.13.0`,
    `model_gateway/src/policies/cache_aware.rs`: `select_worker_scanned` l.1479, `select_worker_with_text` l.3215,
    `select_final_from_affinity` l.2068, `over_count_pressure_gate` l.1805, `absolute_margin` l.1827;
    `policies/least_load.rs` `select_min_expected_wait_with_freshness` l.495, `score` l.291; `worker/monitor.rs`
    (the load monitor); `worker/expected_wait.rs`; `crates/kv_index/src/string_tree.rs` `matched_tenants`; defaults
    from `main.rs`: cache threshold 0.3, balance abs 64, rel 1.5, eviction every 120 s, tree 2^26 characters, load
    monitor every 10 s, overload veto at 8 waiting requests or token usage 0.8).

    - The tree is approximate: the prompts this router sent, per worker (smg's one tree with a tenant per
      worker), page-granular (as smg's token tree, page-aligned). match rate = longest match / prompt.
    - Load monitor: every `LOAD_MONITOR_INTERVAL_S` smg polls each worker's `GET /v1/loads` (SGLang answers it;
      the live bench's worker logs show the polls) into a `LoadsReport` (`on_poll`); each poll resets the
      worker's since-poll credit (requests sent to it since, 1,024 tokens each: smg does not tokenize HTTP text)
      and sets its overload verdict (>= 8 waiting requests or token usage >= 0.8: not eligible).
    - Eligible = not overloaded. avg = mean in-flight requests (smg's own `load()`: +1 when sent, -1 when done) over
      the eligible; spill(w) = load(w) > avg x 1.5 AND load(w) > avg + min(64, max(ceil(2 sqrt(avg)), 4)).
    - If match rate > 0.3: the eligible holders of the deepest matched node (at most 8, in a fixed arbitrary
      order, as a hash map's iteration order) are the affinity group; else the group is empty.
    - The choice (`select_final_from_affinity`): the group's members that do not spill, if any; else, for an
      empty group (a miss), every eligible worker; else (every holder spills) the eligible workers that do not
      spill, or every eligible worker if none. Among them, the lowest expected wait (`expected_wait`), exact ties
      (within 1e-6 s) uniformly at random; the winner is credited 1,024 tokens until the next poll. Expected
      wait of a worker with a report r: (Q + 1024 x credited requests) / drain + 0.15 k / (1 - k), Q =
      r.waiting_uncached_tokens (or 1024 per waiting request if 0) + 1024 per running request + 1024 per request
      in flight beyond r's running + waiting + credited ones, drain = r.gen_throughput (2,000 tokens/s if 0), k =
      r.token_usage (at most 0.999). Before the first poll (no report): the fewest in-flight requests.
      Every worker overloaded: the fewest in-flight requests, no insert, no credit (`overload_fallback`).
    - The prompt is inserted into the chosen worker's tree (so a spill target becomes a holder). Every 120 s the
      trees are trimmed to the shared total budget (2^26 characters, ~2^24 tokens at ~4 characters per token),
      evicting the least recently used leaves of any worker first (smg >= #2137: one per-model budget).
    Not modelled: failed polls (the credit then grows on), retries and the circuit breaker (no failures here), the
    KV-usage triggers (off by default: thresholds 1.0); the event-driven path (gRPC with KV events, its warm-up
    and sampling) is not this one. `load_monitor_s=0`: no load report ever arrives (every poll failing), so the
    fewest requests in flight decide (`cache_aware_inflight`; how this project modelled smg 1.13 before stop 50)."""

    def __init__(self, page_len: int = 1, cfg: CacheAwareConfig = CacheAwareConfig(), seed: int = 0,
                 load_monitor_s: float = LOAD_MONITOR_INTERVAL_S, **_: object) -> None:
        super().__init__(seed)
        self.cfg = cfg
        self.page_len = page_len
        self._trees: list[PageTree] = []
        self._order: list[int] = []
        self._next_trim_s = cfg.eviction_interval_s
        if load_monitor_s < 0:
            raise ValueError(f"load_monitor_s={load_monitor_s!r} must be >= 0")
        self.poll_period_s = load_monitor_s
        # smg was started before the run: its polls fall anywhere in the first period (a fixed phase per seed)
        self.poll_phase_s = random.Random(f"smg-poll/{seed}").uniform(0.0, load_monitor_s)
        self._reports: Optional[list[LoadsReport]] = None
        self._credit: list[int] = []
        self._overloaded: list[bool] = []

    def on_poll(self, reports: Sequence[LoadsReport], now: float) -> None:
        self._grow(len(reports))
        self._reports = list(reports)
        self._credit = [0] * len(reports)
        self._overloaded = [r.num_waiting >= OVERLOAD_WAITING or r.token_usage >= OVERLOAD_TOKEN_USAGE
                            for r in reports]

    def _spills(self, load: int, avg: float) -> bool:
        margin = min(float(self.cfg.balance_abs_threshold), max(math.ceil(2.0 * math.sqrt(avg)), MIN_ABSOLUTE_MARGIN))
        return load > avg * self.cfg.balance_rel_threshold and load > avg + margin

    def _least_in_flight(self, cands: list[int]) -> int:
        loads = self._loads
        lo = min(loads[i] for i in cands)
        ties = [i for i in cands if loads[i] == lo]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def expected_wait(self, i: int) -> float:
        """Returns: smg's expected wait of worker `i` (seconds), from its last report (there must be one)."""
        r, credit = self._reports[i], self._credit[i]
        queued = r.waiting_uncached_tokens if r.waiting_uncached_tokens > 0 else r.num_waiting * MEAN_PREFILL_TOKENS
        unaccounted = max(0, self._loads[i] - (r.num_running + r.num_waiting + credit))
        q = queued + (r.num_running + unaccounted + credit) * MEAN_PREFILL_TOKENS
        drain = r.gen_throughput if r.gen_throughput > 0 else DEFAULT_THROUGHPUT
        k = min(max(r.token_usage, 0.0), 0.999)
        return q / drain + KV_PRESSURE_WEIGHT * k / (1.0 - k)

    def _least_wait(self, cands: list[int]) -> int:
        if self._reports is None or len(self._reports) <= max(cands):
            return self._least_in_flight(cands)
        scores = [self.expected_wait(i) for i in cands]
        lo = min(scores)
        ties = [i for i, s in zip(cands, scores) if s - lo <= 1e-6]
        best = ties[0] if len(ties) == 1 else self._rng.choice(ties)
        self._credit[best] += 1
        return best

    def _eligible(self, n: int) -> list[int]:
        over = self._overloaded
        return [i for i in range(n) if i >= len(over) or not over[i]]

    def choose(self, group: list[int], n: int) -> Optional[int]:
        """Returns: smg's `select_final_from_affinity` over the affinity `group` (worker ids; empty: a miss); None:
        every worker is overloaded."""
        elig = self._eligible(n)
        if not elig:
            return None
        loads = self._loads
        avg = sum(loads[i] for i in elig) / len(elig)
        group = [i for i in group if i in elig]
        safe = [i for i in group if not self._spills(loads[i], avg)]
        if safe:
            return self._least_wait(safe)
        if not group:
            return self._least_wait(elig)
        targets = [i for i in elig if not self._spills(loads[i], avg)]
        return self._least_wait(targets or elig)

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        n = len(workers)
        self._grow(n)
        while len(self._trees) < n:
            self._trees.append(PageTree())
        if len(self._order) != n:
            self._order = sorted(range(n), key=lambda i: _hash64(f"worker-{i}"))
        pages = req.page_hashes
        lens = [t.match_len(pages) for t in self._trees[:n]]
        best = max(lens)
        rate = min(best * self.page_len, req.prompt_len) / req.prompt_len if req.prompt_len else 0.0
        hit = rate > self.cfg.cache_threshold
        group = [i for i in self._order if lens[i] == best][:MATCHED_TENANTS_CAP] if hit else []
        target = self.choose(group, n)
        if target is None:  # `overload_fallback`: no tree insert, no credit
            target = self._least_in_flight(list(range(n)))
            self._sent(req.request_id, target)
            return Route(target)
        tree = self._trees[target]
        tree.insert(pages, len(pages), now)
        if pages:
            tree.touch(pages[-1], now)
        if now >= self._next_trim_s:
            self._trim()
            self._next_trim_s = now + self.cfg.eviction_interval_s
        self._sent(req.request_id, target)
        return Route(target)

    def _trim(self) -> None:
        """Evicts the least recently used leaves, of any worker, until the trees fit the shared budget."""
        excess = sum(len(t) for t in self._trees) - self.cfg.max_tree_tokens // self.page_len
        heap = [(s, i) for i, t in enumerate(self._trees) if (s := t.lru_leaf_s()) is not None]
        heapq.heapify(heap)
        while excess > 0 and heap:
            _, i = heapq.heappop(heap)
            tree = self._trees[i]
            if tree.evict(1):
                excess -= 1
            s = tree.lru_leaf_s()
            if s is not None:
                heapq.heappush(heap, (s, i))


@ROUTERS.register("cache_aware_inflight")
class SmgCacheAwareInFlightRouter(SmgCacheAwareRouter):
    """`cache_aware` without the load monitor: the fewest in-flight requests instead of the expected wait from the
    last poll (smg 1.13 if its polls of `/v1/loads` fail; this project's model of smg 1.13 before stop 50, kept to
    reproduce the numbers made with it and to show what the polls cost smg)."""

    def __init__(self, page_len: int = 1, cfg: CacheAwareConfig = CacheAwareConfig(), seed: int = 0,
                 **_: object) -> None:
        super().__init__(page_len, cfg, seed, load_monitor_s=0.0)


@ROUTERS.register("cache_aware_v03")
class CacheAwareV03Router(RouterPolicy):
    """The `cache_aware` rule as this project modelled it before smg 1.13, named after sglang-router 0.3.2 (smg
    history commit c7f9bf9f5 "[smg] release 0.3.2", `src/policies/cache_aware.rs` `select_worker` l.351-473; the
    `kvrep bench` live baseline, `sglang-router==0.3.2`), with the CLI defaults (`CacheAwareConfig`).

    If the load is imbalanced (max - min > 64 AND max > 1.5 x min, over running + queued requests), route to the
    least-loaded worker (lowest id on ties, as Rust's `min_by_key`); otherwise route to the worker whose
    *approximate* tree (the prompts this router sent it, not the workers' caches) matches the longest prefix if the
    match ratio exceeds 0.3, else to the worker with the smallest tree. The chosen worker's tree gets the prompt;
    trees are trimmed LRU to a per-worker size limit every 120 s.

    Where this differs from 0.3.2's source: (1) a miss (match ratio <= 0.3) goes to the worker with the smallest
    tree (the rule of sglang-router's README, "Cache-Aware Load-Balancing", kept because the live router's fallback,
    `radix_sync.router.policy.ApproxPrefixIndex`, does the same); 0.3.2 sends it to the least-loaded worker (first
    minimum); (2) among workers with the same longest match the lowest id wins; 0.3.2 takes the tenant that
    created the deepest matched node; (3) the load is running + queued requests from the workers' views; 0.3.2
    counts its own in-flight requests (equal while the views are exact); (4) matching is per page, not per
    character."""

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


@dataclass(frozen=True)
class PrefixHashConfig:
    """smg `prefix_hash` defaults (smg 1.13.0 `main.rs`: `--prefix-token-count` 256, `--prefix-hash-load-factor`
    1.25, `--prefix-hash-balance-abs-threshold` 10; `worker/hash_ring.rs`: 150 virtual nodes per worker)."""

    prefix_tokens: int = 256
    """Tokens of the prompt that form the key."""
    load_factor: float = 1.25
    """A worker is overloaded above this x the mean load (and the absolute margin)."""
    balance_abs_threshold: int = 10
    """... and above the mean load + this many requests."""
    virtual_nodes: int = 150
    """Ring positions per worker."""

    def __post_init__(self) -> None:
        if self.prefix_tokens <= 0 or self.virtual_nodes <= 0 or self.load_factor < 1.0 or self.balance_abs_threshold < 0:
            raise ValueError(f"bad prefix_hash config {self!r}")


@ROUTERS.register("sticky")
class SmgPrefixHashRouter(_InFlight):
    """smg `prefix_hash`: bounded-load consistent hashing on the prompt's first 256 tokens (smg 1.13.0 sdist
    `model_gateway/src/policies/prefix_hash.rs`, identical on smg main f8daa8835: key l.135-161, `load_ok`
    l.217-228, selection l.237-316; ring `model_gateway/src/worker/hash_ring.rs`).

    - Ring: 150 virtual nodes per worker at hash("worker-{id}#{vnode}"); a key goes to the first position at or
      after hash(key), clockwise (wrapping). Hash: 64-bit BLAKE2b (smg: blake3 for the ring, xxh3 for the key;
      any fixed hash gives the same behaviour up to which worker gets which key).
    - Key: the first 256 tokens. The simulator knows chained page hashes, not tokens: a prompt of >= 256 tokens
      is keyed by the hash of its page covering token 256 (page length <= 256; with longer pages, its first
      page), a shorter prompt by its last full page and its length, a prompt without a full page by its request
      id (a unique prompt).
    - load_ok(w): load(w) <= max(avg x 1.25, avg + 10) with avg = (total load + 1) / workers (always ok when
      nothing is in flight). The ring's worker if load_ok; else the least-loaded worker that is load_ok (lowest id
      on ties, Rust's `min_by_key`); if none, the ring's worker anyway. Load: in-flight requests.
    No `cache_boundaries` (one key per request) and no `x-smg-routing-key` hint."""

    def __init__(self, page_len: int = 1, cfg: PrefixHashConfig = PrefixHashConfig(), seed: int = 0,
                 **_: object) -> None:
        super().__init__(seed)
        self.cfg = cfg
        self.page_len = page_len
        self._ring_pos: list[int] = []
        self._ring_worker: list[int] = []

    def _build_ring(self, n: int) -> None:
        ring = sorted((_hash64(f"worker-{i}#{v}"), i) for i in range(n) for v in range(self.cfg.virtual_nodes))
        self._ring_pos = [p for p, _ in ring]
        self._ring_worker = [w for _, w in ring]

    def key(self, req: RequestView) -> str:
        """Returns: the key string standing for the prompt's first `prefix_tokens` tokens."""
        pages = req.page_hashes
        if req.prompt_len >= self.cfg.prefix_tokens and pages:
            k = max(1, self.cfg.prefix_tokens // self.page_len)
            return f"p{pages[min(k, len(pages)) - 1]}"
        if pages:
            return f"w{pages[-1]}:{req.prompt_len}"
        return f"r{req.request_id}"

    def ring_worker(self, key: str) -> int:
        """Returns: the worker the ring maps `key` to."""
        j = bisect.bisect_left(self._ring_pos, _hash64(key))
        return self._ring_worker[j % len(self._ring_worker)]

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        n = len(workers)
        self._grow(n)
        if len(self._ring_worker) != n * self.cfg.virtual_nodes:
            self._build_ring(n)
        target = self.ring_worker(self.key(req))
        loads = self._loads
        total = sum(loads[:n])
        if total:
            avg = (total + 1) / n
            limit = max(avg * self.cfg.load_factor, avg + self.cfg.balance_abs_threshold)
            if loads[target] > limit:
                ok = [i for i in range(n) if loads[i] <= limit]
                if ok:
                    target = min(ok, key=lambda i: (loads[i], i))
        self._sent(req.request_id, target)
        return Route(target)
