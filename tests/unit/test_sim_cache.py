"""Exact eviction order, locks and replica handling of the page tree and the worker cache, and their integrity
checks (real exceptions, also under `python -O`)."""

import pytest

from radix_sync.integrity import IntegrityError
from radix_sync.policy.pagetree import PageTree
from radix_sync.sim.cache import Directory, WorkerCache
from tests.util import integrity_errors_under_python_O


def evicted_in_order(tree, n):
    out = []
    tree.evict(n, out.append)
    return out


def test_lru_leaves_first_parent_inherits_child_time():
    t = PageTree()
    t.insert([1, 2, 3], 3, 0.0)
    t.insert([1, 4], 2, 1.0)
    assert t.match_len([1, 2, 3, 9]) == 3
    assert t.match_len([1, 4, 5]) == 2
    assert evicted_in_order(t, 4) == [3, 2, 4, 1]
    t.check_integrity()


def test_replicas_go_first_and_locks_protect_the_path():
    t = PageTree()
    t.insert([1, 2, 3], 3, 0.0)
    t.insert([10, 11], 2, 5.0, replica=True)
    t.lock(3)
    assert evicted_in_order(t, 10) == [11, 10]
    assert len(t) == 3
    t.unlock(3)
    assert evicted_in_order(t, 1) == [3]


def test_promote_and_drop_replica_chain():
    t = PageTree()
    t.insert([1, 2], 2, 0.0)
    t.insert([1, 2, 3, 4], 4, 1.0, replica=True)
    assert t.num_replica_pages == 2
    t2 = PageTree()
    t2.insert([1, 2], 2, 0.0)
    t2.insert([1, 2, 3, 4], 4, 1.0, replica=True)
    assert t2.drop_replica_chain(4) == 2 and len(t2) == 2  # stops at the ordinary page 2
    assert t.promote(4) == 2 and t.num_replica_pages == 0
    assert t.drop_replica_chain(4) == 0
    t.check_integrity()


def test_a_copy_landed_as_ordinary_cache_drops_only_the_pages_it_added():
    t = PageTree()
    t.insert([1, 2], 2, 0.0)
    t.insert([1, 2, 3, 4, 5], 5, 1.0)  # a copy that added pages 3-5, as ordinary cache
    assert t.num_replica_pages == 0
    assert t.drop_replica_chain(5) == 0  # not a replica: the replica-only drop leaves it
    assert t.drop_replica_chain(5, max_ordinary=3) == 3 and sorted(t.nodes) == [1, 2]  # the prefix it found stays
    t.insert([1, 2, 3, 4], 4, 2.0)
    t.insert([1, 2, 3, 6], 4, 2.0)  # another branch shares page 3
    assert t.drop_replica_chain(4, max_ordinary=2) == 1 and 3 in t.nodes  # stops at the shared page
    t.check_integrity()


def test_worker_cache_conservation_and_directory():
    d = Directory()
    c = WorkerCache(0, capacity_tokens=40, page_len=10, directory=d, radix_nodes=False)  # page by page
    c.insert([1, 2, 3], 3, 0.0)
    assert c.free_tokens == 10
    c.reserved_tokens = 10
    assert c.free_tokens == 0
    assert c.make_room(20)  # evicts pages 3 then 2
    assert 3 not in d.holders and 2 not in d.holders and d.holders[1] == 1
    assert c.free_tokens == 20 and len(c.tree) == 1
    assert not c.make_room(31)  # only 30 could ever be freed
    c.check_integrity()


def test_radix_nodes_go_whole_as_sglangs_do():
    """SGLang's radix cache frees a whole leaf node when it evicts (measured on 0.5.23: 13 prompts of 2,508 tokens
    in a 32,768-token pool, then one of 308: the oldest prompt gone whole, not 300 tokens of it); a node is what one
    insert added, cut where a later insert branched off or a match ended."""
    t = PageTree(radix_nodes=True)
    t.insert([1, 2, 3, 4], 4, 0.0)  # one node
    t.insert([1, 2, 3, 4, 5, 6], 6, 1.0)  # a later turn: a node below it
    t.insert([1, 2, 7, 8], 4, 2.0)  # a branch after page 2 cuts the first node
    assert evicted_in_order(t, 1) == [6, 5]  # one page wanted, the least recently used leaf node goes whole
    assert evicted_in_order(t, 1) == [4, 3]  # its parent node, a leaf now, next
    assert evicted_in_order(t, 1) == [8, 7]
    assert evicted_in_order(t, 1) == [2, 1] and len(t) == 0
    t.check_integrity()
    flat = PageTree()  # page by page: one page
    flat.insert([1, 2, 3, 4], 4, 0.0)
    assert evicted_in_order(flat, 1) == [4]


def test_a_match_that_ends_inside_a_node_cuts_it_and_a_lock_keeps_the_part_above():
    t = PageTree(radix_nodes=True)
    t.insert([1, 2, 3, 4, 5, 6], 6, 0.0)
    t.lock(3)
    t.split_at(3)  # a request matched pages 1-3 (SGLang splits the node there and locks the part above)
    assert evicted_in_order(t, 10) == [6, 5, 4] and len(t) == 3
    t.unlock(3)
    assert evicted_in_order(t, 1) == [3, 2, 1]


def test_a_full_worker_loses_its_oldest_prompt_whole_as_measured_on_sglang():
    d = Directory()
    c = WorkerCache(0, capacity_tokens=40, page_len=4, directory=d)  # 10 pages; radix nodes by default
    for base in (10, 20, 30):  # three prompts of 3 pages, one insert each, the first the least recently used
        c.insert([base + i for i in range(3)], 3, float(base))
    assert c.make_room(8)  # a new prompt of 2 pages: 1 page free
    assert c.match_len([10, 11, 12]) == 0 and c.match_len([20, 21, 22]) == 3 and c.free_tokens == 16
    assert all(p not in d.holders for p in (10, 11, 12))
    c.check_integrity()


def test_a_waiting_requests_prefix_is_refreshed_not_taken_back_from_demotion():
    t = PageTree()
    t.insert([1, 2], 2, 0.0)
    t.insert([3, 4], 2, 1.0)
    t.insert([5, 6], 2, 2.0)
    t.demote(6)
    t.refresh(2, 5.0)  # a request waits for [1, 2]: recent now, so [3, 4] is the oldest ordinary leaf
    assert evicted_in_order(t, 3) == [6, 5, 4]  # the demoted chain first all the same
    assert t.nodes[2].last_access_s == 5.0


def test_directory_match_lens_equal_per_worker_tree_matches():
    from radix_sync.sim.cache import Directory, WorkerCache
    d = Directory()
    caches = [WorkerCache(i, 1000, 1, d) for i in range(3)]
    caches[0].insert([1, 2, 3, 4], 4, 0.0)
    caches[1].insert([1, 2], 2, 0.0)
    caches[2].insert([1, 2, 3, 9], 4, 0.0)  # diverges after page 3
    assert d.match_lens([1, 2, 3, 4, 5], 3) == [4, 2, 3] == [c.match_len([1, 2, 3, 4, 5]) for c in caches]
    assert d.match_lens([7, 2], 3) == [0, 0, 0]
    assert d.match_lens([], 3) == [0, 0, 0]


def test_demote_marks_the_unshared_chain_evict_first_and_a_hit_clears_it():
    t = PageTree()
    t.insert([1, 2, 3, 4], 4, 5.0)      # a session's history: system prompt [1, 2], then its own turns [3, 4]
    t.insert([1, 2, 7], 3, 0.0)         # another session's history, older
    assert t.demote(3) == 0             # not a leaf: nothing demoted
    assert t.demote(99) == 0            # absent
    assert t.demote(4) == 2             # the chain 4, 3, up to the shared page 2 (two children): not 2 or 1
    assert t.demote(4) == 0             # already stale
    # the stale chain goes before the older, ordinary leaf 7; the shared prefix stays while 7 lives
    assert evicted_in_order(t, 3) == [4, 3, 7]
    t2 = PageTree()
    t2.insert([1, 2, 3, 4], 4, 5.0)
    t2.insert([1, 2, 7], 3, 0.0)
    t2.demote(4)
    t2.touch(4, 6.0)                    # the session came back: ordinary cache again
    assert evicted_in_order(t2, 1) == [7]
    t2.check_integrity()


def test_only_demoted_pages_with_nothing_live_below_count_as_evict_first():
    """A demoted chain that a later prefill extends stays marked, but goes only after the live page below it: it is
    not evict-first room (`num_evict_first_stale_pages`, what the simulator reports as `demoted_tokens`)."""
    t = PageTree()
    t.insert([1, 2, 3], 3, 0.0)
    t.insert([8, 9], 2, 0.0, replica=True)
    assert t.demote(3) == 3 and (t.num_stale_pages, t.num_evict_first_stale_pages) == (3, 3)
    t.insert([1, 2, 3, 4], 4, 1.0)      # a prefill on top of the demoted chain (no hit touched it)
    assert (t.num_stale_pages, t.num_evict_first_stale_pages) == (3, 0)
    t.check_integrity()
    assert evicted_in_order(t, 2) == [9, 8]  # the replicas go first, not the demoted pages
    assert evicted_in_order(t, 1) == [4]     # then the live leaf; its demoted parent is a leaf again:
    assert t.num_evict_first_stale_pages == 3
    t.check_integrity()
    t.touch(2, 2.0)                       # a hit on the chain's first two pages takes them back; 3 stays demoted
    assert (t.num_stale_pages, t.num_evict_first_stale_pages) == (1, 1)
    t.check_integrity()


def test_demote_leaves_replica_pages_counted_as_replicas():
    t = PageTree()
    t.insert([1, 2], 2, 0.0)
    t.insert([1, 2, 3], 3, 1.0, replica=True)
    assert t.demote(3) == 2 and t.num_replica_pages == 1  # page 3 was a replica already: only 2 and 1 demoted
    t.check_integrity()


def test_demoted_chains_go_before_replicas_as_on_a_live_worker():
    # the live agent frees demoted chains before SGLang's own eviction (which takes replicas first): same order
    t = PageTree()
    t.insert([1, 2], 2, 0.0, replica=True)   # an older replica
    t.insert([5, 6], 2, 5.0)
    t.demote(6)
    assert evicted_in_order(t, 4) == [6, 5, 2, 1]
    t.check_integrity()


def test_tlru_drains_tel_safe_leaves_first_then_lru():
    # slack 2 pages: a leaf is TEL-safe when the pages above it cover max(high-water - 2, 0)
    t = PageTree(tlru_slack_pages=2)
    t.insert([1, 2, 3, 4, 5], 5, 0.0)   # high-water 5: pages 5 and 4 are TEL-safe, 3 is not
    t.insert([10, 11], 2, 5.0)          # high-water 2 <= slack: the whole branch is TEL-safe
    t.insert([20, 21, 22, 23], 4, 10.0)  # high-water 4: 23 and 22 TEL-safe
    assert t.is_tel_safe(5) and not t.is_tel_safe(3) and t.is_tel_safe(10)
    assert evicted_in_order(t, 11) == [5, 4, 11, 10, 23, 22, 3, 2, 1, 21, 20]
    t.check_integrity()


def test_lru_order_of_the_same_tree_and_tlru_without_slack_is_lru():
    for tree in (PageTree(), PageTree(tlru_slack_pages=0), PageTree(tlru_slack_pages=-3)):
        tree.insert([1, 2, 3, 4, 5], 5, 0.0)
        tree.insert([10, 11], 2, 5.0)
        tree.insert([20, 21, 22, 23], 4, 10.0)
        assert evicted_in_order(tree, 11) == [5, 4, 3, 2, 1, 11, 10, 23, 22, 21, 20]


def test_tlru_high_water_mark_rises_with_the_branch_and_survives_eviction():
    t = PageTree(tlru_slack_pages=2)
    t.insert([1, 2, 3], 3, 0.0)
    assert t.is_tel_safe(3)  # 2 pages above it >= max(3 - 2, 0)
    t.insert([1, 2, 3, 4, 5, 6], 6, 1.0)  # the conversation grew: its pages now budget 6 - 2 = 4
    t.insert([50], 1, 0.5)  # an ordinary one-page branch, TEL-safe itself (high-water 1)
    assert evicted_in_order(t, 3) == [50, 6, 5]
    assert not t.is_tel_safe(4)  # 3 above it < 4: the high-water mark did not drop with the evicted pages
    # a new page's own mark is its depth (SGLang's `_set_tlru_lens_and_raise_history`): 4 above it >= 5 - 2
    t.insert([1, 2, 3, 4, 7], 5, 2.0)
    assert t.is_tel_safe(7)
    assert evicted_in_order(t, 2) == [7, 4]  # then 4, a leaf again, goes by LRU (not TEL-safe under mark 6)
    assert len(t) == 3


def test_worker_cache_and_engine_pass_tlru_through():
    from radix_sync.policy.cost import load_profile
    from radix_sync.policy.planner import PlannerConfig
    from radix_sync.sim.config import EngineConfig
    from radix_sync.sim.engine import Engine
    from radix_sync.sim.generators import AgentWorkload, GeneratorConfig
    from radix_sync.sim.policies import build_policy
    c = WorkerCache(0, 64 * 100, 64, Directory(), tlru_slack_tokens=130)  # floor(130 / 64) = 2 pages
    c.insert([1, 2, 3, 4], 4, 0.0)
    assert c.tree.is_tel_safe(4) and not c.tree.is_tel_safe(2)
    profile = load_profile("llama3.1-8b-h200")
    wl = AgentWorkload(GeneratorConfig(), 5.0, 5.0, 1, profile.max_context_len, "poisson")
    cfg = EngineConfig(num_workers=2, duration_s=5.0, eviction="tlru", tlru_threshold_tokens=4096,
                       tlru_next_prompt_tokens=1024)
    eng = Engine(profile, wl, build_policy("cache_aware", profile, wl.page_len, 1, PlannerConfig()), cfg)
    assert all(w.cache.tree._slack == 3072 // 64 for w in eng.workers)
    import pytest
    with pytest.raises(ValueError, match="eviction"):
        EngineConfig(eviction="lfu")
    with pytest.raises(ValueError, match="tlru_threshold_tokens"):
        EngineConfig(eviction="tlru", tlru_threshold_tokens=-1)


def consistent_cache() -> WorkerCache:
    """A worker cache with ordinary, replica, demoted and locked pages, all invariants holding."""
    c = WorkerCache(0, capacity_tokens=100, page_len=10, directory=Directory())
    c.insert([1, 2, 3], 3, 0.0)
    c.insert([1, 2, 4], 3, 1.0, replica=True)
    c.insert([5, 6], 2, 2.0)
    c.tree.demote(6)
    c.lock(3)
    c.reserved_tokens = 10
    c.check_integrity()
    return c


def corruptions():
    """(what the error names, a corruption of `consistent_cache()`), one per invariant `check_integrity` checks."""

    return [("parent 99 missing", lambda c: setattr(c.tree.nodes[3], "parent", 99)),
            ("negative lock count", lambda c: setattr(c.tree.nodes[3], "lock_count", -1)),
            ("page 2: child count 3", lambda c: setattr(c.tree.nodes[2], "num_children", 3)),
            ("replica count 2 != 1", lambda c: setattr(c.tree, "num_replica_pages", 2)),
            ("demoted count 0 != 2", lambda c: setattr(c.tree, "num_stale_pages", 0)),
            ("evict-first demoted count 0 != 2", lambda c: setattr(c.tree, "num_evict_first_stale_pages", 0)),
            ("page 5: live child count 1 != 0", lambda c: setattr(c.tree.nodes[5], "live_children", 1)),
            ("reserved -10 < 0", lambda c: setattr(c, "reserved_tokens", -10)),
            ("reserved 50 > capacity 100", lambda c: setattr(c, "reserved_tokens", 50)),
            ("page 5 missing from the directory", lambda c: c.directory.remove(5, 0))]


@pytest.mark.parametrize("needle,corrupt", corruptions(), ids=[n for n, _ in corruptions()])
def test_check_integrity_raises_on_a_corrupted_cache(needle, corrupt):
    c = consistent_cache()
    corrupt(c)
    with pytest.raises(IntegrityError, match=needle):
        c.check_integrity()


def test_check_integrity_is_not_an_assert_it_holds_under_python_O():
    """The same corruptions raise with assertions compiled out."""
    assert integrity_errors_under_python_O("tests.unit.test_sim_cache", "consistent_cache") == (1, len(corruptions()))


def test_pages_stay_out_of_the_cycle_collectors_sight():
    import gc

    # NOTE: a router's approximate trees and a simulated cache hold up to millions of pages; as a `__slots__` class
    # each page was tracked, and the collector's full passes walked them all (36-40 ms per 200,000 pages)
    for t in (PageTree(), PageTree(tlru_slack_pages=4), PageTree(radix_nodes=True)):
        t.insert([1, 2, 3], 3, 0.0)
        t.insert([1, 4], 2, 1.0, replica=True)
        assert len(t.nodes) == 4 and not any(gc.is_tracked(n) for n in t.nodes.values())
        t.check_integrity()
    t = PageTree(tlru_slack_pages=4)
    t.insert([7], 1, 0.0)
    assert (t.nodes[7].depth, t.nodes[7].hist) == (1, 1)  # T-LRU's high-water mark starts at the page's depth
    t.insert([7, 8, 9], 3, 1.0)
    assert [t.nodes[p].hist for p in (7, 8, 9)] == [3, 3, 3]
