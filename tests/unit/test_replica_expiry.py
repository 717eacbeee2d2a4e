"""A replica's TTL does not run out under a request that was routed to it and is still queued (not admitted, so it
holds no lock on the tree): expiring it then would make that request recompute the whole prefix."""
from sglang_kvrep.replicas import Replica, ReplicaTable


class FakeView:
    def __init__(self):
        self.cached = {}  # (namespace, tuple(ids)) -> tokens
        self.waiting = []  # (namespace, ids) of queued requests
        self.evicted = 0

    def match(self, token_ids, namespace):
        return self.cached.get((namespace, tuple(token_ids)), 0), None

    def evict(self, n):
        self.cached.clear()
        self.evicted += n
        return n

    def waiting_wants(self, token_ids, namespace):
        n = len(token_ids)
        return any(ns == namespace and list(ids[:n]) == list(token_ids) for ns, ids in self.waiting)


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
    assert table.expire_due() == [("r1", 32)] and view.evicted == 32 and not table.replicas
