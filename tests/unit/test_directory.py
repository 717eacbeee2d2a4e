import pytest

from radix_sync.directory import OWNER, REPLICA, PrefixDirectory
from radix_sync.hashing import page_digests, page_hashes


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
    d.add_pages("b", "", chain(toks))                  # the granted pages (the coordinator knows their tokens)
    assert d.mark_replica("b", hashes, 3, expires_at_s=10.0, replication_id="r1") == 3
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
    d.add_pages("b", "", chain(toks))
    d.mark_replica("b", hashes, 2, 5.0, "r2")
    assert d.remove_replica("b", "r2") == 2
    assert d.match(hashes) == {"b": 2}
    d.check_integrity()


def test_a_replica_fact_alone_never_makes_a_worker_a_holder(d):
    toks = list(range(8))
    hashes = page_hashes(toks, 4)
    assert d.mark_replica("b", hashes, 2, 5.0, "r3") == 0    # pages b never reported with their tokens
    assert d.match(hashes) == {} and d.num_pages() == 0 and d.feed.seq == 0
    d.add_pages("b", "", chain(toks)[:1])
    assert d.mark_replica("b", hashes, 2, 5.0, "r3") == 1    # only the page it holds
    assert d.replicas() == {("b", "r3"): {"num_pages": 1, "expires_at_s": 5.0}}
    d.check_integrity()


def test_verify_blocks_accepts_only_pages_whose_hash_is_their_tokens(d):
    toks = list(range(16))
    good = chain(toks)
    accepted, errors = d.verify_blocks("a", "", good, 4)
    assert errors == [] and [b[:3] for b in accepted] == good and all(len(b[3]) == 32 for b in accepted)
    d.add_pages("a", "", accepted)
    # a child of a verified page: checked from the parent's kept digest, not the whole prefix
    more = chain(toks + [7, 7, 7, 7])[-1:]
    assert d.verify_blocks("a", "", more, 4)[1] == []
    # forged: another tenant's hashes with made-up tokens; a claim without the tokens; a wrong page length
    forged = [(h, par, [0, 0, 0, 0]) for h, par, _ in chain(list(range(100, 108)), ns="tenant-a")]
    accepted, errors = d.verify_blocks("evil", "tenant-a", forged, 4)
    assert accepted == [] and "does not match" in errors[0] and "parent" in errors[1]
    assert d.verify_blocks("evil", "", [(good[0][0], None, [])], 4)[1][0].endswith("0 token ids, page size 4")
    # a page whose parent this worker never verifiably held (it is another worker's page)
    assert "not a verified page of evil" in d.verify_blocks("evil", "", more, 4)[1][0]
    # the same tokens in another namespace hash differently: the namespace is part of the check
    assert "does not match" in d.verify_blocks("evil", "t", good[:1], 4)[1][0]
    # ids at or over the vocabulary
    big = chain([1, 2, 3, 500])
    assert "vocab_size 500" in d.verify_blocks("a", "", big, 4, vocab_size=500)[1][0]
    # ids outside uint32 (what SGLang hashes as uint32 cannot hold them)
    assert "must be uint32" in d.verify_blocks("c", "", [(good[0][0], None, [0, 1, 2, 2**32])], 4)[1][0]
    assert "must be uint32" in d.verify_blocks("c", "", [(good[0][0], None, [0, 1, -2, 3])], 4)[1][0]
    # the kept digests are the chain's own (`page_digests`), page by page
    assert [b[3] for b in d.verify_blocks("c", "", good, 4)[0]] == page_digests(toks, 4)
    # the cap on new pages
    accepted, errors = d.verify_blocks("b", "", good, 4, max_new=2)
    assert len(accepted) == 2 and len(errors) == 2 and "cap" in errors[0]


def test_namespaces_are_disjoint(d):
    toks = list(range(8))
    d.add_pages("a", "t1", chain(toks, ns="t1"))
    assert d.match(page_hashes(toks, 4, "t1")) == {"a": 2}
    assert d.match(page_hashes(toks, 4, "t2")) == {}
    assert d.match(page_hashes(toks, 4)) == {}


def test_change_feed_replays_holdings_and_falls_back_to_a_snapshot():
    from radix_sync.directory import ChangeFeed

    d = PrefixDirectory(max_changes=5)
    d.add_pages("w1", "", [(1, None, [0]), (2, 1, [1])])
    d.add_pages("w1", "", [(1, None, [0])])  # no new holding, no change
    d.add_pages("w2", "", [(1, None, [0]), (2, 1, [1]), (3, 2, [2])])
    d.mark_replica("w2", [1, 2, 3], 1, 10.0, "r1")
    epoch = d.feed.epoch
    out = d.feed_since(epoch, 0)
    assert out["changes"] == [(1, "w1", 1), (1, "w1", 2), (1, "w2", 1), (1, "w2", 2), (1, "w2", 3)]
    assert out["seq"] == out["head"] == 5
    d.remove_pages("w2", [3])
    assert d.feed_since(epoch, 5) == {"epoch": epoch, "seq": 6, "head": 6, "changes": [(-1, "w2", 3)]}
    assert d.feed_since(epoch, 6)["changes"] == []
    assert d.feed_since(epoch, 4, limit=1) == {"epoch": epoch, "seq": 5, "head": 6, "changes": [(1, "w2", 3)]}
    # change 1 is gone (5 kept): a reader at 0, of another epoch, or ahead of the head gets a snapshot
    for e, seq in ((epoch, 0), ("other", 6), (epoch, 99)):
        snap = d.feed_since(e, seq)
        assert "changes" not in snap and {w: sorted(h) for w, h in snap["snapshot"].items()} == \
            {"w1": [1, 2], "w2": [1, 2]} and snap["seq"] == 6
    f = ChangeFeed(max_changes=10)
    for i in range(10):
        f.add(1, "w", i)
    assert [c[2] for c in f.since(7, 100)] == [7, 8, 9] and [c[2] for c in f.since(1, 2)] == [1, 2]


def test_the_stepwise_check_passes_across_changes_between_steps_and_finds_a_broken_index(d):
    """`check_integrity_steps` (the `/status` check on a large directory, the lock held per step only): pages added
    and removed between its steps are no violation; an index that disagrees is found, in steps as at once."""
    from radix_sync.directory import IntegrityError

    for w in range(3):
        d.add_pages(f"w{w}", "", chain(list(range(w, w + 64))))
    steps = d.check_integrity_steps(step=5)
    next(steps)
    d.remove_pages("w1", page_hashes(list(range(1, 65)), 4)[8:])
    next(steps)
    d.add_pages("w3", "", chain(list(range(500, 540))))
    d.drop_worker("w2")
    assert sum(1 for _ in steps) > 3
    victim = page_hashes(list(range(64)), 4)[3]
    d._by_worker["w0"].discard(victim)  # the worker index loses a page its node still lists
    with pytest.raises(IntegrityError, match="held by w0, who does not index it"):
        for _ in d.check_integrity_steps(step=5):
            pass
    with pytest.raises(IntegrityError):
        d.check_integrity()


def test_pages_keep_their_tokens_out_of_the_cycle_collectors_sight(d):
    import gc

    toks = [0, 1, 2**32 - 1, 70000] + list(range(4, 16))
    accepted, errors = d.verify_blocks("a", "", chain(toks), 4)
    assert errors == []
    d.add_pages("a", "", accepted)
    d.add_pages("b", "", chain([1, 2, 3, 4]))  # unchecked (tools, tests): packed here
    d.add_pages("c", "", [(123, None, [2**40, 1, 2, 3])])  # unchecked and outside uint32: kept as given
    for h in page_hashes(toks, 4) + page_hashes([1, 2, 3, 4], 4):
        node = d.node(h)
        # NOTE: an array("I") is tracked by the collector: 200,000 of them made its full passes ~140 ms
        assert isinstance(node.tokens, bytes) and not gc.is_tracked(node.tokens) and not gc.is_tracked(node)
    assert [list(d.node(h).token_ids) for h in page_hashes(toks, 4)] == [toks[i:i + 4] for i in range(0, 16, 4)]
    assert d.prefix_tokens(page_hashes(toks, 4)[-1]) == toks
    assert d.prefix_tokens(page_hashes([1, 2, 3, 4], 4)[0]) == [1, 2, 3, 4]
    assert list(d.node(123).token_ids) == [2**40, 1, 2, 3] and d.prefix_tokens(123) == [2**40, 1, 2, 3]
