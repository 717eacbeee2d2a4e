"""`scripts/pool_claims.py`: several saved `kvrep bench` runs' rounds pooled into one set of claim ratios."""
import importlib.util
from pathlib import Path

import pytest

from kvrep_dev.bench import claim_ratios, load_results

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pool_claims", ROOT / "scripts" / "pool_claims.py")
pool_claims = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pool_claims)

RUN = ROOT / "bench" / "results" / "bench-draws58-s2.json.gz"


def test_a_run_pooled_with_itself_has_twice_the_rounds_and_the_same_mean_ratio():
    one = {(c["num"], c["den"]): c for c in claim_ratios(load_results(RUN)["rows"])}
    rows = pool_claims.pooled_rows([str(RUN), str(RUN)])
    assert sorted({r["repeat"] for r in rows}) == [0, 1, 2, 3, 4, 5]
    two = {(c["num"], c["den"]): c for c in claim_ratios(rows)}
    key = ("shadow@4", "shadow-nodraw@4")
    assert two[key]["rounds"] == 6 and one[key]["rounds"] == 3
    assert two[key]["requests"] == [2 * n for n in one[key]["requests"]]
    assert two[key]["mean"]["value"] == pytest.approx(one[key]["mean"]["value"])


def test_runs_of_different_fleets_are_not_pooled():
    with pytest.raises(SystemExit, match="worker counts"):
        pool_claims.pooled_rows([str(RUN), str(ROOT / "bench" / "results" / "bench-val1.json.gz")])
