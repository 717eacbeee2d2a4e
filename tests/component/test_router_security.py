"""The router's attack surface (issue 17, items 4-6, router side), each reproduction run against a real router
process over loopback, in front of stub workers that behave as SGLang does (`--api-key`: 401 without the key;
`--vocab-size`: an out-of-vocabulary token id kills the process) and a real coordinator. No SGLang server here;
`tests/integration/test_router_worker_key.py` repeats the key and vocabulary checks on a real CPU worker.
"""
import json
import os
import stat
import sys
import threading

import pytest

from kvrep_dev.cluster import Coordinator, Proc, Router, free_port, local_keys
from radix_sync.secret_files import read_secret
from radix_sync.router.tenants import derive_namespace
from tests.component.test_router_process import call, metric, ready, start_stub
from tests.util import wait_until

VOCAB = 4096
TENANTS = {"tenants": {"acme": {"namespace": "ns-acme", "api_keys": ["sk-acme"]},
                       "globex": {"api_keys": ["sk-globex"]}}}
ACME = {"Authorization": "Bearer sk-acme"}
GLOBEX = {"Authorization": "Bearer sk-globex"}
BOUNDS = ("--vocab-size", str(VOCAB), "--max-body-bytes", "1000000", "--max-prompt-tokens", "1000",
          "--max-prompt-chars", "20000", "--max-batch-prompts", "4", "--max-messages", "8",
          "--hints-per-s", "0.001", "--hints-burst", "3")


def stats(stub):
    return json.loads(call(stub.url + "/stub/stats")[2])


class Env:
    def __init__(self, tmp):
        self.tmp = tmp
        self.keys = local_keys(tmp / "keys")
        self.key = (self.keys / "worker-api-key").read_text().strip()
        (tmp / "tenants.json").write_text(json.dumps(TENANTS))
        self.coord = Coordinator(tmp, extra_args=("--policy", "none"))
        self.stub = start_stub("S", tmp, keys=self.keys, extra=("--vocab-size", str(VOCAB)))
        self.router = Router(tmp, self.keys, coordinator=self.coord, workers=(self.stub.url,),
                             extra_args=("--tenants", str(tmp / "tenants.json"), *BOUNDS))
        self.twin = Router(tmp, self.keys, workers=(self.stub.url,), name="router-twin",
                           extra_args=("--tenants", str(tmp / "tenants.json")))
        self.open = Router(tmp, self.keys, workers=(self.stub.url,), name="router-open")  # no tenants file
        self.procs = [self.coord, self.stub, self.router, self.twin, self.open]
        try:
            self.coord.wait_ready()
            for proc in (self.stub, self.router, self.twin, self.open):
                wait_until(lambda: ready(proc.url), what=f"{proc.name} up")
        except BaseException:
            self.stop()
            raise

    def stop(self):
        for proc in reversed(self.procs):
            proc.stop(5)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("router-security"))
    try:
        yield e
    finally:
        e.stop()


def gen(router, body, headers=ACME, path="/generate"):
    status, _, raw = call(router.url + path, body, headers)
    return status, json.loads(raw or b"null")


# ------------------------------------------------------------------------------------------------ admin routes
def test_admin_routes_refuse_anonymous_wrong_and_tenant_credentials(env):
    r = env.router
    wrong = {"Authorization": "Bearer " + "0" * 64}
    for path in ("/kvrep/status", "/metrics", "/metrics?name=x"):
        for headers in ({}, wrong, ACME, {"Authorization": r.admin("read")["Authorization"][7:]}):
            status, _, raw = call(r.url + path, headers=headers)
            assert status == 401, (path, headers, raw)
            assert b"ns-" not in raw and b"last_decisions" not in raw
        assert call(r.url + path, headers=r.admin("read"))[0] == 200
        assert call(r.url + path, headers=r.admin("write"))[0] == 200  # the write token also reads
    st = r.status()
    assert "last_decisions" in st and st["tenants"] == sorted([r.namespace("ns-acme"), r.namespace("globex")])
    # /health stays open and says only whether the router can serve: no workers, no namespaces
    status, _, raw = call(r.url + "/health")
    assert status == 200 and json.loads(raw) == {"ok": True}
    assert metric(r, "kvrep_router_refused_total", reason="admin_auth") >= 12


def test_no_tenant_can_flush_a_cache(env):
    r = env.router
    before = stats(env.stub).get("/flush_cache", 0)
    for method in ("POST", "GET"):
        assert call(r.url + "/flush_cache", headers=ACME, method=method)[0] == 401
        assert call(r.url + "/flush_cache", headers={}, method=method)[0] == 401
        assert call(r.url + "/flush_cache", headers=r.admin("read"), method=method)[0] == 403
    assert stats(env.stub).get("/flush_cache", 0) == before  # none of them reached a worker
    status, _, raw = call(r.url + "/flush_cache", headers=r.admin("write"), method="POST")
    assert status == 200 and json.loads(raw)["success"] is True
    assert stats(env.stub)["/flush_cache"] == before + 1


def test_missing_credential_files_are_created_0600_and_their_path_logged(tmp_path, env):
    state = tmp_path / "state"
    (tmp_path / "tenants.json").write_text(json.dumps(TENANTS))
    port = free_port()
    # no --admin-tokens, no --tenant-secret: the router creates both in --state-dir
    proc = Proc("router-fresh", [sys.executable, "-m", "radix_sync.cli", "router", "--port", str(port),
                                 "--tokenizer", "none", "--worker", env.stub.url, "--state-dir", str(state),
                                 "--worker-api-key", str(env.keys / "worker-api-key"),
                                 "--tenants", str(tmp_path / "tenants.json")], tmp_path / "router-fresh.log")
    proc.url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: ready(proc.url), what="router with created credentials up")
        tokens, secret = state / "router-tokens.json", state / "tenant-secret"
        for f in (tokens, secret):
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
        assert str(tokens) in proc.tail(200) and str(secret) in proc.tail(200)
        read = json.loads(tokens.read_text())["read"]
        assert call(proc.url + "/kvrep/status")[0] == 401
        assert call(proc.url + "/kvrep/status", headers={"Authorization": f"Bearer {read}"})[0] == 200
        # its own new secret: acme's namespace there is not the cluster's
        status, out = gen(proc, {"input_ids": [1, 2, 3]})
        assert status == 200
        assert out["meta_info"]["cache_salt"] == derive_namespace(read_secret(secret), "ns-acme")
        assert out["meta_info"]["cache_salt"] != env.router.namespace("ns-acme")
    finally:
        proc.stop(5)


# ---------------------------------------------------------------------------------------------- namespaces
def test_namespaces_are_hmacs_of_the_tenant_shared_by_every_router_with_the_secret(env):
    salts = {}
    for router in (env.router, env.twin):
        for name, headers in (("acme", ACME), ("globex", GLOBEX)):
            status, out = gen(router, {"input_ids": [1, 2, 3], "cache_salt": "ns-acme", "extra_key": "x"}, headers)
            assert status == 200
            salts[(router.name, name)] = out["meta_info"]["cache_salt"]
            assert out["meta_info"]["extra_key"] is None
    secret = read_secret(env.keys / "tenant-secret")
    assert salts[("router", "acme")] == salts[("router-twin", "acme")] == derive_namespace(secret, "ns-acme")
    assert salts[("router", "globex")] == salts[("router-twin", "globex")] == derive_namespace(secret, "globex")
    assert salts[("router", "acme")] != salts[("router", "globex")]
    assert all(s not in ("ns-acme", "globex", "acme") and len(s) == 32 for s in salts.values())


# -------------------------------------------------------------------------------------------- the worker key
def test_the_router_sends_the_worker_key_never_the_clients_and_redacts_it(env):
    s = env.stub
    assert call(s.url + "/generate", {"input_ids": [1, 2]})[0] == 401  # a client straight to the worker
    assert call(s.url + "/generate", {"input_ids": [1, 2]}, ACME)[0] == 401  # with a tenant's key too
    refused = stats(s).get("unauthorized", 0)
    assert call(env.router.url + "/generate", {"input_ids": [1, 2], "stream": True}, ACME)[0] == 200
    assert gen(env.router, {"input_ids": [1, 2]})[0] == 200
    assert gen(env.router, {"prompt": [1, 2], "max_tokens": 2}, path="/v1/completions")[0] == 200
    for path in ("/v1/models", "/model_info"):
        assert call(env.router.url + path, headers=ACME)[0] == 200
    status, _, raw = call(env.router.url + "/server_info", headers=ACME)
    assert status == 200 and env.key.encode() not in raw and b"<redacted>" in raw
    assert env.key in call(s.url + "/server_info", headers={"Authorization": f"Bearer {env.key}"})[2].decode()
    status, _, raw = call(env.router.url + "/flush_cache", headers=env.router.admin("write"), method="POST")
    assert status == 200 and env.key.encode() not in raw
    assert stats(s).get("unauthorized", 0) == refused  # every call the router made carried the key


# --------------------------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [5, 6, 7, 5000]}),  # the one request that killed the worker
    ("/generate", {"input_ids": [[5, 6], [7, VOCAB]]}),  # the second prompt of a batch
    ("/generate", {"input_ids": [5, -1]}),
    ("/generate", {"input_ids": [5, 2**40]}),
    ("/generate", {"input_ids": [5, True]}),
    ("/generate", {"input_ids": [5, 6.0]}),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [9999]}}),
    ("/generate", {"input_ids": [5], "sampling_params": {"logit_bias": {"5000": 1.0}}}),
    ("/v1/completions", {"prompt": [1, 2, 4096]}),
    ("/v1/completions", {"prompt": [[1], [99999]]}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"70000": -100}}),
])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_worker(env, path, body):
    before = stats(env.stub).get(path, 0)
    status, out = gen(env.router, body, path=path)
    assert status == 400 and "error" in out, out
    assert env.stub.alive() and stats(env.stub).get(path, 0) == before  # no worker saw it
    assert gen(env.router, {"input_ids": [5, 6, 7, VOCAB - 1]})[0] == 200  # and the cluster still serves


@pytest.mark.parametrize("body,what", [
    ({"input_ids": list(range(1001))}, "token ids"),
    ({"text": "x" * 20001}, "characters"),
    ({"text": ["a"] * 5}, "prompts in one batch"),
    ({"input_ids": [[1]] * 5}, "prompts in one batch"),
])
def test_prompts_and_batches_over_their_caps_are_413(env, body, what):
    before = stats(env.stub).get("/generate", 0)
    status, out = gen(env.router, body)
    assert status == 413 and what in out["error"], out
    assert stats(env.stub).get("/generate", 0) == before


def test_bodies_and_chats_over_their_caps_are_413(env):
    status, _, _ = call(env.router.url + "/generate", {"input_ids": [1], "pad": "x" * 1_000_001}, ACME)
    assert status == 413
    msgs = [{"role": "user", "content": "hi"}] * 9
    status, out = gen(env.router, {"messages": msgs}, path="/v1/chat/completions")
    assert status == 413 and "messages" in out["error"]
    status, out = gen(env.router, {"messages": [{"role": "user", "content": "y" * 20001}]},
                      path="/v1/chat/completions")
    assert status == 413 and "characters" in out["error"]
    assert stats(env.stub).get("/v1/chat/completions", 0) == 0
    assert metric(env.router, "kvrep_router_refused_total", reason="too_large") >= 3
    assert gen(env.router, {"input_ids": [1, 2, 3]})[0] == 200


# ---------------------------------------------------------------------------------------------------- hints
def test_hints_need_a_credential_and_are_rate_limited_per_tenant(env):
    r, o = env.router, env.open
    hint = {"kind": "fanout", "input_ids": list(range(10, 74)), "k": 2}
    # the router without tenants: nobody is anonymous-allowed; the read token cannot write
    assert call(o.url + "/kvrep/hints", hint, {})[0] == 401
    assert call(o.url + "/kvrep/hints", hint, o.admin("read"))[0] == 403
    # with tenants: a tenant's own key hints in its own namespace; the write token names the tenant
    assert call(r.url + "/kvrep/hints", hint, r.admin("read"))[0] == 403
    assert call(r.url + "/kvrep/hints", hint, r.admin("write"))[0] == 400  # which tenant?
    assert call(r.url + "/kvrep/hints", {**hint, "tenant": "nobody"}, r.admin("write"))[0] == 400
    before = env.coord.get("/status")[1]["num_live_hints"]
    codes = [call(r.url + "/kvrep/hints", hint, ACME)[0] for _ in range(3)]
    assert codes == [200, 200, 200]
    status, headers_ct, raw = call(r.url + "/kvrep/hints", hint, ACME)
    assert status == 429 and "acme" in json.loads(raw)["error"]
    assert call(r.url + "/kvrep/hints", {**hint, "tenant": "acme"}, r.admin("write"))[0] == 429  # same bucket
    assert call(r.url + "/kvrep/hints", hint, GLOBEX)[0] == 200  # another tenant's bucket is its own
    assert call(r.url + "/kvrep/hints", {**hint, "tenant": "globex"}, r.admin("write"))[0] == 200
    wait_until(lambda: env.coord.get("/status")[1]["num_live_hints"] >= before + 1, what="hints recorded")
    assert metric(r, "kvrep_router_refused_total", reason="rate_limited") >= 2


# --------------------------------------------------------------------------------------------- arrivals
def test_a_long_session_id_does_not_cost_the_batch_of_arrivals(env):
    before = env.coord.get("/status")[1]["num_recent_arrivals"]
    assert gen(env.router, {"input_ids": [1, 2, 3, 4], "user": "u" * 300})[0] == 200
    assert gen(env.router, {"input_ids": [1, 2, 3, 5]}, GLOBEX)[0] == 200
    wait_until(lambda: env.coord.get("/status")[1]["num_recent_arrivals"] >= before + 2,
               what="both arrivals (one with a 300-character user) reported")
    assert env.router.status()["coordinator"]["arrivals_dropped"] == 0


def test_decisions_carry_the_clients_request_id_and_status_bounds_how_many(env):
    """A benchmark joins its requests to the router's decisions by `X-Request-Id`; an id that is not short
    printable ASCII is not kept; `/kvrep/status?decisions=N` is bounded."""
    assert gen(env.router, {"input_ids": [1, 2, 3, 6]}, {**ACME, "X-Request-Id": "cell-7"})[0] == 200
    assert gen(env.router, {"input_ids": [1, 2, 3, 7]}, {**ACME, "X-Request-Id": "x" * 129})[0] == 200
    last = env.router.status()["last_decisions"]
    assert last[-2]["request_id"] == "cell-7" and last[-2]["prompt_len"] == 4 and "request_id" not in last[-1]
    assert len(env.router.status(1)["last_decisions"]) == 1 and env.router.status(0)["last_decisions"] == []
    for bad in ("4097", "-1", "many"):
        status, _, raw = call(f"{env.router.url}/kvrep/status?decisions={bad}", headers=env.router.admin("read"))
        assert status == 400 and b"decisions must be an integer in 0..4096" in raw


# ----------------------------------------------------------------------------------- tokenizing off the loop
class GatedTokenizer:
    """A real tokenizer whose calls wait for `gate` (so a tokenization is "long" for exactly as long as the test
    wants): if the router tokenized on its event loop, nothing else could be answered meanwhile."""

    def __init__(self, tok):
        self.tok, self.gate, self.entered = tok, threading.Event(), threading.Event()

    def __call__(self, text, **kw):
        if len(text) > 1000:
            self.entered.set()
            assert self.gate.wait(30)
        return self.tok(text, **kw)

    def __len__(self):
        return len(self.tok)

    def encode(self, *a, **kw):
        return self.tok.encode(*a, **kw)


def test_a_long_tokenization_leaves_the_event_loop_serving(tmp_path):
    import asyncio

    import aiohttp

    from kvrep_dev.cluster import model_path
    from kvrep_dev.stub_worker import build_stub
    from radix_sync.router.app import build_app
    from radix_sync.router.config import RouterConfig
    from radix_sync.router.tokenize import PromptTokenizer
    from tests.util import serve_app

    real = PromptTokenizer.from_pretrained(model_path("tiny"))
    gated = GatedTokenizer(real.tok)

    async def main():
        async with serve_app(build_stub("W")) as worker:
            cfg = RouterConfig(port=0, worker_urls=(worker,), state_dir=str(tmp_path))
            app = build_app(cfg, PromptTokenizer(gated, real.vocab_size))
            async with serve_app(app) as router, aiohttp.ClientSession() as s:
                big = asyncio.create_task(s.post(router + "/generate", json={"text": "word " * 50_000}))
                assert await asyncio.get_running_loop().run_in_executor(None, gated.entered.wait, 30)
                # the long one is being tokenized (held at the gate): short ones are answered meanwhile
                for k in range(3):
                    async with s.post(router + "/generate", json={"input_ids": [1, 2, k]},
                                      timeout=aiohttp.ClientTimeout(total=10)) as resp:
                        assert resp.status == 200
                    async with s.get(router + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                        assert resp.status == 200
                assert not big.done()
                gated.gate.set()
                resp = await big
                assert resp.status == 200 and (await resp.json())["meta_info"]["served_by"] == "W"
                # the 2M-token request: refused at once (no tokenizing, no worker), by the default caps
                async with s.post(router + "/generate", json={"text": "word " * 2_000_000}) as resp:
                    assert resp.status == 413
                async with s.post(router + "/generate", json={"input_ids": [7] * 2_000_000}) as resp:
                    assert resp.status == 413
                async with s.post(router + "/generate", json={"input_ids": [5, 6, 7, real.vocab_size]}) as resp:
                    assert resp.status == 400  # the tokenizer's model vocabulary bounds the ids
    asyncio.run(main())
