"""`kvrep bench` / `kvrep demo` (the README's main job) end to end on real CPU workers, small and short: our two
arms and the smg 1.13 `cache_aware` baseline (PyPI `smg`, on its defaults) run on the same cluster, every request
answers, the coordinator's copies are accounted, ratios are against the baseline with bootstrap intervals, the
simulator columns, the JSON and the PNG are written, and nothing is left running."""
import json
import subprocess
import sys
import time

import pytest

from kvrep_dev import testbed
from kvrep_dev.cluster import ROOT
from tests.integration.test_up import alive, descendants

pytestmark = pytest.mark.server


def run_watched(argv: list[str], out_dir, timeout_s: float = 600) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Runs the command; returns its result and every process it started (its descendants, seen every 0.2 s)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "stdout", "w") as out, open(out_dir / "stderr", "w") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, text=True)
        seen: set[int] = set()
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the bench did not finish"
                seen |= descendants(proc.pid)
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
    result = subprocess.CompletedProcess(argv, proc.returncode, (out_dir / "stdout").read_text(),
                                         (out_dir / "stderr").read_text())
    return result, seen


def test_bench_shadow_active_and_smg_on_a_fanout(tmp_path):
    out_dir = tmp_path / "bench"
    argv = [sys.executable, "-m", "radix_sync.cli", "bench", "--model", "tiny", "--workers", "2",
            "--workloads", "fanout", "--arms", "shadow,active,smg-ca,shadow@2,smg-ca@2,shadow@1", "--duration-s", "5",
            "--fanout-rate", "2",
            "--fanout-k", "3", "--simulate", "--out-dir", str(out_dir)]
    proc, started = run_watched(argv, tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fanout   shadow" in proc.stdout and "fanout   active" in proc.stdout and "fanout   smg-ca" in proc.stdout
    assert f"simulator ({testbed.PROFILE} profile) vs live" in proc.stdout
    assert "within 20% of the measured value" in proc.stdout and "within 0.1 of the measured ratio" in proc.stdout
    res = json.loads((out_dir / "results.json").read_text())
    # every arm started on empty caches: each worker flushed once per arm (6 here)
    assert res["flushed"] is True
    for i in range(2):
        log = (out_dir / "logs" / f"worker-{i}.log").read_text()
        assert log.count("Cache flushed successfully") >= 6, log.count("Cache flushed successfully")
    # `shadow@1`, the A/A control: `shadow` again on a router of its own, simulated as `shadow`
    [aa] = [r for r in res["rows"] if r["arm"] == "shadow@1"]
    assert aa["live"]["errors"] == 0 and aa["sim"]["ttft_s"]["p99"] > 0 and "fronts" not in aa
    assert not (out_dir / "live-rows.json").exists()  # the cells' checkpoint, gone once the results are written
    fronts = {r["arm"]: r for r in res["rows"] if "@" in r["arm"] and r["arm"] != "shadow@1"}
    rows = {r["arm"]: r for r in res["rows"] if "@" not in r["arm"]}
    assert set(rows) == {"shadow", "active", "smg-ca"}
    # `ARM@N`: the same arm behind N front doors (ours: N routers on one directory; smg: N gateways), served in turn
    assert set(fronts) == {"shadow@2", "smg-ca@2"} and "fanout   shadow@2" in proc.stdout
    for r in fronts.values():
        assert r["fronts"] == 2 and r["live"]["errors"] == 0
        assert r["sim"]["ttft_s"]["p99"] > 0  # (simulated behind 2 simulated routers, `PolicyBundle.doors`)
        assert r["live"]["requests"] == rows[r["arm"].split("@")[0]]["live"]["requests"]
    assert (out_dir / "logs" / "router-shadow@2-1.log").exists()  # the second front door of ours ran
    # each of our cells was served by a router process of its own (as smg's are), no long-lived shared one
    assert res["args"]["router_per_cell"] is True
    for name in ("router-shadow-r0", "router-active-r0", "router-shadow-2-r0"):
        assert "listening on" in (out_dir / "logs" / f"{name}.log").read_text(), name
    assert not (out_dir / "logs" / "router-pull.log").exists()
    # what every process used of the CPU over each cell: the workers (their schedulers counted), the front door
    for r in rows.values():
        assert {"coordinator", "worker-0", "worker-1", "front_door", "client"} <= set(r["cpu_s"]), r["cpu_s"]
        assert r["cpu_s"]["worker-0"] + r["cpu_s"]["worker-1"] > 0 and r["cpu_s"]["front_door"] >= 0
    # P99 ratios are against the baseline users run today, measured in the same run
    assert rows["active"]["ratio_vs"] == "smg-ca" and rows["active"]["p99_ratio"] > 0
    assert rows["smg-ca"]["replication"]["count"] == 0 and "router_decisions" not in rows["smg-ca"]
    for r in rows.values():
        assert r["live"]["requests"] > 0 and r["live"]["errors"] == 0
        assert r["live"]["ttft_s"]["p99"] > 0 and r["sim"]["ttft_s"]["p99"] > 0
        # every request's own record is kept (which requests make the tail)
        assert len(r["requests"]) == r["live"]["requests"] and all(q["ttft_s"] > 0 for q in r["requests"])
    # our arms keep the coordinator's loop timing and each fan-out hint's timeline
    for arm in ("shadow", "active"):
        assert rows[arm]["coordinator_loop"]["ticks"] > 0 and rows[arm]["hints"]
        assert all("hint_s" in h for h in rows[arm]["hints"])
        assert set(rows[arm]["demotions"]) == {"sent", "shadow"} and min(rows[arm]["demotions"].values()) >= 0
    assert rows["shadow"]["demotions"]["sent"] == 0  # shadow sends nothing
    assert len(rows["active"]["worker_demotions"]) == 2 and all(
        v["demoted_evicted_tokens"] >= 0 for v in rows["active"]["worker_demotions"].values())
    # shadow decides and copies nothing; every copy the active arm made is accounted with its bytes
    assert rows["shadow"]["replication"]["count"] == 0
    assert all(x["state"] in ("done", "failed") for x in rows["active"]["replications"])
    assert rows["active"]["replication"]["bytes"] == sum(x["bytes"] for x in rows["active"]["replications"]
                                                         if x["state"] == "done")
    # the simulator ran on this machine's speed measured in the same run, on the very requests replayed
    assert res["speed"]["prefill"] > 0 and res["speed"]["decode"] > 0 and len(res["speed"]["samples"]) == 8
    for r in rows.values():
        assert r["sim_error"]["matched"] == r["live"]["requests"]
    # every cell's TTFT mean and P99 carry a bootstrap interval around them; the claim ratios too
    for r in rows.values():
        for k in ("mean", "p99"):
            c = r["ci"][k]
            assert 0 < c["lo"] <= c["hi"] and c["value"] == pytest.approx(r["live"]["ttft_s"][k], abs=1e-3)
    claims = {(c["num"], c["den"]): c for c in res["claims"]}
    assert set(claims) == {("active", "shadow"), ("active", "smg-ca"), ("shadow@1", "shadow")}
    for c in (claims[("active", "shadow")], claims[("active", "smg-ca")]):
        assert 0 < c["p99"]["lo"] <= c["p99"]["hi"] and c["rounds"] == 1
        assert c["p99"]["value"] == pytest.approx(rows[c["num"]]["p99_ratio"] / rows[c["den"]]["p99_ratio"], rel=0.02)
    assert "active/smg-ca" in proc.stdout
    assert (out_dir / "ttft_cdf.png").stat().st_size > 0
    # nothing it started outlives it (the machine is shared: other checkouts' processes are not counted)
    assert len(started) >= 5, started  # coordinator, two workers (and their schedulers), routers, smg
    deadline = time.monotonic() + 10  # a liveness bound for init to reap them
    while [p for p in started if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in started if alive(p)] == [], "the bench left processes behind"


def test_bench_with_sglangs_own_client_through_our_router_and_smg(tmp_path):
    """`--client sglang`: `python -m sglang.benchmark.serving` (multi-turn generated-shared-prefix over the chat API)
    through our router (no key) and smg (the workers' key, as OPENAI_API_KEY); its per-request TTFTs tabulated."""
    out_dir = tmp_path / "bench"
    argv = [sys.executable, "-m", "radix_sync.cli", "bench", "--model", "tiny", "--workers", "2", "--client", "sglang",
            "--arms", "active,smg-ca", "--sgl-groups", "2", "--sgl-conversations", "2", "--sgl-turns", "2",
            "--sgl-system-len", "512", "--sgl-rate", "4", "--no-simulate", "--out-dir", str(out_dir)]
    proc, started = run_watched(argv, tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sgl-gsp  active" in proc.stdout and "sgl-gsp  smg-ca" in proc.stdout
    res = json.loads((out_dir / "results.json").read_text())
    rows = {r["arm"]: r for r in res["rows"]}
    assert set(rows) == {"active", "smg-ca"}
    for r in rows.values():
        assert r["client"] == "sglang" and r["workload"] == "sgl-gsp"
        assert r["live"]["requests"] == 8 and r["live"]["errors"] == 0  # 2 groups x 2 conversations x 2 turns
        assert all(q["ttft_s"] > 0 and q["prompt_tokens"] > 512 for q in r["requests"])
        c = r["ci"]["p99"]
        assert 0 < c["lo"] <= c["hi"] and c["value"] == pytest.approx(r["live"]["ttft_s"]["p99"], abs=1e-3)
    assert rows["active"]["ratio_vs"] == "smg-ca" and rows["active"]["p99_ratio"] > 0
    assert {(c["num"], c["den"]) for c in res["claims"]} == {("active", "smg-ca")}
    deadline = time.monotonic() + 10  # a liveness bound for init to reap them
    while [p for p in started if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in started if alive(p)] == [], "the bench left processes behind"
