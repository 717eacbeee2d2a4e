"""The planner's gate: what a speculative copy costs the others (issue 16, item 7, "never worse").

A copy is worth making only if its expected gain is net of the harm it does to everything else. The planner
(`radix_sync.policy.planner.KvrepPlanner`) asks three questions of a candidate copy, each answered here from the
snapshot alone (pure functions, seconds and tokens):

1. *When can it start?* A link is busy until what is booked on it ends, plus what is already decided but not booked
   yet (chained copies waiting for their source's pages), plus what this pass has planned: `link_free_s`.
2. *Whom does it delay?* A copy holding a link for `x` seconds delays every copy on a request's critical path
   (pull) that wants the same link meanwhile. With pulls arriving at rate `r` (Poisson), those arriving before the
   copy starts wait all of `x`, those arriving during it the rest of it:

       delay = r x (start - now) + r x^2 / 2          (`pull_delay_s`; seconds of TTFT, one request per pull)

3. *What does it evict when it lands?* Replicas and demoted chains are evicted before any ordinary page (a demoted
   page counts only while nothing live is below it: `WorkerView.demoted_tokens`). So once
   the target's memory is full, a landing copy first takes the evict-first pages, and if some of them are wanted
   (requests routed there wait to use them, or the planner predicts demand for a replica there) it can evict the
   very replica those requests will need, and they recompute it. Past the evict-first pages it takes ordinary
   pages in LRU order, which the snapshot does not give: where the planner predicts demand for a prefix the
   target holds as ordinary cache (a hinted trunk whose branches are still to come), those pages may be next,
   so the copy must stay within the evict-first pages there. Memory taken before the copy lands: the copies
   still coming in and the prompts of the requests queued there. `landing_room_tokens` is how much a copy may take
   without reaching a wanted page (unlimited when nothing there is wanted, or when the target reports no
   replica accounting).

Live, the coordinator fills the `WorkerView` fields these read (see each field in `radix_sync.policy.snapshot`); the
simulator fills them in `radix_sync.sim.views.gate_fields`.
"""

from __future__ import annotations

from radix_sync.policy.snapshot import WorkerView

UNLIMITED = 1 << 62
"""`landing_room_tokens` when no wanted page can be evicted."""


def link_free_s(busy_until_s: float, pending_bytes: int, bandwidth_bytes_per_s: float, now: float) -> float:
    """When a link has carried what is booked on it and what is decided for it but not booked yet.

    Args:
        busy_until_s: end of the transfers booked on the link.
        pending_bytes: bytes of copies decided for the link and not booked yet.
        bandwidth_bytes_per_s: the link's bandwidth (0: no copies possible; pending bytes are then ignored).
        now: current time, s.
    Returns:
        max(now, busy_until_s) + pending_bytes / bandwidth, s.
    """
    free = max(now, busy_until_s)
    if pending_bytes > 0 and bandwidth_bytes_per_s > 0:
        free += pending_bytes / bandwidth_bytes_per_s
    return free


def pull_delay_s(pull_rate_per_s: float, start_s: float, xfer_s: float, now: float) -> float:
    """Expected TTFT seconds a copy holding a link from `start_s` for `xfer_s` imposes on the critical-path pulls
    that want the link meanwhile (module docstring, question 2).

    Args:
        pull_rate_per_s: pulls per second wanting the link (recent rate).
        start_s: when the copy starts on the link.
        xfer_s: how long it holds the link.
        now: current time, s.
    Returns:
        r x (start - now) + r x^2 / 2, seconds (>= 0).
    """
    if pull_rate_per_s <= 0 or xfer_s <= 0:
        return 0.0
    return pull_rate_per_s * xfer_s * (max(0.0, start_s - now) + xfer_s / 2.0)


def landing_room_tokens(w: WorkerView, wanted_replica_tokens: int = 0, wanted_ordinary_tokens: int = 0) -> int:
    """Tokens a copy may bring to `w` without evicting a page that is wanted (module docstring, question 3).

    Memory free at landing = free - queued prompts (admitted first) - copies still coming in. Beyond it the copy
    evicts evict-first pages (demoted, then replicas); the unwanted ones are taken first (they are the older ones:
    a replica is wanted while its demand is to come), so the room ends where the wanted ones would go. Beyond all
    the evict-first pages it evicts ordinary pages, least recently used first; with wanted ordinary pages there
    (their place in the LRU order unknown) the room ends at the evict-first pages too.

    Args:
        w: the target's view (`free_tokens`, `waiting_new_tokens`, `incoming_tokens`, `demoted_tokens`,
            `replica_tokens`, `waited_evict_first_tokens`).
        wanted_replica_tokens: replica tokens on `w` the planner predicts demand for (its own earlier copies).
        wanted_ordinary_tokens: ordinary (not evict-first) tokens on `w` the planner predicts demand for (prefixes
            it holds as their owner, e.g. a hinted trunk before its branches arrive).
    Returns:
        tokens (>= 0), or `UNLIMITED` when nothing wanted can be evicted there (nothing wanted, or `replica_tokens`
        not reported).
    """
    wanted = w.waited_evict_first_tokens + wanted_replica_tokens
    if w.replica_tokens < 0 or (wanted <= 0 and wanted_ordinary_tokens <= 0):
        return UNLIMITED
    evict_first = max(0, w.demoted_tokens) + w.replica_tokens
    unwanted = max(0, evict_first - wanted)
    free_at_landing = w.free_tokens - w.waiting_new_tokens - w.incoming_tokens
    return max(0, free_at_landing + unwanted)
