"""`kvrep sim` from its command line: the table, the results JSON the issue specifies, and the CPU-cluster flags."""
import argparse
import json

from radix_sync.sim import cli


def sim(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / f"r{len(extra)}.json"
    args = parser.parse_args(["--generator", "agent", "--rate", "5", "--duration-s", "20", "--workers", "3",
                              "--profile", "cpu-local", "--policies", "cache_aware,kvrep", "--seed", "1",
                              "--out", str(out), "--no-progress", *extra])
    assert cli.run(args) == 0
    return json.loads(out.read_text())


def test_results_json_and_cpu_cluster_flags(tmp_path, capsys):
    plain = sim(tmp_path)
    assert "cache_aware" in capsys.readouterr().out
    assert [r["policy"] for r in plain["results"]] == ["cache_aware", "kvrep"]
    for r in plain["results"]:
        assert set(r["ttft_s"]) >= {"mean", "p50", "p90", "p95", "p99"} and set(r["tpot_s"]) >= {"mean", "p99"}
        assert r["throughput_rps"] > 0
        assert set(r["replication"]) >= {"count", "bytes", "useful_bytes_frac", "request_hit_rate", "byte_hit_rate",
                                         "bytes_per_prefill_s_saved"}
    # three workers on one core, outputs one iteration late: every policy's requests take longer
    shared = sim(tmp_path, "--shared-cores", "1", "--overlap-lag")
    assert shared["args"]["shared_cores"] == 1 and shared["args"]["overlap_lag"] is True
    for a, b in zip(plain["results"], shared["results"]):
        assert b["ttft_s"]["mean"] > a["ttft_s"]["mean"]


def test_eviction_flags(tmp_path, capsys):
    r = sim(tmp_path, "--eviction", "tlru", "--tlru-threshold", "8192", "--tlru-next-prompt", "1024")
    assert (r["args"]["eviction"], r["args"]["tlru_threshold"], r["args"]["tlru_next_prompt"]) == ("tlru", 8192, 1024)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    bad = parser.parse_args(["--generator", "agent", "--rate", "5", "--duration-s", "20", "--eviction", "tlru",
                             "--tlru-threshold", "-1", "--no-progress"])
    assert cli.run(bad) == 2
    assert "tlru_threshold_tokens=-1" in capsys.readouterr().err


def test_planner_overrides(tmp_path, capsys):
    cfg = cli.planner_config(" min_gain_s=0.01, max_copies_per_tick=3,allow_pull=false")
    assert (cfg.min_gain_s, cfg.max_copies_per_tick, cfg.allow_pull) == (0.01, 3, False)
    assert cli.planner_config("") == cli.PlannerConfig()
    for bad, why in (("nope=1", "not KEY=VALUE"), ("min_gain_s", "not KEY=VALUE"),
                     ("max_copies_per_tick=1.5", "bad value"),
                     ("allow_pull=maybe", "bad value"), ("depth_fractions=1", "only numbers and booleans"),
                     ("horizon_s=nan", "not finite"), ("horizon_s=0", "horizon_s=0.0 must be > 0")):
        try:
            cli.planner_config(bad)
        except ValueError as e:
            assert why in str(e), (bad, str(e))
        else:
            raise AssertionError(f"{bad!r} accepted")
    # the overrides reach kvrep's planner and router: no planned copy clears a 1,000 s bar, and no pulls
    h200 = ("--rate", "20", "--profile", "llama3.1-8b-h200")
    default = {r["policy"]: r for r in sim(tmp_path, *h200)["results"]}
    assert default["kvrep"]["replication"]["count"] > 0
    off = sim(tmp_path, *h200, "--planner", "min_gain_s=1000,allow_pull=false")
    assert off["args"]["planner"] == "min_gain_s=1000,allow_pull=false"
    assert {r["policy"]: r for r in off["results"]}["kvrep"]["replication"]["count"] == 0
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    bad = parser.parse_args(["--generator", "agent", "--rate", "5", "--duration-s", "20", "--planner", "x=1",
                             "--no-progress"])
    assert cli.run(bad) == 2
    assert "--planner: 'x=1'" in capsys.readouterr().err


def test_endpoint_wait_reaches_the_engine_the_routers_and_the_planner(tmp_path):
    assert cli.planner_config("min_gain_s=0.5", endpoint_wait=True).endpoint_wait
    assert not cli.planner_config("min_gain_s=0.5").endpoint_wait
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--generator", "agent", "--rate", "5", "--duration-s", "20", "--endpoint-wait"])
    assert cli.engine_config(args, 20.0).endpoint_wait
    assert not cli.engine_config(parser.parse_args(["--generator", "agent"]), 20.0).endpoint_wait
    r = sim(tmp_path, "--endpoint-wait")
    assert r["args"]["endpoint_wait"] is True and [x["policy"] for x in r["results"]] == ["cache_aware", "kvrep"]


def test_seeds_report_mean_and_t_interval(tmp_path, capsys):
    from radix_sync.sim.seeds import mean_ci, t_quantile

    r = sim(tmp_path, "--seeds", "1,2,3")
    out = capsys.readouterr().out
    assert "3 seeds: mean +- 95% CI" in out and r["seeds"] == [1, 2, 3] and set(r["runs"]) == {"1", "2", "3"}
    m = r["summary"]["kvrep"]["ttft_p99_s"]
    vals = [next(x for x in r["runs"][s] if x["policy"] == "kvrep")["ttft_s"]["p99"] for s in ("1", "2", "3")]
    assert m["values"] == vals and m["mean"] == sum(vals) / 3
    # hand-computed: values 1, 2, 3: s = 1, half-width t(2) / sqrt(3) = 4.303 / 1.732
    assert mean_ci([1.0, 2.0, 3.0])["ci95"] == 4.303 / 3 ** 0.5 and t_quantile(2) == 4.303 and t_quantile(99) == 1.96
    assert mean_ci([5.0])["ci95"] == 0.0


def test_nic_bandwidth_override(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--generator", "agent", "--rate", "5", "--duration-s", "5", "--nic-gbytes-s", "6"])
    assert cli.cli_profile(args).nic_bandwidth_bytes_per_s == 6e9
    args.nic_gbytes_s = 0.0
    assert cli.run(args) == 2
    args.nic_gbytes_s, args.seeds = None, "1,1"
    assert cli.run(args) == 2
