"""SGLang's `kv_hints` envelope on the router's proxied endpoints (`radix_sync.kv_hints`, issue 19 item 3): our
actions become coordinator hints on the request's own prompt, in the tenant's namespace, within its hint rate; the
body goes to the worker unchanged; a malformed envelope is a 400 before any worker sees the request; a caller who
may not hint is served and told its hints were ignored. A real router process, a real coordinator, a stub worker
(no SGLang here)."""
import json

import pytest

from radix_sync.kv_hints import envelope
from tests.component.test_router_process import call, metric
from tests.component.test_router_security import ACME, GLOBEX, Env, stats
from tests.util import wait_until

PROMPT = list(range(10, 10 + 64))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("router-kv-hints"))
    try:
        yield e
    finally:
        e.stop()


def live_hints(env) -> int:
    return env.coord.get("/status")[1]["num_live_hints"]


def post(router, body, headers, path="/generate"):
    status, _, raw = call(router.url + path, body, headers)
    return status, json.loads(raw or b"null")


def headers_of(router, body, headers, path="/generate"):
    import urllib.request

    req = urllib.request.Request(router.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, dict(resp.headers), json.loads(resp.read())


def test_a_fanout_action_becomes_a_hint_and_the_body_reaches_the_worker_unchanged(env):
    hints = envelope(("kvrep.fanout", {"k": 4, "delay_s": 0.3}), ("someone.else", {"x": [1]}), message_id="fan-1")
    before = live_hints(env)
    status, headers, out = headers_of(env.router, {"input_ids": PROMPT, "kv_hints": hints}, ACME)
    assert status == 200 and headers["x-kvrep-kv-hints"] == "1 of 1 sent", headers
    assert out["meta_info"]["kv_hints"] == hints  # forwarded as sent: SGLang gets the envelope as without us
    wait_until(lambda: live_hints(env) == before + 1, what="the coordinator recorded the fan-out hint")
    assert metric(env.router, "kvrep_router_kv_hints_total", outcome="sent") >= 1
    # a session end on the same prompt drops that hint
    end = envelope(("kvrep.session_end", {}), message_id="end-1")
    status, headers, _ = headers_of(env.router, {"input_ids": PROMPT, "kv_hints": end}, ACME)
    assert status == 200 and headers["x-kvrep-kv-hints"] == "1 of 1 sent", headers
    wait_until(lambda: live_hints(env) == before, what="the session end dropped the prefix's hint")
    # a chat prompt this router cannot tokenize (no tokenizer here): served, the hints not acted on, and said so
    status, headers, out = headers_of(env.router, {"messages": [{"role": "user", "content": "hi"}],
                                                   "kv_hints": envelope(("kvrep.fanout", {"k": 2}))},
                                      GLOBEX, path="/v1/chat/completions")
    assert status == 200 and headers["x-kvrep-kv-hints"].startswith("ignored: no token ids"), headers


@pytest.mark.parametrize("hints,what", [
    ({"message_id": "m"}, "protocol_version"),
    (envelope(("kvrep.fanout", {"k": 0})), ">= 1"),
    (envelope(("kvrep.keepalive", {"ttl_s": 5})) | {"actions": [{"action_id": "a", "action_type": "kvrep.keepalive",
                                                                  "action_version": "7", "payload": {"ttl_s": 5}}]},
     "version '7'"),
    ([envelope(("kvrep.fanout", {"k": 2}))] * 2, "2 envelopes for 1 prompt"),
])
def test_a_malformed_envelope_is_a_400_before_any_worker_sees_the_request(env, hints, what):
    before, hints_before = stats(env.stub).get("/generate", 0), live_hints(env)
    status, out = post(env.router, {"input_ids": PROMPT, "kv_hints": hints}, ACME)
    assert status == 400 and what in out["error"] and "kv_hints" in out["error"], out
    assert stats(env.stub).get("/generate", 0) == before and live_hints(env) == hints_before


def test_a_caller_who_may_not_hint_is_served_and_told_and_the_rate_limit_never_loses_a_request(env):
    hints = envelope(("kvrep.keepalive", {"ttl_s": 30}))
    # the router without tenants: an anonymous caller may send requests, not hints (as /kvrep/hints: 401)
    before = live_hints(env)
    status, headers, out = headers_of(env.open, {"input_ids": PROMPT, "kv_hints": hints}, {})
    assert status == 200 and headers["x-kvrep-kv-hints"].startswith("ignored: hints need"), headers
    assert out["meta_info"]["kv_hints"] == hints
    assert metric(env.open, "kvrep_router_kv_hints_total", outcome="unauthorized") == 1
    # over the tenant's hint rate (burst 3 in this env): every request served, the hints beyond it dropped
    answers = [headers_of(env.router, {"input_ids": PROMPT, "kv_hints": envelope(("kvrep.keepalive", {"ttl_s": 30}),
                                                                              message_id=f"ka-{i}")}, ACME)
               for i in range(4)]
    assert [a[0] for a in answers] == [200] * 4
    assert answers[-1][1]["x-kvrep-kv-hints"] == "0 of 1 sent (hint rate limit)", answers[-1][1]
    assert metric(env.router, "kvrep_router_kv_hints_total", outcome="rate_limited") >= 1
    assert live_hints(env) >= before
