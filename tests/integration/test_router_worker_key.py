"""Isolation at a real CPU SGLang worker (issue 17, item 5) and the vocabulary bound (item 6): a worker started
by the harness with SGLang's `--api-key` refuses a client that talks to it directly, serves the router (which
sends the key, and never lets a client read it back from `/server_info`), and the router refuses the issue's
`{"input_ids": [5, 6, 7, 5000]}` (which killed an SGLang 0.5.23 CPU worker) with a 400 before the worker sees it.
"""
import pytest

from kvrep_dev.cluster import Router, Worker, http_json, local_keys, model_path

from .conftest import LOGS, wait_until

pytestmark = pytest.mark.server

SAMPLING = {"max_new_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def keyed():
    logs = LOGS / "worker-key"
    keys = local_keys(logs / "keys")
    worker = Worker("worker-keyed", "tiny", logs, kvrep=False, api_key_file=keys / "worker-api-key")
    router = None
    try:
        worker.wait_ready()
        router = Router(logs, keys, workers=(worker.url,), tokenizer=model_path("tiny"))
        router.wait_http(router.url + "/health", timeout_s=120)
        yield worker, router
    finally:
        for proc in (router, worker):
            if proc is not None:
                proc.stop()


def test_a_client_straight_to_the_worker_is_refused_and_the_router_is_served(keyed):
    worker, router = keyed
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": SAMPLING}
    assert http_json(worker.url + "/generate", body)[0] == 401
    assert http_json(worker.url + "/generate", body, headers={"Authorization": "Bearer sk-guess"})[0] == 401
    assert http_json(worker.url + "/flush_cache", {})[0] == 401
    status, out = http_json(router.url + "/generate", body)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out
    status, out = http_json(router.url + "/generate", {"text": "hello world", "sampling_params": SAMPLING})
    assert status == 200, out
    status, out = http_json(router.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 2})
    assert status == 200, out
    status, out = http_json(router.url + "/flush_cache", {}, headers=router.admin("write"))
    assert status == 200 and out["success"] is True, out


def test_the_worker_key_never_reaches_a_client(keyed):
    worker, router = keyed
    direct = http_json(worker.url + "/server_info", headers=worker.headers)[1]
    assert worker.api_key in repr(direct)  # SGLang lists its server args and launch command
    status, via = http_json(router.url + "/server_info")
    assert status == 200 and worker.api_key not in repr(via), via


def test_an_out_of_vocabulary_id_is_refused_and_the_worker_lives(keyed):
    worker, router = keyed
    status, out = http_json(router.url + "/generate", {"input_ids": [5, 6, 7, 5000], "sampling_params": SAMPLING})
    assert status == 400 and "5000" in out["error"], out
    status, out = http_json(router.url + "/v1/completions", {"prompt": [5, 6, 4096], "max_tokens": 2})
    assert status == 400, out
    assert worker.alive()
    wait_until(lambda: http_json(worker.url + "/health", timeout=5)[0] == 200, what="worker healthy")
    status, out = http_json(router.url + "/generate", {"input_ids": [5, 6, 7, 4095], "sampling_params": SAMPLING})
    assert status == 200, out
