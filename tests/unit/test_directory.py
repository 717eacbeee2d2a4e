import pytest

from radix_sync.directory import OWNER, REPLICA, PrefixDirectory
from radix_sync.hashing import page_hashes


def chain(tokens, ps=4, ns=""):
    hashes = page_hashes(tokens, ps, ns)
    parents = [None] + hashes[:-1]
    return [(h, par, tokens[i * ps:(i + 1) * ps]) for i, (h, par) in enumerate(zip(hashes, parents))]


@pytest.fixture
def d():
    return PrefixDirectory()


def test_match_counts_consecutive_pages_per_worker(d):
    toks = list(range(16))
    d.add_pages("a", "", chain(toks))           # 4 pages
    d.add_pages("b", "", chain(toks)[:2])       # first 2 pages
    d.check_integrity()
    assert d.match(page_hashes(toks, 4)) == {"a": 4, "b": 2}
    assert d.match(page_hashes(toks[:8] + [99] * 8, 4)) == {"a": 2, "b": 2}
    assert d.match(page_hashes([5] * 16, 4)) == {}
    assert d.prefix_tokens(page_hashes(toks, 4)[-1]) == toks


def test_remove_and_drop(d):
    toks = list(range(16))
    d.add_pages("a", "", chain(toks))
    d.add_pages("b", "", chain(toks))
    hashes = page_hashes(toks, 4)
    assert d.remove_pages("a", hashes[2:]) == 2
    assert d.match(hashes) == {"a": 2, "b": 4}
    assert d.drop_worker("b") == 4
    assert d.match(hashes) == {"a": 2}
    assert d.num_pages() == 2
    d.check_integrity()
    assert d.remove_pages("zzz", hashes) == 0


def test_replica_lifecycle(d):
    toks = list(range(16))
    hashes = page_hashes(toks, 4)
    d.add_pages("a", "", chain(toks))
    d.add_pages("b", "", chain(toks)[:1])              # b already owned page 0
    d.mark_replica("b", "", hashes, 3, expires_at_s=10.0, replication_id="r1")
    d.check_integrity()
    assert d.holders(hashes[0])["b"].role == OWNER
    assert [d.holders(h)["b"].role for h in hashes[1:]] == [REPLICA] * 3
    # the store facts of the replica's own insert arrive afterwards: they must not demote it
    d.add_pages("b", "", chain(toks))
    assert d.holders(hashes[3])["b"].role == REPLICA
    assert d.replicas() == {("b", "r1"): {"num_pages": 3, "expires_at_s": 10.0}}
    assert d.promote("b", "r1") == 3
    assert d.replicas() == {}
    assert d.holders(hashes[3])["b"].expires_at_s is None
    d.check_integrity()


def test_replica_expiry_removes_only_replica_pages(d):
    toks = list(range(16))
    hashes = page_hashes(toks, 4)
    d.add_pages("b", "", chain(toks)[:2])
    d.mark_replica("b", "", hashes, 2, 5.0, "r2")
    assert d.remove_replica("b", "r2") == 2
    assert d.match(hashes) == {"b": 2}
    d.check_integrity()


def test_replica_fact_before_store_fact_fills_tokens_later(d):
    toks = list(range(8))
    hashes = page_hashes(toks, 4)
    d.mark_replica("b", "", hashes, 2, 5.0, "r3")
    assert d.prefix_tokens(hashes[-1]) is None
    d.add_pages("b", "", chain(toks))
    assert d.prefix_tokens(hashes[-1]) == toks
    d.check_integrity()


def test_namespaces_are_disjoint(d):
    toks = list(range(8))
    d.add_pages("a", "t1", chain(toks, ns="t1"))
    assert d.match(page_hashes(toks, 4, "t1")) == {"a": 2}
    assert d.match(page_hashes(toks, 4, "t2")) == {}
    assert d.match(page_hashes(toks, 4)) == {}
