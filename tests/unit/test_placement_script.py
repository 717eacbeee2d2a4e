"""`scripts/placement.py` on a hand-made run and on the committed run docs/bench.md quotes it for."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("placement", ROOT / "scripts" / "placement.py")
placement = importlib.util.module_from_spec(spec)
spec.loader.exec_module(placement)


def _dec(worker, cached, ttfts):
    return {"worker": worker, "cached_by_worker": cached, "expected_ttft_s": ttfts}


def test_counts_shares_cold_ties_and_requests_sent_away_from_their_holder():
    reqs = [{"ttft_s": t, "prompt_tokens": 100, "cached_tokens": c, "error": None}
            for t, c in ((0.1, 90), (0.3, 0), (0.2, 60), (0.5, 0))]
    run = {"rows": [{"arm": "shadow", "requests": reqs, "router_decisions": [
        _dec("http://a", [0, 0], [0.3, 0.3]),      # nobody holds it, an exact tie, to the first worker
        _dec("http://b", [0, 0], [0.3, 0.4]),      # nobody holds it, no tie
        _dec("http://b", [10, 80], [0.5, 0.6]),    # sent away from a (80 cached there) to b (10)
        _dec("http://a", [80, 0], [0.1, 0.4])]},   # to its holder
        {"arm": "smg-ca", "requests": reqs[:1]}]}
    out = placement.placement(run)
    s = out["shadow"]
    assert (s["requests"], s["decisions"], s["cold"], s["ties"], s["sent_away"]) == (4, 4, 2, 1, 1)
    assert s["on_first"] == 0.5 and s["cold_on_first"] == 0.5 and abs(s["warm_median_s"] - 0.15) < 1e-12
    assert out["smg-ca"]["on_first"] is None and out["smg-ca"]["warm_median_s"] == 0.1


def test_the_committed_tie_ablation_run_shows_the_lowest_id_rule_piling_onto_worker_0():
    out = placement.placement(placement.load(str(ROOT / "bench" / "results" / "bench-agent-ties49-s3.json.gz")))
    assert out["shadow-lowid"]["on_first"] > 0.7 > out["shadow"]["on_first"]
