"""The routers' sends, relayed: what each router in front of the workers sent where, told to the others at once.

A router merges the workers' last load reports with what it sent itself since (`radix_sync.router.policy.
with_local_load`); behind several routers each one is blind to the others' sends until the workers' next reports
(0.2 s apart), and two routers pile onto the same idle worker. In the simulator (docs/bench.md "Many routers, one
directory"), 4 routers cost 1.19x (agent) to 1.92x (bursty shared prefixes) the mean time to first token of one;
relaying every send to the others within 5 ms takes most of it back, instantly all of it. This board carries them:
routers post their events (`POST /sends`, `api.SendBatch`), each one long-polls the others' (`GET /sends/feed`,
`api.SendsFeed`) and counts them as its own until they start or end (`radix_sync.router.peers.PeerSends`).

Kept apart from the coordinator's state and its lock (the plan tick holds that for milliseconds): the board lives on
the admin API's event loop alone. Bounded: the last `capacity` events (a caller further behind is told to reset),
batches and answers of `api.MAX_SEND_EVENTS`, router names of 128 characters, at most `max_routers` routers. A
router that stops polling for `router_gone_s` is announced `gone` (its peers forget its requests). Pure: callers
pass `now`.
"""
from __future__ import annotations

import uuid
from collections import deque
import msgspec

from radix_sync import api
from radix_sync.api import AdminError


class SendRelay:
    """The relay board (see the module docstring).

    Args:
        capacity: events kept (older ones are gone: a caller that asks for them resets).
        router_gone_s: a router not heard of (no post, no poll) this long is announced gone, s.
        max_routers: routers tracked at once (a new one beyond it is refused, 429).
    """

    def __init__(self, capacity: int = 65_536, router_gone_s: float = 5.0, max_routers: int = 1024) -> None:
        if capacity < 1 or not router_gone_s > 0 or max_routers < 1:
            raise ValueError("capacity and max_routers must be >= 1 and router_gone_s > 0")
        self.capacity, self.router_gone_s, self.max_routers = capacity, router_gone_s, max_routers
        self.epoch = uuid.uuid4().hex[:16]
        self.head = 0
        """Number of the last event kept."""
        self._events: deque[tuple[int, api.SendEvent]] = deque(maxlen=capacity)
        self._serving: dict[str, float] = {}
        """Router -> when it last posted, or polled saying it serves requests (only those count: `routers`; an idle
        router, e.g. a benchmark's spare one, listens without making the others post)."""
        self._heard: dict[str, float] = {}
        """Router -> when it last posted or polled."""
        self.num_posted = 0

    # --------------------------------------------------------------------------------------------------- writing
    def post(self, batch: api.SendBatch, now: float) -> int:
        """Keeps a router's events, in order, each named by the poster. Returns: how many."""
        self._hear(batch.router, now)
        self._serving[batch.router] = now
        self.sweep(now)
        for e in batch.events:
            if e.kind == "gone":
                continue  # (the coordinator's own event)
            self._append(msgspec.structs.replace(e, router=batch.router))
        self.num_posted += len(batch.events)
        return len(batch.events)

    def _append(self, event: api.SendEvent) -> None:
        self.head += 1
        self._events.append((self.head, event))

    def _hear(self, router: str, now: float) -> None:
        if router not in self._heard and len(self._heard) >= self.max_routers:
            raise AdminError(f"more than {self.max_routers} routers on the send relay", 429)
        self._heard[router] = now

    def sweep(self, now: float) -> None:
        """Announces every router not heard of for `router_gone_s` as gone (once) and forgets it."""
        cutoff = now - self.router_gone_s
        for router in [r for r, t in self._heard.items() if t < cutoff]:
            del self._heard[router]
            self._serving.pop(router, None)
            self._append(api.SendEvent(kind="gone", router=router))

    # --------------------------------------------------------------------------------------------------- reading
    def routers(self, now: float) -> int:
        """Routers that served requests within `router_gone_s` (posted, or polled saying so)."""
        cutoff = now - self.router_gone_s
        return sum(1 for t in self._serving.values() if t >= cutoff)

    def feed(self, router: str, epoch: str, since: int, now: float, serving: bool = True,
             max_events: int = api.MAX_SEND_EVENTS) -> api.SendsFeed:
        """The other routers' events after `since` for `router` (its own left out), at most `max_events`; a
        `reset` answer (no events, `seq` = `head`) for another epoch or a `since` older than what is kept.
        `serving`: the caller sends requests to workers (it counts among `routers`)."""
        self._hear(router, now)
        if serving:
            self._serving[router] = now
        self.sweep(now)
        n = self.routers(now)
        oldest = self._events[0][0] if self._events else self.head + 1
        if epoch != self.epoch or since > self.head or (since < oldest - 1 and since < self.head):
            return api.SendsFeed(epoch=self.epoch, seq=self.head, head=self.head, routers=n, reset=True)
        out: list[api.SendEvent] = []
        seq = since
        if since < self.head:
            start = since - oldest + 1  # index of event since + 1 (numbers are consecutive)
            for i in range(start, len(self._events)):
                num, e = self._events[i]
                if len(out) >= max_events:
                    break
                seq = num
                if e.router != router:
                    out.append(e)
        return api.SendsFeed(epoch=self.epoch, seq=seq, head=self.head, routers=n, events=out)

    def status(self, now: float) -> dict:
        return {"epoch": self.epoch, "head": self.head, "kept": len(self._events), "routers": self.routers(now),
                "posted": self.num_posted}


def parse_feed_query(query) -> tuple[str, str, int, float, bool]:
    """`GET /sends/feed`'s query: (router, epoch, since, wait_s, serving). Raises AdminError (400) when malformed."""
    router = query.get("router", "")
    if not 1 <= len(router) <= 128:
        raise AdminError("router must name the caller (1-128 characters)")
    try:
        since = int(query.get("since", "0"))
        wait_s = min(max(float(query.get("wait_s", "0")), 0.0), 30.0)
    except ValueError:
        raise AdminError("since must be an integer and wait_s a number") from None
    return router, query.get("epoch", ""), since, wait_s, query.get("serving", "1") != "0"

