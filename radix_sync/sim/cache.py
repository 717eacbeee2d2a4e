"""A simulated worker's KV pool: a page-granular radix cache (`PageTree`) plus reservations of running requests,
with the cluster-wide exact directory (page -> bitmask of holders) kept in step.

Conservation (checked by `check_integrity`): tree tokens + reserved tokens <= capacity.
"""

from __future__ import annotations

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


class WorkerCache:
    """One worker's KV pool. Owns its `PageTree` and the token reservation of admitted requests."""

    def __init__(self, worker_id: int, capacity_tokens: int, page_len: int, directory: Directory,
                 oracle_pages: Optional[set] = None, tlru_slack_tokens: Optional[int] = None,
                 radix_nodes: bool = True) -> None:
        """Args:
            tlru_slack_tokens: None: LRU eviction; else T-LRU with threshold - next prompt estimate, tokens.
            radix_nodes: evict whole radix nodes as SGLang does (`PageTree`); False: page by page.
        """
        self.worker_id = worker_id
        self.capacity_tokens = capacity_tokens
        self.page_len = page_len
        self.tree = PageTree(None if tlru_slack_tokens is None else tlru_slack_tokens // page_len, radix_nodes)
        self.reserved_tokens = 0
        self.directory = directory
        self.oracle_pages = oracle_pages
        """When set (the `oracle` policy), matches are against every page ever computed, at no memory cost."""
        self._evicted = self._on_evict

    def _on_evict(self, page: int) -> None:
        self.directory.remove(page, self.worker_id)

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
