"""`scripts/bench_plan_tick.py` run small (8 workers, 2,000 prefixes): with `--pause-s` the ticks are spaced and the
summary says so, with `--settle` each tick is followed by the coordinator's collector settle (timed apart), and the
decisions are the same every tick (equal digests: the pause and the settle change nothing the planner decides).
No time is asserted."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_plan_tick_pauses_settles_and_decides_alike():
    argv = [sys.executable, str(ROOT / "scripts" / "bench_plan_tick.py"), "--workers", "8", "--prefixes", "2000",
            "--hot", "50", "--ticks", "3", "--pause-s", "0.01", "--settle"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ticks = [line for line in proc.stdout.splitlines() if line.startswith("tick ")]
    assert len(ticks) == 3 and all(re.search(r", settle [0-9.]+ ms \(", t) for t in ticks), ticks
    assert len({re.search(r"digest (\w+)", t).group(1) for t in ticks}) == 1, ticks
    assert "(0.01 s between ticks; 8 workers, 2,000 prefixes, 50 candidates)" in proc.stdout
