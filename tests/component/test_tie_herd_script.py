"""`scripts/tie_herd.py` run small: real routers, a real coordinator and stub workers; the routers started with
`--tie-draws` (the default) draw every tie while the relay says four serve, those with `--no-tie-draws` none. No
spread is asserted (a few bursts): what must hold is that every request was served and both arms ran as named."""
import json
import subprocess
import sys

from kvrep_dev.cluster import ROOT


def test_the_tie_herd_script_runs_both_arms_through_four_routers(tmp_path):
    out = tmp_path / "herd.json"
    proc = subprocess.run([sys.executable, "scripts/tie_herd.py", "--bursts", "4", "--rounds", "1", "--gap-s", "0.05",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "pooled over 1 rounds" in proc.stdout
    [row] = json.loads(out.read_text())["rounds"]
    for name, drawn in (("drawn", True), ("shared", False)):
        arm = row[name]
        assert arm["draws"] is drawn and [len(b) for b in arm["served"]] == [4] * 4
        assert arm["modes"] == {"directory": arm["logged"]} and arm["logged"] >= 16  # (4 warm-up + 16 requests)
        # every burst request drawn (the warm-up's, sent before the relay counted four routers, may not be)
        assert arm["drawn"] >= 16 if drawn else arm["drawn"] == 0
        assert 0.0 <= arm["collisions"] <= 1.0
