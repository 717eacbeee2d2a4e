"""`IntegrityError`: what a `check_integrity()` raises when an owner's indexes disagree.

A real exception, not an `assert`: the checks still run under `python -O` (the coordinator's `/status` reports
them). Raised by `radix_sync.directory.PrefixDirectory`, the coordinator's state owners
(`radix_sync.coordinator.workers`, `.replications`, `.demand`, `.state`), the page tree
(`radix_sync.policy.pagetree.PageTree`) and the simulator's worker cache (`radix_sync.sim.cache.WorkerCache`).
"""
from __future__ import annotations


class IntegrityError(RuntimeError):
    """An invariant of a state owner does not hold (a bug); the message names the broken one."""
