"""scripts/held_lag.py: a held request's release lag is measured from the last copy to its worker finished before it."""
import importlib.util
from pathlib import Path


def _script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "held_lag.py"
    spec = importlib.util.spec_from_file_location("held_lag", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_lag_is_from_the_last_copy_to_the_same_worker_finished_before_the_dispatch():
    rows = [{"arm": "active", "repeat": 0, "requests": [{"request_id": "0-7", "cached_tokens": 12}],
             "router_decisions": [{"time_s": 10.10, "worker": "http://127.0.0.1:9001", "held_s": 0.3,
                                   "request_id": "0-7", "cached_by_worker": [0, 64]},
                                  {"time_s": 10.20, "worker": "http://127.0.0.1:9002"},  # not held
                                  {"time_s": 5.0, "worker": "http://127.0.0.1:9001", "held_s": 0.1}],  # no copy yet
             "replications": [{"target": "127.0.0.1:9001", "origin": "pull", "finished_s": 9.0},
                              {"target": "127.0.0.1:9001", "origin": "kvrep", "finished_s": 10.02, "num_tokens": 64},
                              {"target": "127.0.0.1:9002", "origin": "kvrep", "finished_s": 10.08},  # another worker
                              {"target": "127.0.0.1:9001", "origin": "pull", "finished_s": 10.5},  # after it went
                              {"target": "127.0.0.1:9001", "origin": "kvrep", "finished_s": None}]}]
    held = _script().held_requests({"rows": rows})
    assert held == [{"arm": "active", "round": 0, "origin": "kvrep", "held_s": 0.3, "lag_ms": 80.0,
                     "expected_tokens": 64,
                     "cached_tokens": 12}]
