"""The worker agent's demoted chains: evicted oldest demotion first when an allocation needs room, as much as asked
(whole chains or partial ones resumed later), and taken back when a request holds or has extended one."""
import collections
import types

from sglang_kvrep.agent import WorkerAgent


class FakeView:
    def __init__(self, chains):
        self.chains = chains  # (namespace, first token) -> [tokens, outcome when asked]
        self.calls = []

    def evict_chain(self, token_ids, namespace, max_tokens):
        key = (namespace, token_ids[0])
        self.calls.append((key, max_tokens, len(token_ids)))
        tokens, outcome = self.chains[key]
        left = 0
        if outcome == "evicted":
            got = tokens
        elif outcome == "partial":
            got = min(tokens, max_tokens)
            self.chains[key][0] -= got
            left = len(token_ids) - got
            if self.chains[key][0] == 0:  # the chain is gone up to its shared ancestor
                self.chains[key][1] = "absent"
                outcome, left = "evicted", 0
        else:
            got = 0
        return got, outcome, left


def agent(chains, cap=4096, capacity=10 ** 6):
    a = types.SimpleNamespace(view=FakeView(chains), demoted=collections.OrderedDict(), MAX_DEMOTED=cap,
                              capacity=capacity, _demoted_tokens=0,
                              demote_stats={"evicted_tokens": 0, "taken_back": 0})
    a._forget = lambda key: WorkerAgent._forget(a, key)
    return a


def demote(a, ns, first, n=100):
    WorkerAgent.demote(a, ns, [first] + [0] * (n - 1))


def evict(a, n):
    return WorkerAgent.evict_demoted(a, n)


def test_oldest_demotion_first_and_only_as_much_as_asked():
    a = agent({("", 1): [100, "evicted"], ("", 2): [50, "evicted"], ("t", 3): [70, "evicted"]})
    demote(a, "", 1)
    demote(a, "", 2)
    demote(a, "t", 3)
    assert evict(a, 120) == 150  # chain 1 (100) is not enough, chain 2 (50) goes too; chain 3 stays
    assert [k for k, *_ in a.view.calls] == [("", 1), ("", 2)] and a.view.calls[1][1] == 20
    assert [ns for ns, _ in a.demoted.values()] == ["t"]
    assert a.demote_stats == {"evicted_tokens": 150, "taken_back": 0}


def test_a_partly_evicted_chain_is_resumed_and_a_used_one_taken_back():
    a = agent({("", 1): [100, "partial"], ("", 2): [30, "in_use"], ("", 3): [30, "extended"],
               ("", 4): [30, "absent"]})
    for first in (1, 2, 3, 4):
        demote(a, "", first)
    assert evict(a, 40) == 40 and len(a.demoted) == 4  # stopped inside chain 1: it stays first in line
    assert len(next(iter(a.demoted.values()))[1]) == 60 and a._demoted_tokens == 360  # cut to what is left
    assert evict(a, 1000) == 60  # the rest of chain 1; 2 and 3 were used since (taken back), 4 is gone
    assert a.view.calls[-4][2] == 60  # resumed on the cut chain
    assert not a.demoted and a.demote_stats["taken_back"] == 2 and a._demoted_tokens == 0


def test_demoting_again_moves_a_chain_to_the_back_and_the_list_is_bounded():
    a = agent({("", 1): [10, "evicted"], ("", 2): [10, "evicted"], ("", 3): [10, "evicted"]}, cap=2)
    demote(a, "", 1)
    demote(a, "", 2)
    demote(a, "", 1)
    assert [toks[0] for _, toks in a.demoted.values()] == [2, 1]
    demote(a, "", 3)  # over the cap: the oldest demotion is forgotten (that cache is plain LRU again)
    assert [toks[0] for _, toks in a.demoted.values()] == [1, 3]
    # namespaces are part of the key: the same tokens in another namespace are another chain
    demote(a, "t", 3)
    assert [(ns, toks[0]) for ns, toks in a.demoted.values()] == [("", 3), ("t", 3)]
    # and the tokens listed never exceed the pool (a chain must fit in it to be cached at all)
    b = agent({}, capacity=250)
    for first in (1, 2, 3):
        demote(b, "", first)  # 100 tokens each
    assert [toks[0] for _, toks in b.demoted.values()] == [2, 3] and b._demoted_tokens == 200


def test_allocation_predicate_stops_the_eviction_early():
    a = agent({("", 1): [100, "evicted"], ("", 2): [100, "evicted"]})
    demote(a, "", 1)
    demote(a, "", 2)
    assert WorkerAgent.evict_demoted(a, 1000, satisfied=lambda: True) == 100  # chain 1 sufficed
    assert len(a.demoted) == 1


def test_an_error_while_evicting_turns_demotion_off_and_frees_nothing():
    class Panic(BaseException):  # what pyo3 raises for a Rust panic
        pass

    a = agent({})

    def boom(*_):
        raise Panic("tree core assertion")

    a.view.evict_chain = boom
    a.disabled = False
    a.evict_demoted = lambda n, satisfied=None: WorkerAgent.evict_demoted(a, n, satisfied)
    demote(a, "", 1)
    assert WorkerAgent.evict_demoted_safe(a, 100) == 0
    assert not a.demoted and a.MAX_DEMOTED == 0 and a._demoted_tokens == 0
    demote(a, "", 2)  # later demotions are dropped at once
    assert not a.demoted
