"""`SchedulerView`: the handles of one live SGLang scheduler the worker agent needs (radix tree, allocator, KV pool,
queues), with SGLang's names kept in here. Part of the one door to SGLang (`sglang_kvrep.compat`).

Everything here that touches the tree cache or the allocator must be called on the scheduler thread.
"""
from __future__ import annotations

from array import array
from typing import Any, Optional

import torch

from sglang_kvrep.compat.version import sglang_version


class SchedulerView:
    """The handles of one live scheduler the agent needs, with the SGLang names kept in here."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.server_args = scheduler.server_args
        self.tree_cache = scheduler.tree_cache
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.pool = self.allocator.get_kvcache()
        self.page_size = int(self.server_args.page_size or 1)

    def vocab_size(self) -> int:
        """The model's vocabulary size (0 when SGLang does not say)."""
        return int(getattr(getattr(self.scheduler, "model_config", None), "vocab_size", 0) or 0)

    def is_of(self, scheduler: Any) -> bool:
        """Is this the view of `scheduler` (a hook's `self`)?"""
        return self.scheduler is scheduler

    def owns_cache(self, cache: Any) -> bool:
        """Is `cache` this scheduler's radix tree (a cache hook's `self`)?"""
        return self.tree_cache is cache

    # -------------------------------------------------------------------------------------------- radix tree
    @staticmethod
    def key(token_ids, namespace: str):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", token_ids), extra_key=None, cache_salt=namespace or None)

    def match(self, token_ids, namespace: str) -> tuple[int, Any]:
        """Returns (device prefix length, last device node id)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        res = self.tree_cache.match_prefix(MatchPrefixParams(key=self.key(token_ids, namespace)))
        return int(res.device_prefix_len), res.last_device_node

    def lock(self, node_id):
        return self.tree_cache.lock(node_id)

    def unlock(self, lock) -> None:
        self.tree_cache.unlock(lock)

    def path_slots(self, node_id) -> torch.Tensor:
        return self.tree_cache.path_device_indices(node_id)

    def alloc_slots(self, num_tokens: int) -> torch.Tensor:
        """Page-aligned slots, evicting by the cache's policy if needed. Raises RuntimeError when out of memory."""
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        return alloc_token_slots(self.tree_cache, num_tokens)

    def free_slots(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def insert(self, token_ids, namespace: str, slots: torch.Tensor, priority: int) -> int:
        """Insert an externally written prefix. Returns the tokens that were already present (their slots in
        `slots` are freed by the cache itself, per UnifiedRadixCache's insert semantics)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        res = self.tree_cache.insert(InsertParams(key=self.key(token_ids, namespace), value=slots.to(torch.int64),
                                                  prev_prefix_len=0, priority=priority))
        return int(res.prefix_len)

    def raise_priority(self, token_ids, namespace: str, priority: int) -> int:
        """Raises the eviction priority of the cached path of `token_ids` to at least `priority`, as SGLang caches a
        request's prompt (`UnifiedRadixCache.cache_finished_req`): an insert of the path's own slots with
        `prev_prefix_len` covering them (nothing is freed, no hit is counted; the tree keeps the max priority along
        the path). Scheduler thread, between iterations. Returns: the tokens raised (0: not cached)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        n, node = self.match(token_ids, namespace)
        n = n // self.page_size * self.page_size
        if n <= 0:
            return 0
        slots = self.path_slots(node)[:n].to(torch.int64)
        self.tree_cache.insert(InsertParams(key=self.key(token_ids[:n], namespace), value=slots, prev_prefix_len=n,
                                            inserted_len=n, priority=priority))
        return n

    def waiting_wanting(self, prefixes: list, limit: int = 128) -> set:
        """Returns: the indices of `prefixes` (token ids, namespace) that one of the first `limit` requests waiting
        in the scheduler's queue has as a prefix of its prompt in that namespace (its last token compared first:
        most prompts share their first tokens, few their n-th)."""
        waiting = list(getattr(self.scheduler, "waiting_queue", None) or [])[:limit]
        out: set = set()
        if not waiting or not prefixes:
            return out
        for r in waiting:
            ids = getattr(r, "origin_input_ids", None)
            if ids is None:
                continue
            salt, m = getattr(r, "cache_salt", None), len(ids)
            for i, (want, namespace) in enumerate(prefixes):
                n = len(want)
                if i in out or n == 0 or m < n or ids[n - 1] != want[n - 1] or salt != (namespace or None):
                    continue
                if list(ids[:n]) == list(want):
                    out.add(i)
        return out

    def evict(self, num_tokens: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return int(self.tree_cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted)

    def evict_chain(self, token_ids, namespace: str, max_tokens: int) -> tuple[int, str, int]:
        """Evicts the unshared chain of cached pages that ends exactly where `token_ids` ends (page-aligned): the
        leaf, then each ancestor left childless, deepest first, stopping at a node another branch shares, a locked
        node (a running request uses it), the root, or once `max_tokens` are freed (whole nodes: it may free more).

        Returns:
            (tokens freed, outcome, tokens of the chain left to evict after "partial"). Outcomes: "evicted" (gone
            up to a shared or locked ancestor), "partial" (stopped at `max_tokens`; call again with the chain cut
            to the length returned), "absent" (its end is not cached any more), "extended" (the cache holds more
            beyond its end: a later request used and extended it), "in_use" (its leaf is locked), "unsupported"
            (HiCache: a device leaf may have to be backed up or have host-only children; SGLang's walk knows).
        """
        from collections import defaultdict

        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        cache = self.tree_cache
        core = cache.tree_core
        if getattr(cache, "is_write_back", False) or getattr(core, "enable_hicache", False):
            return 0, "unsupported", 0
        want = len(token_ids) // self.page_size * self.page_size
        if want <= 0:
            return 0, "absent", 0
        # NOTE: the read-only match: `match_prefix` would refresh the path's access times (making what is left
        # look recently used to SGLang's LRU) and split a node the tokens end inside
        matched, node, pinned = core.match_full_device_prefix(self.key(token_ids[:want], namespace))
        if matched < want:
            return 0, "absent", 0  # its end went already; what is left is a prefix other chains may share
        if pinned > matched:
            return 0, "extended", 0  # the deepest node it reaches goes on past its end
        freed = 0
        first = True
        while True:
            path = core.collect_path_info([node])[0]  # root (excluded) -> node
            me = path[-1]
            if me.num_children != 0:
                return freed, ("extended" if first else "evicted"), 0
            # A lock on a node is also a lock on its ancestors: probing the node's own lock count tells whether
            # any running request holds it (the probe's delta counts the tokens it moved out of evictable).
            probe = cache.inc_lock_ref(node)
            cache.dec_lock_ref(node, probe.to_dec_params())
            if not (probe.delta or 0) > 0:
                return freed, ("in_use" if first else "evicted"), 0
            shared_parent = len(path) >= 2 and path[-2].num_children > 1
            tracker = defaultdict(int)
            cache._evict_device_leaf(node, tracker)
            freed += int(tracker.get(ComponentType.FULL, 0))
            first = False
            if shared_parent or len(path) < 2 or core.is_root(me.parent_id):
                return freed, "evicted", 0
            if freed >= max_tokens:
                return freed, "partial", path[-2].path_end
            node = me.parent_id

    # ------------------------------------------------------------------------------------------------- load
    def available_tokens(self) -> int:
        return int(self.allocator.available_size())

    def evictable_tokens(self) -> int:
        return int(self.tree_cache.evictable_size())

    def waiting_new_tokens(self, waiting: list, limit: int = 64) -> int:
        """Returns: the prompt tokens of the `waiting` requests that their worker's tree does not hold (what their
        prefills will compute, as the policies' `waiting_new_tokens` means it): each prompt less its device prefix,
        matched read-only (no recency refreshed, no node split); past the first `limit` requests, whole prompts.

        NOTE: a waiting request's whole prompt counted as new made a worker holding agent sessions' histories look
        busy with cold prefills whenever their follow-ups queued there, and routers sent the next follow-ups away
        from the holder to recompute (the live agent tail's "history elsewhere")."""
        from sglang.srt.mem_cache.radix_cache import RadixKey

        core = getattr(self.tree_cache, "tree_core", None)
        total = 0
        for i, r in enumerate(waiting):
            ids = getattr(r, "origin_input_ids", None) or ()
            total += len(ids)
            if i >= limit or core is None or not ids:
                continue
            try:
                key = RadixKey(array("q", ids), extra_key=getattr(r, "extra_key", None),
                               cache_salt=getattr(r, "cache_salt", None))
                total -= min(len(ids), int(core.match_full_device_prefix(key)[0]))
            except Exception:  # (a cache without this read-only match: the whole prompt, as before)
                core = None
        return total

    def load(self) -> dict[str, int]:
        s = self.scheduler
        waiting = list(getattr(s, "waiting_queue", []) or [])
        running = getattr(s, "running_batch", None)
        return {
            "num_running_reqs": len(running.reqs) if running is not None else 0,
            "num_waiting_reqs": len(waiting),
            "num_waiting_tokens": self.waiting_new_tokens(waiting),
            "available_tokens": self.available_tokens(),
            "evictable_tokens": self.evictable_tokens(),
        }

    def waiting_wants(self, token_ids, namespace: str) -> bool:
        """True when a request waiting in the scheduler's queue (not admitted yet, so holding no lock on the
        tree) has `token_ids` as a prefix of its prompt in `namespace` (`waiting_wanting` for one prefix)."""
        return bool(self.waiting_wanting([(token_ids, namespace)], limit=1 << 30))

    def touch_waiting_prefixes(self, limit: int = 128) -> int:
        """Refreshes the recency of the cached prefixes of the first `limit` waiting requests, the queue's head last,
        as SGLang's scheduler does under `--radix-eviction-policy lru` (`SchedulePolicy._touch_waiting_prefixes`,
        `SGLANG_ENABLE_WAITING_PREFIX_REFRESH`) and skips under `priority`, the policy the plugin sets (replicas
        first): there a queued request's prefix, matched only once it is scheduled, was evicted as the least recently
        used while it waited, and the request recomputed the prefix its router had sent it there for. Under
        `priority` recency still orders the entries of one priority. Scheduler thread. Returns: requests touched."""
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.common import touch_waiting_prefix

        waiting = list(getattr(self.scheduler, "waiting_queue", []) or [])[:limit]
        if (not waiting or not envs.SGLANG_ENABLE_WAITING_PREFIX_REFRESH.get()
                or not self.tree_cache.supports_prefix_sharing()):
            return 0
        for r in reversed(waiting):
            touch_waiting_prefix(r, self.tree_cache)
        return len(waiting)

    def flush_kv_events(self) -> None:
        """Publish the radix tree's pending KV events now (SGLang publishes them only at the next prefill batch,
        every `--decode-log-interval` decode steps, or on idle: a prompt's pages would reach the coordinator only
        when its answer is done). Scheduler thread; a no-op when nothing is pending."""
        publisher = getattr(self.scheduler, "kv_events_publisher", None)
        if publisher is not None:
            publisher.publish_kv_events()

    def is_idle(self) -> bool:
        """No request queued or running (cheap: what `load` counts, without the pool sums)."""
        s = self.scheduler
        running = getattr(s, "running_batch", None)
        return not (getattr(s, "waiting_queue", None) or (running is not None and running.reqs))

    def pool_capacity_tokens(self) -> int:
        return int(getattr(self.scheduler, "max_total_num_tokens", 0) or self.pool.size)

    def add_idle_wakeup(self, socket) -> None:
        """Make `--sleep-on-idle` wake up when `socket` is readable (the agent's command doorbell)."""
        sleeper = getattr(self.scheduler, "idle_sleeper", None)
        poller = getattr(sleeper, "poller", None)
        if poller is not None:
            poller.register(socket, 1)  # zmq.POLLIN

    # ------------------------------------------------------------------------------------------------ pool
    def forward_stream(self) -> Any:
        """SGLang's forward stream (the model runner's: the forwards of overlap scheduling run on it, and HiCache
        fences its copies behind it, `scheduler.py` ~616-624); None where the runner has none."""
        runner = getattr(getattr(self.scheduler, "tp_worker", None), "model_runner", None)
        return getattr(runner, "forward_stream", None)

    def load_back_stream(self) -> Any:
        """The stream HiCache loads host-tier pages back to the device on (`--enable-hierarchical-cache`), None
        without one. Pages being loaded back already match as device prefix (SGLang's own early send skips them,
        `disaggregation/prefill.py` ~1474): a copy fenced behind this stream reads them loaded."""
        controller = getattr(self.tree_cache, "cache_controller", None)
        engine = getattr(controller, "l2_transfer_engine", None)
        return getattr(engine, "host_to_device_stream", None)

    def kv_buffers(self) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]], str]:
        """(K buffers, V buffers or None for MLA, layout "NHD"|"HND").

        Raises:
            RuntimeError: a pool whose pages are more than these buffers (the block scales of SGLang's FP4 and
                MXFP8 pools: copying K/V without them would install garbage), or of an unknown kind.
        """
        pool = self.pool
        for name in ("k_scale_buffer", "v_scale_buffer", "kv_scale_buffer"):
            if getattr(pool, name, None) is not None:
                raise RuntimeError(f"unsupported KV pool {type(pool).__name__}: its {name} (block scales of a "
                                   f"quantized pool) would not be copied with the pages")
        if hasattr(pool, "k_buffer") and pool.k_buffer is not None:
            layout = "HND" if getattr(pool, "use_hnd", False) else "NHD"
            return list(pool.k_buffer), list(pool.v_buffer), layout
        if hasattr(pool, "kv_buffer"):
            return list(pool.kv_buffer), None, "NHD"
        raise RuntimeError(f"unsupported KV pool {type(pool).__name__}")

    def fingerprint_fields(self, model_path: Optional[str] = None) -> dict[str, str]:
        """Everything two workers must share for one's KV pages to be valid on the other: the content of the
        weights (`model_path`, default the served one: a disk update loads another), the KV-changing serving
        flags and adapters, the RoPE in effect, and the live pool's geometry, dtypes and layout. Hashes the
        weight files that are not in the user's fingerprint cache (`sglang_kvrep.fingerprint`)."""
        from sglang_kvrep import fingerprint
        from sglang_kvrep.compat.serving import kv_serving_flags, lora_adapters, rope_in_effect

        sa = self.server_args
        pool = self.pool
        model_config = getattr(self.scheduler, "model_config", None)
        path = model_path or str(getattr(model_config, "model_path", None) or sa.model_path)
        fields = fingerprint.model_fields(path, kv_serving_flags(sa), lora_adapters(sa),
                                          rope=rope_in_effect(model_config))
        k_bufs, v_bufs, layout = self.kv_buffers()
        geometry = tuple(k_bufs[0].shape[1:]) if k_bufs else ()
        fields.update({
            "kv_store_dtype": str(getattr(pool, "store_dtype", "")),
            "kv_pool_dtype": str(getattr(pool, "dtype", "")),
            "page_size": str(self.page_size),
            "num_layers": str(len(k_bufs)),
            "kv_geometry": str(geometry),
            "mla": str(v_bufs is None),
            "layout": layout,
            "sglang": sglang_version(),
        })
        return fields
