"""The router's replica of the coordinator's directory: who holds which page, kept current from the
coordinator's change feed (`GET /directory/feed`, a long poll), so a routing decision matches a prompt's page
hashes locally instead of asking the coordinator per request.

Only holdings are mirrored (block hash -> worker ids), the workers' host-memory tiers apart (`match_host`; feed
ops +2 / -2, `radix_sync.host_tier`): roles, expiry and tokens stay at the coordinator. A replica
is usable while its feed is healthy: the last long poll answered within `max_silence_s`; otherwise the router
asks the coordinator per request (and falls back to its own view when that fails too). Owned by
`radix_sync.router.service.Router`; runs on its event loop.
"""
from __future__ import annotations

import time
from typing import Optional

from radix_sync.directory import match_runs


class FeedError(ValueError):
    """A feed answer the replica cannot apply (malformed); the replica resyncs from a snapshot."""


class DirectoryReplica:
    def __init__(self, max_silence_s: float = 3.0) -> None:
        self.max_silence_s = max_silence_s
        self.epoch = ""
        self.seq = 0
        """Number of the last change applied (of `epoch`)."""
        # NOTE: holders as tuples of shared worker-id strings, not sets: a set is a container the cycle collector
        # tracks (its full passes went over every page of the mirror: 33 ms at 200,000 pages in a bare process),
        # a tuple of strings is untracked after the first pass that sees it, and takes 56 bytes, not 216
        self._holders: dict[int, tuple[str, ...]] = {}
        """Page hash -> the workers holding it (device pool)."""
        self._host: dict[int, tuple[str, ...]] = {}
        """Page hash -> the workers whose host-memory tier holds it."""
        self._ids: dict[str, str] = {}
        """Worker ids, one string object each (a feed answer decodes a new one per change)."""
        self._answered_at = -float("inf")
        self.healthy = False
        self.num_snapshots = 0
        self.num_changes = 0
        self.num_matches = 0

    # ---------------------------------------------------------------------------------------------- updating
    def apply(self, msg: dict, now: Optional[float] = None) -> None:
        """Applies one feed answer. Raises FeedError (and forgets everything, so the next call asks for a
        snapshot) on a malformed one."""
        try:
            epoch, seq = msg["epoch"], msg["seq"]
            if not isinstance(epoch, str) or not isinstance(seq, int):
                raise TypeError("epoch must be a string and seq an integer")
            if "snapshot" in msg:
                self._ids = {}
                self._holders = self._from_snapshot(msg["snapshot"])
                self._host = self._from_snapshot(msg.get("host_snapshot", {}))
                self.num_snapshots += 1
            else:
                if epoch != self.epoch:
                    raise ValueError(f"changes of epoch {epoch!r} on a replica of epoch {self.epoch!r}")
                ids = self._ids
                for op, worker_id, h in msg["changes"]:
                    if op not in (1, -1, 2, -2):
                        raise ValueError(f"unknown change op {op!r}")
                    if not isinstance(worker_id, str) or not isinstance(h, int):
                        raise TypeError(f"a change is (op, worker id, page hash), got {[op, worker_id, h]!r}")
                    holders = self._holders if op in (1, -1) else self._host
                    ws = holders.get(h, ())
                    if op > 0:
                        if worker_id not in ws:
                            holders[h] = (*ws, ids.setdefault(worker_id, worker_id))
                    elif worker_id in ws:
                        rest = tuple(w for w in ws if w != worker_id)
                        if rest:
                            holders[h] = rest
                        else:
                            del holders[h]
                    self.num_changes += 1
        except (KeyError, TypeError, ValueError) as exc:
            self.reset()
            raise FeedError(f"bad directory feed answer: {type(exc).__name__}: {exc}") from None
        self.epoch, self.seq = epoch, seq
        self._answered_at = time.monotonic() if now is None else now
        self.healthy = True

    def _from_snapshot(self, snapshot: dict) -> dict[int, tuple[str, ...]]:
        """Page hash -> holders from a snapshot (worker id -> its page hashes)."""
        out: dict[int, tuple[str, ...]] = {}
        for worker_id, hashes in snapshot.items():
            w = str(worker_id)
            w = self._ids.setdefault(w, w)
            for h in hashes:
                h = int(h)
                ws = out.get(h, ())
                if w not in ws:
                    out[h] = (*ws, w)
        return out

    def reset(self) -> None:
        """Forgets everything (the next feed call gets a snapshot)."""
        self.epoch, self.seq, self._holders, self._host, self.healthy = "", 0, {}, {}, False
        self._ids = {}

    def mark_unhealthy(self) -> None:
        self.healthy = False

    # ----------------------------------------------------------------------------------------------- queries
    def usable(self, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.healthy and now - self._answered_at <= self.max_silence_s

    def match(self, block_hashes: list[int]) -> dict[str, int]:
        """Pages matched from the root, per worker (as `PrefixDirectory.match`)."""
        self.num_matches += 1
        return match_runs(block_hashes, self._holders.get)

    def match_host(self, block_hashes: list[int], matched: dict[str, int]) -> dict[str, int]:
        """Per worker, the pages of `block_hashes` its host tier holds right after the `matched` pages its device
        holds (`match`): what SGLang would load back before the prefill; workers with none are left out."""
        host = self._host
        if not host or not block_hashes:
            return {}
        out: dict[str, int] = {}
        for w in {w for h in block_hashes for w in host.get(h, ())}:
            i = start = matched.get(w, 0)
            while i < len(block_hashes) and w in host.get(block_hashes[i], ()):
                i += 1
            if i > start:
                out[w] = i - start
        return out

    def status(self) -> dict:
        return {"epoch": self.epoch, "seq": self.seq, "usable": self.usable(), "pages": len(self._holders),
                "host_pages": len(self._host),
                "snapshots": self.num_snapshots, "changes": self.num_changes, "matches": self.num_matches}
