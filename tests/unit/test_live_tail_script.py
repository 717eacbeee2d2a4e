"""`scripts/live_tail.py`: a live arm's P99 tail by kind, on hand-made bench rows."""
import gzip
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "live_tail.py"


def load():
    spec = importlib.util.spec_from_file_location("live_tail", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def q(session, sent, prompt, cached, ttft, error=None):
    return {"key": f"{session}:{prompt}:x:y", "sent_s": sent, "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_s": ttft, "error": error}


def test_kinds_follow_each_session_in_send_order():
    lt = load()
    reqs = [q(2, 3.0, 1000, 0, 0.5), q(1, 1.0, 500, 0, 0.3), q(1, 2.0, 800, 448, 0.2),  # 448 >= 500 - 64: cached
            q(1, 4.0, 1200, 100, 0.9), q(2, 5.0, 1100, 0, 1.0, error="boom")]
    assert lt.kinds(reqs) == [(0.3, "first turn", 500), (0.2, "history cached", 352), (0.5, "first turn", 1000),
                              (0.9, "history lost", 1100)]


def test_report_pools_the_rounds_of_an_arm(tmp_path):
    lt = load()
    rows = [{"workload": "agent", "arm": "active", "requests": [q(1, 1.0, 500, 0, 2.0), q(1, 2.0, 800, 500, 0.1)]},
            {"workload": "agent", "arm": "active", "requests": [q(1, 1.0, 500, 0, 0.1), q(1, 2.0, 800, 0, 1.9)]}]
    [line] = lt.report({"rows": rows})
    # TTFTs 0.1, 0.1, 1.9, 2.0: P99 = 2.0; >= 1.8: the first turn (2.0) and the lost history (1.9)
    assert line == ("agent active: 4 requests, mean 1.025 s, P99 2.000 s; 2 >= 0.9 x P99: "
                    "first turn 1 (new 500 tokens), "
                    "history lost 1 (new 800 tokens); of all: first turn 2, history cached 1, history lost 1")
    path = tmp_path / "run.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"rows": rows}, f)
    assert lt.main([str(path)]) == 0 and lt.main([]) == 2


def test_the_routers_decisions_tell_where_a_lost_history_was():
    lt = load()
    reqs = [q(1, 1.0, 500, 0, 0.3), q(1, 2.0, 800, 0, 0.9), q(2, 2.5, 300, 0, 0.2), q(2, 3.0, 700, 0, 0.8),
            q(2, 4.0, 900, 0, 1.0)]
    d = {"ranked": ["a", "b"], "worker": "a"}
    decisions = [{**d, "time_s": 10.0, "prompt_len": 500, "cached_by_worker": [0, 0]},
                 {**d, "time_s": 11.0, "prompt_len": 800, "cached_by_worker": [0, 480]},  # b had it: sent away
                 {**d, "time_s": 11.5, "prompt_len": 300, "cached_by_worker": [0, 0]},
                 {**d, "time_s": 12.0, "prompt_len": 700, "cached_by_worker": [200, 0]},  # nobody had 300 - 64
                 {**d, "time_s": 13.0, "prompt_len": 900, "cached_by_worker": [688, 0]}]  # a had it, yet missed
    assert [k for _, k, _ in lt.kinds(reqs, decisions)] == ["first turn", "history elsewhere", "first turn",
                                                            "history nowhere", "history missed where sent"]


def test_decisions_of_earlier_cells_are_not_joined():
    """A router keeps its last decisions over its life: a cell's list starts with the previous cell's, of the same
    prompt lengths; the join keeps to this cell's clock offset (and by request id when the decisions carry it)."""
    lt = load()
    reqs = [q(1, 1.0, 500, 0, 0.3), q(1, 2.0, 800, 0, 0.9), q(2, 2.5, 300, 0, 0.2)]
    d = {"ranked": ["a", "b"], "worker": "a"}
    earlier = [{**d, "time_s": 3.0, "prompt_len": 800, "cached_by_worker": [800, 0]},  # the previous cell's
               {**d, "time_s": 4.0, "prompt_len": 500, "cached_by_worker": [0, 0]}]
    now = [{**d, "time_s": 101.0, "prompt_len": 500, "cached_by_worker": [0, 0]},
           {**d, "time_s": 102.3, "prompt_len": 800, "cached_by_worker": [0, 480]},  # 0.3 s late: a pull's wait
           {**d, "time_s": 102.4, "prompt_len": 800, "cached_by_worker": [0, 480], "attempt": 1},  # its failover
           {**d, "time_s": 102.5, "prompt_len": 300, "cached_by_worker": [0, 0]}]
    joined = lt.match_decisions(reqs, earlier + now)
    assert [joined[i]["time_s"] for i in range(3)] == [101.0, 102.3, 102.5]
    assert [k for _, k, _ in lt.kinds(reqs, earlier + now)] == ["first turn", "history elsewhere", "first turn"]
    # with request ids, the ids decide, whatever the clocks say
    tagged = [{**r, "request_id": f"c-{i}"} for i, r in enumerate(reqs)]
    ids = [{**earlier[0], "request_id": "c-1"}, {**now[0], "request_id": "c-0"}]
    assert lt.match_decisions(tagged, ids) == {0: ids[1], 1: ids[0]}
