"""Whole-engine properties on small generated workloads: determinism, conservation, copies and shadow mode."""

from radix_sync.policy.cost import load_profile
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import FanoutWorkload, GeneratorConfig
from radix_sync.sim.policies import build_policy

PROFILE = load_profile("llama3.1-8b-h200")


def run(policy, seed=1, rate=6.0):
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=rate, duration_s=20.0, seed=seed,
                        max_context_len=PROFILE.max_context_len)
    eng = Engine(PROFILE, wl, build_policy(policy, PROFILE, wl.page_len, seed), EngineConfig(num_workers=4,
                                                                                             duration_s=20.0))
    stats = eng.run()
    for w in eng.workers:
        w.cache.check_integrity()
        assert w.cache.reserved_tokens == 0 and not w.waiting and not w.running
    return stats.to_dict(), eng


def test_deterministic_for_a_seed():
    a, _ = run("kvrep")
    b, _ = run("kvrep")
    assert a == b
    c, _ = run("kvrep", seed=2)
    assert c != a


def test_every_issued_request_completes_under_every_policy():
    # closed loop: a slower policy issues fewer branches before the cut-off, but finishes all it issued
    for p in ("round_robin", "least_load", "cache_aware", "cache_aware_v03", "cost", "pull", "sticky", "precise", "e2",
              "free_copies", "kvrep_route", "kvrep_pull", "kvrep_pull_demote", "pull_demote"):
        r = run(p)[0]
        assert r["num_requests"] == r["num_arrived"] > 0, p


def test_kvrep_copies_hinted_trunks_and_shadow_copies_nothing():
    active, _ = run("kvrep")
    shadow, _ = run("kvrep_shadow")
    assert active["replication"]["by_kind"].get("replica", {}).get("landed", 0) > 0
    assert shadow["replication"]["count"] == 0 and shadow["replication"]["shadow"]["count"] > 0


def test_free_copies_beats_load_and_cache_routing_here():
    # a reference on this small case, not a bound in general (see `free_copies`)
    free, _ = run("free_copies")
    for p in ("round_robin", "cache_aware", "cache_aware_v03"):
        assert free["ttft_s"]["mean"] <= run(p)[0]["ttft_s"]["mean"]


def test_oracle_is_a_deprecated_alias_of_free_copies(capsys):
    old, _ = run("oracle")
    assert "deprecated" in capsys.readouterr().err and old["policy"] == "free_copies"
    assert old["ttft_s"] == run("free_copies")[0]["ttft_s"]


def test_ablations_add_one_mechanism_each():
    from radix_sync.policy.cost import load_profile
    from radix_sync.sim.policies import build_policy

    prof = load_profile("llama3.1-8b-h200")
    b = {n: build_policy(n, prof, 64, 1) for n in ("kvrep_route", "kvrep_pull", "kvrep_pull_demote", "kvrep",
                                                    "pull_demote")}
    assert [(x.router.allow_pull, x.demote_stale, x.planner is not None) for x in
            (b["kvrep_route"], b["kvrep_pull"], b["kvrep_pull_demote"], b["kvrep"])] == [
        (False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    assert b["pull_demote"].demote_stale and b["pull_demote"].planner is None and b["pull_demote"].predictor
    # demotion without a planner plans nothing and copies only on the critical path
    r, _ = run("kvrep_pull_demote")
    assert r["num_requests"] == r["num_arrived"] > 0
    assert "replica" not in r["replication"]["by_kind"]


def test_kvrep_lru_lands_the_planners_copies_as_ordinary_cache_and_drops_unused_ones_at_their_ttl():
    from radix_sync.policy.pagetree import PageTree

    results = {}
    for name in ("kvrep", "kvrep_lru"):
        inserted, dropped = [], []
        wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=20.0, seed=1,
                            max_context_len=PROFILE.max_context_len)
        eng = Engine(PROFILE, wl, build_policy(name, PROFILE, wl.page_len, 1), EngineConfig(num_workers=4,
                                                                                           duration_s=20.0))
        for w in eng.workers:
            tree, ins, drop = w.cache.tree, w.cache.insert, w.cache.tree.drop_replica_chain
            w.cache.insert = lambda *a, _ins=ins, **k: (inserted.append(k.get("replica", False)), _ins(*a, **k))[1]
            def spy(page, on_evict=None, max_ordinary=0, _d=drop):
                dropped.append(max_ordinary)
                return _d(page, on_evict, max_ordinary)
            tree.drop_replica_chain = spy
        results[name] = eng.run().to_dict()
        for w in eng.workers:
            w.cache.check_integrity()
            assert isinstance(w.cache.tree, PageTree) and w.cache.reserved_tokens == 0
        landed = results[name]["replication"]["by_kind"]["replica"]["landed"]
        assert landed > 0 and dropped, name
        if name == "kvrep":
            assert any(inserted) and not any(dropped)  # evict-first pages, dropped by their replica flag
        else:
            assert not any(inserted) and all(dropped)  # ordinary pages, each drop bounded by what the copy added
    assert results["kvrep_lru"]["num_requests"] == results["kvrep_lru"]["num_arrived"] > 0


def test_fanout_hint_plans_at_admission_and_copies_onward_from_replicas():
    booked = []
    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=20.0, seed=1,
                        max_context_len=PROFILE.max_context_len)
    eng = Engine(PROFILE, wl, build_policy("kvrep", PROFILE, wl.page_len, 1), EngineConfig(num_workers=4,
                                                                                         duration_s=20.0))
    book = eng._book

    def spy(x, now):
        booked.append((x.pending, x.src, x.dst, x.node_id, now))
        # a copy starts only once its source holds the pages
        assert eng.workers[x.src].cache.match_len(x.pages[: x.hi]) >= x.hi
        book(x, now)
    eng._book = spy
    eng.run()
    pending = [b for b in booked if b[0]]
    assert pending, "copies planned before the trunk's prefill ended"
    dsts = {(b[3], b[2]) for b in booked}
    assert any((b[3], b[1]) in dsts for b in booked), "some copy's source is an earlier copy's target"
    assert not eng.pending and not eng.inflight


def test_worker_views_fill_every_field_by_name():
    # the engine builds views positionally (tuple.__new__, the hot loop): every field of WorkerView, in order
    from radix_sync.policy.snapshot import WorkerView
    _, eng = run("kvrep")
    views = tuple(eng.loads.exact(w, eng.now, *eng.loads._consts()) for w in eng.workers)
    assert [len(v) for v in views] == [len(WorkerView._fields)] * 4
    for v, w in zip(views, eng.workers):
        assert v.worker_id == w.wid and v.fingerprint == "" and v.waiting_cached_pairs == 0.0
        assert v.free_tokens == w.cache.free_tokens and v.nic_bandwidth_bytes_per_s == PROFILE.nic_bandwidth_bytes_per_s
        assert v.replica_budget_tokens == int(0.25 * PROFILE.kv_capacity_tokens) - w.cache.tree.num_replica_pages * 64
        assert v.num_running == w.num_running and v.num_waiting == w.num_waiting
        assert v.replica_tokens == w.cache.tree.num_replica_pages * 64 and v.demoted_tokens == w.cache.tree.num_evict_first_stale_pages * 64


def _booked_inside_an_iteration(endpoint_wait: bool) -> tuple[int, int]:
    """Runs `kvrep_pull` on the fan-out case; returns (copies booked, copies whose start falls inside an iteration in
    progress at the source or the target at the moment they were booked)."""
    from radix_sync.policy.planner import PlannerConfig

    wl = FanoutWorkload(GeneratorConfig(fanout_k=8), rate=6.0, duration_s=20.0, seed=1,
                        max_context_len=PROFILE.max_context_len)
    policy = build_policy("kvrep_pull", PROFILE, wl.page_len, 1, PlannerConfig(endpoint_wait=endpoint_wait))
    assert policy.router.endpoint_wait is endpoint_wait
    eng = Engine(PROFILE, wl, policy, EngineConfig(num_workers=4, duration_s=20.0, endpoint_wait=endpoint_wait))
    book, seen = eng.net.book, []

    def spy(src, dst, num_bytes, now):
        start, end = book(src, dst, num_bytes, now)
        ends = [eng.workers[w].busy_until_s(eng.now) for w in (src, dst)]
        seen.append(start < max(ends) - 1e-12)
        return start, end
    eng.net.book = spy
    eng.run()
    return len(seen), sum(seen)


def test_with_endpoint_wait_a_copy_starts_after_the_iterations_in_progress_at_both_ends():
    booked, inside = _booked_inside_an_iteration(True)
    assert booked > 0 and inside == 0
    booked, inside = _booked_inside_an_iteration(False)  # the model before: pages move during iterations
    assert booked > 0 and inside > 0


def test_the_planners_copies_feed_the_use_calibration_and_the_ablation_has_none():
    """Every replica the planner started is one decision; each promotion (a request's first hit) one use, of kind
    `hint` here (fan-out trees); `kvrep_uncalibrated` runs without it."""
    r, eng = run("kvrep")
    st = eng.calibration.status()
    assert eng.policy.planner.calibration is eng.calibration
    promoted = sum(1 for rec in eng.stats.copy_records if rec.kind == "replica" and rec.promoted)
    assert st["decided"] == st["used"] + st["unused"] + st["dropped"] + st["pending"] > 0
    assert st["used"] + st["late_used"] + st["pending_used"] == promoted > 0  # (used, judged or not yet)
    assert set(st["kinds"]) == {"hint"}
    _, plain = run("kvrep_uncalibrated")
    assert plain.calibration is None and plain.policy.planner.calibration is None


def test_every_arrival_reaches_the_calibration_with_the_pages_some_worker_held():
    """A flash crowd's popular prefix is copied; each arrival is handed to the calibration once (its pages and the
    global match), so the popular copies' outcomes count the requests that reused their prefix."""
    from radix_sync.sim.generators import FlashCrowdWorkload

    wl = FlashCrowdWorkload(GeneratorConfig(), rate=40.0, duration_s=20.0, seed=1,
                            max_context_len=PROFILE.max_context_len)
    eng = Engine(PROFILE, wl, build_policy("kvrep", PROFILE, wl.page_len, 1), EngineConfig(num_workers=4,
                                                                                           duration_s=20.0))
    calls = []
    real = eng.calibration.requested
    eng.calibration.requested = lambda pages, n, now: (calls.append((tuple(pages), n)), real(pages, n, now))
    stats = eng.run()
    assert len(calls) == stats.num_arrived > 0
    st = eng.calibration.status()["kinds"]["popularity"]
    assert st["outcomes"] > 0 and 0 < st["requests_seen"] <= len(calls) * st["outcomes"]
    assert any(n > 0 for _, n in calls) and all(0 <= n <= len(p) for p, n in calls)
