"""A page-granular prefix tree over chained page hashes, with LRU leaf eviction (demoted chains, then replicas, first).

Chained hashes name a whole prefix (a page hash appears under one parent only), so the tree is a dict keyed by
page hash. Only leaves are evicted, which keeps the prefix property: if page i of a prompt is present, pages
0..i-1 are too, and the matched length is found by binary search.

Eviction order: demoted leaves (what the live agent frees before SGLang's own eviction runs), then replica leaves,
then, with T-LRU on, "TEL-safe" leaves, then the rest, each least recently used first. T-LRU (Tail-Optimized LRU, Zhang et al., arXiv:2510.15152; SGLang 0.5.23's
`--radix-eviction-policy tlru`, `TLRUStrategy` in `srt/mem_cache/evict_policy.py`): a conversation whose branch
reached H tokens (a high-water mark that never shrinks) and whose next prompt adds about Q tokens needs only
H + Q - threshold tokens cached for its next prefill to stay within the TTFT budget; a leaf whose ancestors
already cover that is TEL-safe and goes before any other ordinary page. Here per page rather than per radix node.

Locks: a request locks only the deepest page it uses; its ancestors all have a child and so are never leaves,
hence never evicted (NOTE: this relies on leaf-only eviction). Replica pages sit in their own LRU heap and go
first. When a leaf is evicted its parent, if it becomes a leaf, inherits the later of the two access times (what
SGLang's path-wide timestamp update would have given it).

Users: the simulator's per-worker cache (`radix_sync.sim.cache`) and the `cache_aware` router's approximate tree.
"""

from __future__ import annotations

import heapq
from typing import Callable, Container, Optional, Sequence

import msgspec

from radix_sync.integrity import IntegrityError


class _Node(msgspec.Struct, gc=False):
    """One page. NOTE: a struct the cycle collector does not track (`gc=False`: every field is a number): a router's
    approximate trees and a simulated worker's cache hold up to millions of pages, and as a `__slots__` class each
    was tracked: the collector's full passes went over all of them (36-40 ms per 200,000 pages)."""

    parent: Optional[int]
    last_access_s: float
    replica: bool
    depth: int = 0
    """Pages from the root to this one, inclusive (T-LRU only; 0 otherwise)."""
    hist: int = 0
    """T-LRU: the deepest page count its branch ever reached (never lowered by eviction); `depth` at creation."""
    num_children: int = 0
    lock_count: int = 0
    stamp: int = -1
    stale: bool = False
    live_children: int = 0
    """Children that are live: not demoted, or demoted with a live child
    (`PageTree.num_evict_first_stale_pages`)."""
    split_below: bool = False
    """Radix nodes: a node of SGLang's tree ends at this page (its children begin other nodes)."""


def chained_prefix_len(pages: Sequence[int], present: Container[int], limit: Optional[int] = None) -> int:
    """Number of leading pages of `pages` that are in `present`, by binary search.

    NOTE: relies on the prefix property of chained page hashes: whoever holds a page holds every page before it,
    so the pages present are a prefix of `pages`.

    Args:
        pages: chained page hashes of a prompt.
        present: the pages held (a set, or a dict keyed by page hash).
        limit: look at most at this many pages.
    Returns:
        matched page count.
    """
    lo, hi = 0, len(pages) if limit is None else min(limit, len(pages))
    if hi == 0 or pages[0] not in present:
        return 0
    if pages[hi - 1] in present:
        return hi
    lo = 1  # pages[:lo] present, pages[hi-1] absent
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if pages[mid - 1] in present:
            lo = mid
        else:
            hi = mid
    return lo


class PageTree:
    """Set of cached pages with parent links, lock counts, replica flags and two LRU heaps of leaves."""

    def __init__(self, tlru_slack_pages: Optional[int] = None, radix_nodes: bool = False) -> None:
        """Args:
            tlru_slack_pages: None for LRU; else T-LRU with (threshold - next prompt estimate) / page length,
                rounded down, pages of budget (see the module docstring; 0 or less evicts as LRU does).
            radix_nodes: evict as SGLang's radix cache does, a whole node at a time (see `evict`); False: one
                page at a time (an idealised page-granular cache).
        """
        self.nodes: dict[int, _Node] = {}
        self.num_replica_pages = 0
        self.num_stale_pages = 0
        """Pages marked demoted, including those under a page that is not (which go only after it: see
        `num_evict_first_stale_pages`)."""
        self.num_evict_first_stale_pages = 0
        """Demoted pages with no live page below them (a live page: one not demoted): those the eviction takes before
        the replicas. A demoted page that a later prefill extended (a child not demoted) stays marked until a hit
        touches it, but is a leaf only after that child is gone, so it is evicted as late as the child is."""
        self._heaps: tuple[list, list, list, list] = ([], [], [], [])  # ordinary, replica, TEL-safe, demoted leaves
        self._seq = 0
        self._tlru = tlru_slack_pages is not None
        self._slack = tlru_slack_pages or 0
        self._radix = radix_nodes
        self.evicting_replica = False
        """While `evict` calls its `on_evict`: whether the page going was a replica."""

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, page: int) -> bool:
        return page in self.nodes

    # ---- queries ----
    def match_len(self, pages: Sequence[int], limit: Optional[int] = None) -> int:
        """Number of leading pages of `pages` present (binary search; relies on the prefix property).

        Args:
            pages: chained page hashes of a prompt.
            limit: look at most at this many pages.
        Returns:
            matched page count.
        """
        return chained_prefix_len(pages, self.nodes, limit)

    # ---- mutation ----
    def _push(self, page: int, node: _Node) -> None:
        if node.num_children == 0 and node.lock_count == 0:
            self._seq += 1
            node.stamp = self._seq
            if node.replica:
                heap = self._heaps[1]
            elif node.stale:
                heap = self._heaps[3]
            elif self._tlru and node.depth - 1 >= max(node.hist - self._slack, 0):
                heap = self._heaps[2]
            else:
                heap = self._heaps[0]
            heapq.heappush(heap, (node.last_access_s, self._seq, page))

    def is_tel_safe(self, page: int) -> bool:
        """Whether T-LRU counts `page` as TEL-safe: the pages above it cover its branch's budget
        max(H - slack, 0) (False without T-LRU)."""
        node = self.nodes[page]
        return self._tlru and node.depth - 1 >= max(node.hist - self._slack, 0)

    def insert(self, pages: Sequence[int], upto: int, now: float, replica: bool = False) -> list[int]:
        """Inserts `pages[:upto]`; pages already present are left as they are (not touched).

        Args:
            pages: chained page hashes.
            upto: number of leading pages to make present.
            now: time, s (the new pages' access time).
            replica: whether the new pages are replicas.
        Returns:
            the pages that were added, in order.
        """
        nodes = self.nodes
        start = self.match_len(pages, upto)
        added = []
        parent = pages[start - 1] if start > 0 else None
        tlru = self._tlru
        for i in range(start, upto):
            page = pages[i]
            node = _Node(parent, now, replica, i + 1, i + 1) if tlru else _Node(parent, now, replica)
            nodes[page] = node
            if parent is not None:
                nodes[parent].num_children += 1
            added.append(page)
            parent = page
        if added:
            if start > 0 and self._radix:  # the added pages are a new node (SGLang splits a node it branches off)
                nodes[pages[start - 1]].split_below = True
            for p in added[:-1]:
                nodes[p].live_children = 1
            if start > 0:
                self._live_changed(pages[start - 1], 1)
            if replica:
                self.num_replica_pages += len(added)
            if tlru and start > 0:  # the branch now reaches `upto` pages: raise the high-water mark above it
                cur = nodes[pages[start - 1]]
                while cur is not None and cur.hist < upto:
                    cur.hist = upto
                    cur = nodes[cur.parent] if cur.parent is not None else None
            for p in added[:-1]:
                nodes[p].hist = upto
            self._push(added[-1], nodes[added[-1]])
        return added

    def touch(self, page: int, now: float) -> None:
        """Marks `page` (and, implicitly, its ancestors) used at `now`."""
        node = self.nodes[page]
        node.last_access_s = now
        cur = node
        while cur is not None and cur.stale:
            cur.stale = False
            self.num_stale_pages -= 1
            if cur.live_children == 0:  # it was evict-first; now live
                self.num_evict_first_stale_pages -= 1
                if cur.parent is not None:
                    self._live_changed(cur.parent, 1)
            cur = self.nodes[cur.parent] if cur.parent is not None else None
        self._push(page, node)

    def refresh(self, page: int, now: float) -> None:
        """Marks `page` (and, implicitly, its ancestors) recent at `now`, as SGLang's `touch_prefix` does for a
        waiting request: unlike `touch` (a hit), a demoted chain stays demoted."""
        node = self.nodes[page]
        node.last_access_s = max(node.last_access_s, now)
        self._push(page, node)

    def lock(self, page: int) -> None:
        """Pins `page` and its ancestors against eviction."""
        self.nodes[page].lock_count += 1

    def split_at(self, page: int) -> None:
        """Radix nodes: a match ended at `page`, so a node ends there (SGLang's `match_prefix` splits the node a
        match ends inside, and a request locks whole nodes); no-op without radix nodes."""
        if self._radix:
            self.nodes[page].split_below = True

    def unlock(self, page: int) -> None:
        """Releases one lock taken with `lock`."""
        node = self.nodes[page]
        if node.lock_count <= 0:
            raise ValueError(f"unlock of page {page} that is not locked")
        node.lock_count -= 1
        self._push(page, node)

    def promote(self, page: int) -> int:
        """Turns the replica pages on the path ending at `page` into ordinary cache (a real hit).

        Returns:
            number of pages promoted.
        """
        n = 0
        cur: Optional[int] = page
        while cur is not None:
            node = self.nodes[cur]
            if not node.replica:
                break
            node.replica = False
            n += 1
            self._push(cur, node)
            cur = node.parent
        self.num_replica_pages -= n
        return n

    def demote(self, page: int) -> int:
        """Marks the unshared chain of pages ending at the leaf `page` stale: evicted first, before the replicas and
        any ordinary page (another worker now serves the session this chain belongs to). A later hit clears it.

        Returns:
            pages demoted (0 when `page` is absent or not a leaf).
        """
        node = self.nodes.get(page)
        if node is None or node.num_children:
            return 0
        n = 0
        cur = node
        while True:
            if not cur.stale and not cur.replica:
                cur.stale = True
                n += 1
                if cur.live_children == 0:  # nothing live below: evict-first now
                    self.num_evict_first_stale_pages += 1
                    if cur.parent is not None:
                        self._live_changed(cur.parent, -1)
            if cur.parent is None:
                break
            parent = self.nodes[cur.parent]
            if parent.num_children != 1:
                break
            cur = parent
        if n:
            self.num_stale_pages += n
            self._push(page, node)
        return n

    def _remove(self, page: int, node: _Node) -> None:
        del self.nodes[page]
        if node.replica:
            self.num_replica_pages -= 1
        if node.stale:
            self.num_stale_pages -= 1
            if node.live_children == 0:
                self.num_evict_first_stale_pages -= 1
        elif node.parent is not None:  # a live leaf is gone
            self._live_changed(node.parent, -1)
        if node.parent is not None:
            parent = self.nodes[node.parent]
            parent.num_children -= 1
            if parent.num_children == 0:
                if node.last_access_s > parent.last_access_s:
                    parent.last_access_s = node.last_access_s
                self._push(node.parent, parent)

    def _live_changed(self, page: int, delta: int) -> None:
        """One child of `page` became live (`delta` 1) or stopped being live (-1): updates the live-children counts
        up the path while a page's own liveness changes, and `num_evict_first_stale_pages`."""
        nodes = self.nodes
        cur: Optional[int] = page
        while cur is not None:
            node = nodes[cur]
            before = node.live_children > 0
            node.live_children += delta
            after = node.live_children > 0
            if before == after or not node.stale:
                return  # a page not demoted is live either way
            self.num_evict_first_stale_pages += -1 if after else 1
            cur = node.parent

    def evict(self, num_pages: int, on_evict: Optional[Callable[[int], None]] = None) -> int:
        """Evicts up to `num_pages` unlocked leaves: demoted pages first, then replicas, then (T-LRU) TEL-safe ones,
        then the rest, least recently used first within each. With radix nodes, a leaf goes with the rest of its
        node (up to where a node ends: an insert added pages below it, a match ended there, or a branch), so more
        than `num_pages` may go, as in SGLang, whose `evict` frees whole leaf nodes (measured on SGLang 0.5.23,
        `docs/bench.md`); T-LRU's TEL-safe leaves still go one page at a time.

        Args:
            num_pages: pages wanted.
            on_evict: called with each evicted page.
        Returns:
            pages evicted (fewer when everything left is locked).
        """
        done = 0
        for heap in (self._heaps[3], self._heaps[1], self._heaps[2], self._heaps[0]):
            whole = self._radix and heap is not self._heaps[2]
            while done < num_pages and heap:
                _, seq, page = heapq.heappop(heap)
                node = self.nodes.get(page)
                if node is None or node.stamp != seq or node.num_children or node.lock_count:
                    continue
                while True:
                    self._remove(page, node)
                    done += 1
                    if on_evict is not None:
                        self.evicting_replica = node.replica
                        on_evict(page)
                    up = node.parent
                    if not whole or up is None:
                        break
                    parent = self.nodes[up]
                    if parent.split_below or parent.num_children or parent.lock_count or parent.replica != node.replica:
                        break
                    page, node = up, parent
        return done

    def lru_leaf_s(self) -> Optional[float]:
        """Returns: the access time of the leaf `evict(1)` would take next (None when nothing is evictable)."""
        for heap in (self._heaps[3], self._heaps[1], self._heaps[2], self._heaps[0]):
            while heap:
                t, seq, page = heap[0]
                node = self.nodes.get(page)
                if node is None or node.stamp != seq or node.num_children or node.lock_count:
                    heapq.heappop(heap)
                    continue
                return t
        return None

    def drop_replica_chain(self, page: int, on_evict: Optional[Callable[[int], None]] = None,
                           max_ordinary: int = 0) -> int:
        """Removes the replica pages ending at `page`, deepest first, while they are unlocked replica leaves, or,
        with `max_ordinary` > 0, at most that many unlocked leaves of any kind (a copy landed as ordinary cache:
        the pages it added).

        Returns:
            pages removed.
        """
        n = 0
        cur: Optional[int] = page
        while cur is not None and (not max_ordinary or n < max_ordinary):
            node = self.nodes.get(cur)
            if node is None or (not node.replica and not max_ordinary) or node.num_children or node.lock_count:
                break
            parent = node.parent
            self._remove(cur, node)
            n += 1
            if on_evict is not None:
                on_evict(cur)
            cur = parent
        return n

    def check_integrity(self) -> None:
        """Checks child counts, parent links, lock counts and the replica and demoted counts.

        Raises:
            IntegrityError: naming the first disagreement.
        """
        children: dict[int, int] = {}
        num_replica = num_stale = 0
        for page, node in self.nodes.items():
            if node.parent is not None:
                if node.parent not in self.nodes:
                    raise IntegrityError(f"page {page}: parent {node.parent} missing")
                children[node.parent] = children.get(node.parent, 0) + 1
            if node.lock_count < 0:
                raise IntegrityError(f"page {page}: negative lock count")
            num_replica += node.replica
            num_stale += node.stale
        for page, node in self.nodes.items():
            if node.num_children != children.get(page, 0):
                raise IntegrityError(f"page {page}: child count {node.num_children}")
        depth: dict[int, int] = {}
        for page in self.nodes:  # pages from the root, memoised
            path, cur = [], page
            while cur is not None and cur not in depth:
                path.append(cur)
                cur = self.nodes[cur].parent
            d = depth[cur] if cur is not None else 0
            for q in reversed(path):
                d += 1
                depth[q] = d
        live: dict[int, int] = {}  # page -> live children, counted from the deepest pages up
        for page in sorted(self.nodes, key=depth.__getitem__, reverse=True):
            node = self.nodes[page]
            if node.parent is not None and (not node.stale or live.get(page, 0) > 0):
                live[node.parent] = live.get(node.parent, 0) + 1
        num_free_stale = 0
        for page, node in self.nodes.items():
            if node.live_children != live.get(page, 0):
                raise IntegrityError(f"page {page}: live child count {node.live_children} != {live.get(page, 0)}")
            num_free_stale += node.stale and not live.get(page, 0)
        if num_replica != self.num_replica_pages:
            raise IntegrityError(f"replica count {self.num_replica_pages} != {num_replica}")
        if num_stale != self.num_stale_pages:
            raise IntegrityError(f"demoted count {self.num_stale_pages} != {num_stale}")
        if num_free_stale != self.num_evict_first_stale_pages:
            raise IntegrityError(f"evict-first demoted count {self.num_evict_first_stale_pages} != {num_free_stale}")
