"""Bootstrap intervals of the live tables (`kvrep_dev.stats`) and the claim ratios `kvrep bench` prints."""
import math
import random

import numpy as np
import pytest

from kvrep_dev import stats
from kvrep_dev.bench import _add_cis, _paired, _ratios, claim_ratios, format_claims, format_summary, format_table, \
    ratio_interval, summarize_rounds
from kvrep_dev.loadgen import _pct


def test_a_constant_sample_has_a_zero_width_interval():
    for k in ("mean", "p99"):
        c = stats.ci([2.5] * 40, k)
        assert c == {"value": 2.5, "lo": 2.5, "hi": 2.5, "n": 40}
    r = stats.rounds_ratio_ci([[1.0] * 10, [1.0] * 5], [[4.0] * 7, [4.0] * 3], "p99", paired=False)
    assert r == {"value": 0.25, "lo": 0.25, "hi": 0.25, "n": 15}


def test_the_interval_holds_the_true_value_of_a_known_distribution():
    rng = random.Random(1)
    xs = [rng.expovariate(1.0) for _ in range(3000)]  # mean 1, P99 ln(100) = 4.605
    mean, p99 = stats.ci(xs, "mean"), stats.ci(xs, "p99")
    assert mean["lo"] < 1.0 < mean["hi"] and mean["hi"] - mean["lo"] < 0.15
    assert p99["lo"] < math.log(100) < p99["hi"]
    assert mean["lo"] <= mean["value"] <= mean["hi"] and p99["lo"] <= p99["value"] <= p99["hi"]
    ys = [2 * rng.expovariate(1.0) for _ in range(3000)]  # twice as slow
    r = stats.rounds_ratio_ci([xs], [ys], "mean", paired=False)
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


def keyed_row(wl, arm, rnd, reqs):
    """A row whose requests carry keys: `reqs` = (key, sent_s, ttft_s)."""
    r = row(wl, arm, rnd, [t for _, _, t in reqs])
    r["requests"] = [{"key": k, "sent_s": s, "ttft_s": t, "error": None} for k, s, t in reqs]
    return r


def test_paired_intervals_leave_out_what_differs_between_requests():
    """The same requests in both arms, each 5% faster in the numerator's, their TTFTs spread over two orders of
    magnitude: drawing both arms' values of the same requests gives the 0.95 exactly; drawing each arm's requests
    alone gives an interval as wide as the spread between requests."""
    rng = random.Random(5)
    den = [[rng.lognormvariate(0, 1.2) for _ in range(150)] for _ in range(3)]
    num = [[0.95 * x for x in g] for g in den]
    for k in ("mean", "p99"):
        p = stats.rounds_ratio_ci(num, den, k, paired=True)
        assert p["value"] == pytest.approx(0.95) and p["lo"] == pytest.approx(0.95) and p["hi"] == pytest.approx(0.95)
        assert p["n"] == 450
        u = stats.rounds_ratio_ci(num, den, k, paired=False)
        assert u["lo"] < 0.9 and u["hi"] > 1.0 and u["value"] == pytest.approx(0.95)
    # noise of its own in each arm: the paired interval holds the true ratio and is narrower than the unpaired one
    noisy = [[x * rng.uniform(0.85, 1.05) for x in g] for g in den]  # mean factor 0.95
    p = stats.rounds_ratio_ci(noisy, den, "mean", paired=True)
    u = stats.rounds_ratio_ci(noisy, den, "mean", paired=False)
    assert p["lo"] < 0.95 < p["hi"] and p["hi"] - p["lo"] < (u["hi"] - u["lo"]) / 3
    assert math.isnan(stats.rounds_ratio_ci([[]], [[]], "mean", paired=True)["value"])


def test_rounds_are_samples_too_an_arm_slower_in_one_round_is_not_a_sure_difference():
    """Two arms equal in two rounds and 1.5x apart in the third (the machine slower while one arm ran): an
    interval over the requests within rounds would exclude 1.0; drawing the rounds too it does not."""
    rng = random.Random(7)
    den = [[rng.lognormvariate(0, 1.0) for _ in range(150)] for _ in range(3)]
    num = [list(den[0]), list(den[1]), [1.5 * x for x in den[2]]]
    c = stats.rounds_ratio_ci(num, den, "mean", paired=True)
    assert c["value"] > 1.1 and c["lo"] <= 1.0 + 1e-9 < c["hi"]


def test_an_a_a_run_of_two_identical_arms_is_not_called_a_difference():
    """Stop 44's A/A run (`shadow` and `shadow@1`, the same arm twice, 4 rounds of agent sessions): its claim
    interval covers 1.0 (the rounds differ by 0.80-1.58x: the arms of a round run one after the other)."""
    import gzip
    import json
    from pathlib import Path

    data = json.loads(gzip.decompress((Path(__file__).parents[2] / "bench/results/bench-agent-aa-s4.json.gz")
                                      .read_bytes()))
    cells = {(r["arm"], r["repeat"]): r for r in data["rows"]}
    a = [cells[("shadow@1", k)] for k in range(4)]
    b = [cells[("shadow", k)] for k in range(4)]
    for k in ("mean", "p99"):
        c = ratio_interval(a, b, k)
        assert c["paired"] > 600 and c["lo"] < 1.0 < c["hi"]


def test_requests_pair_by_key_in_send_order_and_only_when_nearly_all_match():
    a = keyed_row("agent", "active", 0, [("s1", 0.0, 1.0), ("s2", 1.0, 2.0), ("s1", 2.0, 3.0)])
    # the other arm issued the same requests at other times and in another order
    b = keyed_row("agent", "pull", 0, [("s2", 0.5, 4.0), ("s1", 3.1, 6.0), ("s1", 0.2, 5.0)])
    assert sorted(_paired(a, b)) == [(1.0, 5.0), (2.0, 4.0), (3.0, 6.0)]
    c = keyed_row("agent", "pull", 0, [("s2", 0.5, 4.0), ("x", 3.1, 6.0), ("y", 0.2, 5.0)])
    assert _paired(a, c) is None  # one in three matches
    assert _paired(a, row("agent", "pull", 0, [1.0, 2.0, 3.0])) is None  # no keys (SGLang's client)
    lone = ratio_interval([a], [row("agent", "pull", 0, [4.0, 5.0, 6.0])], "mean")
    assert lone["paired"] == 0 and lone["value"] == pytest.approx(6.0 / 15.0)
    both = ratio_interval([a], [b], "mean")
    assert both["paired"] == 3 and both["value"] == pytest.approx(6.0 / 15.0)


def test_claims_are_paired_where_the_arms_served_the_same_requests():
    rng = random.Random(6)
    rows = []
    for rnd in range(3):
        reqs = [(f"k{i}", float(i), rng.lognormvariate(0, 1)) for i in range(60)]
        rows += [keyed_row("agent", "pull", rnd, reqs),
                 keyed_row("agent", "active", rnd, [(k, s + 0.1, 0.9 * t) for k, s, t in reqs])]
    _ratios(rows)
    (c,) = claim_ratios(rows)
    assert (c["num"], c["den"]) == ("active", "pull") and c["mean"]["paired"] == 180
    assert c["mean"]["lo"] == pytest.approx(0.9) and c["mean"]["hi"] == pytest.approx(0.9)
    text = format_claims([c])
    assert "paired" in text and " 180 " in text and "0.90x [0.90-0.90]" in text


def test_claims_of_a_saved_run_are_recomputed_from_its_requests(capsys):
    """`kvrep bench --claims FILE`: the claim table of a saved run with today's intervals (no cluster)."""
    from pathlib import Path

    from kvrep_dev.bench import run_bench

    class Args:
        claims = str(Path(__file__).parents[2] / "bench/results/bench-agent-aa-s4.json.gz")

    assert run_bench(Args()) == 0
    out = capsys.readouterr().out
    assert "--arms shadow,shadow@1,active" in out.splitlines()[0]  # the run's own command
    line = next(x for x in out.splitlines() if "active/shadow" in x)
    assert " 684 " in line and line.split()[2] == "4"  # 4 rounds, 684 requests paired


def test_a_one_round_claim_table_says_its_intervals_do_not_count_rounds():
    rows = [keyed_row("agent", "pull", 0, [(f"k{i}", float(i), 1.0 + i) for i in range(20)]),
            keyed_row("agent", "active", 0, [(f"k{i}", float(i), 0.9 + i) for i in range(20)])]
    _ratios(rows)
    assert "one round: its intervals are over requests only" in format_claims(claim_ratios(rows))
    three = [keyed_row("agent", a, k, [(f"k{i}", float(i), 1.0 + i) for i in range(20)])
             for k in range(3) for a in ("pull", "active")]
    _ratios(three)
    assert "one round" not in format_claims(claim_ratios(three))
