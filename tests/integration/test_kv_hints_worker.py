"""SGLang's `kv_hints` envelope sent straight to a real CPU SGLang worker with the plugin (no router of ours in
front): kvrep's actions reach the coordinator as hints on the request's prompt (`HintReported`), a repeat of the
same envelope is one hint, a session end drops it; an action of ours SGLang cannot check is dropped and the
request served; an envelope SGLang refuses is SGLang's 400, as without the plugin (issue 19, item 3)."""
import pytest

from kvrep_dev.cluster import http_json
from radix_sync.kv_hints import envelope
from tests.integration.conftest import prompt, wait_until

pytestmark = pytest.mark.server

SAMPLING = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}


def live_hints(cluster) -> int:
    return cluster.coord.get("/status")[1]["num_live_hints"]


def generate(worker, ids, hints):
    return http_json(worker.url + "/generate", {"input_ids": ids, "sampling_params": SAMPLING, "kv_hints": hints},
                     headers=worker.headers)


def test_a_requests_kv_hints_reach_the_coordinator_through_the_plugin(cluster):
    ids = prompt(1901, 96)
    before = live_hints(cluster)
    fanout = envelope(("kvrep.fanout", {"k": 3}), ("someone.else", {"z": 1}), message_id="kvh-1")
    status, out = generate(cluster.a, ids, fanout)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out
    wait_until(lambda: live_hints(cluster) == before + 1, timeout_s=30, what="the worker reported the fan-out hint")
    # the same envelope again (a retry, or the router's send and the worker's): still one hint
    assert generate(cluster.a, ids + [7], fanout)[0] == 200
    status, out = generate(cluster.a, ids, envelope(("kvrep.session_end", {}), message_id="kvh-2"))
    assert status == 200, out
    wait_until(lambda: live_hints(cluster) == before, timeout_s=30, what="the session end dropped the hint")
    st = cluster.coord.get("/status")[1]
    assert st["integrity"] == "ok"


def test_a_bad_action_of_ours_is_dropped_and_the_request_served_and_a_bad_envelope_is_sglangs_400(cluster):
    ids = prompt(1902, 64)
    before = live_hints(cluster)
    status, out = generate(cluster.b, ids, envelope(("kvrep.fanout", {"k": 0}), message_id="kvh-3"))
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out
    status, out = generate(cluster.b, ids, {"message_id": "no-version"})  # SGLang's own shape rule
    assert status == 400, out
    assert cluster.b.generate(ids)["meta_info"]["completion_tokens"] == 8  # the worker serves on
    assert live_hints(cluster) == before
