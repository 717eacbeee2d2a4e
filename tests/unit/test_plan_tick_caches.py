"""What a plan tick keeps from one tick to the next (docs/coordinator-scale.md): the live planner's candidate views
(`LivePlanner.check_views`: kept views equal fresh ones), the planner's per-view plans (a pass over the same view
objects decides as one over fresh copies), the forecast's waits (`WaitForecast.waits_at`) and the demand log's
stamps, each checked against a fresh build through random facts."""
import dataclasses
import random

from radix_sync import protocol as p
from radix_sync.coordinator.config import StateConfig
from radix_sync.coordinator.demand import ArrivalRecord, DemandLog
from radix_sync.coordinator.live_planner import LivePlanner
from radix_sync.coordinator.state import ClusterState
from radix_sync.hashing import page_hashes
from radix_sync.policy.cost import CostModel, load_profile
from radix_sync.policy.forecast import WaitForecast
from radix_sync.policy.planner import KvrepPlanner, PlannerConfig
from radix_sync.policy.rules import HitRecord
from radix_sync.policy.snapshot import ClusterSnapshot, HolderView, PrefixView, WorkerView
from tests.unit.test_live_planner import PS, hello

WORKERS = "abcde"


def _load(wid: str, seq: int, waiting: int) -> p.LoadReported:
    return p.LoadReported(worker_id=wid, seq=seq, num_running_reqs=1 if waiting else 0, num_waiting_reqs=waiting,
                          num_waiting_tokens=waiting * 2048, available_tokens=60000, evictable_tokens=0,
                          replica_tokens=0, iteration_s=0.5 if waiting else 0.0)


def _random_facts(seed: int, steps: int):
    """Yields (state, now) after each of `steps` random facts: pages stored and removed, replicas marked, promoted
    and removed, hits, arrivals, hints, loads, a worker joining late, copies in flight; hits trimmed as they age."""
    rng = random.Random(seed)
    st = ClusterState(StateConfig(worker_timeout_s=1e6, hit_window_s=20.0))
    seqs = {}
    for w in WORKERS[:4]:
        st.handle(w.encode(), hello(w), 0.0)
        seqs[w] = 0
    prompts = [[1000 * i + j for j in range(4 * PS)] for i in range(10)]
    hashes = [page_hashes(t, PS) for t in prompts]
    now = 1.0
    for step in range(steps):
        now += rng.choice([0.05, 0.25, 1.0])
        i, w = rng.randrange(len(prompts)), rng.choice(list(seqs))
        blocks = [(h, par, prompts[i][k * PS:(k + 1) * PS])
                  for k, (h, par) in enumerate(zip(hashes[i], [None] + hashes[i][:-1]))]
        r = rng.random()
        if r < 0.2:
            st.directory.add_pages(w, "", blocks[:rng.randint(1, 4)])
        elif r < 0.27:
            st.directory.remove_pages(w, hashes[i][rng.randrange(4):])
        elif r < 0.34:
            st.directory.mark_replica(w, hashes[i], rng.randint(1, 4), now + rng.choice([5.0, 10.0]), f"r{i}")
        elif r < 0.38:
            st.directory.promote(w, f"r{i}")
        elif r < 0.41:
            st.directory.remove_replica(w, f"r{i}")
        elif r < 0.7:
            st.demand.add_hit(HitRecord(now, w, rng.choice(["", "t1"]), hashes[i][-1], 4 * PS))
        elif r < 0.78:
            st.demand.add_arrival(ArrivalRecord(now, "", hashes[i][-1], 4 * PS, w), hashes[i], 4, (0, []))
        elif r < 0.82:
            st.record_hint({"kind": rng.choice(["fanout", "keepalive"]), "input_ids": prompts[i], "k": 4,
                            "ttl_s": 3.0}, now)
        elif r < 0.9:
            seqs[w] += 1
            st.handle(w.encode(), _load(w, seqs[w], rng.choice([0, 0, 3, 8])), now)
        elif r < 0.93 and "e" not in seqs:
            st.handle(b"e", hello("e"), now)
            seqs["e"] = 0
        elif r < 0.97:
            holders = st.directory.match(hashes[i])
            src = next((x for x, n in holders.items() if n == 4), None)
            dst = rng.choice([x for x in seqs if x != src])
            if src is not None:
                st.request_replication(src, dst, prompts[i], "", 10.0, now, origin="planner",
                                       block_hash=hashes[i][-1])
        st.tick(now)
        yield st, now


def test_kept_candidate_views_equal_fresh_ones_through_random_facts():
    for seed in range(3):
        planner = LivePlanner("cpu-local")
        num_kept = 0
        for st, now in _random_facts(seed, 400):
            planner.check_views(st, now)
            before = {v.node_id: v for v in planner.snapshot(st, now)[0].prefixes}
            planner.decide(st, now)
            num_kept += sum(1 for v in planner.snapshot(st, now)[0].prefixes if before.get(v.node_id) is v)
        assert num_kept > 100  # (the views are kept: the same objects while nothing they came from changed)


def test_the_demand_log_stamps_change_with_the_entries():
    rng = random.Random(5)
    log = DemandLog(max_events=100)
    for step in range(500):
        now = step * 0.1
        before = {b: (s, tuple(map(tuple, log.by_prefix[b]))) for b, s in log.stamps.items()}
        block = rng.choice([1, 2, 3, 4])
        if rng.random() < 0.5:
            log.add_hit(HitRecord(now, "w", "", block, 16))
        else:
            log.add_arrival(ArrivalRecord(now, "", block, 16, "w"), [], 0, (0, []))
        log.trim(now, window_s=rng.choice([0.3, 1.0, 5.0]))
        log.check_integrity()
        for b, (stamp, entries) in before.items():
            if b in log.stamps and log.stamps[b] == stamp:
                assert tuple(map(tuple, log.by_prefix[b])) == entries
    assert set(log.stamps) == set(log.by_prefix)


def test_the_forecasts_kept_waits_equal_fresh_ones():
    rng = random.Random(11)
    cost = CostModel(load_profile("cpu-local"))
    workers = tuple(WorkerView(i, num_waiting=rng.randrange(3), waiting_new_tokens=rng.randrange(4000),
                               busy_until_s=rng.random()) for i in range(6))
    fc = WaitForecast(cost, workers, 0.0)
    added = []
    for _ in range(300):
        if added and rng.random() < 0.4:
            fc.remove_work(*added.pop(rng.randrange(len(added))))
        else:
            entry = (rng.randrange(6), rng.choice([0.5, 1.0, 2.0, 15.0]), rng.random())
            fc.add_work(*entry)
            added.append(entry)
        t = rng.choice([0.0, 1.0, 2.0, 15.0, 30.0])
        assert fc.waits_at(t) == [fc.wait_at(w, t) for w in range(6)]


def test_the_forecast_after_removals_of_alike_work_is_the_one_built_afresh():
    """Work alike at one time (a thousand popular prefixes) is common: removing one of a run of equal entries
    leaves the arrivals, and so every wait, as removing the first of them did."""
    rng = random.Random(4)
    cost = CostModel(load_profile("cpu-local"))
    workers = tuple(WorkerView(i, num_waiting=i % 2, waiting_new_tokens=1000 * i) for i in range(3))
    fc = WaitForecast(cost, workers, 0.0)
    model = [[] for _ in workers]  # (the arrivals as the first-match removal leaves them)
    for _ in range(400):
        w = rng.randrange(3)
        entry = (rng.choice([1.0, 2.0]), rng.choice([0.25, 0.5]))
        if model[w] and rng.random() < 0.45:
            entry = rng.choice(model[w])
            fc.remove_work(w, *entry)
            model[w].remove(entry)  # (list.remove: the first equal one)
        else:
            fc.add_work(w, *entry)
            model[w].insert(sum(1 for t, _ in model[w] if t <= entry[0]), entry)
        fresh = WaitForecast(cost, workers, 0.0)
        fresh.add_all([(i, t, x) for i in range(3) for t, x in model[i]])
        for t in (0.5, 1.0, 2.0, 3.0):
            assert fc.waits_at(t) == fresh.waits_at(t) == [fresh.wait_at(i, t) for i in range(3)]


def _random_snapshot(rng: random.Random, num_workers: int, num_prefixes: int) -> ClusterSnapshot:
    workers = tuple(WorkerView(i, fingerprint="f", num_running=1, num_waiting=rng.choice([0, 0, 2, 6]),
                               waiting_new_tokens=rng.choice([0, 4096, 16384]), busy_until_s=rng.random(),
                               free_tokens=rng.choice([0, 2048, 100_000]),
                               replica_budget_tokens=rng.choice([0, 8192, 65536]),
                               nic_bandwidth_bytes_per_s=1e9, replica_tokens=rng.choice([-1, 0, 4096]))
                    for i in range(num_workers))
    prefixes = []
    for n in range(num_prefixes):
        holders = tuple(HolderView(w, rng.choice(["owner", "replica"]), rng.choice([512, 1024]),
                                   eta_s=rng.choice([None, None, 0.5]))
                        for w in rng.sample(range(num_workers), rng.randint(1, 2)))
        node_id = n + 1 if rng.random() < 0.95 else rng.randint(1, num_prefixes)  # (now and then one twice)
        hits = tuple(sorted(rng.uniform(0, 10) for _ in range(rng.randint(1, 9))))
        prefixes.append(PrefixView(node_id=node_id, token_len=1024, holders=holders, recent_hit_times_s=hits,
                                   fanout_hint=rng.choice([0, 0, 0, 8]), hint_at_s=rng.choice([None, 12.0])))
    return ClusterSnapshot(workers=workers, prefixes=tuple(prefixes), page_len=16, kv_bytes_per_token=8192)


def test_a_pass_over_kept_views_decides_as_one_over_fresh_copies():
    cost = CostModel(load_profile("cpu-local"))
    num_copies = 0
    for seed in range(6):
        rng = random.Random(seed)
        snap = _random_snapshot(rng, 8, 40)
        cfg = PlannerConfig(endpoint_wait=True, max_scored_per_tick=rng.choice([0, 16, 64]),
                            chain_sources=seed % 2 == 1, allow_pull=seed < 3)
        kept = KvrepPlanner(cost, cfg=cfg)
        for tick in range(6):
            fresh = KvrepPlanner(cost, cfg=cfg)  # (nothing kept: every plan from its view)
            now = 10.0 + tick
            # a few prefixes change (new views, other holders), the others are the same view objects
            changed = _random_snapshot(rng, 8, 40).prefixes
            snap = dataclasses.replace(snap, prefixes=tuple(changed[i] if rng.random() < 0.3 else v
                                                            for i, v in enumerate(snap.prefixes)))
            snap = dataclasses.replace(snap, carried=dict(kept.deferred))
            copies = dataclasses.replace(snap, prefixes=tuple(dataclasses.replace(v) for v in snap.prefixes))
            a = kept.plan(snap, now)
            b = fresh.plan(copies, now)
            assert (a, kept.outcomes, kept.deferred) == (b, fresh.outcomes, fresh.deferred)
            assert kept._wanted_last[2] == fresh._wanted_last[2]  # (the wanted tokens, kept and summed afresh)
            num_copies += len(a)
    assert num_copies > 10


def test_the_spreads_mean_is_the_plain_left_to_right_sum():
    from radix_sync.policy.spread import _mean
    rng = random.Random(2)
    for _ in range(2000):
        values = sorted(rng.choice([rng.random(), rng.uniform(0, 1e6), rng.uniform(0, 1e-6), 0.1, 1e16, -0.0])
                        for _ in range(rng.randint(1, 40)))
        total = 0.0
        for v in values:
            total += v
        assert _mean(values, len(values)) == total / len(values)


def test_the_spread_merged_with_an_option_is_a_lower_bound_of_it_replacing_any_worker():
    from radix_sync.policy.spread import Spread
    rng = random.Random(9)
    for _ in range(3000):
        opts = [(rng.choice([0.1, 0.5, rng.random(), rng.uniform(0, 20)]), rng.choice([0.05, 0.3, rng.random()]))
                for _ in range(rng.randint(2, 12))]
        spread = Spread(opts, rng.randint(2, 8))
        worker, opt = rng.randrange(len(opts)), (rng.uniform(0, 10), rng.choice([0.05, 0.3, rng.random()]))
        assert spread.merged(opt) <= spread.with_option(worker, opt)
        if worker not in spread.inner:
            assert spread.merged(opt) == spread.with_option(worker, opt)


def test_worker_views_built_positionally_are_the_keyword_ones():
    st = ClusterState(StateConfig(worker_timeout_s=1e6))
    for w in "abc":
        st.handle(w.encode(), hello(w), 0.0)
    st.handle(b"a", _load("a", 1, 3), 2.0)
    st.handle(b"b", _load("b", 1, 0), 2.0)  # ("c" has reported no load)
    planner = LivePlanner("cpu-local")
    ids = sorted(st.workers)
    busy = {"b": 7.0}
    views = planner._worker_views(st, ids, [], busy, 2.0)
    for i, wid in enumerate(ids):
        rec, bw = st.workers[wid], planner.profile.nic_bandwidth_bytes_per_s
        load = rec.load
        assert views[i] == WorkerView(
            worker_id=i, fingerprint=rec.hello.fingerprint,
            num_running=load.num_running_reqs if load else 0, num_waiting=load.num_waiting_reqs if load else 0,
            waiting_new_tokens=load.num_waiting_tokens if load else 0,
            busy_until_s=2.0 + (0.5 * load.iteration_s if load and load.num_running_reqs + load.num_waiting_reqs
                                else 0.0),
            free_tokens=load.available_tokens if load else 0,
            replica_budget_tokens=max(0, rec.hello.replica_budget_tokens - (load.replica_tokens if load else 0)),
            egress_busy_until_s=busy.get(wid, 2.0), ingress_busy_until_s=busy.get(wid, 2.0),
            nic_bandwidth_bytes_per_s=0.0 if rec.plain else bw, replica_tokens=load.replica_tokens if load else -1,
            demoted_tokens=load.demoted_tokens if load else 0)
        assert type(views[i]) is WorkerView
