"""The testbed's prefill costs fitted on a bench run's own lone requests (`kvrep_dev.calibration`), and the
simulator running its engine on them while its policies price with the live profile (`kvrep_dev.bench`)."""
import copy
import json
from dataclasses import replace

import pytest

from kvrep_dev import calibration
from kvrep_dev.bench import machine_profile, measure_machine, simulate
from radix_sync.policy.cost import load_profile


def req(rid, sent, ttft, prompt=1000, cached=0, error=None):
    return {"rid": rid, "sent_s": sent, "ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
            "error": error}


def test_isolated_requests_keeps_only_requests_that_ran_alone():
    rows = [{"requests": [
        req(0, 0.0, 1.0),                    # alone: the next is sent at 5.0
        req(1, 5.0, 1.0),                    # overlaps the next (sent at 5.5, before 1's first token)
        req(2, 5.5, 1.0, 900, 800),          # sent while 1 was in flight
        req(3, 10.0, 0.5, 1200, 1024),       # alone (2 answered at 6.5, plus the margin, well before)
        req(4, 10.7, 0.3),                   # 3's first token at 10.5: within the decode margin
        req(5, 20.0, None, error="boom"),    # failed: no sample, and no neighbour to anyone
        req(6, 30.0, 0.2, 64, 0),            # alone
    ]}, {"requests": [req(0, 0.0, 2.0, 3000, 0)]}]  # another cell: its own timeline
    got = calibration.isolated_requests(rows)
    assert got == [(1000, 0, 1.0), (176, 1024, 0.5), (64, 0, 0.2), (3000, 0, 2.0)]


def synthetic(profile, shapes, factor=1.0):
    return [(n, c, factor * profile.prefill_s(n, c)) for n, c in shapes]


SHAPES = [(n, c) for n in (16, 64, 256, 700, 1500, 3000) for c in (0, 300, 1100, 2500)]


def test_fit_prefill_recovers_the_terms_that_made_the_samples():
    truth = load_profile("cpu-wide")
    f = calibration.fit_prefill(synthetic(truth, SHAPES))
    fitted = replace(truth, **f["values"])
    assert f["rms"] < 1e-3 and f["samples"] == len(SHAPES)
    for n, c in [(32, 2048), (2000, 0), (500, 1000)]:
        assert fitted.prefill_s(n, c) == pytest.approx(truth.prefill_s(n, c), rel=1e-3)


def test_balanced_fit_is_not_decided_by_one_crowded_cell():
    """A thousand short extensions measured 40% slow (one crowded cell, a flash crowd) against a few samples of
    every other shape: balanced, the other shapes keep their costs; unbalanced, the crowd pulls every term."""
    truth = load_profile("cpu-wide")
    crowd = synthetic(truth, [(24, 2048)] * 1000, factor=1.4)
    samples = crowd + synthetic(truth, SHAPES)
    err = {}
    for balance in (True, False):
        fitted = replace(truth, **calibration.fit_prefill(samples, balance=balance)["values"])
        err[balance] = max(abs(r) for r in calibration.residuals(fitted, synthetic(truth, SHAPES)))
    assert err[True] < 0.5 * err[False]


def test_prefill_part_takes_off_the_first_token_lag():
    p = load_profile("cpu-wide")
    lag = calibration.first_token_lag_s(p, 100, 2000)
    assert lag == pytest.approx(p.decode_steps_s(1, 1, 2100)) and lag > 0
    assert calibration.prefill_part([(100, 2000, 0.5), (10, 0, 0.0)], p) == [(100, 2000, 0.5 - lag), (10, 0, 1e-3)]
    # workers without the overlap scheduler (the testbed since stop 53) stream the first token after the prefill
    assert calibration.prefill_part([(100, 2000, 0.5)], p, overlap=False) == [(100, 2000, 0.5)]


def test_drift_is_the_machine_speed_against_the_profile():
    p = load_profile("cpu-wide")
    assert calibration.drift(p, synthetic(p, SHAPES, factor=1.3)) == pytest.approx(1.3)
    # every cell weighs the same: a crowd of slow samples in one cell does not move it
    skew = synthetic(p, SHAPES, factor=0.9) + synthetic(p, [(24, 2048)] * 500, factor=2.0)
    assert calibration.drift(p, skew) == pytest.approx(0.9)
    assert calibration.drift(p, []) == 1.0
    with pytest.raises(ValueError):
        calibration.fit_prefill(synthetic(p, SHAPES[:3]))


def test_machine_profile_takes_the_prefill_terms_and_keeps_the_rest():
    priced = replace(load_profile("cpu-wide"), kv_capacity_tokens=32768, max_running_requests=8)
    m = load_profile("cpu-wide-bench")
    got = machine_profile(priced, {"profile": "cpu-wide-bench", "drift": 1.25, "decode": 0.5})
    assert got.prefill_s(700, 1500) == pytest.approx(1.25 * m.prefill_s(700, 1500))
    assert got.decode_steps_s(5, 2, 4000) == pytest.approx(0.5 * priced.decode_steps_s(5, 2, 4000))
    assert (got.kv_capacity_tokens, got.max_running_requests) == (32768, 8)
    assert got.transfer_s(1e6) == priced.transfer_s(1e6)


def test_measure_machine_needs_enough_lone_requests():
    m = load_profile("cpu-wide-bench")
    # a lone request's TTFT: its prefill, 1.2x the profile's, then the first-token lag at this run's decode speed
    ttft = 1.2 * m.prefill_s(1000, 0) + 1.1 * calibration.first_token_lag_s(m, 1000, 0)
    lone = [req(i, 10.0 * i, ttft) for i in range(calibration.MIN_SAMPLES)]
    got = measure_machine([{"requests": lone}], {"prefill": 3.0, "decode": 1.1})
    assert got["drift"] == pytest.approx(1.2, rel=1e-3) and got["decode"] == 1.1
    assert got["isolated_requests"] == calibration.MIN_SAMPLES
    assert measure_machine([{"requests": lone[:-1]}], None) is None
    # the same TTFTs from workers without the overlap scheduler: no lag in them, all of it is prefill
    plain = measure_machine([{"requests": lone}], {"prefill": 3.0, "decode": 1.1}, overlap=False)
    assert plain["drift"] == pytest.approx(ttft / m.prefill_s(1000, 0), rel=1e-3) and plain["drift"] > 1.2


def test_simulated_policies_price_with_the_live_profile_and_the_engine_runs_on_the_machine(monkeypatch):
    """The live router and planner price with --profile (unscaled); the simulated ones must too, while the engine
    (the machine) runs on the measured costs."""
    import radix_sync.sim.engine as engine_mod
    import radix_sync.sim.policies as policies_mod
    from kvrep_dev.bench import build_workload
    from tests.unit.test_bench_simulate import bench_args

    seen = {}
    real_build, real_engine = policies_mod.build_policy, engine_mod.Engine

    def build(name, profile, *a, **k):
        seen["priced"] = profile
        return real_build(name, profile, *a, **k)

    def engine(profile, *a, **k):
        seen["engine"] = profile
        return real_engine(profile, *a, **k)

    monkeypatch.setattr(policies_mod, "build_policy", build)
    monkeypatch.setattr(engine_mod, "Engine", engine)
    wl = build_workload("shared", bench_args("--duration-s", "5"))
    machine = {"profile": "cpu-wide-bench", "drift": 1.1, "decode": 1.2}
    simulate(copy.deepcopy(wl), "active", 2, 0, "cpu-wide", 32768, 8, {"prefill": 3.0, "decode": 3.0},
             machine=machine)
    live = load_profile("cpu-wide")
    assert seen["priced"].prefill_s(900, 1000) == pytest.approx(live.prefill_s(900, 1000))
    assert seen["priced"].kv_capacity_tokens == 32768
    assert seen["engine"].prefill_s(900, 1000) == pytest.approx(
        1.1 * load_profile("cpu-wide-bench").prefill_s(900, 1000))
    # without a measured machine: the engine is the priced profile scaled by the probe, the policies still unscaled
    simulate(copy.deepcopy(wl), "active", 2, 0, "cpu-wide", 32768, 8, {"prefill": 3.0, "decode": 3.0})
    assert seen["engine"].prefill_s(900, 1000) == pytest.approx(3.0 * live.prefill_s(900, 1000))
    assert seen["priced"].prefill_s(900, 1000) == pytest.approx(live.prefill_s(900, 1000))


def test_committed_machine_profile_is_what_its_samples_fit():
    """cpu-wide-bench's prefill terms are the balanced fit of the TTFTs it records less the first-token lag
    (`--from-bench` wrote both)."""
    from pathlib import Path

    import radix_sync

    doc = json.loads((Path(radix_sync.__file__).parent / "profiles" / "cpu-wide-bench.json").read_text())
    samples = [tuple(s) for s in doc["measurements"]["prefill"]]
    f = calibration.fit_prefill(calibration.prefill_part(samples, load_profile("cpu-wide-bench")), balance=True)
    for k, v in f["values"].items():
        assert doc["values"][k] == pytest.approx(v, rel=1e-4)


def test_lone_decodes_give_the_decode_speed():
    """Requests that decoded alone (nothing else of the cell in flight from send to end) measure the decode step;
    runs that did not record each request's end give none."""
    p = load_profile("cpu-wide")

    def r(rid, sent, ctx, factor, n=8):
        ttft = 0.3
        return {**req(rid, sent, ttft, ctx, 0), "e2e_s": ttft + factor * (n - 1) * p.decode_steps_s(1, 1, ctx),
                "output_tokens": n}

    rows = [{"requests": [r(0, 0.0, 1000, 1.5), r(1, 10.0, 2000, 1.5), r(2, 10.2, 500, 9.0),  # 1 and 2 overlap
                          r(3, 30.0, 3000, 1.5), r(4, 40.0, 800, 1.5, n=1)]}]                 # 4: one token only
    steps = calibration.lone_decode_steps(rows)
    assert [ctx for ctx, _ in steps] == [1000, 3000]
    assert calibration.decode_drift(p, steps) == pytest.approx(1.5)
    assert calibration.lone_decode_steps([{"requests": [req(0, 0.0, 0.3)]}]) == []  # no e2e_s recorded
    assert calibration.decode_drift(p, []) == 1.0
    # measure_machine takes them over the probe when there are enough
    lone = [r(i, 20.0 * i, 1000, 1.3) for i in range(calibration.MIN_SAMPLES)]
    got = measure_machine([{"requests": lone}], {"prefill": 1.0, "decode": 3.0})
    assert got["decode"] == pytest.approx(1.3) and got["decode_from"] == f"{calibration.MIN_SAMPLES} lone decodes"
    got = measure_machine([{"requests": [{k: v for k, v in q.items() if k != "e2e_s"} for q in lone]}],
                          {"prefill": 1.0, "decode": 3.0})
    assert got["decode"] == 3.0 and got["decode_from"] == "the probe"


def test_refit_refuses_a_profile_fitted_from_bench_runs(tmp_path):
    """`calibrate_cpu.py --refit` fits the calibration grid's way; a `--from-bench` profile was fitted otherwise
    (less the first-token lag, cells weighing the same), so refitting it that way would silently change it."""
    import importlib.util
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("calibrate_cpu", root / "scripts" / "calibrate_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "p.json"
    shutil.copy(root / "radix_sync" / "profiles" / "cpu-wide-bench.json", path)
    before = path.read_text()
    assert mod.refit(str(path)) == 2 and path.read_text() == before


def test_sim_load_gap_shapes_reads_the_committed_runs():
    """`scripts/sim_load_gap.py shapes` (docs/bench.md's per-shape errors of `cpu-wide`) runs on the committed runs."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    runs = [str(root / "bench" / "results" / f"bench-{r}-split.json.gz") for r in ("agent", "fanflash", "unique")]
    out = subprocess.run([sys.executable, str(root / "scripts" / "sim_load_gap.py"), "shapes", *runs],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("1764 lone requests") and "new 1500-4096 cold" in out
