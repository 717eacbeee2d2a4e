"""The coordinator's demand signals: prefix hits, arrivals, finishes and hints, kept for the policies.

`DemandLog` owns the recent records (trimmed to a time window) and the ordered event queue the predictive
planner drains (`LivePlanner.consume`). What a record says (which prefix, held by whom) is worked out by
`ClusterState` (`state.py`) from the directory and the workers, under the coordinator's lock.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import msgspec

from radix_sync.integrity import IntegrityError

if TYPE_CHECKING:
    from radix_sync.policy.tracker import TrackedNode

HINT_KINDS = ("fanout", "keepalive")
MAX_HINT_IDS = 65_536
"""Hint ids remembered for idempotency at most (`DemandLog.hint_ids`)."""


class ArrivalRecord(msgspec.Struct, frozen=True, gc=False):
    """A request the router saw (the earliest demand signal): where it went and what prefix it carried."""

    time_s: float
    namespace: str
    block_hash: Optional[int]
    """Hash of the deepest page of the prompt some worker held when it arrived (the prefix it reuses); None when
    no worker held any of it (no reuse to predict from)."""
    prompt_len: int
    worker_id: str
    session_id: str = ""
    class_key: str = ""
    """Tenant/workload class the router put the request in (gap distributions are learned per class)."""


class FinishRecord(msgspec.Struct, frozen=True, gc=False):
    """A response the router saw end: the session-continuation signal (the next turn of a session extends this
    prompt, after a gap that depends on how the response ended)."""

    time_s: float
    namespace: str
    block_hash: Optional[int]
    """Hash of the prompt's deepest full page (None: shorter than a page)."""
    num_pages: int
    stop: Optional[str]
    """How the response ended, normalised by the router: `tool_use` (a tool call), `stop`, `length`, ...;
    None when the router could not tell."""
    class_key: str
    worker_id: str


class HintRecord(msgspec.Struct, frozen=True, gc=False):
    """An explicit demand hint: `fanout` (k branches will extend this prefix) or `keepalive` (a session's next
    turn is expected within ttl_s)."""

    time_s: float
    kind: str
    namespace: str
    block_hash: Optional[int]
    prefix_len: int
    k: int
    ttl_s: float
    delay_s: float = 0.5
    """Fan-out: the branches follow the trunk's answer after about this long (the client's estimate; default
    0.5 s, a short answer plus client work). The branches cannot come before the trunk is computed."""


DemandEvent = tuple[str, object, list[int], int, tuple[int, list[str]]]


class DemandLog:
    def __init__(self, max_events: int) -> None:
        self.hits: deque = deque()
        """`HitRecord`s (`radix_sync.coordinator.rules`) of the workers' prefix hits."""
        self.arrivals: deque[ArrivalRecord] = deque()
        self.hints: deque[HintRecord] = deque()
        self.finishes: deque[FinishRecord] = deque()
        self.events: deque[DemandEvent] = deque(maxlen=max_events)
        """(kind, record, the prompt's page hashes, pages held somewhere at arrival, (pages the worker it was
        routed to held, the other workers holding exactly as much)) of each arrival (`arrival`), finish
        (`finish`) and session end (`end`: the hint's record, [its prefix's last page hash], 1, (0, [])) in the
        order recorded; the predictive planner drains it (`LivePlanner`)."""
        self.hint_counts: dict[str, int] = {}
        """Live hints per namespace (tenant): capped by `ClusterState`'s `max_hints_per_namespace`."""
        self._hint_buckets: dict[str, tuple[float, float]] = {}
        """Namespace -> (hint tokens left, when last refilled): the per-tenant rate limit (`take_hint_token`)."""
        self.hint_ids: "OrderedDict[tuple[str, str, str], HintRecord]" = OrderedDict()
        """(namespace, hint id, kind) -> the hint recorded with it, oldest first, kept the hit window (at most
        `MAX_HINT_IDS`): a hint sent again with its id (by the router and by the worker) is recorded once."""
        self.by_prefix: dict[int, tuple[deque, deque]] = {}
        """Prefix (block hash) -> its (hits, arrivals) in `hits`/`arrivals`, as (sequence number, time,
        namespace), oldest first: kept with the logs (`_index`, `trim`), so a plan tick reads the prefixes it may
        plan for without a pass over every record (`popular`)."""
        self.popular: dict[int, None] = {}
        """Prefixes with two or more hits or two or more arrivals (a candidate by popularity needs that much)."""
        self.stamps: dict[int, int] = {}
        """Prefix in `by_prefix` -> a number that changes whenever its entries change (a record added or trimmed),
        unique over the log's life: a reader that derived something from a prefix's entries keeps it while the
        stamp is the same (the live planner's candidate views, `LivePlanner`)."""
        self._seq = 0
        self.hint_times: dict[int, dict[str, float]] = {}
        """Live hinted prefix -> `hint_s` (the hint came), `stored_s` (its pages reached the directory: the
        trunk's prefill is done) and `copy_s` (the first copy of it was issued): when a fan-out's branches are
        due, and, in `/status`, whether its copies could have landed in time."""

    # ------------------------------------------------------------------------------------------------ records
    def add_hit(self, hit) -> None:
        self.hits.append(hit)
        self._index(hit, 0)

    def add_arrival(self, rec: ArrivalRecord, hashes: list[int], held: int, copies: tuple[int, list[str]]) -> None:
        self.arrivals.append(rec)
        self._index(rec, 1)
        self.events.append(("arrival", rec, hashes, held, copies))

    def _index(self, rec, which: int) -> None:
        """`rec` (a hit: `which` 0, an arrival: 1) into `by_prefix` and `popular`."""
        if rec.block_hash is None:
            return
        entries = self.by_prefix.get(rec.block_hash)
        if entries is None:
            entries = self.by_prefix[rec.block_hash] = (deque(), deque())
        self._seq += 1
        entries[which].append((self._seq, rec.time_s, rec.namespace))
        self.stamps[rec.block_hash] = self._seq
        if len(entries[which]) == 2:
            self.popular[rec.block_hash] = None

    def _unindex(self, rec, which: int) -> None:
        """The oldest record of its prefix (`rec`, leaving its log) out of `by_prefix` and `popular`."""
        if rec.block_hash is None:
            return
        entries = self.by_prefix[rec.block_hash]
        entries[which].popleft()
        self._seq += 1
        self.stamps[rec.block_hash] = self._seq
        if len(entries[0]) < 2 and len(entries[1]) < 2:
            self.popular.pop(rec.block_hash, None)
            if not entries[0] and not entries[1]:
                del self.by_prefix[rec.block_hash]
                del self.stamps[rec.block_hash]

    def add_finish(self, rec: FinishRecord, hashes: list[int]) -> None:
        self.finishes.append(rec)
        if hashes:
            self.events.append(("finish", rec, hashes, len(hashes), (0, [])))

    def add_hint(self, rec: HintRecord, already_stored: bool) -> None:
        """`already_stored`: the hinted prefix is in the directory already (computed before the hint came)."""
        self.hints.append(rec)
        self.hint_counts[rec.namespace] = self.hint_counts.get(rec.namespace, 0) + 1
        if rec.block_hash is not None:
            times = self.hint_times.setdefault(rec.block_hash, {"hint_s": rec.time_s})
            if already_stored:
                times.setdefault("stored_s", rec.time_s)

    def end_session(self, rec: HintRecord) -> int:
        """An `end` hint: the live hints on its prefix (its namespace's) are dropped, and an `end` event queued for
        the planner (which closes the session there).

        Returns:
            the hints dropped.
        """
        kept = deque(h for h in self.hints if not (h.block_hash == rec.block_hash and h.namespace == rec.namespace))
        dropped = len(self.hints) - len(kept)
        if dropped:
            self.hints = kept
            self.hint_counts[rec.namespace] -= dropped
            if not self.hint_counts[rec.namespace]:
                del self.hint_counts[rec.namespace]
        if rec.block_hash is not None:
            self.events.append(("end", rec, [rec.block_hash], 1, (0, [])))
        return dropped

    def take_hint_token(self, namespace: str, now_s: float, rate_per_s: float, burst: float) -> bool:
        """The per-namespace token bucket of hints: True (and one token taken) when `namespace` may hint now."""
        left, last_s = self._hint_buckets.get(namespace, (burst, now_s))
        left = min(burst, left + max(0.0, now_s - last_s) * rate_per_s)
        if left < 1.0:
            self._hint_buckets[namespace] = (left, now_s)
            return False
        self._hint_buckets[namespace] = (left - 1.0, now_s)
        return True

    def clear(self) -> None:
        """Forgets every demand signal (a policy switch with `reset_demand`)."""
        for log in (self.hits, self.arrivals, self.finishes, self.hints, self.events, self.hint_ids, self.by_prefix,
                    self.popular, self.stamps):
            log.clear()
        self.hint_times.clear()
        self.hint_counts.clear()

    def pages_stored(self, block_hashes, now_s: float) -> None:
        """Pages reached the directory: the hinted prefixes among them are computed now."""
        if self.hint_times:
            for block_hash in block_hashes:
                times = self.hint_times.get(block_hash)
                if times is not None:
                    times.setdefault("stored_s", now_s)

    def copy_issued(self, block_hash: Optional[int], now_s: float) -> None:
        if block_hash in self.hint_times:
            self.hint_times[block_hash].setdefault("copy_s", now_s)

    # ------------------------------------------------------------------------------------------------ timers
    def seen_hint(self, namespace: str, hint_id: str, kind: str) -> Optional[HintRecord]:
        """The hint of this kind recorded with this id (idempotency), if any."""
        return self.hint_ids.get((namespace, hint_id, kind)) if hint_id else None

    def remember_hint_id(self, namespace: str, hint_id: str, rec: HintRecord) -> None:
        if hint_id:
            self.hint_ids[(namespace, hint_id, rec.kind)] = rec
            while len(self.hint_ids) > MAX_HINT_IDS:
                self.hint_ids.popitem(last=False)

    def trim(self, now_s: float, window_s: float) -> None:
        """Forgets hits, arrivals and finishes older than `window_s`, and hints older than both their TTL and
        `window_s` (TTLs are capped when a hint is recorded, so no hint outlives the cap)."""
        ids = self.hint_ids
        while ids and now_s - next(iter(ids.values())).time_s > window_s:
            ids.popitem(last=False)
        for which, log in enumerate((self.hits, self.arrivals)):
            while log and now_s - log[0].time_s > window_s:
                self._unindex(log.popleft(), which)
        while self.finishes and now_s - self.finishes[0].time_s > window_s:
            self.finishes.popleft()
        # NOTE: the planner drains `events` every tick; with a policy that never reads them (rules, none) they
        # piled up to `max_events`, each with its prompt's page hashes (the soak saw the coordinator grow by
        # ~10 MB a minute under the rules policy)
        events = self.events
        while events and now_s - events[0][1].time_s > window_s:
            events.popleft()
        if any(now_s - h.time_s > max(h.ttl_s, window_s) for h in self.hints):
            kept = deque(h for h in self.hints if now_s - h.time_s <= max(h.ttl_s, window_s))
            self.hints = kept
            counts: dict[str, int] = {}
            for h in kept:
                counts[h.namespace] = counts.get(h.namespace, 0) + 1
            self.hint_counts = counts
        if len(self._hint_buckets) > 4 * len(self.hint_counts) + 64:  # forget the buckets of quiet tenants
            self._hint_buckets = {ns: b for ns, b in self._hint_buckets.items() if ns in self.hint_counts}
        if len(self.hint_times) > len(self.hints):
            live = {h.block_hash for h in self.hints}
            self.hint_times = {b: t for b, t in self.hint_times.items() if b in live}

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every hint is of a known kind and bounds, every event is an arrival or
        a finish whose held pages are pages of its prompt, and every hinted prefix's timeline starts with its
        hint."""
        index: dict[int, tuple[list, list]] = {}
        for which, log in enumerate((self.hits, self.arrivals)):
            for rec in log:
                if rec.block_hash is not None:
                    index.setdefault(rec.block_hash, ([], []))[which].append((rec.time_s, rec.namespace))
        kept = {b: tuple([(t, ns) for _, t, ns in e] for e in entries) for b, entries in self.by_prefix.items()}
        if kept != index:
            raise IntegrityError("the hits and arrivals by prefix disagree with their logs")
        if set(self.popular) != {b for b, (hits, arrivals) in index.items() if len(hits) >= 2 or len(arrivals) >= 2}:
            raise IntegrityError("the popular prefixes disagree with the hits and arrivals")
        if self.stamps.keys() != self.by_prefix.keys() or any(
                stamp < max(e[-1][0] for e in entries if e) for stamp, entries in
                ((self.stamps[b], entries) for b, entries in self.by_prefix.items())):
            raise IntegrityError("the prefixes' stamps disagree with their hits and arrivals")
        counts: dict[str, int] = {}
        for hint in self.hints:
            if hint.kind not in HINT_KINDS or hint.k < 1 or not hint.ttl_s > 0:
                raise IntegrityError(f"bad hint {hint}")
            counts[hint.namespace] = counts.get(hint.namespace, 0) + 1
        if counts != {ns: n for ns, n in self.hint_counts.items() if n}:
            raise IntegrityError(f"live hints per namespace {counts} but counted {self.hint_counts}")
        for kind, rec, hashes, held, (num_at_worker, _) in self.events:
            if kind not in ("arrival", "finish", "end"):
                raise IntegrityError(f"demand event of unknown kind {kind!r}")
            if not 0 <= held <= len(hashes) or not 0 <= num_at_worker <= held:
                raise IntegrityError(f"{kind} event holds {held} (worker: {num_at_worker}) of {len(hashes)} "
                                     f"pages: {rec}")
        for block_hash, times in self.hint_times.items():
            if "hint_s" not in times:
                raise IntegrityError(f"hinted prefix {block_hash} has no hint time: {times}")


# ---------------------------------------------------------------------------------- what a plan tick reads
def drop_explained(times: list[float], since_s: float, k: int) -> list[float]:
    """`times` without the first `k` at or after `since_s` (the arrivals a fan-out hint announced)."""
    out = []
    for t in sorted(times):
        if k > 0 and t >= since_s:
            k -= 1
            continue
        out.append(t)
    return out


@dataclass
class CandidateDemand:
    """The demand signals one plan tick's snapshot chooses its prefixes from, by block hash. Built by
    `candidate_demand`, then `LivePlanner._add_hints` and
    `LivePlanner._add_busy_sessions`, in that order."""

    times: dict[int, list[float]]
    """Recent request times (arrivals, else hits, less those a fan-out hint explains); empty for a prefix that
    only a hint or an open session names."""
    namespaces: dict[int, str]
    fanout: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Live fan-out hints: (branches, when they are due)."""
    keepalive: dict[int, float] = field(default_factory=dict)
    """Keep-alive hints: until when."""
    sessions: dict[int, "TrackedNode"] = field(default_factory=dict)
    """Open session nodes whose every holder is busy."""
    by_prefix: dict = field(default_factory=dict)
    """`DemandLog.by_prefix`: each prefix's hits and arrivals."""
    fanout_hints: dict[int, list] = field(default_factory=dict)
    """Fan-out hints (all, live or not) by prefix."""
    memo: Optional[ViewCache] = None
    """What earlier ticks derived from the demand entries, with `entry(block hash, entries)` -> [stamp, times,
    namespace, log position, ...] (`ViewCache`); None: derive everything."""
    order: dict[int, int] = field(default_factory=dict)
    """Prefix -> where a pass over the logs meets it (`log_position`), or, without entries, after them all in
    the order added."""

    def add(self, block_hash: int) -> None:
        """The prefix's request times (its arrivals', else its hits', less those a fan-out hint announced) into
        `times`, its namespace (that of its latest arrival, else hit) into `namespaces`; no-op if it is there."""
        if block_hash in self.times:
            return
        entries = self.by_prefix.get(block_hash)
        if entries is None:
            self.order[block_hash] = NO_ENTRIES + len(self.times)
            self.times[block_hash] = []
            return
        hints = self.fanout_hints.get(block_hash)
        if hints is None and self.memo is not None:
            kept = self.memo.entry(block_hash, entries)
            times, namespace, pos = kept[1], kept[2], kept[3]
        else:
            times, namespace = entry_times(entries, hints or ())
            pos = log_position(entries)
        self.order[block_hash] = pos
        self.times[block_hash] = times
        self.namespaces[block_hash] = namespace

    def in_log_order(self) -> list[int]:
        """The prefixes of `times` as a pass over the logs meets them: those with hits by their oldest hit, then
        those with arrivals only by their oldest arrival, then the others as added (hinted, then sessions)."""
        return sorted(self.times, key=self.order.__getitem__)


def entry_times(entries: tuple, hints) -> tuple[list[float], str]:
    """A prefix's request times (arrivals, else hits, less those a fan-out hint of `hints` announced) and its
    namespace (its latest arrival's, else hit's), from its `DemandLog.by_prefix` entries."""
    hits, arrivals = ([t for _, t, _ in e] for e in entries)
    for hint in hints:
        hits = drop_explained(hits, hint.time_s, hint.k) if hits else hits
        arrivals = drop_explained(arrivals, hint.time_s, hint.k) if arrivals else arrivals
    return arrivals or hits, (entries[1] or entries[0])[-1][2]


ARRIVALS_ONLY = 1 << 62
NO_ENTRIES = 2 << 62


def log_position(entries: tuple) -> int:
    """Where a pass over the logs first meets a prefix with entries: at its oldest hit, or, with arrivals only,
    after every hit, at its oldest arrival (sequence numbers of `DemandLog.by_prefix`, below 2^62)."""
    return entries[0][0][0] if entries[0] else ARRIVALS_ONLY + entries[1][0][0]


def candidate_demand(log: DemandLog, memo: Optional[ViewCache] = None) -> CandidateDemand:
    """Recent request times and the namespace of each prefix (block hash) the planner may be offered: the popular
    ones (`DemandLog.popular`) and the hinted ones; `CandidateDemand.add` adds others (busy sessions).

    NOTE: with a router in front, one request shows up twice: as the router's arrival and as the worker's prefix
    hit, both on the prefix it reuses. A prefix's demand is its arrivals when the router reported any, else its
    hits (workers without our router), never the sum.
    NOTE: read from the demand log's index by prefix, kept as records come and go: a pass over every record each
    tick (20,000 hits in the window) was most of a plan tick's time at 100,000 prefixes.
    `memo`: what earlier ticks derived (`ViewCache`), None: nothing.
    """
    demand = CandidateDemand({}, {}, by_prefix=log.by_prefix, memo=memo)
    for hint in log.hints:
        # NOTE: a fan-out's branches are explained by its hint, not popularity (the tracker's rule): counted as
        # hits, the K branches of a finished tree made its trunk look hot for the whole window and it was copied
        # again after its replicas expired (~half the copies of a fan-out run were such re-copies).
        if hint.kind == "fanout" and hint.block_hash is not None:
            demand.fanout_hints.setdefault(hint.block_hash, []).append(hint)
    if memo is not None:
        memo.add_popular(demand, log.popular)
    else:
        for block_hash in log.popular:
            demand.add(block_hash)
    for hint in log.hints:
        if hint.block_hash is not None:
            demand.add(hint.block_hash)
    return demand


class ViewCache:
    """What the last tick derived from facts that have not changed since, kept for the next (each tick keeps only
    what it used), per prefix: its request times, namespace and log position from its demand entries (valid while
    its `DemandLog.stamps` entry is the same; not for a prefix a fan-out hint names), and, for a candidate by its
    popularity alone (no hint names it, no open session, no copy of it in flight), its `PrefixView`: then a
    function of those entries and of its directory page (the same page object, depth, and holders with their
    roles and expiries: the page's `version`), for the same worker index and page length (`scope`). `LivePlanner.check_views`
    checks the views against fresh ones."""

    def __init__(self) -> None:
        self.scope: tuple = ()
        """What every kept entry depends on: (directory, demand index, worker ids, page length)."""
        self._kept: dict[int, list] = {}
        """Prefix -> [stamp, times, namespace, log position, page node, its depth, its holders' version
        (`PageNode.version`), view] (the last four None until a view is made)."""
        self.entries: dict[int, list] = {}
        """This tick's entries (those it used), by prefix."""
        self._stamps: dict[int, int] = {}

    def begin(self, scope: tuple, stamps: dict[int, int]) -> None:
        """A new tick over `scope` (everything is dropped when that changed)."""
        old = self.scope
        if not old or scope[0] is not old[0] or scope[1] is not old[1] or scope[2:] != old[2:]:
            self._kept = {}
        self.scope = scope
        self._stamps = stamps
        self.entries = {}

    def end(self) -> None:
        """The tick is over: what it used is kept for the next."""
        self._kept, self.entries = self.entries, {}

    def entry(self, block_hash: int, entries: tuple) -> list:
        """The kept entry of a prefix no fan-out hint names (its times are shared: read-only)."""
        stamp = self._stamps[block_hash]
        kept = self._kept.get(block_hash)
        if kept is None or kept[0] != stamp:
            kept = [stamp, *entry_times(entries, ()), log_position(entries), None, 0, None, None]
        self.entries[block_hash] = kept
        return kept

    def add_popular(self, demand: CandidateDemand, popular) -> None:
        """`demand.add` of each prefix of `popular` (in order, into an empty `demand`), from the kept entries."""
        times, namespaces, order, fanout_hints = demand.times, demand.namespaces, demand.order, demand.fanout_hints
        by_prefix, stamps, kept_by, next_by = demand.by_prefix, self._stamps, self._kept, self.entries
        for block_hash in popular:
            if block_hash in fanout_hints:
                demand.add(block_hash)
                continue
            stamp = stamps[block_hash]
            kept = kept_by.get(block_hash)
            if kept is None or kept[0] != stamp:
                entries = by_prefix[block_hash]
                kept = [stamp, *entry_times(entries, ()), log_position(entries), None, 0, None, None]
            next_by[block_hash] = kept
            times[block_hash] = kept[1]
            namespaces[block_hash] = kept[2]
            order[block_hash] = kept[3]
