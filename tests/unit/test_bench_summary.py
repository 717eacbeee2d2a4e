"""`kvrep bench` over several rounds: ratios are paired within a round, medians and ranges over the rounds."""
from kvrep_dev.bench import _ratios, format_summary, format_table, summarize_rounds


def row(wl, arm, rnd, p99, mean, copies=0):
    return {"workload": wl, "arm": arm, "repeat": rnd, "wall_s": 1.0,
            "live": {"requests": 10, "errors": 0, "ttft_s": {"mean": mean, "p50": mean, "p95": p99, "p99": p99},
                     "tpot_s": {"mean": 0.01}, "throughput_rps": 1.0, "cached_token_ratio": 0.5},
            "replication": {"count": copies, "bytes": 0, "useful_bytes_frac": None}}


def test_ratios_are_paired_within_a_round_and_summarized_over_rounds():
    rows = [row("agent", "shadow", 0, 4.0, 2.0), row("agent", "active", 0, 2.0, 1.0, 3),
            row("agent", "shadow", 1, 10.0, 5.0), row("agent", "active", 1, 15.0, 5.0, 5),
            row("agent", "shadow", 2, 8.0, 4.0), row("agent", "active", 2, 6.0, 4.0, 4)]
    _ratios(rows)
    assert [r["p99_ratio"] for r in rows if r["arm"] == "active"] == [0.5, 1.5, 0.75]
    summary = {x["arm"]: x for x in summarize_rounds(rows)}
    active = summary["active"]
    assert active["rounds"] == 3 and active["vs"] == "shadow"
    assert active["p99_ratio"] == {"median": 0.75, "min": 0.5, "max": 1.5}
    assert active["p99_s"] == {"median": 6.0, "min": 2.0, "max": 15.0}
    assert active["copies"]["median"] == 4.0
    assert summary["shadow"]["p99_ratio"]["median"] == 1.0
    text = format_summary(summarize_rounds(rows))
    assert "0.75 [0.50-1.50]" in text
    assert len(format_table(rows).splitlines()) == 2 + len(rows)


def test_front_doors_compare_cached_token_ratios_pooled_over_rounds_and_per_round():
    from kvrep_dev.bench import format_front_doors, front_door_ratios

    def reqs(pairs):
        return [{"prompt_tokens": n, "cached_tokens": c, "ttft_s": 0.1} for n, c in pairs]

    rows = [row("agent", "shadow", 0, 1, 1), row("agent", "shadow@4", 0, 1, 1),
            row("agent", "shadow", 1, 1, 1), row("agent", "shadow@4", 1, 1, 1), row("agent", "smg-ca@4", 0, 1, 1)]
    rows[0]["requests"] = reqs([(100, 80), (100, 60)])  # 70% cached
    rows[1]["requests"] = reqs([(100, 70), (100, 70)])  # 70%
    rows[2]["requests"] = reqs([(200, 100)])  # 50%
    rows[3]["requests"] = reqs([(200, 90), (10, 0, )]) + [{"prompt_tokens": 50, "cached_tokens": 50, "error": "x"}]
    rows[4]["requests"] = reqs([(100, 10)])  # no smg-ca row with one front door: not compared
    [f] = front_door_ratios(rows, resamples=200)
    assert (f["workload"], f["arm"], f["vs"], f["rounds"]) == ("agent", "shadow@4", "shadow", 2)
    assert f["cached"] == 230 / 410 and f["cached_vs"] == 240 / 400  # the errored request counts nowhere
    assert f["ratio"] == (230 / 410) / (240 / 400)
    assert f["per_round"] == [1.0, (90 / 210) / 0.5]
    assert f["ratio_ci"][0] <= f["ratio"] <= f["ratio_ci"][1]
    text = format_front_doors([f])
    assert "shadow@4 / shadow" in text and "56.1%" in text and "60.0%" in text


def test_front_doors_with_nothing_cached_in_the_one_door_arm_give_no_ratio_and_no_error():
    """A workload with no sharing (`unique`): no cached token behind one front door, so no quotient (stop 51's run
    of `shadow@1` on it crashed here after its 16 cells)."""
    import math

    from kvrep_dev.bench import format_front_doors, front_door_ratios

    rows = [row("unique", "shadow", 0, 1, 1), row("unique", "shadow@1", 0, 1, 1)]
    for r in rows:
        r["requests"] = [{"prompt_tokens": 100, "cached_tokens": 0, "ttft_s": 0.1}]
    [f] = front_door_ratios(rows, resamples=50)
    assert f["cached"] == 0.0 and math.isnan(f["ratio"]) and all(math.isnan(x) for x in f["ratio_ci"] + f["per_round"])
    assert "shadow@1 / shadow" in format_front_doors([f])


def test_a_checkpoint_holds_the_rows_so_far_and_replaces_the_last_whole(tmp_path):
    """`kvrep bench` rewrites its live rows after every cell: a run that fails after its cells keeps them, and a
    reader never sees a half-written file (written aside, then renamed over the last one)."""
    import json

    from kvrep_dev.bench import CHECKPOINT, checkpoint

    checkpoint(tmp_path, [{"arm": "shadow", "repeat": 0}])
    checkpoint(tmp_path, [{"arm": "shadow", "repeat": 0}, {"arm": "active", "repeat": 0}])
    assert json.loads((tmp_path / CHECKPOINT).read_text()) == [{"arm": "shadow", "repeat": 0},
                                                              {"arm": "active", "repeat": 0}]
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT]
