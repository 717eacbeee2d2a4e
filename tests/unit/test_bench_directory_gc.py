"""`scripts/bench_directory_gc.py` on a small mirror: it runs, and what it reports of the mirror's structure holds
(the collector tracks next to nothing per page); never its timings."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_mirror_adds_next_to_no_tracked_objects():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_directory_gc.py"), "--only", "mirror",
                           "--mirror-pages", "20000"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.splitlines()[-1]
    assert line.startswith("router mirror: 20,000 pages"), line
    tracked = int(re.search(r"; ([\d,]+) more objects tracked", line).group(1).replace(",", ""))
    assert tracked < 200, line  # one set per page before (20,000)


def test_a_page_tree_adds_next_to_no_tracked_objects():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_directory_gc.py"), "--only", "tree"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.splitlines()[-1]
    assert line.startswith("page tree: 204,800 pages"), line
    tracked = int(re.search(r"; ([\d,]+) more objects tracked", line).group(1).replace(",", ""))
    assert tracked < 2000, line  # one per page before (204,800)
