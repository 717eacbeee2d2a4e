"""scripts/cache_diff.py: per round, the cache hits two arms' requests got (matched by key), and the requests that
lost or gained, on a hand-made run and on the committed stop-32 ablation (the numbers docs/bench.md quotes)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("cache_diff", ROOT / "scripts" / "cache_diff.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def req(key, cached, ttft):
    return {"key": key, "cached_tokens": cached, "ttft_s": ttft}


def test_requests_are_matched_by_key_and_only_changes_past_the_threshold_count():
    cd = load()
    run = {"rows": [
        {"workload": "w", "arm": "a", "repeat": 0, "requests": [req("x", 1000, 1.0), req("y", 0, 2.0),
                                                                  req("z", 600, 1.0), req("only-a", 5, 1.0)]},
        {"workload": "w", "arm": "b", "repeat": 0, "requests": [req("y", 2000, 0.5), req("x", 0, 3.0),
                                                                  req("z", 200, 1.5)]},
        {"workload": "w", "arm": "a", "repeat": 1, "requests": [req("x", 1, 1.0)]},  # no b in round 1
    ]}
    [r] = cd.diff(run, "a", "b")
    assert (r["requests"], r["cached_a"], r["cached_b"]) == (3, 1600, 2200)
    assert (r["lost"], r["lost_tokens"], r["lost_ttft_s"]) == (1, 1000, 2.0)  # x; z lost only 400
    assert (r["gained"], r["gained_tokens"], r["gained_ttft_s"]) == (1, 2000, -1.5)


def test_the_committed_ablation_demote_lost_hits_against_pull_in_every_round(capsys):
    cd = load()
    assert cd.main([str(ROOT / "bench/results/bench-agent-ablation.json.gz"), "pull", "demote"]) == 0
    rounds = cd.diff(cd.load(str(ROOT / "bench/results/bench-agent-ablation.json.gz")), "pull", "demote")
    assert [(r["cached_a"], r["cached_b"], r["lost"]) for r in rounds] == [
        (252032, 231392, 19), (253776, 231456, 16), (249600, 246480, 12)]
    assert "cached demote" in capsys.readouterr().out
