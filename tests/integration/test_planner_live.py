"""The predictive planner running in the live coordinator: shadow mode decides and sends nothing; active mode
replicates a hinted fan-out trunk to the idle worker."""
import pytest

from tests.integration.conftest import PAGE_SIZE, prompt, wait_until

pytestmark = pytest.mark.server


def test_kvrep_planner_shadow_then_active_on_fanout_hint(cluster):
    a, b, coord = cluster.a, cluster.b, cluster.coord
    trunk = prompt(80, 1024)
    a.generate(trunk, 2)
    wait_until(lambda: cluster.lookup(trunk)[a.worker_id] >= len(trunk) - PAGE_SIZE, 10, what="A's trunk in the "
               "directory")
    try:
        assert coord.post("/policy", {"policy": "kvrep", "mode": "shadow"}) == (200, {"policy": "kvrep",
                                                                                        "mode": "shadow"})
        assert coord.post("/hints", {"kind": "fanout", "input_ids": trunk, "k": 8})[0] == 200
        decisions = wait_until(lambda: [d for d in coord.get("/status")[1]["shadow_decisions"]
                                        if d["policy"] == "kvrep" and d["source"] == a.worker_id], 10,
                               what="a shadow decision")
        assert decisions[0]["target"] == b.worker_id
        assert not [r for r in coord.get("/replications")[1] if r["origin"] == "kvrep"]  # shadow sent nothing
        assert cluster.lookup(trunk)[b.worker_id] == 0

        assert coord.post("/policy", {"policy": "kvrep", "mode": "active"})[0] == 200
        reps = wait_until(lambda: [r for r in coord.get("/replications")[1]
                                   if r["origin"] == "kvrep" and r["state"] == "done"], 15,
                          what="the planner's replication")
        assert reps[0]["source"] == a.worker_id and reps[0]["target"] == b.worker_id
        out = b.generate(trunk + prompt(81, 16), 4)
        assert out["meta_info"]["cached_tokens"] >= reps[0]["num_tokens"] - PAGE_SIZE > 0
    finally:
        coord.post("/policy", {"policy": "rules", "mode": "active"})
    assert coord.post("/policy", {"policy": "nope"})[0] == 400
