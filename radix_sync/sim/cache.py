"""A simulated worker's KV pool: a page-granular radix cache (`PageTree`) plus reservations of running requests,
with the cluster-wide exact directory (page -> bitmask of holders) kept in step.

Conservation (checked by `check_integrity`): tree tokens + reserved tokens <= capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from radix_sync.integrity import IntegrityError
from radix_sync.policy.pagetree import PageTree, chained_prefix_len


class Directory:
    """Exact cluster index: page hash -> bitmask of the workers whose cache holds it (ordinary or replica)."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}

    def add(self, page: int, worker: int) -> None:
        self.holders[page] = self.holders.get(page, 0) | (1 << worker)

    def match_lens(self, pages: Sequence[int], num_workers: int) -> list[int]:
        """Per worker, the number of leading pages of `pages` it holds.

        Relies on each worker's prefix property (page i held implies pages 0..i-1 held), so the holder sets
        along the prompt only shrink; each change point is found by binary search: O(distinct lengths x log n)
        lookups instead of one tree search per worker.
        """
        out = [0] * num_workers
        holders = self.holders
        n = len(pages)
        k = 0  # pages[:k] checked; `cur` = holders of pages[k - 1]
        cur = holders.get(pages[0], 0) if n else 0
        while cur:
            lo, hi = k + 1, n  # holders(pages[lo-1]) == cur; find the last index with the same set
            if holders.get(pages[hi - 1], 0) == cur:
                lo = hi
            else:
                while lo < hi - 1:
                    mid = (lo + hi) // 2
                    if holders.get(pages[mid - 1], 0) == cur:
                        lo = mid
                    else:
                        hi = mid
            nxt = holders.get(pages[lo], 0) & cur if lo < n else 0
            gone, i = cur & ~nxt, 0
            while gone:
                if gone & 1:
                    out[i] = lo
                gone >>= 1
                i += 1
            cur, k = nxt, lo
        return out

    def remove(self, page: int, worker: int) -> None:
        bits = self.holders.get(page, 0) & ~(1 << worker)
        if bits:
            self.holders[page] = bits
        else:
            self.holders.pop(page, None)


class HostTier:
    """A worker's host-memory KV tier: SGLang's hierarchical cache (`--enable-hierarchical-cache`) with its
    defaults, `--hicache-write-policy write_through` (every page is backed up to host memory when the device pool
    first holds it) and `--hicache-ratio 2.0` (host pool = 2 x the device pool). Modelled by what it adds: the
    pages the device pool evicted, kept here least recently used first, up to `capacity_pages` (the host pool less
    the backups of what the device still holds: (ratio - 1) x the device pool when the device is full). A
    request's match continues here past its device match; those pages go back to the device (`take`) and are
    loaded before its prefill. Replicas are not backed up (the plugin's copies are evict-first bets).

    Held pages are also in `directory` (page -> workers whose host tier holds it), which routers may read.
    """

    def __init__(self, worker_id: int, capacity_pages: int, directory: Directory) -> None:
        if capacity_pages < 1:
            raise ValueError(f"host tier of worker {worker_id}: capacity_pages={capacity_pages!r} must be >= 1")
        self.worker_id = worker_id
        self.capacity_pages = capacity_pages
        self.directory = directory
        self.pages: OrderedDict[int, None] = OrderedDict()
        self.num_dropped = 0
        """Pages the host tier itself evicted (full)."""

    def __len__(self) -> int:
        return len(self.pages)

    def add(self, page: int) -> None:
        """The device evicted `page` (not a replica): it stays in host memory, most recently used."""
        pages = self.pages
        if page in pages:
            pages.move_to_end(page)
            return
        pages[page] = None
        self.directory.add(page, self.worker_id)
        while len(pages) > self.capacity_pages:
            old, _ = pages.popitem(last=False)
            self.directory.remove(old, self.worker_id)
            self.num_dropped += 1

    def add_chain(self, pages: Sequence[int]) -> None:
        """A copy of `pages` (a prompt's consecutive pages, past what the device holds) landed here: added deepest
        first, so that the first page is the most recently used and the chain loses its tail first."""
        for p in reversed(pages):
            self.add(p)

    def match_from(self, pages: Sequence[int], start: int) -> int:
        """Returns: how many pages of `pages[start:]`, from its first, this tier holds."""
        held = self.pages
        n = start
        while n < len(pages) and pages[n] in held:
            n += 1
        return n - start

    def take(self, pages: Sequence[int]) -> None:
        """`pages` are on the device again (loaded back, or computed anew): they leave this tier (the host pool's
        backup of what the device holds is not counted here)."""
        held = self.pages
        for p in pages:
            if p in held:
                del held[p]
                self.directory.remove(p, self.worker_id)

    def check_integrity(self, device_pages) -> None:
        """Raises: IntegrityError when over capacity, disagreeing with its directory, or holding a device page."""
        if len(self.pages) > self.capacity_pages:
            raise IntegrityError(f"host tier of worker {self.worker_id}: {len(self.pages)} > {self.capacity_pages}")
        bit = 1 << self.worker_id
        for page in self.pages:
            if not self.directory.holders.get(page, 0) & bit:
                raise IntegrityError(f"host page {page} missing from the host directory")
            if page in device_pages:
                raise IntegrityError(f"page {page} both on the device and in the host tier of {self.worker_id}")


class WorkerCache:
    """One worker's KV pool. Owns its `PageTree` and the token reservation of admitted requests."""

    def __init__(self, worker_id: int, capacity_tokens: int, page_len: int, directory: Directory,
                 oracle_pages: Optional[set] = None, tlru_slack_tokens: Optional[int] = None,
                 radix_nodes: bool = True, host: Optional[HostTier] = None) -> None:
        """Args:
            tlru_slack_tokens: None: LRU eviction; else T-LRU with threshold - next prompt estimate, tokens.
            radix_nodes: evict whole radix nodes as SGLang does (`PageTree`); False: page by page.
            host: the worker's host tier (SGLang's hierarchical cache); None: none.
        """
        self.worker_id = worker_id
        self.capacity_tokens = capacity_tokens
        self.page_len = page_len
        self.tree = PageTree(None if tlru_slack_tokens is None else tlru_slack_tokens // page_len, radix_nodes)
        self.reserved_tokens = 0
        self.directory = directory
        self.oracle_pages = oracle_pages
        """When set (the `oracle` policy), matches are against every page ever computed, at no memory cost."""
        self.host = host if oracle_pages is None else None
        self._evicted = self._on_evict if self.host is None else self._to_host

    def _on_evict(self, page: int) -> None:
        self.directory.remove(page, self.worker_id)

    def _to_host(self, page: int) -> None:
        self.directory.remove(page, self.worker_id)
        if not self.tree.evicting_replica:
            self.host.add(page)

    @property
    def tree_tokens(self) -> int:
        return len(self.tree) * self.page_len

    @property
    def free_tokens(self) -> int:
        """Tokens free without evicting."""
        return self.capacity_tokens - self.tree_tokens - self.reserved_tokens

    def match_len(self, pages: Sequence[int]) -> int:
        """Returns: pages of `pages` this worker can reuse now."""
        if self.oracle_pages is not None:
            return chained_prefix_len(pages, self.oracle_pages)
        return self.tree.match_len(pages)

    def make_room(self, tokens: int) -> bool:
        """Evicts (replicas first, LRU) until `tokens` are free.

        Returns:
            whether they are.
        """
        short = tokens - self.free_tokens
        if short <= 0:
            return True
        self.tree.evict(-(-short // self.page_len), self._evicted)
        return self.free_tokens >= tokens

    def insert(self, pages: Sequence[int], upto: int, now: float, replica: bool = False) -> list[int]:
        """Inserts `pages[:upto]` (the caller has made room). Returns: the pages added."""
        if self.oracle_pages is not None:
            self.oracle_pages.update(pages[:upto])
            return []
        added = self.tree.insert(pages, upto, now, replica)
        for p in added:
            self.directory.add(p, self.worker_id)
        if self.host is not None and added:
            self.host.take(added)
        return added

    def lock(self, page: Optional[int]) -> None:
        if page is not None and self.oracle_pages is None:
            self.tree.lock(page)
            self.tree.split_at(page)

    def unlock(self, page: Optional[int]) -> None:
        if page is not None and self.oracle_pages is None:
            self.tree.unlock(page)

    def check_integrity(self) -> None:
        """Checks the tree's invariants, the pool conservation and the directory's agreement.

        Raises:
            IntegrityError: naming the first disagreement.
        """
        self.tree.check_integrity()
        if self.reserved_tokens < 0:
            raise IntegrityError(f"worker {self.worker_id}: reserved {self.reserved_tokens} < 0")
        if self.tree_tokens + self.reserved_tokens > self.capacity_tokens:
            raise IntegrityError(f"worker {self.worker_id}: tree {self.tree_tokens} + reserved {self.reserved_tokens} "
                                 f"> capacity {self.capacity_tokens}")
        bit = 1 << self.worker_id
        for page in self.tree.nodes:
            if not self.directory.holders.get(page, 0) & bit:
                raise IntegrityError(f"page {page} missing from the directory")
        if self.host is not None:
            self.host.check_integrity(self.tree.nodes)


def worker_cache(worker_id: int, profile, cfg, page_len: int, directory: Directory, host_directory: Directory,
                 oracle_pages: Optional[set]) -> WorkerCache:
    """Returns: worker `worker_id`'s cache as `cfg` (`EngineConfig`) sets it up, on `profile`'s pool."""
    slack = cfg.tlru_threshold_tokens - cfg.tlru_next_prompt_tokens if cfg.eviction == "tlru" else None
    host = None
    if cfg.host_tier_ratio:
        host = HostTier(worker_id, int((cfg.host_tier_ratio - 1.0) * profile.kv_capacity_tokens) // page_len,
                        host_directory)
    return WorkerCache(worker_id, profile.kv_capacity_tokens, page_len, directory, oracle_pages, slack,
                       cfg.radix_nodes, host)
