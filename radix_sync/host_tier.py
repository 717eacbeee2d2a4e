"""Which worker holds which pages in its host-memory tier (SGLang's hierarchical cache, `--enable-hierarchical-cache`),
from the KV events SGLang publishes for that tier (medium `CPU_PINNED`, `sglang.srt.disaggregation.kv_events.
StorageMedium.CPU`; SGLang 0.5.23 emits them when a page is backed up to host memory and when the host pool evicts
it).

A host-tier page is not servable as is: the worker loads it back to its device pool before the prefill that hits it
(at PCIe rate, far faster than recomputing it). The router prices that load (`ExpectedTtftRouter`,
`RequestView.host_len`); nothing here is a copy source or target.

Every page is checked as a device page is (`PrefixDirectory.verify_blocks`): its hash must be the chain digest of
its parent's digest and its tokens, the parent a verified page of the same worker and namespace, on its device or in
its host tier. A page the worker holds verified on its device (the usual case: write-through backs pages up while the
device has them) is taken with the device page's digest. Changes go into the directory's `ChangeFeed` as ops +2 / -2
(a router asks for them: `PrefixDirectory.feed_since(..., tiers=True)`).

Who calls it: `radix_sync.directory.PrefixDirectory` (its `host`), under the coordinator's lock.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from radix_sync.hashing import chain_digest_packed, digest_to_int64, namespace_seed, pack_page

# (the directory's `ChangeFeed` and `PageNode`, by what they do: this module is below `radix_sync.directory`)
ChangeFeed = Any
PageNode = Any

HOST_MEDIUM = "CPU_PINNED"
"""The medium of SGLang's KV events for its host-memory tier."""
_UNVERIFIED = object()
STORED, REMOVED = 2, -2
"""Feed ops of host-tier holdings."""


class HostTierIndex:
    """Page hash -> the workers whose host tier holds it (with the page's digest and namespace, to check children)."""

    def __init__(self, feed: ChangeFeed) -> None:
        self.feed = feed
        self._pages: dict[int, tuple[bytes, str, set[str]]] = {}
        """Page hash -> (its chain digest, its namespace, the workers holding it in host memory)."""
        self._by_worker: dict[str, set[int]] = {}

    def verify_and_add(self, worker_id: str, namespace: str, blocks: Iterable[tuple[int, Optional[int], list[int]]],
                       page_size: int, device: dict[int, PageNode], device_held: set, vocab_size: int = 0,
                       max_new: Optional[int] = None) -> tuple[int, list[str]]:
        """Records the host-tier pages of `worker_id` that check out (module docstring).

        Args:
            worker_id, namespace: the reporting worker and the pages' namespace.
            blocks: (hash, parent hash or None, token ids), parents first.
            page_size, vocab_size: the worker's page size and vocabulary (0: unchecked).
            device: the directory's page nodes; device_held: the hashes the worker holds on its device.
            max_new: most pages the worker does not hold in host memory yet that may be added.
        Returns:
            (pages newly held, one reason per refused page).
        """
        mine = self._by_worker.setdefault(worker_id, set())
        pages = self._pages
        seed = namespace_seed(namespace)
        errors: list[str] = []
        digests: dict[int, bytes] = {}
        changes: list[tuple[int, str, int]] = []
        for block_hash, parent_hash, token_ids in blocks:
            node = device.get(block_hash)
            if block_hash in device_held and node is not None and node.digest and node.namespace == namespace:
                digest = node.digest  # (verified when the device reported it)
            else:
                if len(token_ids) != page_size or (vocab_size and max(token_ids) >= vocab_size):
                    errors.append(f"host page {block_hash}: {len(token_ids)} token ids or one >= the vocabulary")
                    continue
                prior = self._parent_digest(worker_id, namespace, parent_hash, digests, device, device_held, seed)
                if prior is _UNVERIFIED:
                    errors.append(f"host page {block_hash}: parent {parent_hash} is not a verified page of "
                                  f"{worker_id} in this namespace")
                    continue
                digest = chain_digest_packed(prior, pack_page(token_ids))
                if digest_to_int64(digest) != block_hash:
                    errors.append(f"host page {block_hash}: hash does not match its token ids and parent")
                    continue
            digests[block_hash] = digest
            if block_hash in mine:
                continue
            if max_new is not None and len(changes) >= max_new:
                errors.append(f"host page {block_hash}: {worker_id} holds its cap of host pages")
                continue
            entry = pages.get(block_hash)
            if entry is None:
                entry = pages[block_hash] = (digest, namespace, set())
            entry[2].add(worker_id)
            mine.add(block_hash)
            changes.append((STORED, worker_id, block_hash))
        self.feed.add_many(changes)
        return len(changes), errors

    def _parent_digest(self, worker_id: str, namespace: str, parent_hash: Optional[int], batch: dict[int, bytes],
                       device: dict[int, PageNode], device_held: set, seed: Optional[bytes]) -> object:
        """Returns: the digest a page under `parent_hash` chains from (the namespace's seed at the root, None for
        the default namespace), or `_UNVERIFIED`."""
        if parent_hash is None:
            return seed
        if parent_hash in batch:
            return batch[parent_hash]
        node = device.get(parent_hash)
        if parent_hash in device_held and node is not None and node.digest and node.namespace == namespace:
            return node.digest
        entry = self._pages.get(parent_hash)
        if entry is not None and worker_id in entry[2] and entry[1] == namespace:
            return entry[0]
        return _UNVERIFIED

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
