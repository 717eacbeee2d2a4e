"""NVIDIA Dynamo's KV router, `cost`: potential prefill blocks + potential decode blocks, lowest wins."""

from __future__ import annotations

import random
from typing import Sequence

from radix_sync.policy.pagetree import chained_prefix_len
from radix_sync.policy.routers import ROUTERS, RouterPolicy
from radix_sync.policy.snapshot import RequestView, Route, WorkerView


@ROUTERS.register("cost")
class DynamoCostRouter(RouterPolicy):
    """NVIDIA Dynamo KV router, classic/default cost (`ai-dynamo/dynamo`: `lib/llm/src/kv_router/scheduler.rs` and
    `sequence.rs` (`ActiveSequences`: `unique_blocks`, `new_blocks`, `new_tokens`, `potential_blocks_and_tokens`),
    later `lib/kv-router/src/scheduling/selector.rs` (`logit = overlap_weight * potential_prefill_block +
    decode_block`) and `lib/kv-router/src/sequences/single.rs`, read through a code index, no single commit pinned;
    the newest default (`lib/kv-router/src/scheduling/selector/default.rs` @ 07a6c9ce, `overlap_score_credit = 1`,
    `prefill_load_scale = 1`, no decay, `decode_active_request_weight = 0`) reduces to the same formula with
    device-only overlap).

    For each worker w, with `bs` the block (page) size and `overlap(w)` the request's cached prefix on w (the
    exact directory: Dynamo's KV-event indexer):
        cost(w) = weight x (active_prefill_tokens(w) + prompt_len - overlap(w)) / bs
                + active_blocks(w) + (request_blocks - blocks of the request already among them)
    `active_prefill_tokens(w)`: the uncached tokens (at routing time) of the requests this router sent to w that
    have not produced their first token; `active_blocks(w)`: the full prompt blocks of the requests it sent to w
    and that have not finished, each block counted once however many of them share it (chained hashes: a block is
    shared only with the whole prefix before it). Weight 1.0 (the default `--kv-overlap-score-weight`).
    Temperature 0 (the default): the lowest cost, exact ties uniformly at random.

    The state is the router's own (its decisions, `on_first_token`, `on_finished`), as Dynamo's `ActiveSequences`
    is; generated tokens are not tracked (`router_track_output_blocks=false`, the default)."""

    uses_cached_len = True
    uses_worker_views = False

    def __init__(self, page_len: int = 1, overlap_score_weight: float = 1.0, seed: int = 0, **_: object) -> None:
        if overlap_score_weight < 0:
            raise ValueError(f"overlap_score_weight={overlap_score_weight!r} must be >= 0")
        self.page_len = page_len
        self.weight = overlap_score_weight
        self._rng = random.Random(seed)
        self._blocks: list[dict[int, int]] = []
        """Per worker: block hash -> number of active requests holding it (`unique_blocks`)."""
        self._prefill: list[int] = []
        """Per worker: active prefill tokens."""
        self._active: dict[int, list] = {}
        """Request id -> [worker, uncached tokens still counted as prefill (0 once the first token came), blocks]."""

    def _grow(self, n: int) -> None:
        while len(self._blocks) < n:
            self._blocks.append({})
            self._prefill.append(0)

    def cost(self, req: RequestView, worker_id: int) -> float:
        """Returns: the Dynamo cost of placing `req` on `worker_id`, in blocks."""
        self._grow(worker_id + 1)
        blocks = self._blocks[worker_id]
        pages = req.page_hashes
        prefill = (self._prefill[worker_id] + req.prompt_len - req.cached_len[worker_id]) / self.page_len
        decode = len(blocks) + len(pages) - chained_prefix_len(pages, blocks)
        return self.weight * prefill + decode

    def route(self, req: RequestView, workers: Sequence[WorkerView], now: float) -> Route:
        n = len(workers)
        self._grow(n)
        costs = [self.cost(req, i) for i in range(n)]
        best = min(costs)
        ties = [i for i, c in enumerate(costs) if c <= best + 1e-9]
        target = ties[0] if len(ties) == 1 else self._rng.choice(ties)
        new = req.prompt_len - req.cached_len[target]
        blocks = self._blocks[target]
        pages = tuple(req.page_hashes)
        for p in pages:
            blocks[p] = blocks.get(p, 0) + 1
        self._prefill[target] += new
        old = self._active.pop(req.request_id, None)
        if old is not None:  # a request id routed again (not expected): forget the old placement
            self._release(req.request_id, old)
        self._active[req.request_id] = [target, new, pages]
        return Route(target)

    def on_first_token(self, worker_id: int, request_id: int, now: float) -> None:
        a = self._active.get(request_id)
        if a is not None and a[1]:
            self._prefill[a[0]] -= a[1]
            a[1] = 0

    def _release(self, request_id: int, a: list) -> None:
        w, new, pages = a
        self._prefill[w] -= new
        blocks = self._blocks[w]
        for p in pages:
            c = blocks[p] - 1
            if c:
                blocks[p] = c
            else:
                del blocks[p]

    def on_finished(self, worker_id: int, request_id: int, now: float) -> None:
        a = self._active.pop(request_id, None)
        if a is not None:
            self._release(request_id, a)
