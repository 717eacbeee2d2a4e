"""`scripts/live_sim_gap.py`'s grouping on a hand-made run: hits and misses, the other worker busy or idle while a
request waited for its first token, and a tree's later requests on its first request's worker or another."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("live_sim_gap", ROOT / "scripts" / "live_sim_gap.py")
gap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gap)


def _req(rid, key, sent, ttft, e2e, cached, prompt=100):
    return {"request_id": rid, "key": key, "sent_s": sent, "ttft_s": ttft, "e2e_s": e2e, "prompt_tokens": prompt,
            "cached_tokens": cached, "error": None}


def test_requests_group_by_hit_by_the_other_workers_state_and_by_the_trees_first_worker():
    reqs = [_req("r0", "7:100:a", 0.0, 0.20, 0.30, 0),     # the tree's trunk on A, alone: a miss, other idle
            _req("r1", "7:100:b", 1.0, 0.10, 0.20, 90),    # a branch on A while r2 runs on B: a hit, other busy
            _req("r2", "7:100:c", 1.0, 0.12, 0.25, 90),    # a branch on B while r1 runs on A
            _req("r3", "8:100:d", 5.0, 0.30, 0.40, 0)]     # another tree, alone
    where = {"r0": "A", "r1": "A", "r2": "B", "r3": "B"}
    run = [{"arm": "active", "requests": reqs,
            "router_decisions": [{"request_id": q["request_id"], "worker": where[q["request_id"]]} for q in reqs]}]
    occ = {(q["key"], 0): q for q in reqs}
    sim = {k: {"ttft_s": q["ttft_s"] - 0.05} for k, q in occ.items()}  # the simulator 50 ms faster on each
    busy, home = gap.groups(run, "active", sim)
    assert sorted((k, len(v)) for k, v in busy.items()) == [((False, False), 2), ((True, True), 2)]
    assert all(x - y == pytest.approx(0.05) for v in busy.values() for x, y in v)
    assert sorted((k, len(v)) for k, v in home.items()) == [((True, False), 1), ((True, True), 1)]
    assert gap.groups(run, "pull", sim) == ({}, {})
