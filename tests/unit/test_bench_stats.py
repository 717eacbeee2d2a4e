"""Bootstrap intervals of the live tables (`kvrep_dev.stats`) and the claim ratios `kvrep bench` prints."""
import math
import random

import numpy as np
import pytest

from kvrep_dev import stats
from kvrep_dev.bench import _add_cis, _ratios, claim_ratios, format_claims, format_summary, format_table, \
    summarize_rounds
from kvrep_dev.loadgen import _pct


def test_a_constant_sample_has_a_zero_width_interval():
    for k in ("mean", "p99"):
        c = stats.ci([2.5] * 40, k)
        assert c == {"value": 2.5, "lo": 2.5, "hi": 2.5, "n": 40}
    r = stats.ratio_ci([[1.0] * 10, [1.0] * 5], [[4.0] * 7], "p99")
    assert r == {"value": 0.25, "lo": 0.25, "hi": 0.25}


def test_the_interval_holds_the_true_value_of_a_known_distribution():
    rng = random.Random(1)
    xs = [rng.expovariate(1.0) for _ in range(3000)]  # mean 1, P99 ln(100) = 4.605
    mean, p99 = stats.ci(xs, "mean"), stats.ci(xs, "p99")
    assert mean["lo"] < 1.0 < mean["hi"] and mean["hi"] - mean["lo"] < 0.15
    assert p99["lo"] < math.log(100) < p99["hi"]
    assert mean["lo"] <= mean["value"] <= mean["hi"] and p99["lo"] <= p99["value"] <= p99["hi"]
    ys = [2 * rng.expovariate(1.0) for _ in range(3000)]  # twice as slow
    r = stats.ratio_ci(xs, ys, "mean")
    assert r["lo"] < 0.5 < r["hi"] and r["value"] == pytest.approx(np.mean(xs) / np.mean(ys))


def test_the_interval_is_fixed_by_the_seed_and_narrows_with_more_requests():
    rng = random.Random(2)
    xs = [rng.lognormvariate(0, 1) for _ in range(200)]
    assert stats.ci(xs, "p99") == stats.ci(xs, "p99")  # same data, same interval
    assert stats.ci(xs, "p99", seed=1) != stats.ci(xs, "p99", seed=2)
    wide = stats.ci(xs[:50], "mean")
    narrow = stats.ci(xs * 8, "mean")
    assert narrow["hi"] - narrow["lo"] < wide["hi"] - wide["lo"]


def test_rounds_are_resampled_separately_and_pooled():
    """Two rounds of different level: every resample keeps both, so the pooled mean never leaves the values a
    stratified resample can reach; an unstratified one would reach the rounds' extremes."""
    c = stats.ci([[1.0] * 20, [3.0] * 20], "mean")
    assert c["value"] == 2.0 and c["lo"] == c["hi"] == 2.0 and c["n"] == 40
    assert stats.point([[1.0, None], [float("nan"), 3.0]], "mean") == 2.0  # failed requests dropped


def test_p99_is_the_tables_percentile():
    xs = [random.Random(3).random() for _ in range(157)]
    assert stats.point(xs, "p99") == pytest.approx(_pct(xs, 0.99))


def row(wl, arm, rnd, ttfts, copies=0):
    xs = sorted(ttfts)
    t = {"mean": sum(xs) / len(xs), "p50": _pct(xs, 0.5), "p95": _pct(xs, 0.95), "p99": _pct(xs, 0.99)}
    return {"workload": wl, "arm": arm, "repeat": rnd, "wall_s": 1.0,
            "live": {"requests": len(xs), "errors": 0, "ttft_s": t, "tpot_s": {"mean": 0.01}, "throughput_rps": 1.0,
                     "cached_token_ratio": 0.5},
            "replication": {"count": copies, "bytes": 0, "useful_bytes_frac": None},
            "requests": [{"ttft_s": x, "error": None} for x in ttfts]}


def test_claim_ratios_pool_the_rounds_and_pair_within_a_round():
    rows = []
    for rnd, scale in enumerate((1.0, 2.0, 1.5)):
        rows += [row("fanout", "shadow", rnd, [scale * 2.0] * 30), row("fanout", "pull", rnd, [scale * 4.0] * 30),
                 row("fanout", "active", rnd, [scale * 1.0] * 30), row("fanout", "smg-ca", rnd, [scale * 3.0] * 30)]
    _ratios(rows)
    _add_cis(rows)
    claims = {(c["num"], c["den"]): c for c in claim_ratios(rows)}
    # the ablation's step (pull / shadow) is there as its two arms ran; demote's are not (that arm did not run)
    assert set(claims) == {("active", "shadow"), ("active", "pull"), ("active", "smg-ca"), ("pull", "shadow")}
    assert claims[("pull", "shadow")]["mean"]["value"] == pytest.approx(2.0)
    a_s = claims[("active", "shadow")]
    assert a_s["rounds"] == 3 and a_s["requests"] == [90, 90]
    assert a_s["mean"]["value"] == pytest.approx(0.5) and a_s["mean"]["median"] == pytest.approx(0.5)
    # constant within each round: the stratified interval is the point
    assert a_s["p99"]["lo"] == pytest.approx(0.5) and a_s["p99"]["hi"] == pytest.approx(0.5)
    assert claims[("active", "smg-ca")]["p99"]["value"] == pytest.approx(1 / 3)
    assert claims[("active", "pull")]["mean"]["min"] == pytest.approx(0.25)
    text = format_claims(claim_ratios(rows))
    assert "active/smg-ca" in text and "0.33x [0.33-0.33]" in text
    # every arm of the per-round table and of the summary carries its intervals
    assert all(r["ci"]["p99"]["lo"] == r["ci"]["p99"]["hi"] for r in rows)
    assert "[2.00-2.00]" in format_table(rows)
    summary = {x["arm"]: x for x in summarize_rounds(rows)}
    assert summary["active"]["mean_ci"]["value"] == pytest.approx(1.5) and summary["active"]["vs"] == "smg-ca"
    assert "[1.50-1.50]" in format_summary(list(summary.values()))


def test_no_claim_without_both_arms():
    rng = random.Random(4)
    rows = [row("agent", "active", 0, [rng.random() for _ in range(20)]),
            row("agent", "smg-rr", 0, [rng.random() for _ in range(20)])]
    assert claim_ratios(rows) == []
