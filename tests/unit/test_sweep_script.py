"""`scripts/sweep.py`: the "never worse" rule on hand-computed cells, the sweeps' cells, and the quick mode's files."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sweep.py"


def load():
    spec = importlib.util.spec_from_file_location("sweep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sweep"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def m(mean, ci):
    return {"ttft_p99_s": {"mean": mean, "ci95": ci}}


def test_never_worse_against_the_better_of_pull_and_pull_demote_within_the_ci():
    sw = load()
    # reference = kvrep_pull_demote (1.0 +- 0.01); bound 1.02 x (1.0 + 0.01) = 1.0302
    res = {"kvrep_pull": m(1.2, 0.0), "kvrep_pull_demote": m(1.0, 0.01), "kvrep": m(1.02, 0.5)}
    assert sw.never_worse(res, "ttft_p99_s") == "1.02x met"
    res["kvrep"] = m(1.05, 0.02)
    assert sw.never_worse(res, "ttft_p99_s") == "1.05x within CI"  # 1.05 - 0.02 = 1.03 <= 1.0302
    res["kvrep"] = m(1.05, 0.01)
    assert sw.never_worse(res, "ttft_p99_s") == "1.05x NOT met"  # 1.04 > 1.0302
    assert sw.never_worse({"kvrep": m(1.0, 0.0)}, "ttft_p99_s") == "n/a"


def test_cells_of_each_sweep():
    sw = load()
    args = sw.parse_args(["--workers", "16", "--rate", "40"])
    assert [c.nic_gbytes_s for c in sw.cells("link", args)] == [3, 6, 12, 24, 50]
    assert [(c.workers, c.rate) for c in sw.cells("size", args)] == [(4, 10.0), (8, 20.0), (16, 40.0), (64, 160.0)]
    assert [c.view_staleness_s for c in sw.cells("staleness", args)] == [0.0, 0.2]
    assert [c.cost_factor for c in sw.cells("cost-error", args)] == [0.7, 1.0, 1.3]
    with pytest.raises(ValueError, match="unknown sweep"):
        sw.cells("nope", args)


def test_quick_mode_writes_table_json_and_png(tmp_path):
    sw = load()
    assert sw.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "fanout-link.md").read_text()
    assert "| 6 GB/s |" in md and "| 24 GB/s |" in md and "never worse" in md
    data = json.loads((tmp_path / "fanout-link.json").read_text())
    assert [c["cell"]["nic_gbytes_s"] for c in data["cells"]] == [6.0, 24.0]
    assert set(data["cells"][0]["results"]) == {"pull", "kvrep_pull", "kvrep"}
    assert data["cells"][0]["results"]["kvrep"]["ttft_mean_s"]["values"].__len__() == 2
    assert (tmp_path / "fanout-link.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
