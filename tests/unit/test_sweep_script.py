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


def load_summary():
    path = SCRIPT.parent / "sweep_summary.py"
    spec = importlib.util.spec_from_file_location("sweep_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cell(p50, p99, mean=0.5, floor=None):
    out = {"ttft_mean_s": {"mean": mean, "ci95": 0.0}, "ttft_p50_s": {"mean": p50, "ci95": 0.0},
           "ttft_p99_s": {"mean": p99, "ci95": 0.0}, "copies": {"mean": 3.0, "ci95": 0.0}}
    if floor is not None:
        out["ttft_floor_p99_s"] = {"mean": floor, "ci95": 0.0}
    return out


def test_summary_verdicts_pays_inert_not_asked_and_unreachable():
    su = load_summary()
    # best baseline: cache_aware (P99 4.0, P50 1.0: 4x, the load condition holds); kvrep_pull P99 2.0
    res = {"pull": cell(1.0, 5.0), "cache_aware": cell(1.0, 4.0), "kvrep_pull": cell(0.5, 2.0),
           "kvrep": cell(0.2, 1.4, floor=0.5)}
    assert su.verdict("targets-flash-crowd-load", res, "cache_aware", 23.75) == "pays: met"  # 1.4 <= 1.4, <= 2.0
    res["kvrep"] = cell(0.2, 1.5, floor=0.5)
    assert su.verdict("fanout-load", res, "cache_aware", 23.75) == "pays: NOT met"
    res["kvrep"] = cell(0.2, 1.9, floor=1.6)  # floor 1.6 > 0.7 x 2.0: no policy's copies could meet it
    assert su.verdict("fanout-load", res, "cache_aware", 23.75) == (
        "pays: NOT met, unreachable (floor 0.80x `kvrep_pull`, 0.40x best)")
    assert su.verdict("fanout-link", res, "cache_aware", 6.0) == "pays: not asked (link < 12 GB/s)"
    res["cache_aware"] = cell(2.0, 4.0)
    assert su.verdict("fanout-load", res, "cache_aware", 23.75) == "pays: not asked (best P99 < 3x P50)"
    # inert: within +2% of the best baseline on mean and P99
    res = {"pull": cell(1.0, 2.0, mean=1.0), "kvrep_pull": cell(1.0, 2.0), "kvrep": cell(1.0, 2.04, mean=1.02)}
    assert su.verdict("targets-mooncake-staleness", res, "pull", 23.75) == "inert: met"
    res["kvrep"] = cell(1.0, 2.05, mean=1.0)
    assert su.verdict("targets-no-sharing-load", res, "pull", 23.75) == "inert: NOT met"
    assert su.verdict("agent-load", res, "pull", 23.75) == "never worse only"


def test_summary_rows_from_a_sweeps_json(tmp_path):
    su = load_summary()
    res = {"pull": cell(1.0, 5.0), "cache_aware": cell(1.0, 4.0), "kvrep_pull": cell(0.5, 2.0),
           "kvrep_pull_demote": cell(0.5, 2.0), "kvrep": cell(0.2, 1.4, floor=0.5)}
    path = tmp_path / "fanout-load.json"
    path.write_text(json.dumps({"command": "x", "sweep": "load", "seeds": [1], "cells": [
        {"cell": {"label": "rate 40", "nic_gbytes_s": None}, "results": res}]}))
    [row] = su.rows(str(path))
    assert row.startswith("| fanout-load rate 40 | `cache_aware` 0.500 / 4.000 (4.0x) | - | 0.500 / 2.000 |")
    assert "| 0.500 | 1.00x met / 0.70x met | 0.70x / 0.35x | 40% | pays: met | 3 |" in row  # (2.0-1.4)/(2.0-0.5)
    assert su.closed({"kvrep_pull": cell(0.5, 1.0), "kvrep": cell(0.5, 1.0, floor=0.99)}) == "-"
    assert su.closed({"kvrep_pull": cell(0.5, 2.0), "kvrep": cell(0.5, 2.5, floor=1.0)}) == "-50%"
