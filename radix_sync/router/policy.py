"""Routing decisions for the router, pure: a `RoutingView` + `now` in, a ranked `Decision` out.

Two rules:
- `rank_by_ttft` (coordinator reachable): the policy engine's `ExpectedTtftRouter` (lowest expected TTFT = queue
  wait + prefill of the uncached part, replicas in flight counted), through a small adapter from the router's
  string-keyed view to the engine's dense `WorkerView` / `RequestView`. The ranking never counts a copy on the
  critical path; with `allow_pull` (`kvrep router --pull`) the same router with pulls (the simulator's
  `kvrep_pull`) says whether one wins, and the decision carries it (`Decision.pull`, `radix_sync.policy.pull`).
- `ApproxPrefixIndex.rank` (coordinator unreachable): sgl-model-gateway's `cache_aware` rule on an approximate
  per-worker tree of what this router routed (rule and defaults as published in sgl-model-gateway's README,
  "Cache-Aware Load-Balancing", and `CacheAwareConfig` in `radix_sync.policy.routers`).

The loads they rank on: `with_local_load` merges a worker's last load report with what this router itself has
sent there and not seen start (`QueuedWork`, counted by `radix_sync.router.pool.WorkerPool`).

The whole ranking is returned, not only the winner, so the proxy can fail over to the next worker. Workers are
named by the router's one id for them (their base URL). Called by `radix_sync.router.service`; nothing here reads
a clock or a socket.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.forecast import drained, own_prefill_s, split_iteration
from radix_sync.policy.pagetree import PageTree
from radix_sync.policy.pull import PullConfig, PullPlan, plan_pull
from radix_sync.policy.routers import CacheAwareConfig, ExpectedTtftRouter, full_tie, ttft_rank_key, two_choices
from radix_sync.policy.snapshot import REPLICA, HolderView, RequestView, WorkerView
from radix_sync.policy.speed import runs_alone

DIRECTORY = "directory"
FALLBACK = "fallback"


@dataclass(frozen=True)
class RouterCosts:
    """The cost profile of the TTFT rule. Defaults are an order of magnitude for an 8B model on one H200
    (about 20k prefill tokens/s; Llama-3.1-8B bf16 KV = 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes);
    calibrate with `--prefill-s-per-token` etc. Only ratios matter for the ranking."""

    prefill_s_per_token: float = 5e-5
    """Prefill seconds per uncached prompt token."""
    queue_s_per_request: float = 0.005
    """Fixed seconds per request queued ahead (one prefill iteration's overhead)."""
    decode_step_s: float = 0.02
    """A worker with running requests finishes its decode iteration first, s."""
    kv_bytes_per_token: int = 131072
    """KV bytes per token, to time replicas in flight."""
    link_bytes_per_s: float = 10e9
    """Worker-to-worker copy bandwidth, bytes/s."""
    transfer_latency_s: float = 0.002
    """Fixed cost of a copy, s."""

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "queue_s_per_request", "decode_step_s",
                     "transfer_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.kv_bytes_per_token <= 0 or not self.link_bytes_per_s > 0:
            raise ValueError(f"kv_bytes_per_token={self.kv_bytes_per_token!r} and link_bytes_per_s="
                             f"{self.link_bytes_per_s!r} must be > 0")

    def profile(self) -> CostProfile:
        """Returns: the equivalent `CostProfile` (linear prefill, no attention term, no chunking).

        NOTE: `forecast.queue_wait_s` prices the queue as waiting requests x `prefill_overhead_s` + waiting tokens
        x `prefill_s_per_token`, so a queued token costs what a token of this prompt costs, and each request
        (queued or this one) one `queue_s_per_request`."""
        return CostProfile(
            name="router", kv_bytes_per_token=self.kv_bytes_per_token, kv_capacity_tokens=1 << 40,
            max_context_len=1 << 40, chunked_prefill_len=1 << 40, max_running_requests=1 << 20,
            prefill_overhead_s=self.queue_s_per_request, prefill_s_per_token=self.prefill_s_per_token,
            prefill_s_per_token_pair=0.0, decode_step_s=self.decode_step_s, decode_s_per_request=0.0,
            decode_s_per_ctx_token=0.0, nic_bandwidth_bytes_per_s=self.link_bytes_per_s,
            transfer_latency_s=self.transfer_latency_s, provenance="kvrep router flags")


@dataclass(frozen=True)
class WorkerState:
    """One worker as the router sees it: the coordinator's last load report merged with what the router itself has
    sent there and not yet seen start."""

    worker_id: str
    """The router's id for the worker: its base URL (no trailing slash)."""
    page_size: int = 16
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    """Prompt tokens queued for prefill."""
    num_waiting_pairs: float = 0.0
    """Attention pairs (new*cached + new*(new+1)/2) of the requests this router sent and has not seen start."""
    num_waiting_cached_pairs: float = 0.0
    """cached*(cached+1)/2 of the same requests (see `CostProfile.prefill_s_per_cached_pair`)."""
    copies: bool = True
    """Whether it can send and receive copies (False: a plain worker, without the plugin; never a pull's end)."""
    own_waiting_tokens: int = 0
    """Uncached prompt tokens of the requests this router sent and has not seen start: with the two pair sums, the
    prefill that may be in progress there (the reported waiting queue is not running)."""
    own_elapsed_s: float = 0.0
    """Seconds the worker has been computing this router's requests not started: since the first of them went to it
    while it was idle (`WorkerPool.alone_since`); 0: not known to have started any."""


@dataclass(frozen=True)
class CopyInFlight:
    """A replication `pending` or `running` at the coordinator."""

    source: str
    target: str
    namespace: str
    num_tokens: int
    id: str = field(default="", compare=False)
    """The coordinator's replication id ("" while not known: a pull being asked for); not part of equality, so a copy
    listed by the coordinator and by this router's own pulls is one copy."""


@dataclass(frozen=True)
class Decision:
    """Workers best first, with the expected TTFT of each (seconds; 0 for the fallback rule)."""

    ranked: tuple[str, ...]
    expected_ttft_s: tuple[float, ...]
    mode: str
    """`directory` or `fallback`."""
    cached_tokens: int = 0
    """Tokens of the prompt the first choice holds (directory mode: or will have computed for this router's requests
    sent there before it starts, `rank_by_ttft`'s `sent_pages`) or approximately holds (fallback)."""
    wait_inflight: bool = False
    """The first choice is best only once a replica in flight to it has landed."""
    cached_by_worker: tuple[int, ...] = ()
    """Tokens of the prompt each ranked worker holds, in `ranked` order (directory mode; for the record)."""
    pull: Optional[PullPlan] = None
    """A copy on the critical path that beats every option of `ranked` (workers named by URL): copy, then send to
    its target; on refusal, failure or deadline, `ranked` as is (`radix_sync.router.pull`)."""
    wait_copy: Optional[CopyInFlight] = None
    """With `wait_inflight`: the copy to the first choice the request waits for (the deepest one in flight there that
    covers its prompt; ends named as in the ranking): it is held until that copy is done, not every copy there."""
    idle: frozenset = frozenset()
    """The workers a request sent now runs alone at (`radix_sync.policy.speed.runs_alone`, this router's own
    requests counted): its time to first token there is its own prefill (the router's speed calibration)."""
    tie_taken: Optional[str] = None
    """The first choice when it won a full tie (equal expected TTFT and load: `policy.routers.full_tie`) and is where
    the request goes (no pull): the next tie goes to the worker after it (`rank_by_ttft`'s `tie_after`); None: no
    tie decided the request."""
    tie_drawn: bool = False
    """Ties on the expected TTFT went by a random draw (`rank_by_ttft`'s `tie_draw`: other routers serve too)."""


@dataclass(frozen=True)
class QueuedWork:
    """The prefill work of one request this router sent to a worker that has not started it (no output yet)."""

    num_tokens: int
    """Uncached prompt tokens."""
    attn_pairs: float
    """new x cached + new x (new + 1) / 2 attention pairs."""
    cached_pairs: float
    """cached x (cached + 1) / 2 (see `CostProfile.prefill_s_per_cached_pair`)."""


def queued_work(uncached: int, cached: int) -> QueuedWork:
    """Returns: the prefill work of a request with `uncached` new tokens (negative: 0) after `cached` ones."""
    uncached = max(0, uncached)
    return QueuedWork(uncached, uncached * cached + uncached * (uncached + 1) / 2.0, cached * (cached + 1) / 2.0)


def with_local_load(reported: WorkerState, num_outstanding: int, queued_tokens: int, queued_pairs: float,
                    queued_cached_pairs: float, directory: bool, own_elapsed_s: float = 0.0) -> WorkerState:
    """Merges a worker's load with this router's own counts of it.

    NOTE: load reports lag; what this router sent and has not seen finish is a lower bound on the queue.

    Args:
        reported: the worker with its last reported load (directory mode) or with none (fallback).
        num_outstanding: requests this router sent there and has not seen finish.
        queued_tokens, queued_pairs, queued_cached_pairs: the sums of `QueuedWork` of those not started.
        directory: True: raise the reported load to the router's counts; False: the router's counts alone.
        own_elapsed_s: see `WorkerState.own_elapsed_s`.
    Returns:
        the worker as the ranking sees it.
    """
    if not directory:
        return WorkerState(reported.worker_id, reported.page_size, num_outstanding, 0, queued_tokens, queued_pairs,
                           queued_cached_pairs, reported.copies, queued_tokens, own_elapsed_s)
    return WorkerState(reported.worker_id, reported.page_size, reported.num_running,
                       max(reported.num_waiting, num_outstanding - reported.num_running),
                       max(reported.num_waiting_tokens, queued_tokens), queued_pairs, queued_cached_pairs,
                       reported.copies, queued_tokens, own_elapsed_s)


def _load(w: WorkerState) -> int:
    return w.num_running + w.num_waiting


def cost_model(costs: RouterCosts) -> CostModel:
    """Returns: the policy engine's cost model for these costs (uncalibrated)."""
    return CostModel(costs.profile())


def rank_by_ttft(workers: Sequence[WorkerState], matched: Mapping[str, int], copies: Sequence[CopyInFlight],
                 prompt_len: int, namespace: str, now: float, model: CostModel, allow_pull: bool = False,
                 pull_cfg: PullConfig = PullConfig(), host_matched: Mapping[str, int] = {},
                 host_load_bytes_per_s: float = 0.0, tie_after: Optional[str] = None,
                 page_hashes: Sequence[int] = (), page_len: int = 1,
                 sent_pages: Mapping[str, Mapping[int, int]] = {},
                 tie_draw: Optional[Sequence[float]] = None) -> Decision:
    """Ranks workers by expected TTFT (the policy engine's `ExpectedTtftRouter`, no pull), and with `allow_pull`
    says whether a copy on the critical path beats the ranking's first (the same router with pulls).

    Args:
        workers: the candidates (non-empty).
        matched: tokens of the prompt each worker holds, from the coordinator's directory (missing: 0).
        copies: replications in flight. One counts for this prompt when it is in the same namespace and its
            source holds at least `num_tokens` of the prompt. NOTE: an approximation: the coordinator does not
            say which prefix a copy carries, only its length; a copy of another branch of equal length on the
            same source would be counted too.
        prompt_len: tokens of the prompt.
        namespace: the tenant's namespace.
        now: current time, s (any clock; copies in flight are assumed to have just started).
        model: the cost model (`cost_model(costs)`).
        allow_pull: also consider a copy from the best holder on the request's path (`Decision.pull`). Every copy
            in flight, of any namespace, keeps its source's outgoing and its target's incoming link busy (queued
            one after the other, each assumed to start when the link frees). A copy also waits for the prefill
            iteration in progress at both ends (`forecast.split_iteration`: the first chunk of what this router
            sent there and has not seen start).
        pull_cfg: the deadline bounds of a pull.
        host_matched: tokens of the prompt past `matched` that each worker's host-memory tier holds (SGLang's
            hierarchical cache loads them back before the prefill), priced at `host_load_bytes_per_s` (0: not).
        tie_after: the worker that took the last full tie (`Decision.tie_taken`), None: none yet.
        tie_draw: a random number per worker, in worker id order (`radix_sync.policy.routers.tie_draws`), drawn
            by a router that is not alone (the send relay's other routers serve too): ties on the expected TTFT go
            to the less loaded of the two with the lowest draws (`two_choices`), not to the one least-loaded worker
            every router sees, then in turn (`tie_after` unused, no `tie_taken`).
        page_hashes, page_len: the prompt's chained page hashes and their page size (empty: not known).
        sent_pages: per worker, the page hashes of the requests this router sent there and has not seen start
            (hash -> how many hold it; `WorkerPool.sent_pages`): what that worker will have computed before a
            request sent now starts (FCFS), priced as cached there (the policy engine's `_own_len`, as the
            simulated router does). Without it a request arriving while the first request with its prefix is
            still computing saw no worker holding it, and went to compute it cold elsewhere. With it, a worker's
            own work that has been computing since it went to the idle worker (`WorkerState.own_elapsed_s`)
            counts only what is left of it (it counted whole, so a request arriving 0.5 s into a 1-s prefill
            saw a 1-s wait there).
    Returns:
        every worker, best first; ties go to fewer outstanding requests, then in turn: to the first worker after
        `tie_after` in id order (`ExpectedTtftRouter`'s rotation, `next_tie_start`).
    """
    order = sorted(workers, key=lambda w: w.worker_id)
    tie_start = next((i for i, w in enumerate(order) if tie_after is not None and w.worker_id > tie_after), 0)
    index = {w.worker_id: i for i, w in enumerate(order)}
    kvb = model.profile.kv_bytes_per_token
    egress, ingress = [0.0] * len(order), [0.0] * len(order)
    for c in copies:
        if allow_pull and c.source in index and c.target in index:
            s, t = index[c.source], index[c.target]
            egress[s] = max(egress[s], now) + model.transfer_s(c.num_tokens * kvb)
            ingress[t] = max(ingress[t], now) + model.transfer_s(c.num_tokens * kvb)
    views = tuple(WorkerView(i, num_running=w.num_running, num_waiting=w.num_waiting,
                             waiting_new_tokens=w.num_waiting_tokens, waiting_attn_pairs=w.num_waiting_pairs,
                             waiting_cached_pairs=w.num_waiting_cached_pairs,
                             busy_until_s=now + (model.profile.decode_step_s if w.num_running else 0.0),
                             egress_busy_until_s=egress[i], ingress_busy_until_s=ingress[i],
                             nic_bandwidth_bytes_per_s=model.profile.nic_bandwidth_bytes_per_s if w.copies else 0.0)
                  for i, w in enumerate(order))
    own_s = [own_prefill_s(model, w.own_waiting_tokens, w.num_waiting_pairs, w.num_waiting_cached_pairs)
             for w in order]
    if sent_pages:
        done = [min(w.own_elapsed_s, s) for w, s in zip(order, own_s)]
        views = tuple(drained(model, v, d, now) for v, d in zip(views, done))
        own_s = [s - d for s, d in zip(own_s, done)]
    cached = tuple(min(prompt_len, int(matched.get(w.worker_id, 0))) for w in order)
    inflight, covering = [], {}
    for c in copies:
        if c.namespace != namespace or c.target not in index or c.source not in index:
            continue
        depth = min(c.num_tokens, cached[index[c.source]])
        if depth < c.num_tokens or depth <= 0:
            continue
        eta = now + model.transfer_s(depth * model.profile.kv_bytes_per_token)
        inflight.append(HolderView(index[c.target], REPLICA, depth, eta_s=eta))
        if depth > covering.get(c.target, (0, None))[0]:  # the deepest, as the router's `_scan` prices it
            covering[c.target] = (depth, c)
    host = (tuple(max(0, min(prompt_len - c, int(host_matched.get(w.worker_id, 0)))) for w, c in zip(order, cached))
            if host_matched and host_load_bytes_per_s else ())
    req = RequestView(0, prompt_len, page_hashes=page_hashes if sent_pages else (), cached_len=cached,
                      inflight=tuple(inflight), host_len=tuple(host))
    sent = {index[u]: c for u, c in sent_pages.items() if u in index and c}
    policy = ExpectedTtftRouter(model, model.profile.kv_bytes_per_token, allow_pull=False, page_len=page_len,
                                host_load_bytes_per_s=host_load_bytes_per_s)
    policy.expect_pages(sent)
    options = policy.options(req, views, now)
    # NOTE: the key ExpectedTtftRouter.route picks by, so ranked[0] is exactly its choice.
    options.sort(key=lambda r: ttft_rank_key(r.expected_ttft_s, r.worker_id, views, tie_start, tie_draw))
    if tie_draw is not None:
        options = two_choices(options, views, lambda r: r.expected_ttft_s, lambda r: r.worker_id)
    first = options[0]
    tied = tie_draw is None and full_tie([(r.expected_ttft_s, r.worker_id) for r in options], views)
    pull = None
    if allow_pull:
        # NOTE: a live view counts the prefill in progress as queued; a copy waits for it at both ends
        iterating = tuple(split_iteration(model, v, now, s) for v, s in zip(views, own_s))
        puller = ExpectedTtftRouter(model, kvb, allow_pull=True, endpoint_wait=True, page_len=page_len,
                                    host_load_bytes_per_s=host_load_bytes_per_s)
        puller.expect_pages(sent)
        puller.tie_start, puller.tie_draw = tie_start, tie_draw
        route = puller.route(req, iterating, now)
        plan = plan_pull(route, first, model.prefill_s(prompt_len - route.pull_len, route.pull_len), now, pull_cfg)
        if plan is not None:
            pull = replace(plan, source=order[plan.source].worker_id, target=order[plan.target].worker_id)
    waited = covering.get(order[first.worker_id].worker_id, (0, None))[1] if first.wait_inflight else None
    own = policy.expected_own_len(first.worker_id, req.page_hashes, prompt_len) if req.page_hashes else 0
    return Decision(tuple(order[r.worker_id].worker_id for r in options),
                    tuple(r.expected_ttft_s for r in options), DIRECTORY, max(cached[first.worker_id], own),
                    first.wait_inflight, tuple(cached[r.worker_id] for r in options), pull,
                    waited, frozenset(order[v.worker_id].worker_id for v in views if runs_alone(v, now)),
                    order[first.worker_id].worker_id if tied and pull is None else None, tie_draw is not None)


class ApproxPrefixIndex:
    """The router's own view: per worker, a tree of the page hashes of the prompts it routed there.

    Fed with every routing decision (in both modes, so it is warm when the coordinator goes away); read only when
    the coordinator is unreachable. Trees are trimmed LRU to `cfg.max_tree_tokens` every `cfg.eviction_interval_s`.
    """

    def __init__(self, cfg: CacheAwareConfig = CacheAwareConfig()) -> None:
        self.cfg = cfg
        self._trees: dict[str, PageTree] = {}
        self._page_size: dict[str, int] = {}
        self._next_trim_s: Optional[float] = None

    def observe(self, worker_id: str, page_hashes: Sequence[int], page_size: int, now: float) -> None:
        """Records that the prompt with these page hashes was sent to `worker_id`."""
        tree = self._trees.setdefault(worker_id, PageTree())
        self._page_size[worker_id] = page_size
        if page_hashes:
            tree.insert(page_hashes, len(page_hashes), now)
            tree.touch(page_hashes[-1], now)
        if self._next_trim_s is None:
            self._next_trim_s = now + self.cfg.eviction_interval_s
        elif now >= self._next_trim_s:
            for wid, t in self._trees.items():
                limit = max(1, self.cfg.max_tree_tokens // self._page_size.get(wid, 1))
                if len(t) > limit:
                    t.evict(len(t) - limit)
            self._next_trim_s = now + self.cfg.eviction_interval_s

    def match_len(self, worker_id: str, page_hashes: Sequence[int]) -> int:
        """Returns: leading pages of `page_hashes` this router sent to `worker_id` (approximately still cached)."""
        tree = self._trees.get(worker_id)
        return tree.match_len(page_hashes) if tree is not None and page_hashes else 0

    def rank(self, workers: Sequence[WorkerState], page_hashes: Sequence[int], prompt_len: int) -> Decision:
        """sgl-model-gateway `cache_aware`: if the load is imbalanced (max - min > abs threshold and
        max > rel threshold x min) the least loaded first; else the longest match if its ratio exceeds
        `cache_threshold`; else the smallest tree. The others follow by load, then id.

        Args:
            workers: candidates (non-empty); loads are the router's own counts of outstanding requests.
            page_hashes: the prompt's page hashes (one page size for all workers: the first worker's).
            prompt_len: tokens of the prompt.
        Returns:
            the ranking (mode `fallback`).
        """
        order = sorted(workers, key=lambda w: w.worker_id)
        loads = [_load(w) for w in order]
        lo, hi = min(loads), max(loads)
        by_load = sorted(range(len(order)), key=lambda i: (loads[i], order[i].worker_id))
        matches = [self.match_len(w.worker_id, page_hashes) for w in order]
        if hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo:
            first = by_load[0]
        else:
            best = max(range(len(order)), key=lambda i: (matches[i], -i))
            ratio = matches[best] * order[best].page_size / prompt_len if prompt_len else 0.0
            if ratio > self.cfg.cache_threshold:
                first = best
            else:
                first = min(range(len(order)), key=lambda i: (len(self._trees.get(order[i].worker_id, ())), i))
        rest = [i for i in by_load if i != first]
        ranked = tuple(order[i].worker_id for i in [first, *rest])
        return Decision(ranked, (0.0,) * len(ranked), FALLBACK, matches[first] * order[first].page_size)
