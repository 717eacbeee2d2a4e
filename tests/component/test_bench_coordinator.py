"""`scripts/bench_coordinator.py` at a small size: synthetic workers over real sockets to a real coordinator
process. Its numbers are not checked here (timing is never a pass/fail test); that it measures what it says is:
every page reported is in the directory, nothing is refused or answered unexpectedly, the planner ran its ticks
on the hot prefixes, the integrity check passed, and every phase had lookups answered."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_records_every_page_and_plans_on_its_hot_prefixes(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_coordinator.py"), "--workers", "6",
                           "--prefixes", "600", "--hot", "40", "--cold-hits", "100", "--ticks", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    wl = r["workload"]
    assert r["num_pages_recorded"] == r["num_distinct_pages_expected"] == 600 * wl["pages_per_prefix"]
    assert r["num_holdings_expected"] == 600 * wl["pages_per_prefix"] * wl["holders"]
    assert r["num_refused"] == {} and r["num_unexpected_replies"] == 0 and r["num_tick_errors"] == 0
    assert r["num_barriers_refused"] == wl["num_workers"] * 2  # one barrier a worker after each phase
    assert r["num_ticks_measured"] >= 2 and r["planner"]["candidates"] == 40
    # the loop thread's CPU in a tick is part of the tick's wall time (`time.thread_time` inside `time.monotonic`)
    assert 0 < r["tick_cpu_ms"] <= r["tick_ms"] * 1.05 + 0.1
    assert r["lookup_errors"] == 0 and {"ingest", "tick"} <= set(r["lookup_ms"])
    assert "plan tick:" in proc.stdout.splitlines()[-1] and "ingest:" in proc.stdout.splitlines()[-2]
