"""`kvrep bench --simulate` runs the simulator on the very requests the live replay sends: every session turn and
every fan-out branch (the simulator's `duration_s` stops issuing requests, so it must not cut sessions still going
after the last start), each recorded under the same `request_key` as the live result."""
import argparse
import collections
import copy

import pytest

from kvrep_dev import cli
from kvrep_dev.loadgen import workload_size
from kvrep_dev.bench import build_workload, simulate


def bench_args(*extra: str):
    parser = argparse.ArgumentParser()
    cli._add_demo_and_bench(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["bench", *extra])


@pytest.mark.parametrize("workload", ["agent", "fanout", "flash", "shared"])
def test_simulated_requests_are_the_replayed_ones(workload):
    wl = build_workload(workload, bench_args())
    expected = workload_size(wl)["requests"]
    result = simulate(copy.deepcopy(wl), "shadow", 3, 0)
    records = result["requests"]
    assert result["num_requests"] == expected == len(records)
    # one key per request (flash: requests whose own tail is under a page share a key; their send times differ)
    assert len({(r["key"], r["sent_s"]) if workload == "flash" else r["key"] for r in records}) == expected
    for r in records:
        assert r["ttft_s"] > 0 and 0 <= r["cached_tokens"] < r["prompt_tokens"] and r["worker"] in (0, 1, 2)
        assert r["e2e_s"] >= r["ttft_s"] and r["output_tokens"] >= 1  # as the live records, for TPOT by load


def test_compare_requests_matches_by_key():
    from kvrep_dev.bench import compare_requests

    live = [{"key": "a", "ttft_s": 1.0, "cached_tokens": 0}, {"key": "b", "ttft_s": 2.0, "cached_tokens": 64},
            {"key": "c", "ttft_s": 4.0, "cached_tokens": 64}, {"key": "x", "ttft_s": 1.0, "cached_tokens": 0},
            {"key": "d", "ttft_s": None, "cached_tokens": 0}]
    sim = [{"key": "c", "ttft_s": 2.0}, {"key": "a", "ttft_s": 1.5}, {"key": "b", "ttft_s": 1.0},
           {"key": "d", "ttft_s": 1.0}]
    out = compare_requests(live, sim)
    assert out["matched"] == 3  # x has no simulated twin, d failed live
    # one key twice: matched in the order sent
    live2 = [{"key": "k", "sent_s": 2.0, "ttft_s": 4.0}, {"key": "k", "sent_s": 1.0, "ttft_s": 1.0}]
    sim2 = [{"key": "k", "sent_s": 1.0, "ttft_s": 1.0}, {"key": "k", "sent_s": 2.0, "ttft_s": 4.0}]
    assert compare_requests(live2, sim2)["median_rel_error"] == 0.0
    assert out["median_rel_error"] == -0.5  # errors +0.5, -0.5, -0.5
    assert out["median_rel_error_uncached"] == 0.5 and out["median_rel_error_cached"] == -0.5


def test_scale_profile_scales_prefill_and_decode_terms_only():
    from radix_sync.policy.cost import load_profile
    from kvrep_dev.bench import scale_profile

    p = load_profile("cpu-local")
    q = scale_profile(p, prefill=1.5, decode=0.5)
    assert q.prefill_s(1000, 2000) == pytest.approx(1.5 * p.prefill_s(1000, 2000))
    assert q.decode_steps_s(7, 2, 3000) == pytest.approx(0.5 * p.decode_steps_s(7, 2, 3000))
    assert q.transfer_s(1e6) == p.transfer_s(1e6) and q.kv_capacity_tokens == p.kv_capacity_tokens


def test_resimulate_a_saved_run_compares_the_same_requests(tmp_path, capsys):
    """A saved run whose "live" side is the simulator's own output re-simulates with no error at all."""
    import json

    from kvrep_dev.bench import resimulate

    args = {"duration_s": 10.0, "shared_rate": 1.0, "workers": 3, "profile": "cpu-local"}
    wl = build_workload("shared", bench_args("--duration-s", "10"))
    own = simulate(copy.deepcopy(wl), "smg-rr", 3, 0, "cpu-local", 32768, 8)
    live = {"ttft_s": own["ttft_s"], "cached_token_ratio": own["prefix_hit_rate"], "requests": own["num_requests"]}
    row = {"workload": "shared", "arm": "smg-rr", "live": live, "requests": own["requests"]}
    # an A/A arm (`ARM@1`) is simulated as its arm; one behind 2 front doors behind 2 simulated routers
    two = simulate(copy.deepcopy(wl), "smg-ca", 3, 0, "cpu-local", 32768, 8, front_doors=2)
    live2 = {"ttft_s": two["ttft_s"], "cached_token_ratio": two["prefix_hit_rate"], "requests": two["num_requests"]}
    saved = {"args": args, "speed": None,
             "rows": [row, {**row, "arm": "smg-rr@1"},
                      {**row, "arm": "smg-ca@2", "fronts": 2, "live": live2, "requests": two["requests"]}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(saved))
    # "probe": the engine on the run's own profile (no speed measured: x1), as this "live" run had it
    assert resimulate(path, machine_name="probe") == 0
    out = capsys.readouterr().out
    assert "within 20% of the measured value: 6 of 6" in out
    row = next(x for x in out.splitlines() if x.startswith("shared   smg-rr  round_robin"))
    assert row.endswith("+0%")
    row = next(x for x in out.splitlines() if x.startswith("shared   smg-ca@2"))
    assert row.endswith("+0%")
    # and the references: free copies are not slower than smg 1.13 cache_aware on these requests
    bounds = {x.split()[1]: x.split() for x in out.splitlines() if x.startswith("shared ") and "x" in x.split()[-2]}
    assert set(bounds) == {"cache_aware", "kvrep", "free_copies"} and float(bounds["free_copies"][2]) <= float(
        bounds["cache_aware"][2])
    # what-if on another host: the workers sharing one core are slower than on this machine's cores
    assert resimulate(path, cores=1) == 0
    one = capsys.readouterr().out
    slow = {x.split()[1]: float(x.split()[2]) for x in one.splitlines()
            if x.startswith("shared ") and "x" in x.split()[-2]}
    assert "1 cores shared" in one and slow["cache_aware"] >= float(bounds["cache_aware"][2])


def test_the_committed_validation_runs_load_for_resimulate():
    """`bench/results/*.json.gz` are the runs docs/bench.md quotes; `kvrep bench --resimulate` reads them."""
    import gzip
    import json
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("*.json.gz"))
    assert [f.name for f in files] == ["bench-agent-aa-s4.json.gz", "bench-agent-aa50-s6.json.gz",
                                       "bench-agent-abl45-s4.json.gz",
                                       "bench-agent-abl47-s3.json.gz", "bench-agent-abl47-s4.json.gz",
                                       "bench-agent-abl48-s3.json.gz", "bench-agent-abl52-s6.json.gz",
                                       "bench-agent-abl56-s6.json.gz",
                                       "bench-agent-ablation-s4.json.gz", "bench-agent-ablation.json.gz",
                                       "bench-agent-age55-s6.json.gz",
                                       "bench-agent-bets-s3.json.gz",
                                       "bench-agent-burst-s2.json.gz",
                                       "bench-agent-cal-sessions.json.gz",
                                       "bench-agent-cal.json.gz", "bench-agent-carry-s1.json.gz",
                                       "bench-agent-cell51-s6.json.gz",
                                       "bench-agent-demand-s2.json.gz", "bench-agent-fade-s2.json.gz",
                                       "bench-agent-fix-s1.json.gz",
                                       "bench-agent-fix-s2.json.gz", "bench-agent-flush50-s6.json.gz",
                                       "bench-agent-gate.json.gz",
                                       "bench-agent-gate2.json.gz", "bench-agent-hits-s2.json.gz",
                                       "bench-agent-lru-s4.json.gz",
                                       "bench-agent-pend-s2.json.gz", "bench-agent-pulled-s4.json.gz",
                                       "bench-agent-room-s2.json.gz",
                                       "bench-agent-seed1.json.gz", "bench-agent-sent53-s6.json.gz",
                                       "bench-agent-slow52-s6.json.gz",
                                       "bench-agent-speed-s3.json.gz", "bench-agent-speed-s4.json.gz",
                                       "bench-agent-split.json.gz", "bench-agent-ties49-s3.json.gz",
                                       "bench-agent-ties49-s4.json.gz",
                                       "bench-agent-touch-s1.json.gz",
                                       "bench-agent-touch-s2.json.gz",
                                       "bench-agent-wait-s2.json.gz", "bench-agent-wait-s3.json.gz",
                                       "bench-agent-wait47-s3.json.gz",
                                       "bench-cpu-account.json.gz", "bench-draws58-s2.json.gz",
                                       "bench-draws58-s3.json.gz",
                                       "bench-fanflash-speed-s5.json.gz",
                                       "bench-fanflash-split.json.gz",
                                       "bench-fanout-abl47-s5.json.gz", "bench-fanout-abl48-s5.json.gz",
                                       "bench-fanout-age55-s7.json.gz",
                                       "bench-fanout-cell51-s7.json.gz",
                                       "bench-fanout-conn-s3.json.gz", "bench-fanout-flush50-s7.json.gz",
                                       "bench-fanout-lru-s3.json.gz",
                                       "bench-fanout-pull54-s7.json.gz", "bench-fanout-pulled-s3.json.gz",
                                       "bench-fanout-s3.json.gz", "bench-fanout-sent53b-s7.json.gz",
                                       "bench-fanout-slow52-s7.json.gz",
                                       "bench-fanout-ties49-s5.json.gz",
                                       "bench-flash-abl48-s5.json.gz", "bench-flash-age55-s5.json.gz",
                                       "bench-flash-long54-s5.json.gz",
                                       "bench-flash-nolap53-s5.json.gz",
                                       "bench-flash-s4.json.gz", "bench-flash-seed1.json.gz",
                                       "bench-flash-sent53-s5.json.gz", "bench-flash-slow52-s5.json.gz",
                                       "bench-flash-wait-s1.json.gz",
                                       "bench-flash-wait-s2.json.gz", "bench-flash-wait-s3.json.gz",
                                       "bench-p2c58-s3.json.gz", "bench-relay57-s2.json.gz",
                                       "bench-routers4-s2.json.gz", "bench-sgl-s0.json.gz",
                                       "bench-sgl49-s0.json.gz", "bench-sgl54-s0.json.gz",
                                       "bench-sgl55-s0.json.gz",
                                       "bench-unique-cell51-s8.json.gz", "bench-unique-flush50-s8.json.gz",
                                       "bench-unique-split.json.gz", "bench-unique54-s8.json.gz",
                                       "bench-val1.json.gz",
                                       "bench-val2-agent.json.gz",
                                       "bench-val2.json.gz"]
    for f in files:
        data = json.loads(gzip.decompress(f.read_bytes()))
        # every request of our load generator keys the simulator's twin (SGLang's client's rows are not simulated)
        assert data["rows"] and all(q["key"] for r in data["rows"] if r["workload"] != "sgl-gsp" for q in r["requests"])
        assert not [v for v in data["args"].values() if isinstance(v, str) and v.startswith("/")], f.name
        # the validation runs: 3 workers sharing 2 cores; the later ones: the testbed (one pinned worker a core)
        assert data["args"]["workers"] == (3 if "val" in f.name else 2)


def test_the_pull_arm_runs_the_live_routers_rule_in_the_simulator_too():
    from kvrep_dev.bench import ARMS, COORDINATOR_ARM, FIXED_SPEED_ARMS, PULL_ARMS, SIM_POLICY

    # live: the router with --pull and the planner off (pull), or on (active); simulated: the same rule
    assert COORDINATOR_ARM == {"pull": ("none", "active"), "demote": ("demote", "active"),
                               "active": ("kvrep", "active"), "active-lru": ("kvrep_lru", "active"),
                               "active-fixed": ("kvrep_fixed", "active"), "active-nosent": ("kvrep", "active")}
    assert set(PULL_ARMS) == {"pull", "demote", "active", "active-lru", "active-nosent"}
    assert SIM_POLICY["pull"] == "kvrep_pull"
    assert SIM_POLICY["active-lru"] == "kvrep_lru" and "active-lru" not in bench_args().arms.split(",")
    # the speed calibration's ablation: the same planner and pulls, a router without --speed-calibration
    assert FIXED_SPEED_ARMS == ("active-fixed",) and SIM_POLICY["active-fixed"] == "kvrep"
    assert "active-fixed" in ARMS and "active-fixed" not in bench_args().arms.split(",")
    assert SIM_POLICY["demote"] == "kvrep_pull_demote" and "demote" in ARMS  # + demotion, no planner
    assert "demote" not in bench_args().arms.split(",")  # only when asked
    assert "pull" in ARMS and "pull" in bench_args().arms.split(",")
    wl = build_workload("fanout", bench_args())
    result = simulate(copy.deepcopy(wl), "pull", 3, 0)
    assert result["num_requests"] == workload_size(wl)["requests"]


def test_the_tie_rotations_ablation_arm_routes_every_full_tie_to_the_lowest_id_live_and_simulated():
    from kvrep_dev.bench import ARMS, CLAIMS, LOWEST_ID_ARMS, SIM_POLICY, router_flags

    assert LOWEST_ID_ARMS == ("shadow-lowid",) and "shadow-lowid" in ARMS
    assert SIM_POLICY["shadow-lowid"] == "kvrep_shadow"
    assert "shadow-lowid" not in bench_args().arms.split(",") and ("shadow", "shadow-lowid") in CLAIMS
    assert ("shadow@1", "shadow") in CLAIMS  # the A/A control, where a run has it
    assert router_flags("shadow-lowid") == ("--no-tie-turns",) and router_flags("shadow") == ()
    assert router_flags("active") == ("--pull",)
    assert router_flags("active-fixed") == ("--pull", "--no-speed-calibration")
    # simulated: the same workload, the two tie rules; a fan-out's trunks are prompts no worker holds
    wl = build_workload("fanout", bench_args())
    turns = simulate(copy.deepcopy(wl), "shadow", 2, 0)
    lowest = simulate(copy.deepcopy(wl), "shadow", 2, 0, tie_turns=False)
    assert turns["num_requests"] == lowest["num_requests"] == workload_size(wl)["requests"]
    per_worker = [sorted(collections.Counter(q["worker"] for q in r["requests"]).values()) for r in (turns, lowest)]
    assert per_worker[0] != per_worker[1], per_worker


def test_the_sent_pages_ablation_arm_prices_the_directory_alone_live_and_simulated():
    from kvrep_dev.bench import ARMS, CLAIMS, NOSENT_ARMS, SIM_POLICY, router_flags

    assert NOSENT_ARMS == ("active-nosent",) and "active-nosent" in ARMS and SIM_POLICY["active-nosent"] == "kvrep"
    assert router_flags("active-nosent") == ("--pull", "--no-sent-pages") and ("active", "active-nosent") in CLAIMS
    assert "active-nosent" not in bench_args().arms.split(",")  # only when asked
    # simulated: `sent_pages` switches the simulated router's count (`ExpectedTtftRouter.count_sent`)
    from radix_sync.policy.routers import ExpectedTtftRouter
    from radix_sync.policy.snapshot import RequestView, WorkerView
    from radix_sync.router.policy import RouterCosts, cost_model
    model = cost_model(RouterCosts(prefill_s_per_token=0.01, queue_s_per_request=0.0, decode_step_s=0.0,
                                   kv_bytes_per_token=1, link_bytes_per_s=200.0, transfer_latency_s=0.0))
    chosen = []
    for count in (True, False):
        sim = ExpectedTtftRouter(model, 1, allow_pull=False, page_len=10)
        sim.count_sent = count
        views = (WorkerView(0), WorkerView(1, num_waiting=1, waiting_new_tokens=20))
        sim.route(RequestView(1, 50, page_hashes=(1, 2, 3, 4, 5), cached_len=(0, 0)), views, 0.0)  # to worker 0
        views = (WorkerView(0, num_waiting=1, waiting_new_tokens=50), views[1])
        chosen.append(sim.route(RequestView(2, 60, page_hashes=(1, 2, 3, 4, 5, 61), cached_len=(0, 0)), views,
                                0.0).worker_id)
    assert chosen == [0, 1]  # 0.5 + 0.1 s behind the first where it went, else 0.2 + 0.6 s at the other


def _validation_row(arm, live_ttfts, sim_ttfts, rnd=0):
    from kvrep_dev.loadgen import _pct

    def t(xs):
        return {"mean": sum(xs) / len(xs), "p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99)}
    reqs = [{"key": f"{arm}{i}", "ttft_s": x, "cached_tokens": 0, "error": None} for i, x in enumerate(live_ttfts)]
    row = {"workload": "fanout", "arm": arm, "repeat": rnd, "requests": reqs,
           "live": {"ttft_s": t(live_ttfts), "cached_token_ratio": 0.5}}
    if sim_ttfts is not None:
        row["sim"] = {"ttft_s": t(sim_ttfts), "prefix_hit_rate": 0.5,
                      "requests": [{"key": f"{arm}{i}", "ttft_s": x} for i, x in enumerate(sim_ttfts)]}
    return row


def test_validation_counts_p50_p99_within_20_percent_and_the_claim_ratios_within_0_1():
    from kvrep_dev.bench import sim_ratio_checks, validation_table

    base = [0.5 + 0.01 * i for i in range(100)]
    rows = [_validation_row("pull", base, [1.19 * x for x in base]),  # +19%: within
            _validation_row("active", [0.8 * x for x in base], [0.8 * 1.21 * x for x in base]),  # +21%: out
            _validation_row("smg-ca", base, base)]
    out = validation_table(rows, "cpu-wide")
    assert "within 20% of the measured value: 4 of 6 (P50 and P99)" in out
    checks = {(c["ratio"], c["stat"]): c for c in sim_ratio_checks(rows)}
    assert set(checks) == {("active/pull", "p99"), ("active/pull", "mean"), ("active/smg-ca", "p99"),
                           ("active/smg-ca", "mean")}
    # active/pull: live 0.8, sim 0.8 x 1.21 / 1.19 = 0.813; active/smg-ca: live 0.8, sim 0.968 (off by 0.17)
    assert checks[("active/pull", "mean")]["live"] == pytest.approx(0.8)
    assert checks[("active/pull", "mean")]["sim"] == pytest.approx(0.8 * 1.21 / 1.19)
    assert checks[("active/pull", "p99")]["ok"] and not checks[("active/smg-ca", "p99")]["ok"]
    assert "within 0.1 of the measured ratio: 2 of 4" in out and "MISS" in out


def test_the_measured_ratio_pools_every_round():
    from kvrep_dev.bench import sim_ratio_checks

    base = [1.0] * 50
    rows = [_validation_row("active", base, base), _validation_row("pull", base, base),
            _validation_row("active", [3.0] * 50, None, rnd=1), _validation_row("pull", base, None, rnd=1)]
    mean = next(c for c in sim_ratio_checks(rows) if c["stat"] == "mean")
    assert mean["live"] == pytest.approx(2.0) and mean["sim"] == pytest.approx(1.0) and not mean["ok"]


def test_per_arm_the_rounds_are_pooled_and_the_simulator_set_against_their_range():
    from kvrep_dev.bench import validation_table

    base = [0.5 + 0.01 * i for i in range(100)]  # P50 0.995, P99 1.49
    rows = [_validation_row("pull", base, base), _validation_row("pull", [2 * x for x in base], base, rnd=1),
            _validation_row("active", base, [1.1 * x for x in base])]  # one round: +10%, outside its one value
    out = validation_table(rows, "cpu-wide")
    pooled = out.split("per arm, every round pooled")[1].splitlines()
    pull = next(x for x in pooled if x.startswith("fanout   pull"))
    # the live P50 of base and 2 x base pooled is 1.33 against the simulated 0.99 (-25%), P99 2.94 against 1.48;
    # the simulated values sit at the low end of the two rounds' range
    assert pull.split() == ["fanout", "pull", "2", "1.33", "[0.99-1.99]", "0.99", "-25%", "2.94", "[1.48-2.96]",
                            "1.48", "-50%"]
    assert "per arm, pooled: within 20% of the measured value 2 of 4; inside the rounds' range 2 of 4" in out
    assert "per arm" not in validation_table(rows[2:], "cpu-wide")  # no arm with more than one round


def test_the_flash_crowd_is_one_hot_prefix_whose_rate_ramps_up():
    """`flash`: the simulator's flash-crowd generator with one crowd over the run, scaled like the others."""
    from radix_sync.sim.generators import FlashCrowdWorkload

    args = bench_args("--duration-s", "60", "--flash-rate", "3", "--flash-prefix", "1024")
    wl = build_workload("flash", args)
    assert isinstance(wl, FlashCrowdWorkload) and wl.name == "flash" and wl.page_len == 16
    reqs = sorted(wl.open_requests, key=lambda r: r.arrival_s)
    assert not wl.session_starts and 130 <= len(reqs) <= 230  # mean 3/s over 60 s: 180 expected
    hot = reqs[0].pages[:1024 // 16]
    for r in reqs:  # every request: the hot prefix, then pages of its own
        assert r.pages[:len(hot)] == hot and 1024 < r.prompt_len <= args.max_prompt
    tails = [tuple(r.pages[len(hot):]) for r in reqs if len(r.pages) > len(hot)]
    assert len(tails) > 0.8 * len(reqs) and len(set(tails)) == len(tails)  # the rest: a tail under one page
    # the ramp: the first quarter sees about 1/8 of the requests, the second half about 2/3
    first_q = sum(r.arrival_s < 15 for r in reqs) / len(reqs)
    second_half = sum(r.arrival_s >= 30 for r in reqs) / len(reqs)
    assert first_q < 0.2 and 0.55 < second_half < 0.8
    # the same seed gives the same workload (every arm replays it)
    again = build_workload("flash", args)
    assert [(r.arrival_s, r.pages) for r in again.open_requests] == [(r.arrival_s, r.pages) for r in wl.open_requests]


def test_the_arms_can_run_in_a_shuffled_order_per_round_reproducibly():
    """The ablation's active arm always ran fourth, after demote: `--arm-order shuffled` gives each round its own
    seeded order, so no arm always follows the same one; `fixed` (the default) keeps the order given."""
    from kvrep_dev.bench import round_order

    arms = ["shadow", "pull", "demote", "active", "smg-ca"]
    assert round_order(arms, 0, 0) == arms and round_order(arms, 5, 3, "fixed") == arms
    orders = [round_order(arms, rnd, 0, "shuffled") for rnd in range(6)]
    assert all(sorted(o) == sorted(arms) for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # the rounds differ
    assert orders == [round_order(arms, rnd, 0, "shuffled") for rnd in range(6)]  # reproducible
    assert bench_args().arm_order == "fixed"
    import pytest

    with pytest.raises(ValueError, match="fixed, shuffled or balanced"):
        round_order(arms, 0, 0, "random")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_a_balanced_order_puts_each_arm_in_each_place_and_after_each_other_arm_equally_often(n):
    from kvrep_dev.bench import round_order

    arms = [f"a{i}" for i in range(n)]
    rounds = n if n % 2 == 0 else 2 * n
    orders = [round_order(arms, rnd, 7, "balanced") for rnd in range(rounds)]
    assert all(sorted(o) == arms for o in orders)
    places = collections.Counter((a, i) for o in orders for i, a in enumerate(o))
    assert set(places.values()) == {rounds // n} and len(places) == n * n
    after = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert len(after) == n * (n - 1) and len(set(after.values())) == 1
    assert orders == [round_order(arms, rnd, 7, "balanced") for rnd in range(rounds)]  # reproducible
    assert bench_args("--arm-order", "balanced").arm_order == "balanced"


def test_the_bench_simulates_copies_between_iterations_as_the_live_agents_make_them(monkeypatch):
    import radix_sync.sim.engine as engine

    seen = []
    real = engine.Engine.__init__

    def spy(self, profile, wl, policy, cfg):
        seen.append((cfg.endpoint_wait, policy.router.endpoint_wait))
        real(self, profile, wl, policy, cfg)
    monkeypatch.setattr(engine.Engine, "__init__", spy)
    wl = build_workload("fanout", bench_args())
    simulate(copy.deepcopy(wl), "pull", 3, 0)
    simulate(copy.deepcopy(wl), "pull", 3, 0, endpoint_wait=False)
    assert seen == [(True, True), (False, False)]
    assert bench_args().sim_endpoint_wait and not bench_args("--no-sim-endpoint-wait").sim_endpoint_wait


def _wide_run_with_lone_requests():
    """A saved 2-worker `cpu-wide` run whose "live" side is the simulator's own, plus 30 lone requests after the
    workload, 10 s apart (no simulated twin: only the machine is measured on them). Returns: (args, row, the
    simulation, the lone requests)."""
    args = {"duration_s": 10.0, "shared_rate": 1.0, "workers": 2, "profile": "cpu-wide"}
    wl = build_workload("shared", bench_args("--duration-s", "10"))
    own = simulate(copy.deepcopy(wl), "smg-rr", 2, 0, "cpu-wide", 32768, 8)
    live = {"ttft_s": own["ttft_s"], "cached_token_ratio": own["prefix_hit_rate"], "requests": own["num_requests"]}
    lone = [{"key": f"lone{i}", "sent_s": 1000.0 + 10 * i, "prompt_tokens": 500 + 100 * i, "cached_tokens": 0,
             "ttft_s": 0.5, "error": None} for i in range(30)]
    return args, {"workload": "shared", "arm": "smg-rr", "live": live, "requests": own["requests"] + lone}, own, lone


def test_resimulate_runs_the_engine_on_the_measured_machine_by_default(tmp_path, capsys):
    """By default the engine runs on `testbed.MACHINE_PROFILE` at the run's drift (measured on its lone requests);
    with too few lone requests it falls back to the priced profile scaled by the probe."""
    import json

    from kvrep_dev.bench import resimulate

    args, row, own, lone = _wide_run_with_lone_requests()
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"args": args, "speed": None, "rows": [row]}))
    assert resimulate(path) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "the engine on cpu-wide-bench at prefill x" in head and "policies priced with cpu-wide" in head
    row["requests"] = own["requests"] + lone[:5]  # too few lone requests to measure the machine on
    path.write_text(json.dumps({"args": args, "speed": None, "rows": [row]}))
    assert resimulate(path) == 0
    assert "cpu-wide scaled by the speed probe then: not measured, x1" in capsys.readouterr().out.splitlines()[0]


def test_resimulate_reports_waiting_prompts_as_the_runs_agents_did(tmp_path, capsys, monkeypatch):
    """Runs saved before stop 40 had agents reporting waiting prompts whole; later runs save `waiting_reports` =
    "uncached" and are simulated so; the flag overrides either."""
    import json

    import kvrep_dev.bench as bench

    args, row, _, _ = _wide_run_with_lone_requests()
    seen = []
    real = bench.simulate
    monkeypatch.setattr(bench, "simulate", lambda *a, **kw: seen.append(a[11] if len(a) > 11 else kw.get(
        "prompt_reports")) or real(*a, **kw))
    path = tmp_path / "results.json"
    for saved, flag, want, said in (({}, None, True, "whole"), ({"waiting_reports": "uncached"}, None, False,
                                                                 "uncached"),
                                    ({"waiting_reports": "uncached"}, True, True, "whole")):
        seen.clear()
        path.write_text(json.dumps({"args": args, "speed": None, "rows": [row], **saved}))
        assert bench.resimulate(path, prompt_reports=flag) == 0
        assert seen and set(seen) == {want}
        assert f"waiting prompts reported {said}" in capsys.readouterr().out.splitlines()[0]


def test_a_saved_run_names_paths_inside_the_checkout_relative_to_its_root():
    from kvrep_dev.bench import DEFAULT_TRACE, ROOT, saved_arg

    assert saved_arg(DEFAULT_TRACE) == "bench/traces/claude_code_sample"
    assert saved_arg(str(ROOT / "logs" / "bench")) == "logs/bench"  # an absolute string too
    assert saved_arg("/elsewhere/traces") == "/elsewhere/traces"  # outside it: kept, nothing to shorten
    assert saved_arg("logs/bench") == "logs/bench" and saved_arg(3) == 3 and saved_arg(None) is None


def test_the_engine_runs_on_prefill_terms_fitted_to_the_runs_own_lone_requests():
    """A machine whose cold prompts got 4x faster than `testbed.MACHINE_PROFILE` and its cache hits 2x (another
    CPU): one drift cannot price both; the run's own fit does, within 5%, and the simulated engine runs on it."""
    from dataclasses import replace

    from kvrep_dev import calibration, testbed
    from kvrep_dev.bench import describe_machine, machine_profile, measure_machine
    from radix_sync.policy.cost import load_profile

    base = load_profile(testbed.MACHINE_PROFILE)
    true = replace(base, prefill_s_per_token=base.prefill_s_per_token / 4,
                   prefill_s_per_token_pair=base.prefill_s_per_token_pair / 4,
                   prefill_s_per_cached_pair=base.prefill_s_per_cached_pair / 2)
    shapes = [(n, c) for n in (16, 40, 100, 300, 700, 1500, 3000) for c in (0, 300, 1200, 2400)]
    reqs = []
    for i in range(150):
        n, c = shapes[i % len(shapes)]
        ttft = true.prefill_s(n, c) + calibration.first_token_lag_s(base, n, c)
        reqs.append({"key": f"k{i}", "sent_s": 10.0 * i, "prompt_tokens": n + c, "cached_tokens": c,
                     "ttft_s": ttft, "error": None})
    rows = [{"workload": "agent", "arm": "shadow", "requests": reqs}]
    machine = measure_machine(rows, None)
    assert machine["fit"]["samples"] == 150 and machine["fit"]["cells"] >= 8 and machine["fit"]["rms"] < 0.02
    engine = machine_profile(load_profile("cpu-wide"), machine)
    for n, c in ((2400, 0), (100, 2400), (30, 1200)):
        assert engine.prefill_s(n, c) == pytest.approx(true.prefill_s(n, c), rel=0.05)
    assert "fitted to 150 requests that ran alone" in describe_machine(machine)
    # the same run at one drift (the model before): a cold prompt and a hit cannot both be right
    drifted = machine_profile(load_profile("cpu-wide"), measure_machine(rows, None, testbed.MACHINE_PROFILE))
    errs = [drifted.prefill_s(n, c) / true.prefill_s(n, c) - 1 for n, c in ((2400, 0), (100, 2400))]
    assert max(abs(e) for e in errs) > 0.15
    # too few lone requests for a fit: the drift, as before
    few = measure_machine([{**rows[0], "requests": reqs[:60]}], None)
    assert few["fit"] is None and "at prefill x" in describe_machine(few)


def test_front_end_cpu_is_simulated_only_when_asked_and_per_front_door(monkeypatch):
    import radix_sync.sim.engine as engine
    from kvrep_dev.testbed import FRONTEND_CPU_S

    seen = []
    real = engine.Engine.__init__

    def spy(self, profile, wl, policy, cfg):
        seen.append(cfg.frontend_cpu_s)
        real(self, profile, wl, policy, cfg)
    monkeypatch.setattr(engine.Engine, "__init__", spy)
    wl = build_workload("fanout", bench_args())
    for arm, frontend in (("active", False), ("active", True), ("smg-ca", True)):
        simulate(copy.deepcopy(wl), arm, 2, 0, frontend=frontend)
    assert seen == [0.0, FRONTEND_CPU_S["kvrep"], FRONTEND_CPU_S["smg"]]
    assert FRONTEND_CPU_S["smg"] < FRONTEND_CPU_S["kvrep"]
    assert bench_args("--sim-frontend-cpu").sim_frontend_cpu and not bench_args().sim_frontend_cpu


def test_every_arm_starts_on_empty_caches_unless_told_otherwise():
    assert bench_args().flush_caches and not bench_args("--no-flush-caches").flush_caches


def test_the_send_relays_ablation_arm_runs_routers_without_it_live_and_simulated():
    from kvrep_dev.bench import ARMS, CLAIMS, NORELAY_ARMS, RELAY_LAG_S, SIM_POLICY, router_flags

    assert NORELAY_ARMS == ("shadow-norelay",) and "shadow-norelay" in ARMS
    assert SIM_POLICY["shadow-norelay"] == "kvrep_shadow" and router_flags("shadow-norelay") == ("--no-peer-sends",)
    assert ("shadow@4", "shadow-norelay@4") in CLAIMS and "shadow-norelay" not in bench_args().arms.split(",")
    # simulated behind 2 doors: relayed (as a run's `shadow@2`) or not (`shadow-norelay@2`), the same requests
    wl = build_workload("agent", bench_args())
    relayed = simulate(copy.deepcopy(wl), "shadow", 2, 0, front_doors=2, door_sends_s=RELAY_LAG_S)
    blind = simulate(copy.deepcopy(wl), "shadow", 2, 0, front_doors=2)
    assert relayed["num_requests"] == blind["num_requests"] == workload_size(wl)["requests"]
    assert [q["worker"] for q in relayed["requests"]] != [q["worker"] for q in blind["requests"]]


def test_the_tie_draws_ablation_arm_runs_routers_without_it_live_and_simulated():
    from kvrep_dev.bench import ARMS, CLAIMS, NODRAW_ARMS, RELAY_LAG_S, SIM_POLICY, TIE_DRAWS, router_flags

    assert NODRAW_ARMS == ("shadow-nodraw",) and "shadow-nodraw" in ARMS and TIE_DRAWS == "drawn"
    assert SIM_POLICY["shadow-nodraw"] == "kvrep_shadow" and router_flags("shadow-nodraw") == ("--no-tie-draws",)
    assert ("shadow@4", "shadow-nodraw@4") in CLAIMS and "shadow-nodraw" not in bench_args().arms.split(",")
    # simulated behind 2 relayed doors: ties drawn (a run's `shadow@2`) or by load and turn (`shadow-nodraw@2`)
    wl = build_workload("agent", bench_args())
    drawn = simulate(copy.deepcopy(wl), "shadow", 2, 0, front_doors=2, door_sends_s=RELAY_LAG_S)
    shared = simulate(copy.deepcopy(wl), "shadow", 2, 0, front_doors=2, door_sends_s=RELAY_LAG_S, tie_draws=False)
    assert drawn["num_requests"] == shared["num_requests"] == workload_size(wl)["requests"]
    assert [q["worker"] for q in drawn["requests"]] != [q["worker"] for q in shared["requests"]]
