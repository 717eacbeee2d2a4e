"""The exact directory of which worker holds which pages, as owner or replica, and until when.

Built only from facts the workers publish (pages stored/removed, replicas stored/promoted/expired). Pages are
identified by SGLang's chained page hashes, so a page's hash names its whole prefix: a lookup hashes the prompt
page by page and walks the chain, O(pages x holders), never a scan of the directory.

Every change of who holds what is also numbered in a `ChangeFeed`, from which a router keeps its own replica of
the holdings (`radix_sync.router.directory_replica`): its per-request lookups are then local calls.

Who calls it: `radix_sync.coordinator.state.ClusterState` (under its lock). Not thread-safe by itself.
"""
from __future__ import annotations

import itertools
import sys
import uuid
from array import array
from collections import deque
from typing import Callable, Collection, Iterable, Iterator, Optional, Sequence, Union

import msgspec

from radix_sync.hashing import chain_digest_packed, digest_to_int64, namespace_seed, pack_page
from radix_sync.host_tier import HostTierIndex
from radix_sync.integrity import IntegrityError

OWNER = "owner"
REPLICA = "replica"


# NOTE: the directory holds a few objects per page (hundreds of thousands in a fleet): plain structs, untracked by
# the cycle collector (`gc=False`: they reference no container that could lead back to them, only the `holders`
# dict, which holds only `Holding`s). As dataclasses, the collector's passes over them took a third of the time
# facts were ingested in (scripts/bench_coordinator.py, 400,000 pages), and each page took ~1 KB.
class Holding(msgspec.Struct, gc=False):
    """One worker's copy of one page."""

    role: str = OWNER
    """`owner` (ordinary cache) or `replica` (copied here, lowest eviction priority, expires)."""
    expires_at_s: Optional[float] = None
    """Coordinator-clock time at which an unpromoted replica is due to expire; None for owners."""
    replication_id: str = ""


class PageNode(msgspec.Struct, gc=False):
    block_hash: int
    parent_hash: Optional[int]
    namespace: str
    tokens: Union[bytes, tuple]
    """The page's token ids as SGLang hashes them, little-endian uint32 (`pack_page`: 4 bytes a token, where a
    tuple of ints took ~36), or a tuple where one does not fit (pages recorded unchecked: tests, tools). Bytes,
    not an `array("I")`: an array is tracked by the cycle collector, and at 200,000 pages the collector's full
    passes over them stalled the coordinator's threads ~140 ms each (`token_ids` reads them as ints)."""
    depth: int
    """Number of pages from the root to this page, this one included."""
    holders: dict[str, Holding] = msgspec.field(default_factory=dict)
    digest: bytes = b""
    """The page's full SHA-256 chain digest (its int64 prefix is `block_hash`), kept so that a child page reported
    later is checked against its tokens in O(page); empty for pages recorded unchecked (tests, tools)."""
    version: int = 0
    """Bumped whenever `holders` changes (a holder added or removed, a holding's role or expiry changed): the
    planner's kept views compare it instead of the holders themselves (`coordinator.demand.ViewCache`; reading every
    candidate's holders and holdings each tick was ~2 of a ~12 ms tick, their memory cold between ticks)."""

    @property
    def token_ids(self) -> Sequence[int]:
        """The page's token ids (a read-only view of `tokens`, no copy)."""
        t = self.tokens
        return memoryview(t).cast("I") if isinstance(t, bytes) else t


Block = tuple  # (block hash, parent hash or None, token ids[, digest[, token ids packed by `pack_page`]])

_LE_U32 = array("I").itemsize == 4 and sys.byteorder == "little"
"""Whether an `array("I")` is the layout `pack_page` packs (then a verified page's packed bytes are copied in)."""


def _compact(block: Block) -> Union[bytes, tuple]:
    """A block's token ids as `PageNode.tokens`: little-endian uint32 bytes (the packed page `verify_blocks` kept,
    else packed here), or a tuple if one does not fit or this host's `array("I")` is not that layout."""
    if _LE_U32:
        if len(block) > 4:
            return block[4]
        try:
            return array("I", block[2]).tobytes()
        except (OverflowError, TypeError):
            pass
    return tuple(block[2])


def match_runs(block_hashes: list[int], holders_of: Callable[[int], Optional[Collection[str]]]) -> dict[str, int]:
    """Pages matched from the root, per worker: the longest run of consecutive pages `holders_of` says the worker
    holds (chained hashes: a page held means its whole prefix is). Shared by the directory and a router's mirror
    of it (`radix_sync.router.directory_replica`)."""
    matched: dict[str, int] = {}
    alive: Optional[set[str]] = None
    for i, block_hash in enumerate(block_hashes):
        holders = holders_of(block_hash)
        if not holders:
            break
        alive = set(holders) if alive is None else alive.intersection(holders)
        if not alive:
            break
        for worker_id in alive:
            matched[worker_id] = i + 1
    return matched


class ChangeFeed:
    """Holding changes in order: `(+1 | -1, worker id, block hash)`, numbered 1, 2, ... within an epoch (a new
    directory, e.g. after a coordinator restart, is a new epoch). The last `max_changes` are kept; a reader further
    behind gets a snapshot instead (`PrefixDirectory.feed_since`)."""

    def __init__(self, max_changes: int = 1_000_000) -> None:
        if max_changes < 1:
            raise ValueError(f"max_changes={max_changes!r} must be >= 1")
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        """Number of the last change."""
        self._log: deque[tuple[int, str, int]] = deque(maxlen=max_changes)

    def add(self, op: int, worker_id: str, block_hash: int) -> None:
        self.seq += 1
        self._log.append((op, worker_id, block_hash))

    def add_many(self, changes: list[tuple[int, str, int]]) -> None:
        """`add` of each change, in order."""
        self.seq += len(changes)
        self._log.extend(changes)

    def since(self, seq: int, limit: int) -> Optional[list[tuple[int, str, int]]]:
        """The changes after number `seq` (at most `limit`), or None when they are no longer all kept."""
        oldest = self.seq - len(self._log) + 1  # number of the oldest change kept
        if seq < oldest - 1 or seq > self.seq:
            return None
        start = seq - oldest + 1
        n = min(limit, self.seq - seq)
        if n <= 0:
            return []
        if start == 0 and n == len(self._log):
            return list(self._log)
        # a deque has no slicing: walk from the nearer end (a reader close to the head costs what it reads)
        if start > len(self._log) // 2:
            tail = list(itertools.islice(reversed(self._log), len(self._log) - start))
            tail.reverse()
            return tail[:n]
        return list(itertools.islice(self._log, start, start + n))


class PrefixDirectory:
    """Page-granular index: block hash -> page node with its holders; worker -> block hashes it holds."""

    def __init__(self, max_changes: int = 1_000_000) -> None:
        self._nodes: dict[int, PageNode] = {}
        self._by_worker: dict[str, set[int]] = {}
        self.feed = ChangeFeed(max_changes)
        self.host = HostTierIndex(self.feed)
        """The workers' host-memory tiers (`radix_sync.host_tier`), in the same feed."""

    # ------------------------------------------------------------------------------------------ mutation (facts)
    def verify_blocks(self, worker_id: str, namespace: str, blocks: Iterable[tuple[int, Optional[int], list[int]]],
                      page_size: int, vocab_size: int = 0, max_new: Optional[int] = None,
                      other_parents: Optional[Callable[[int], Optional[bytes]]] = None
                      ) -> tuple[list[Block], list[str]]:
        """The blocks a worker reports, each checked against its tokens before anything is recorded.

        A page is accepted only when it has exactly `page_size` token ids, each < `vocab_size` (when > 0), and its
        hash is SHA-256 of its parent's digest (or the namespace's seed at the root) and its tokens: the parent must
        be a page this worker holds (or one accepted earlier in `blocks`), in the same namespace. A refused page
        refuses its descendants in `blocks`. At most `max_new` pages the worker does not hold yet are accepted.
        `other_parents(hash)`: the digest of a parent the worker holds verified elsewhere (its host tier: in this
        namespace), or None.

        Returns:
            (the accepted blocks with their digests, for `add_pages`; one reason per refused page).
        """
        held = self._by_worker.get(worker_id, ())
        accepted: list[Block] = []
        errors: list[str] = []
        digests: dict[int, bytes] = {}
        seed = namespace_seed(namespace)
        num_new = 0
        for block_hash, parent_hash, token_ids in blocks:
            if len(token_ids) != page_size:
                errors.append(f"page {block_hash}: {len(token_ids)} token ids, page size {page_size}")
                continue
            if vocab_size and max(token_ids) >= vocab_size:
                errors.append(f"page {block_hash}: token id {max(token_ids)} >= vocab_size {vocab_size}")
                continue
            if parent_hash is None:
                prior = seed
            elif parent_hash in digests:
                prior = digests[parent_hash]
            else:
                parent = self._nodes.get(parent_hash)
                if parent is not None and parent_hash in held and parent.digest and parent.namespace == namespace:
                    prior = parent.digest
                elif other_parents is None or (prior := other_parents(parent_hash)) is None:
                    errors.append(f"page {block_hash}: parent {parent_hash} is not a verified page of {worker_id} "
                                  f"in this namespace")
                    continue
            try:
                packed = pack_page(token_ids)
            except ValueError as exc:
                errors.append(f"page {block_hash}: {exc}")
                continue
            digest = chain_digest_packed(prior, packed)
            if digest_to_int64(digest) != block_hash:
                errors.append(f"page {block_hash}: hash does not match its token ids and parent")
                continue
            if block_hash not in held:
                if max_new is not None and num_new >= max_new:
                    errors.append(f"page {block_hash}: {worker_id} holds its cap of pages")
                    continue
                num_new += 1
            digests[block_hash] = digest
            accepted.append((block_hash, parent_hash, token_ids, digest, packed))
        return accepted, errors

    def add_pages(self, worker_id: str, namespace: str, blocks: Iterable[Block],
                  *, role: str = OWNER, expires_at_s: Optional[float] = None, replication_id: str = "") -> int:
        """Record that `worker_id` holds the given pages (root-to-leaf order within a chain), as given: workers'
        facts go through `verify_blocks` first.

        A page whose parent is unknown is still recorded (depth counted from it); an existing replica holding is
        never downgraded by an owner fact (the insert of a replica also emits ordinary store events).

        Returns:
            the number of (page, worker) holdings that were new.
        """
        held = self._by_worker.setdefault(worker_id, set())
        nodes = self._nodes
        changes: list[tuple[int, str, int]] = []
        for block in blocks:
            block_hash, parent_hash = block[0], block[1]
            node = nodes.get(block_hash)
            if node is None:
                parent = nodes.get(parent_hash) if parent_hash is not None else None
                node = PageNode(block_hash, parent_hash, namespace, _compact(block),
                                (parent.depth + 1) if parent is not None else 1, {},
                                block[3] if len(block) > 3 else b"")
                nodes[block_hash] = node
            elif not node.digest and len(block) > 3:
                node.digest = block[3]
            holding = node.holders.get(worker_id)
            if holding is None:
                node.holders[worker_id] = Holding(role, expires_at_s, replication_id)
                node.version += 1
                held.add(block_hash)
                changes.append((1, worker_id, block_hash))
            elif role == REPLICA:
                holding.role, holding.expires_at_s, holding.replication_id = REPLICA, expires_at_s, replication_id
                node.version += 1
        self.feed.add_many(changes)
        return len(changes)

    def mark_replica(self, worker_id: str, block_hashes: list[int], num_written: int, expires_at_s: float,
                     replication_id: str) -> int:
        """A replica landed: `block_hashes` is its whole prefix root-to-leaf, of which the last `num_written`
        pages were written by the replica (the rest was already cached there and stays as it is). Only pages the
        worker holds (from verified store facts, or `add_pages` of the tokens the coordinator granted) are marked:
        a replica fact alone never makes a worker a holder.

        Returns:
            the number of pages marked.
        """
        held = self._by_worker.get(worker_id, ())
        num = 0
        for block_hash in block_hashes[max(0, len(block_hashes) - num_written):]:
            if block_hash in held:
                node = self._nodes[block_hash]
                node.holders[worker_id] = Holding(REPLICA, expires_at_s, replication_id)
                node.version += 1
                num += 1
        return num

    def promote(self, worker_id: str, replication_id: str) -> int:
        """A real request hit the replica, or it expired: what is left of its pages is ordinary cache. Returns
        pages promoted."""
        num = 0
        for block_hash in self._by_worker.get(worker_id, ()):
            node = self._nodes[block_hash]
            holding = node.holders[worker_id]
            if holding.role == REPLICA and holding.replication_id == replication_id:
                holding.role, holding.expires_at_s = OWNER, None
                node.version += 1
                num += 1
        return num

    def remove_pages(self, worker_id: str, block_hashes: Iterable[int]) -> int:
        """Returns the number of holdings removed; unknown pages are ignored (facts may race a resync)."""
        held = self._by_worker.get(worker_id)
        if not held:
            return 0
        num = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                continue
            held.discard(block_hash)
            node = self._nodes[block_hash]
            del node.holders[worker_id]
            node.version += 1
            self.feed.add(-1, worker_id, block_hash)
            if not node.holders:
                del self._nodes[block_hash]
            num += 1
        return num

    def remove_replica(self, worker_id: str, replication_id: str) -> int:
        hashes = [h for h in self._by_worker.get(worker_id, ())
                  if self._nodes[h].holders[worker_id].replication_id == replication_id
                  and self._nodes[h].holders[worker_id].role == REPLICA]
        return self.remove_pages(worker_id, hashes)

    def drop_worker(self, worker_id: str) -> int:
        """Forget everything a worker holds (it died, restarted or cleared its cache), its host tier included."""
        hashes = list(self._by_worker.get(worker_id, ()))
        num = self.remove_pages(worker_id, hashes)
        self._by_worker.pop(worker_id, None)
        self.host.drop_worker(worker_id)
        return num

    def add_host_pages(self, worker_id: str, namespace: str, blocks: Iterable[tuple[int, Optional[int], list[int]]],
                       page_size: int, vocab_size: int = 0, max_new: Optional[int] = None) -> tuple[int, list[str]]:
        """Records the worker's host-tier pages that check out as a device page does (`verify_blocks`, a parent on
        its device or in its host tier), at most `max_new` it does not hold there yet (`HostTierIndex.add`).
        Returns: (pages newly held, one reason per refused page)."""
        accepted, errors = self.verify_blocks(worker_id, namespace, blocks, page_size, vocab_size,
                                              other_parents=lambda h: self.host.digest(worker_id, namespace, h))
        added, refused = self.host.add(worker_id, namespace, accepted, max_new)
        return added, errors + refused

    # ------------------------------------------------------------------------------------------------- queries
    def feed_since(self, epoch: str, seq: int, limit: int = 200_000, tiers: bool = False) -> dict:
        """What a replica at (`epoch`, `seq`) needs: `{"epoch", "seq", "changes": [[op, worker, hash], ...]}`, or
        `{"epoch", "seq", "snapshot": {worker: [hash, ...]}}` when it is of another epoch or too far behind.
        `seq` in the answer is the number of the last change included (call again while it is below `head`).
        `tiers`: also the host-tier changes (ops +2 / -2) and, with a snapshot, `host_snapshot` (worker -> host-tier
        page hashes); without it they are left out (`seq` still counts them)."""
        feed = self.feed
        changes = feed.since(seq, limit) if epoch == feed.epoch else None
        if changes is None:
            out = {"epoch": feed.epoch, "seq": feed.seq, "head": feed.seq,
                   "snapshot": {w: list(hs) for w, hs in self._by_worker.items() if hs}}
            if tiers:
                out["host_snapshot"] = self.host.snapshot()
            return out
        n = len(changes)
        if not tiers:
            changes = [c for c in changes if c[0] in (1, -1)]
        return {"epoch": feed.epoch, "seq": seq + n, "head": feed.seq, "changes": changes}

    def match(self, block_hashes: list[int]) -> dict[str, int]:
        """Pages matched from the root, per worker: the longest run of consecutive held pages."""
        nodes = self._nodes
        return match_runs(block_hashes, lambda h: nodes[h].holders.keys() if h in nodes else None)

    def holders(self, block_hash: int) -> dict[str, Holding]:
        node = self._nodes.get(block_hash)
        return dict(node.holders) if node is not None else {}

    def node(self, block_hash: int) -> Optional[PageNode]:
        return self._nodes.get(block_hash)

    def prefix_tokens(self, block_hash: int) -> Optional[list[int]]:
        """Token ids of the whole prefix named by `block_hash`, or None if a page on the path is unknown."""
        chunks = []
        node = self._nodes.get(block_hash)
        while node is not None:
            if not node.tokens:
                return None
            chunks.append(node.token_ids)
            if node.parent_hash is None:
                break
            node = self._nodes.get(node.parent_hash)
            if node is None:
                return None
        return [t for chunk in reversed(chunks) for t in chunk]

    def replicas(self, worker_id: Optional[str] = None) -> dict[tuple[str, str], dict]:
        """(worker, replication id) -> {num_pages, expires_at_s} for live replica holdings."""
        out: dict[tuple[str, str], dict] = {}
        for wid, hashes in self._by_worker.items():
            if worker_id is not None and wid != worker_id:
                continue
            for block_hash in hashes:
                holding = self._nodes[block_hash].holders[wid]
                if holding.role == REPLICA:
                    entry = out.setdefault((wid, holding.replication_id),
                                           {"num_pages": 0, "expires_at_s": holding.expires_at_s})
                    entry["num_pages"] += 1
        return out

    def num_pages(self, worker_id: Optional[str] = None) -> int:
        if worker_id is None:
            return len(self._nodes)
        return len(self._by_worker.get(worker_id, ()))

    def workers(self) -> list[str]:
        return [w for w, held in self._by_worker.items() if held]

    def check_integrity_steps(self, step: int = 8192) -> Iterator[None]:
        """`check_integrity` in steps of about `step` pages, for a caller that holds the lock only for one step at
        a time (`/status` on a directory of millions of pages): each step checks some pages against both indexes
        (a page's holders against the worker index, a worker's pages against the page index); the two directions
        over every page imply the counts agree. Pages changed between steps are checked as they are then (a page
        gone is skipped). Yields between steps.

        Raises:
            IntegrityError: naming the first disagreement found.
        """
        keys = list(self._nodes)
        yield
        for i in range(0, len(keys), step):
            for block_hash in keys[i:i + step]:
                node = self._nodes.get(block_hash)
                if node is None:
                    continue
                self._check_node(block_hash, node)
                for worker_id in node.holders:
                    if block_hash not in self._by_worker.get(worker_id, ()):
                        raise IntegrityError(f"page {block_hash} is held by {worker_id}, who does not index it")
            yield
        for worker_id in list(self._by_worker):
            hashes = list(self._by_worker.get(worker_id, ()))
            yield
            for i in range(0, len(hashes), step):
                held = self._by_worker.get(worker_id, ())
                for block_hash in hashes[i:i + step]:
                    if block_hash not in held:
                        continue
                    node = self._nodes.get(block_hash)
                    if node is None:
                        raise IntegrityError(f"{worker_id} holds unknown page {block_hash}")
                    if worker_id not in node.holders:
                        raise IntegrityError(f"{worker_id} missing from holders of {block_hash}")
                yield

    @staticmethod
    def _check_node(block_hash: int, node: PageNode) -> None:
        if not node.holders:
            raise IntegrityError(f"page {block_hash} is held by nobody")
        if node.block_hash != block_hash:
            raise IntegrityError(f"page {block_hash} is indexed as {node.block_hash}")
        for holding in node.holders.values():
            if holding.role not in (OWNER, REPLICA):
                raise IntegrityError(f"unknown role {holding.role!r} on page {block_hash}")
            if (holding.role == REPLICA) != (holding.expires_at_s is not None):
                raise IntegrityError(f"a replica without expiry or an owner with one: {holding}")

    def check_integrity(self) -> None:
        """`check_integrity_steps` at once (nothing changes between its steps): the two indexes agree and every
        node is held by someone.

        Raises:
            IntegrityError: naming the first disagreement.
        """
        for _ in self.check_integrity_steps(step=1 << 62):
            pass
