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
