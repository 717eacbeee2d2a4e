"""The copy ledger (`radix_sync.policy.ledger`): a reproducible holdout of prefixes, answers attributed to the
deepest decided prefix of their prompt, a Welch interval on the difference, and the planner paused while copies
are shown to cost (inert unless it pays), resumed once that evidence ages out."""
import contextlib
import math
import time

import pytest

from radix_sync.policy.ledger import COPIED, HELD_OUT, CopyLedger, LedgerConfig, _unit, welch


def test_welch_interval_by_hand():
    # a: mean 2, var 1 (n 3); b: mean 1, var 1 (n 3): se = sqrt(1/3 + 1/3) = 0.8165
    d, lo, hi = welch([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert d == pytest.approx(1.0)
    assert (lo, hi) == pytest.approx((1.0 - 1.96 * math.sqrt(2 / 3), 1.0 + 1.96 * math.sqrt(2 / 3)))


def test_the_holdout_is_a_reproducible_fraction_of_prefixes_and_a_prefix_keeps_its_group():
    draws = [_unit(h) for h in range(10_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(u < 0.2 for u in draws) / len(draws) - 0.2) < 0.02  # uniform enough at 20%
    ledger = CopyLedger(LedgerConfig(holdout=0.2, attribution_s=10.0))
    groups = {h: ledger.assign(h, 0.0) for h in range(1000)}
    assert groups == {h: _unit(h) >= 0.2 for h in range(1000)}  # copied unless drawn into the holdout
    assert all(ledger.assign(h, 5.0) == groups[h] for h in range(1000))  # the same prefix, its group
    assert ledger.num_decisions[COPIED] + ledger.num_decisions[HELD_OUT] == 1000
    assert CopyLedger(LedgerConfig(holdout=0.0)).assign(7, 0.0) is True
    assert CopyLedger(LedgerConfig(holdout=1.0)).assign(7, 0.0) is False


def copied_and_held(n=2):
    copied = [h for h in range(100) if _unit(h) >= 0.5][:n]
    held = [h for h in range(100) if _unit(h) < 0.5][:n]
    return copied, held


def test_answers_go_to_the_deepest_decided_prefix_of_their_prompt():
    ledger = CopyLedger(LedgerConfig(holdout=0.5, attribution_s=10.0))
    (c,), (h,) = copied_and_held(1)
    assert ledger.assign(c, 0.0) and not ledger.assign(h, 0.0)
    assert ledger.finished([999, c, 998], 0.5, 1.0) == COPIED
    assert ledger.finished([c, 5, h, 6], 0.7, 1.0) == HELD_OUT  # h is deeper in the prompt than c
    assert ledger.finished([5, 6], 0.7, 1.0) is None  # no decided prefix
    assert ledger.finished([c], None, 1.0) is None  # no TTFT (a router that did not measure it)
    assert ledger.finished([c], 0.3, 11.0) is None  # the prefix's group has lapsed
    st = ledger.status(1.0)
    assert st["groups"] == {COPIED: {"answers": 1, "mean_ttft_s": 0.5}, HELD_OUT: {"answers": 1, "mean_ttft_s": 0.7}}
    assert st["verdict"] == "not shown" and st["copied_minus_held_out_s"] is None  # too few answers


def feed(ledger, copied, held, copied_ttft, held_ttft, n, t):
    for i in range(n):
        ledger.finished([copied], copied_ttft + 0.01 * (i % 5), t)
        ledger.finished([held], held_ttft + 0.01 * (i % 5), t)


def test_copies_that_cost_pause_the_planner_until_the_evidence_ages_out():
    cfg = LedgerConfig(holdout=0.5, attribution_s=1000.0, window_s=100.0, min_samples=30)
    ledger = CopyLedger(cfg)
    (c,), (h,) = copied_and_held(1)
    ledger.assign(c, 0.0), ledger.assign(h, 0.0)
    feed(ledger, c, h, copied_ttft=1.0, held_ttft=0.5, n=30, t=10.0)  # copied answers 0.5 s slower
    verdict, (d, lo, hi) = ledger.verdict(10.0)
    assert verdict == "costs" and d == pytest.approx(0.5) and lo > 0
    assert ledger.status(10.0)["paused"] is True
    fresh = [x for x in range(1000, 2000) if _unit(x) >= 0.5][:5]  # would be copied by the draw
    assert [ledger.assign(x, 20.0) for x in fresh] == [False] * 5 and ledger.num_decisions["paused"] == 5
    assert ledger.assign(c, 20.0) is True  # a prefix keeps the group it had (its answers still count)
    # 100 s later the evidence is gone: not shown, and the planner copies again
    assert ledger.verdict(111.0)[0] == "not shown"
    later = [x for x in range(3000, 4000) if _unit(x) >= 0.5][:1]
    assert ledger.assign(later[0], 111.0) is True


def test_copies_that_pay_are_shown_to_pay_and_nothing_is_paused():
    ledger = CopyLedger(LedgerConfig(holdout=0.5, attribution_s=1000.0, min_samples=30))
    (c,), (h,) = copied_and_held(1)
    ledger.assign(c, 0.0), ledger.assign(h, 0.0)
    feed(ledger, c, h, copied_ttft=0.2, held_ttft=0.9, n=40, t=5.0)
    verdict, (d, lo, hi) = ledger.verdict(5.0)
    assert verdict == "pays" and d == pytest.approx(-0.7) and hi < 0
    fresh = [x for x in range(1000, 2000) if _unit(x) >= 0.5][0]
    assert ledger.assign(fresh, 6.0) is True
    # while they pay, a quarter of the holdout is held out (measuring costs what the held-out prefixes lose): a
    # prefix the full holdout draws out, and the smaller one does not, is copied; one both draw out is not
    status = ledger.status(6.0)
    assert status["holdout_now"] == pytest.approx(0.125) and not status["paused"]
    between = [x for x in range(2000, 4000) if 0.125 <= _unit(x) < 0.5][:3]
    below = [x for x in range(2000, 4000) if _unit(x) < 0.125][:3]
    assert [ledger.assign(x, 6.0) for x in between] == [True] * 3
    assert [ledger.assign(x, 6.0) for x in below] == [False] * 3
    # the same prefixes under a ledger that has not judged yet: the full holdout
    judging = CopyLedger(LedgerConfig(holdout=0.5, attribution_s=1000.0, min_samples=30))
    assert [judging.assign(x, 6.0) for x in between] == [False] * 3 and judging.status(6.0)["holdout_now"] == 0.5
    with pytest.raises(ValueError, match="paying_share"):
        LedgerConfig(paying_share=1.5)


def test_bounds():
    ledger = CopyLedger(LedgerConfig(holdout=0.5, attribution_s=1000.0, min_samples=2, max_samples=5,
                                     max_assigned=3))
    for h in range(10):
        ledger.assign(h, 0.0)
    assert ledger.status(0.0)["prefixes_assigned"] == 3
    c = next(h for h in range(7, 10) if _unit(h) >= 0.5)  # one of the 3 kept, copied
    for i in range(20):
        ledger.finished([c], 0.1, 1.0)
    assert ledger.status(1.0)["groups"][COPIED]["answers"] == 5
    for bad in (dict(holdout=1.5), dict(window_s=0), dict(min_samples=1), dict(max_samples=1)):
        with pytest.raises(ValueError):
            LedgerConfig(**bad)
    assert ledger.finished([1], float("nan"), 1.0) is None and ledger.finished([1], -1.0, 1.0) is None


def test_a_routers_finish_report_with_its_ttft_reaches_the_ledger():
    from radix_sync.hashing import page_hashes
    from tests.unit.test_live_planner import PS, state_with_prefix

    tokens = list(range(100, 100 + 1024))
    st = state_with_prefix(tokens, waiting_on_a=0)
    node = page_hashes(tokens, PS)[-1]
    copied = st.ledger.assign(node, 1.0)
    hashes = page_hashes(tokens + list(range(7, 7 + 64)), PS)
    assert st.record_demand([], [{"page_hashes": hashes, "page_size": PS, "worker": "a", "ttft_s": 0.25}], 1.5)[1] == 1
    st.record_demand([], [{"page_hashes": hashes, "page_size": PS, "worker": "a"}], 1.6)  # no TTFT: not evidence
    status = st.ledger.status(2.0)
    group = COPIED if copied else HELD_OUT
    assert status["groups"][group] == {"answers": 1, "mean_ttft_s": 0.25} and status["answers_timed"] == 1
    from radix_sync import api
    from radix_sync.api import AdminError

    with pytest.raises(AdminError):  # bounded like every field
        api.convert({"page_hashes": hashes, "page_size": PS, "ttft_s": -1.0}, api.FinishReport)


@contextlib.contextmanager
def active_coordinator(state_dir, policy="none", holdout=0.0):
    """A coordinator in active mode (no sockets served) that knows workers a and b; yields it and `now` on the
    monotonic clock its tick runs on."""
    from radix_sync.coordinator.config import StateConfig
    from radix_sync.coordinator.server import Coordinator, CoordinatorConfig
    from tests.unit.test_live_planner import hello

    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", admin_port=0, policy=policy, mode="active",
                                          state_dir=str(state_dir), state=StateConfig(ledger_holdout=holdout)))
    try:
        t0 = time.monotonic()
        coord.state.handle(b"A", hello("a"), t0)
        coord.state.handle(b"B", hello("b"), t0)
        yield coord, t0
    finally:
        coord._sock.close(0)
        coord._ctx.term()


def stored(st, routing_id: bytes, worker: str, tokens: list[int], seq: int, now: float, pages=None) -> list[int]:
    """`worker` reports `tokens` cached (its first `pages` pages, default all). Returns: their page hashes."""
    from radix_sync import protocol as p
    from radix_sync.hashing import page_hashes
    from tests.unit.test_live_planner import PS

    hashes = page_hashes(tokens, PS)
    blocks = [p.BlockFact(h, par, tokens[i * PS:(i + 1) * PS])
              for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
    st.handle(routing_id, p.PagesStored(worker_id=worker, seq=seq, namespace="", blocks=blocks[:pages]), now)
    return hashes


def test_the_coordinators_tick_makes_the_copies_of_copied_prefixes_only(tmp_path):
    """Active mode: a planner decision on a held-out prefix is not sent; on a copied one it is; and none while
    the ledger says copies cost."""
    with active_coordinator(tmp_path, holdout=0.5) as (coord, t0):
        st = coord.state
        prompts = {}
        for seed in range(40):
            tokens = [100 + seed * 1000 + i for i in range(64)]
            prompts[stored(st, b"A", "a", tokens, seed + 1, t0)[-1]] = tokens
        decisions = [("a", "b", "", h, 64, 30.0) for h in prompts]
        coord._decisions = lambda now: decisions
        coord._tick()
        made = {r.block_hash for r in st.replications.values()}
        copied = {h for h in prompts if _unit(h) >= 0.5}
        assert made == copied and 0 < len(copied) < len(prompts)
        assert st.ledger.num_decisions == {COPIED: len(copied), HELD_OUT: len(prompts) - len(copied), "paused": 0}


def test_the_tick_sends_no_copy_the_target_would_land_nothing_of(tmp_path):
    """A planner decision whose target holds every page already (its own cache, or an earlier partial copy that a
    prefix's last-page holders do not show) is not sent, as the simulator starts none (`lo >= hi`); one it holds
    part of is sent; the held ones are counted in `num_decisions_held`."""
    from tests.unit.test_live_planner import PS

    with active_coordinator(tmp_path) as (coord, t0):
        st = coord.state
        tokens = [7 + i for i in range(4 * PS)]
        hashes = stored(st, b"A", "a", tokens, 1, t0)
        stored(st, b"B", "b", tokens, 1, t0, pages=2)  # half of it
        # the node is the 4-page prefix; b holds its first 2 pages: a copy of 2 pages lands nothing, of 4 lands 2
        coord._decisions = lambda now: [("a", "b", "", hashes[-1], 2 * PS, 30.0)]
        coord._tick()
        assert not st.replications and coord.num_decisions_held == 1
        coord._decisions = lambda now: [("a", "b", "", hashes[-1], 4 * PS, 30.0)]
        coord._tick()
        (rep,) = st.replications.values()
        assert (rep.target, rep.num_tokens, coord.num_decisions_held) == ("b", 4 * PS, 1)


def test_the_tick_lands_a_kvrep_lru_policys_copies_as_ordinary_cache_and_kvreps_evict_first(tmp_path):
    """The grant the target gets (`ExpectReplica`) says how to land a planner's copy: `kvrep_lru`'s as ordinary
    cache, `kvrep`'s evict-first; neither is a pull (`critical`)."""
    from tests.unit.test_live_planner import PS

    for policy, ordinary in (("kvrep", False), ("kvrep_lru", True)):
        with active_coordinator(tmp_path / policy, policy) as (coord, t0):
            hashes = stored(coord.state, b"A", "a", [7 + i for i in range(4 * PS)], 1, t0)
            coord._decisions = lambda now: [("a", "b", "", hashes[-1], 4 * PS, 30.0)]
            coord._tick()
            (rep,) = coord.state.replications.values()
            target, expect = coord._outbox.get_nowait()
            assert (rep.origin, target, expect.replication_id) == (policy, b"B", rep.id)
            assert (expect.ordinary, expect.critical) == (ordinary, False)
