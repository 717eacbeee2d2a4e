"""Which worker holds which pages in its host-memory tier (SGLang's hierarchical cache, `--enable-hierarchical-cache`),
from the KV events SGLang publishes for that tier (medium `CPU_PINNED`, `sglang.srt.disaggregation.kv_events.
StorageMedium.CPU`; SGLang 0.5.23 emits them when a page is backed up to host memory and when the host pool evicts
it).

A host-tier page is not servable as is: the worker loads it back to its device pool before the prefill that hits it
(at PCIe rate, far faster than recomputing it). The router prices that load (`ExpectedTtftRouter`,
`RequestView.host_len`); nothing here is a copy source or target.

Every page is checked by the device pages' own check (`PrefixDirectory.verify_blocks`, via `add_host_pages`): its
hash must be the chain digest of its parent's digest and its tokens, the parent a verified page of the same worker
and namespace, on its device or in its host tier (`digest`). Changes go into the directory's `ChangeFeed` as ops +2 / -2
(a router asks for them: `PrefixDirectory.feed_since(..., tiers=True)`).

Who calls it: `radix_sync.directory.PrefixDirectory` (its `host`), under the coordinator's lock.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

# (the directory's `ChangeFeed`, by what it does: this module is below `radix_sync.directory`)
ChangeFeed = Any

HOST_MEDIUM = "CPU_PINNED"
"""The medium of SGLang's KV events for its host-memory tier."""
STORED, REMOVED = 2, -2
"""Feed ops of host-tier holdings."""


class HostTierIndex:
    """Page hash -> the workers whose host tier holds it (with the page's digest and namespace, to check children)."""

    def __init__(self, feed: ChangeFeed) -> None:
        self.feed = feed
        self._pages: dict[int, tuple[bytes, str, set[str]]] = {}
        """Page hash -> (its chain digest, its namespace, the workers holding it in host memory)."""
        self._by_worker: dict[str, set[int]] = {}

    def add(self, worker_id: str, namespace: str, blocks: Iterable[tuple], max_new: Optional[int] = None
            ) -> tuple[int, list[str]]:
        """Records verified blocks (hash, parent, tokens, digest, ...: `PrefixDirectory.verify_blocks`'s accepted)
        as held in the worker's host tier, at most `max_new` it does not hold there yet.
        Returns: (pages newly held, one reason per page over the cap)."""
        mine = self._by_worker.setdefault(worker_id, set())
        errors: list[str] = []
        changes: list[tuple[int, str, int]] = []
        for block in blocks:
            block_hash = block[0]
            if block_hash in mine:
                continue
            if max_new is not None and len(changes) >= max_new:
                errors.append(f"host page {block_hash}: {worker_id} holds its cap of host pages")
                continue
            entry = self._pages.get(block_hash)
            if entry is None:
                entry = self._pages[block_hash] = (block[3], namespace, set())
            entry[2].add(worker_id)
            mine.add(block_hash)
            changes.append((STORED, worker_id, block_hash))
        self.feed.add_many(changes)
        return len(changes), errors

    def digest(self, worker_id: str, namespace: str, block_hash: int) -> Optional[bytes]:
        """Returns: the page's chain digest if the worker's host tier holds it in `namespace`, else None."""
        entry = self._pages.get(block_hash)
        return entry[0] if entry is not None and worker_id in entry[2] and entry[1] == namespace else None

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> int:
        """The worker's host tier no longer holds these pages. Returns: holdings removed (unknown ones ignored)."""
        mine = self._by_worker.get(worker_id)
        if not mine:
            return 0
        changes = []
        for h in block_hashes:
            if h in mine:
                mine.discard(h)
                holders = self._pages[h][2]
                holders.discard(worker_id)
                if not holders:
                    del self._pages[h]
                changes.append((REMOVED, worker_id, h))
        self.feed.add_many(changes)
        return len(changes)

    def drop_worker(self, worker_id: str) -> int:
        """Forgets the worker's host tier (it died, restarted or cleared its caches)."""
        n = self.remove(worker_id, list(self._by_worker.get(worker_id, ())))
        self._by_worker.pop(worker_id, None)
        return n

    def num_pages(self, worker_id: Optional[str] = None) -> int:
        if worker_id is None:
            return len(self._pages)
        return len(self._by_worker.get(worker_id, ()))

    def snapshot(self) -> dict[str, list[int]]:
        """Worker -> the page hashes its host tier holds (for a router's replica)."""
        return {w: list(hs) for w, hs in self._by_worker.items() if hs}
