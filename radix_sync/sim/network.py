"""Links and copies: every worker has one NIC; a copy occupies the source's egress and the target's ingress,
FIFO (a copy starts when both are free: contention), for latency + bytes / min(bandwidths). Copies are
asynchronous: the engine is told when one lands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Transfer:
    """One copy of pages `pages[lo:hi]` from `src` to `dst`."""

    kind: str
    """`replica` (planned ahead) or `pull` (on a request's critical path)."""
    src: int
    dst: int
    pages: list
    lo: int
    hi: int
    num_bytes: int
    start_s: float
    end_s: float
    node_id: int = 0
    ttl_s: float = 0.0
    src_lock: Optional[int] = None
    pending: bool = False
    """Planned from a source that does not hold the pages yet (its own copy or prefill is in flight): not booked,
    `start_s`/`end_s` are estimates until the source has the pages."""
    parent: Optional["Transfer"] = None
    """The copy in flight to `src` this one waits for (None: waits for `src`'s own prefill)."""
    waiters: list = field(default_factory=list)
    """Requests held until this copy lands (routed to wait for it while it was pending)."""
    copy_id: int = 0
    """A planner's copy: its key in the engine's `UseCalibration` (0: not the planner's)."""


@dataclass
class CopyRecord:
    """A landed copy on a worker, for hit accounting until `active_until_s`."""

    kind: str
    worker: int
    lo: int
    hi: int
    first_page: int
    last_page: int
    num_bytes: int
    active_until_s: float
    num_hits: int = 0
    promoted: bool = False
    copy_id: int = 0
    """`Transfer.copy_id` of the copy that landed it."""
    inserted: int = 0
    """Pages it added (the rest of `lo`..`hi` was cached there already)."""


class Network:
    """Per-worker NIC booking (FIFO)."""

    def __init__(self, num_workers: int, bandwidth_bytes_per_s: float, latency_s: float) -> None:
        self.bw = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self.egress_free_s = [0.0] * num_workers
        self.ingress_free_s = [0.0] * num_workers

    def book(self, src: int, dst: int, num_bytes: int, now: float) -> tuple[float, float]:
        """Books a copy. Returns: (start, end) times, s."""
        start = max(now, self.egress_free_s[src], self.ingress_free_s[dst])
        end = start + self.latency_s + num_bytes / self.bw
        self.egress_free_s[src] = end
        self.ingress_free_s[dst] = end
        return start, end

    def estimate(self, src: int, dst: int, num_bytes: int, now: float) -> tuple[float, float]:
        """Like `book` without booking."""
        start = max(now, self.egress_free_s[src], self.ingress_free_s[dst])
        return start, start + self.latency_s + num_bytes / self.bw


def reestimate_pending(pending: list, net: Network, nodes: dict, now: float) -> None:
    """Moves the estimated arrival of every pending copy to what the links, the pending copies before it on the
    same links and its source's own copy (or prefill) now say (at every arrival and planning pass: an estimate
    made when it was planned goes stale as other copies are booked and its source's copy slips)."""
    if not pending:
        return
    egress, ingress = list(net.egress_free_s), list(net.ingress_free_s)  # pending copies queue on them too
    for x in pending:  # parents were planned before their children: their estimates are fresh here
        if x.parent is not None:
            ready = x.parent.end_s
        else:
            node = nodes.get(x.node_id)
            ready = node.owner_eta_s if node is not None and node.owner == x.src else now
        start = max(now, ready, egress[x.src], ingress[x.dst])
        x.end_s = egress[x.src] = ingress[x.dst] = start + net.latency_s + x.num_bytes / net.bw
