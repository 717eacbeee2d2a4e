"""The coordinator's side of a copy on the critical path (the router's pull): the checks a critical copy must pass,
and the long poll the router waits on.

A router that pulls holds a client's request until the copy lands, so a copy that cannot succeed must be refused at
once (HTTP 409, the router falls back) rather than fail later: `check_critical` refuses one in shadow mode or one
whose source no longer holds the whole prefix; `join_critical` finds the copy of the same prefix already headed for
the same target (the request waits for it: one copy, not one per router or per sibling request); `room_for_critical`
makes the target's replica budget take it (what the target would refuse on arrival, counting the copies already
headed there), by dropping the planner's speculative replicas there when they leave too little (a pull serves a
request that is waiting; a speculative copy is a bet on one that may never come: seen live, the planner's unused
copies filled the budget and refused the pulls that would have paid), else refuses it. `wait_replication` answers
when the
copy is done or failed, or at the caller's deadline. Called by `server.Coordinator.admin_replicate` and the admin
API (`admin.py`), under `coord.lock` for every read of the state.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from radix_sync import api
from radix_sync import protocol as p
from radix_sync.api import AdminError
from radix_sync.coordinator.replications import FAILED, ORIGIN_PULL
from radix_sync.hashing import page_hashes

CONFLICT = 409
POLL_S = 0.005
"""A waiter looks at its replication this often, s (a dict lookup under the lock: a few waiters cost nothing, and
the answer comes at most this late after the target's `ReplicaStored`)."""


def check_critical(state, req: api.ReplicateRequest, mode: str) -> None:
    """Refuses a critical copy that cannot help its waiting request. Caller holds the coordinator's lock.

    Args:
        state: the coordinator's `ClusterState`.
        req: the copy asked for (`req.critical`).
        mode: the coordinator's mode (`active` or `shadow`).
    Raises:
        AdminError (409): shadow mode, or the source does not hold the whole (page-aligned) prefix. Unknown workers
            and the other checks are `ClusterState.request_replication`'s (404, 400); the budget,
            `room_for_critical`'s.
    """
    if mode != "active":
        raise AdminError(f"coordinator in {mode} mode: no copies", CONFLICT)
    src, dst = state.workers.get(req.source), state.workers.get(req.target)
    if src is None or dst is None:
        return
    page_size = src.hello.page_size
    num_tokens = len(req.input_ids) // page_size * page_size
    if num_tokens == 0:
        return
    namespace = api.namespace_of(req.cache_salt)
    held = state.lookup(req.input_ids[:num_tokens], namespace).get(req.source, 0)
    if held < num_tokens:
        raise AdminError(f"source {req.source} holds {held} of the {num_tokens} tokens to copy", CONFLICT)


def room_for_critical(state, req: api.ReplicateRequest, dropping: dict[str, dict[str, int]]) -> list[str]:
    """Makes the target's replica budget take a critical copy: its budget less its live replicas (less those
    already asked to go) and the copies in flight to it must hold the (page-aligned) prefix; when it does not, the
    replicas nobody waits for make way, as few as needed: first the pulls whose request went elsewhere (it waited
    until its deadline: `wait_replication`), then the speculative ones (any origin but a pull: a pulled replica's
    request may still be queued for it), the soonest to expire first. Caller holds the coordinator's lock and sends
    `DropReplica` for each id returned before the copy's `ExpectReplica` (one socket: the target drops them first).

    Args:
        state: the coordinator's `ClusterState`.
        req: a critical copy that passed `check_critical`.
        dropping: target -> {replication id: tokens} asked to go and still in the directory (updated here: the
            ids returned are added, those the directory no longer holds are forgotten).
    Returns:
        the replication ids to drop at the target (empty when the budget takes the copy as it is).
    Raises:
        AdminError (409): even without every speculative replica there the budget is too small.
    """
    src, dst = state.workers.get(req.source), state.workers.get(req.target)
    if src is None or dst is None:
        return []
    page_size = dst.hello.page_size
    num_tokens = len(req.input_ids) // src.hello.page_size * src.hello.page_size
    asked = dropping.setdefault(req.target, {})
    headed = sum(r.num_tokens for r in state.replications.values() if r.in_flight and r.target == req.target)
    reported = dst.load.replica_tokens if dst.load is not None else 0
    if not asked and num_tokens <= dst.hello.replica_budget_tokens - reported - headed:
        return []  # the common case: room as reported, no walk of the target's pages
    replicas = state.directory.replicas(req.target)
    for rid in [r for r in asked if (req.target, r) not in replicas]:
        del asked[rid]  # gone: the worker's reports count it no more (or will not within a load report)
    live = max(0, reported - sum(asked.values()))
    free = dst.hello.replica_budget_tokens - live - headed
    if num_tokens <= free:
        return []
    speculative = []
    for (_, rid), holding in replicas.items():
        rep = state.replications.get(rid)
        orphan = rep is not None and rep.origin == ORIGIN_PULL and rep.num_abandoned and not rep.num_waiting
        if rid not in asked and (rep is None or rep.origin != ORIGIN_PULL or orphan):
            speculative.append((not orphan, holding["expires_at_s"], rid, holding["num_pages"] * page_size))
    out, room = [], free
    for _, _, rid, tokens in sorted(speculative):
        if room >= num_tokens:
            break
        out.append((rid, tokens))
        room += tokens
    if room < num_tokens:
        raise AdminError(f"target {req.target} has room for {max(0, free)} replica tokens, the copy needs "
                         f"{num_tokens} (budget {dst.hello.replica_budget_tokens}, live {live}, in flight {headed}; "
                         f"speculative replicas there: {room - free} tokens)", CONFLICT)
    asked.update(out)
    return [rid for rid, _ in out]


def critical_prefix_hash(state, req: api.ReplicateRequest) -> Optional[int]:
    """The hash naming the (page-aligned) prefix a critical copy asks for, at the source's page size; None when
    shorter than a page or the source is unknown."""
    src = state.workers.get(req.source)
    if src is None:
        return None
    hashes = page_hashes(req.input_ids, src.hello.page_size, api.namespace_of(req.cache_salt))
    return hashes[-1] if hashes else None


def join_critical(state, req: api.ReplicateRequest, block_hash: Optional[int]):
    """The copy of exactly this prefix already in flight to the same target (another router's pull, or a sibling
    request's), which a critical copy waits for instead of copying the same pages again; None if there is none.
    Caller holds the coordinator's lock."""
    if block_hash is None:
        return None
    namespace = api.namespace_of(req.cache_salt)
    for rep in state.replications.values():
        if rep.in_flight and rep.target == req.target and rep.namespace == namespace and rep.block_hash == block_hash:
            return rep
    return None


def ledger_allows_pull(state, block_hash: Optional[int], now_s: float) -> None:
    """The pull ledger's draw (`ClusterState.pull_ledger`, a `CopyLedger` of its own): pulls are a bet like the
    planner's copies, so a share of the prefixes pulls are asked for is held out (served as without pulls: the router
    routes by its ranking), the two groups' answers are compared, and while pulls are shown to cost every pull is
    held out (the router then only routes: inert). Caller holds the coordinator's lock.

    Raises:
        AdminError (409): held out (the router falls back to its ranking, as for any refused pull).
    """
    if block_hash is None:
        return
    if not state.pull_ledger.assign(block_hash, now_s):
        paused = state.pull_ledger.verdict(now_s)[0] == "costs"
        raise AdminError("held out by the pull ledger: " + (
            "pulls are paused, shown to cost time to first token" if paused else
            "this prefix's pulls are not made, to measure whether pulls pay"), CONFLICT)


async def wait_replication(coord, req: api.ReplicationWaitRequest) -> api.ReplicationInfo:
    """`POST /replications/wait`: the replication once it is done or failed, or as it is after `req.wait_s`.

    Args:
        coord: the `server.Coordinator` (its `lock` and `state`).
        req: which replication, how long to wait.
    Raises:
        AdminError (404): no such replication (never made, or forgotten).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + req.wait_s
    want = None
    with coord.lock:
        rep = coord.state.replications.get(req.id)
        if rep is None:
            raise AdminError(f"unknown replication {req.id!r}", 404)
        rep.num_waiting += 1
        # a request waits for it: a speculative copy lands (or is raised, landed) as ordinary cache, as a pull does
        target = coord.state.workers.get(rep.target)
        if req.want and rep.origin != ORIGIN_PULL and not rep.wanted and rep.state != FAILED and target:
            rep.wanted, want = True, target.routing_id
    if want is not None:
        coord.send(want, p.WantReplica(replication_id=rep.id))
    try:
        while True:
            with coord.lock:
                info = rep.to_info()
                left = deadline - loop.time()
                if rep.in_flight and left <= 0:  # the router's deadline (it waits until then): it falls back
                    rep.num_abandoned += 1
            if not rep.in_flight or left <= 0:
                return info
            await asyncio.sleep(min(left, POLL_S))
    finally:
        with coord.lock:
            rep.num_waiting -= 1
