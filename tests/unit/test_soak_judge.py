"""scripts/soak.py's memory judgement (the soak itself is not in CI): warm-up per process, flatness, slope."""
import importlib.util
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def load():
    spec = importlib.util.spec_from_file_location("soak_script", SOAK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_restarted_process_warms_up_from_its_own_start():
    soak = load()
    mb = 2**20
    # restarted at 1,000 s: its first sample (30 s later) is low, the rest flat
    rss = {"coordinator#2": [(1030.0, 50 * mb)] + [(1000.0 + 60 * k, 84 * mb) for k in range(2, 12)]}
    judged = soak.judge_memory(rss, {"coordinator#2": 1000.0}, 60.0, 0.10)["coordinator#2"]
    assert judged["flat"] is True and judged["num_samples"] == 10 and judged["slope_mb_per_min"] == 0.0
    # with the warm-up counted from the run's start, the warming sample is judged and the series is not flat
    assert soak.judge_memory(rss, {}, 60.0, 0.10)["coordinator#2"]["flat"] is False


def test_growth_beyond_the_tolerance_is_not_flat_and_its_slope_is_reported():
    soak = load()
    mb = 2**20
    rss = {"router": [(60.0 * k, (100 + 10 * k) * mb) for k in range(1, 13)]}  # +10 MB a minute
    judged = soak.judge_memory(rss, {}, 60.0, 0.10)["router"]
    assert judged["flat"] is False
    assert abs(judged["slope_mb_per_min"] - 10.0) < 1e-9
