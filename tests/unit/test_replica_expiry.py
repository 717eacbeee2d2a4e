"""A replica's TTL does not run out under a request that was routed to it and is still queued (not admitted, so it
holds no lock on the tree): expiring it then would make that request recompute the whole prefix."""
from sglang_kvrep.replicas import PULLED_PRIORITY, Replica, ReplicaTable


class FakeView:
    def __init__(self):
        self.cached = {}  # (namespace, tuple(ids)) -> tokens
        self.waiting = []  # (namespace, ids) of queued requests
        self.evicted = 0
        self.chain_outcome = None  # what `evict_chain` says when the chain is cached (None: evicts it)
        self.raised = []  # (namespace, ids, priority) of each `raise_priority` call

    def match(self, token_ids, namespace):
        return self.cached.get((namespace, tuple(token_ids)), 0), None

    def evict(self, n):
        self.cached.clear()
        self.evicted += n
        return n

    def evict_chain(self, token_ids, namespace, max_tokens):
        key = (namespace, tuple(token_ids))
        if key not in self.cached:
            return 0, "absent", 0
        if self.chain_outcome is not None:
            return 0, self.chain_outcome, 0
        n = self.cached.pop(key)
        return n, "evicted", 0

    def waiting_wants(self, token_ids, namespace):
        n = len(token_ids)
        return any(ns == namespace and list(ids[:n]) == list(token_ids) for ns, ids in self.waiting)

    def waiting_wanting(self, prefixes):
        return {i for i, (ids, ns) in enumerate(prefixes) if self.waiting_wants(ids, ns)}

    def raise_priority(self, token_ids, namespace, priority):
        self.raised.append((namespace, tuple(token_ids), priority))
        return self.cached.get((namespace, tuple(token_ids)), 0)


def test_expiry_waits_for_a_queued_request_of_the_same_prefix_and_namespace():
    now = [0.0]
    view = FakeView()
    table = ReplicaTable(view, budget_tokens=1000, clock=lambda: now[0])
    ids = list(range(100, 132))
    view.cached[("t1", tuple(ids))] = 32
    table.replicas["r1"] = Replica("r1", "t1", ids, 32, expires_at_s=5.0, priority=-1)
    now[0] = 6.0
    view.waiting = [("t2", ids + [7, 8]), ("t1", ids[:16] + [9])]  # another tenant; a shorter prefix
    view.waiting.append(("t1", ids + [1, 2, 3]))  # this one was routed here for the copy
    assert table.expire_due() == [] and "r1" in table.replicas
    view.waiting.pop()  # admitted (or gone): the TTL applies again
    assert table.expire_due() == [("r1", 32)] and not view.cached and not table.replicas
    assert view.evicted == 0  # its own chain only (`evict_chain`), never SGLang's policy-ordered eviction


def table_with(outcome):
    now = [6.0]
    view = FakeView()
    view.chain_outcome = outcome
    table = ReplicaTable(view, budget_tokens=1000, clock=lambda: now[0])
    ids = list(range(100, 132))
    view.cached[("", tuple(ids))] = 32
    view.cached[("", (1, 2, 3))] = 3  # other cache, which an expiry must never take
    table.replicas["r1"] = Replica("r1", "", ids, 32, expires_at_s=5.0, priority=-1)
    return table, view


def test_a_replica_a_running_request_holds_outlives_its_ttl_and_nothing_else_is_evicted():
    table, view = table_with("in_use")
    assert table.expire_due() == [] and "r1" in table.replicas  # not reported: the worker still holds it
    assert view.evicted == 0 and len(view.cached) == 2
    view.chain_outcome = None  # the request finished
    assert table.expire_due() == [("r1", 32)] and view.cached == {("", (1, 2, 3)): 3}


def test_a_replica_a_later_request_extended_is_ordinary_cache_and_not_reported_expired():
    table, view = table_with("extended")
    assert table.expire_due() == [] and table.replicas["r1"].promoted and view.evicted == 0
    assert table.take_extended() == ["r1"] and table.take_extended() == []  # told once (as ReplicaPromoted)
    assert table.expire_due() == [] and not table.replicas  # gone from the table, its pages from nobody's cache
    assert table.take_extended() == []


def test_a_replica_sglang_evicted_already_is_reported_with_nothing_freed():
    table, view = table_with(None)
    del view.cached[("", tuple(range(100, 132)))]
    assert table.expire_due() == [("r1", 0)] and view.evicted == 0


def test_with_hicache_the_replica_goes_by_sglangs_own_eviction_as_before():
    table, view = table_with("unsupported")
    assert table.expire_due() == [("r1", 32)] and view.evicted == 32


def test_a_dropped_replica_a_running_request_holds_is_kept_and_goes_at_the_next_expiry_pass():
    table, view = table_with("in_use")
    table.replicas["r1"].expires_at_s = 100.0  # (dropped long before its TTL)
    assert table.drop("r1") is None and "r1" in table.replicas  # not forgotten while held
    view.chain_outcome = None  # the request finished
    assert table.expire_due() == [("r1", 32)] and not table.replicas


def test_a_dropped_replica_a_later_request_extended_is_told_once_as_ordinary_cache():
    table, view = table_with("extended")
    assert table.drop("r1") is None and table.take_extended() == ["r1"]
    assert table.expire_due() == [] and not table.replicas


def test_a_dropped_replica_a_queued_request_was_routed_to_stays_with_its_ttl():
    table, view = table_with(None)
    table.replicas["r1"].expires_at_s = 100.0
    ids = list(range(100, 132))
    view.waiting = [("", ids + [5])]  # routed here for it, not admitted yet (no lock on the tree)
    assert table.drop("r1") is None and table.replicas["r1"].expires_at_s == 100.0 and len(view.cached) == 2
    view.waiting = []
    assert table.drop("r1") == 32 and not table.replicas and table.free_tokens() == 1000


def test_a_replica_sglang_evicted_is_forgotten_at_once_and_leaves_the_budget():
    table, view = table_with(None)
    table.replicas["r1"].expires_at_s = 100.0
    assert table.free_tokens() == 1000 - 32
    assert table.forget("r1") and not table.replicas and table.free_tokens() == 1000
    assert not table.forget("r1")  # unknown now
    table.replicas["r2"] = Replica("r2", "", [1], 16, expires_at_s=100.0, priority=-1, promoted=True)
    assert not table.forget("r2") and not table.replicas  # ordinary cache already: no budget held, nothing told


def test_a_replica_a_queued_request_wants_is_raised_to_ordinary_cache_once():
    """Below every ordinary entry, a replica is the next allocation's first victim on a full pool, also while the
    request routed here for it waits in the queue (no lock until admitted): it is raised then, once; the others
    (not wanted, another tenant's, a promoted one, a pull already ordinary) stay as they are."""
    now = [0.0]
    view = FakeView()
    table = ReplicaTable(view, budget_tokens=1000, clock=lambda: now[0])
    ids, other = list(range(100, 132)), list(range(200, 232))
    for rid, ns, toks, prio in (("r1", "t1", ids, -5), ("r2", "t1", other, -4), ("r3", "t2", ids, -3),
                                ("r4", "t1", ids[:16], PULLED_PRIORITY)):
        view.cached[(ns, tuple(toks))] = len(toks)
        table.replicas[rid] = Replica(rid, ns, toks, len(toks), expires_at_s=5.0, priority=prio)
    table.replicas["r5"] = Replica("r5", "t1", ids, 32, expires_at_s=5.0, priority=-2, promoted=True)
    assert table.raise_wanted() == [] and view.raised == []  # nobody waits
    view.waiting = [("t1", ids + [1, 2]), ("t1", other[:20])]  # r1's prefix is wanted; r2's only in part
    assert table.raise_wanted() == ["r1"]
    assert view.raised == [("t1", tuple(ids), PULLED_PRIORITY)] and table.replicas["r1"].priority == PULLED_PRIORITY
    assert table.raise_wanted() == [] and len(view.raised) == 1  # once
    assert [table.replicas[r].priority for r in ("r2", "r3")] == [-4, -3]
    now[0] = 6.0  # every TTL passed
    assert "r1" not in [rid for rid, _ in table.expire_due()] and "r1" in table.replicas  # wanted: kept
    view.waiting = []
    assert table.expire_due() == [("r1", 32), ("r4", 16)]  # and applies once they are not


def test_the_load_report_counts_only_evict_first_replicas_and_the_budget_counts_every_one():
    view = FakeView()
    table = ReplicaTable(view, budget_tokens=1000, clock=lambda: 0.0)
    table.replicas["r1"] = Replica("r1", "", list(range(32)), 32, expires_at_s=5.0, priority=-1)
    table.replicas["r2"] = Replica("r2", "", list(range(50, 66)), 16, expires_at_s=5.0, priority=PULLED_PRIORITY)
    table.replicas["r3"] = Replica("r3", "", list(range(70, 78)), 8, expires_at_s=5.0, priority=-1, promoted=True)
    # landed as ordinary cache (a pull, or `ExpectReplica.ordinary`): not what SGLang evicts first, still budgeted
    assert table.evict_first_tokens() == 32 and table.live_tokens() == 48 and table.free_tokens() == 952


def test_a_replica_a_request_waits_for_is_raised_to_ordinary_cache_installing_or_landed():
    """`ReplicaTable.want` (the coordinator's `WantReplica`): an install in progress goes in at `PULLED_PRIORITY`; a
    landed evict-first replica is raised to it in the tree; a promoted one, one already ordinary, or an unknown id:
    nothing."""
    from types import SimpleNamespace

    view = FakeView()
    table = ReplicaTable(view, budget_tokens=1000, clock=lambda: 0.0)
    ids = list(range(32))
    table.replicas["r1"] = Replica("r1", "t1", ids, 32, expires_at_s=5.0, priority=-9)
    table.replicas["r2"] = Replica("r2", "t1", ids[:16], 16, expires_at_s=5.0, priority=-8, promoted=True)
    table.replicas["r3"] = Replica("r3", "t1", ids[:8], 8, expires_at_s=5.0, priority=PULLED_PRIORITY)
    job = SimpleNamespace(inc=SimpleNamespace(header=SimpleNamespace(replication_id="r4", token_ids=ids[:12])),
                          priority=-7)
    table.pending["x4"] = job
    assert table.evict_first_tokens() == 32 + 12  # r1 and the install in progress
    assert table.want("r1") and view.raised == [("t1", tuple(ids), PULLED_PRIORITY)]
    assert table.replicas["r1"].priority == PULLED_PRIORITY and not table.want("r1")  # once
    assert not table.want("r2") and not table.want("r3") and not table.want("nope") and len(view.raised) == 1
    assert table.want("r4") and job.priority == PULLED_PRIORITY and len(view.raised) == 1  # lands at it
    assert not table.want("r4") and table.evict_first_tokens() == 0  # what the load report counts as evict-first
