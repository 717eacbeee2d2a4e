"""Demotion in the simulator: a session's next turn ran on one worker, so the other workers' copies of its
history that go no further become evict-first (`PolicyBundle.demote_stale`), where the demotion gate lets it."""

from __future__ import annotations

from typing import Optional, Sequence

from radix_sync.policy.demotion import DemotionGate


def demote_others(workers: Sequence, holders: dict[int, int], gate: Optional[DemotionGate], wid: int, pages,
                  matched_pages: int, now: float) -> None:
    """A session's next turn runs on `wid` with `matched_pages` of `pages` cached: demotes the other workers'
    copies of that history that go no further (a hit on an old copy takes this back), where `gate` lets it.
    `holders`: page -> bitmask of the workers holding it (the simulator's directory)."""
    last = pages[matched_pages - 1]
    bits = holders.get(last, 0) & ~(1 << wid)
    if matched_pages < len(pages):
        bits &= ~holders.get(pages[matched_pages], 0)  # those holding more of the prompt keep theirs
    if bits and gate is not None:
        stale = [i for i in range(bits.bit_length()) if bits >> i & 1]
        if not gate.decide(last, stale, now):
            return
    demote_on(workers, bits, last)


def demote_on(workers: Sequence, bits: int, last: int) -> None:
    """Demotes the chain ending at page `last` on every worker in the bitmask `bits`."""
    i = 0
    while bits:
        if bits & 1:
            workers[i].cache.tree.demote(last)
        bits >>= 1
        i += 1
