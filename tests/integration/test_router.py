"""The router end to end on real CPU SGLang workers (the shared `cluster`: coordinator + workers A and B).

A session's second turn lands on the worker whose cache holds its first turn and reports those cached tokens;
the router's token ids equal the worker's (prompt_tokens); two tenants sending the same prompt never share KV;
streaming works through the router.
"""
import json
import urllib.request

import pytest

from kvrep_dev.cluster import Router, http_json, model_path
from radix_sync.secret_files import read_secret
from radix_sync.router.tenants import derive_namespace

from .conftest import LOGS, PAGE_SIZE, router_keys, router_status, wait_router_synced, wait_until

pytestmark = pytest.mark.server

KEYS = {"tenants": {"acme": {"namespace": "ns-acme", "api_keys": ["sk-acme"]},
                    "globex": {"namespace": "ns-globex", "api_keys": ["sk-globex"]}}}
ACME, GLOBEX = "sk-acme", "sk-globex"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def text(seed: int, num_words: int = 120) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] + str(i % 10) for i in range(num_words))


def post(url: str, body: dict, key: str, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def floor_page(n: int) -> int:
    return n // PAGE_SIZE * PAGE_SIZE


@pytest.fixture(scope="module")
def router(cluster):
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / "router-tenants.json").write_text(json.dumps(KEYS))
    proc = Router(LOGS, router_keys(), coordinator=cluster.coord, tokenizer=model_path("tiny"),
                  extra_args=("--tenants", str(LOGS / "router-tenants.json")))
    url = proc.url

    def up():
        try:
            return http_json(url + "/health", timeout=1)[0] == 200
        except OSError:
            assert proc.alive(), proc.tail()
            return False
    try:
        wait_until(up, timeout_s=120, what="router up")
        yield url
    finally:
        proc.stop()


def last_decision(router: str) -> dict:
    return router_status(router)["last_decisions"][-1]


def namespace(label: str) -> str:
    """Returns: the `cache_salt` the test router gives a tenant labelled `label` (HMAC under the tenant secret)."""
    return derive_namespace(read_secret(router_keys() / "tenant-secret"), label)


def generate(router: str, prompt: str, key: str, **extra) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, **extra}
    return post(router + "/generate", body, key)["meta_info"]


@pytest.mark.parametrize("holder_name", ["a", "b"])
def test_second_turn_lands_on_the_worker_holding_the_first(cluster, router, holder_name):
    holder = getattr(cluster, holder_name)
    turn1 = text(10 + (holder_name == "b"))
    # turn 1 ran on `holder` in acme's namespace (as the router would have sent it)
    status, out = http_json(holder.url + "/generate", {"text": turn1, "cache_salt": namespace("ns-acme"),
                                                        "sampling_params": {"max_new_tokens": 4}})
    assert status == 200, out
    turn1_len = out["meta_info"]["prompt_tokens"]
    assert len(_ids(turn1)) == turn1_len
    wait_until(lambda: cluster.lookup(_ids(turn1), namespace("ns-acme")).get(holder.worker_id, 0)
               >= floor_page(turn1_len),
               what="directory shows turn 1 on the holder")
    wait_router_synced(cluster.coord, router)
    meta = generate(router, turn1 + " zulu yankee xray and a follow-up question", ACME)
    d = last_decision(router)
    assert d["worker"] == holder.url, d
    assert d["mode"] == "directory" and d["cached_tokens"] >= floor_page(turn1_len) - PAGE_SIZE
    assert meta["cached_tokens"] >= floor_page(turn1_len) - PAGE_SIZE
    assert meta["prompt_tokens"] == d["prompt_len"]  # the router tokenized exactly as the worker


_TOKENIZER = None


def _ids(prompt: str) -> list[int]:
    global _TOKENIZER
    if _TOKENIZER is None:
        from radix_sync.router.tokenize import PromptTokenizer
        _TOKENIZER = PromptTokenizer.from_pretrained(model_path("tiny"))
    return _TOKENIZER.prompt_ids("generate", {"text": prompt})


def test_chat_session_through_the_router(cluster, router):
    messages = [{"role": "system", "content": text(20)}, {"role": "user", "content": "first question?"}]
    out1 = post(router + "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0}, ACME)
    d1 = last_decision(router)
    assert out1["usage"]["prompt_tokens"] == d1["prompt_len"]  # chat template applied as the worker does
    reply = out1["choices"][0]["message"]["content"]
    holder = cluster.a if d1["worker"] == cluster.a.url else cluster.b
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "second question?"}]

    def second_turn_hits():
        post(router + "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0}, ACME)
        return last_decision(router)
    # the first turn's pages reach the directory through KV events; retry until they have
    d2 = wait_until(lambda: (lambda d: d if (d["cached_tokens"] or 0) >= floor_page(d1["prompt_len"]) - PAGE_SIZE
                             else None)(second_turn_hits()), timeout_s=20, what="second turn routed to the cache")
    if d2["worker"] != holder.url:  # only a replica made meanwhile (the coordinator runs the rule policy) may win
        reps = cluster.coord.get("/replications")[1]
        assert any(r["state"] == "done" and r["target"] != holder.worker_id for r in reps), d2


def test_two_tenants_never_share_cached_tokens(cluster, router):
    prompt = text(30)
    a1 = generate(router, prompt, ACME)
    wait_until(lambda: generate(router, prompt, ACME)["cached_tokens"] > 0, what="acme hits its own cache")
    # globex sends the same prompt and even claims acme's namespace: the router overrides it
    g1 = generate(router, prompt, GLOBEX, cache_salt=namespace("ns-acme"), extra_key=namespace("ns-acme"))
    # the router saw none of acme's pages as globex's at any worker (`cached_tokens` is None on a failover, when
    # the first choice dropped the request before answering: the worker's own count above still holds)
    d = last_decision(router)
    assert g1["cached_tokens"] == 0 and d["cached_tokens"] in (0, None) and not any(d["cached_by_worker"]), d
    assert a1["prompt_tokens"] == g1["prompt_tokens"]
    wait_until(lambda: generate(router, prompt, GLOBEX)["cached_tokens"] > 0, what="globex hits its own cache")


def test_streaming_through_the_router(cluster, router):
    body = {"text": text(40, 30), "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    req = urllib.request.Request(router + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {ACME}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert "text/event-stream" in resp.headers["Content-Type"]
        events = [e for e in resp.read().decode().split("\n\n") if e.strip()]
    assert events[-1].strip() == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["meta_info"]["completion_tokens"] == 6 and len(events) >= 3


def test_a_replayed_fanout_workload_through_the_router(cluster, router):
    """The live benchmark's load generator against the real router: a trunk with its fan-out hint, then its
    branches together; every request answers, token counts agree, and branches reuse the trunk's pages."""
    import asyncio

    from transformers import AutoTokenizer

    from kvrep_dev.loadgen import Renderer, ReplayConfig, Scale, replay, scale_workload, workload_size
    from radix_sync.sim.generators import FanoutWorkload, GeneratorConfig

    cfg = GeneratorConfig(page_len=16, fanout_k=3, fanout_prefix_min_len=256, fanout_branch_len=32,
                          fanout_output_len=4, fanout_delay_s=0.1)
    wl = scale_workload(FanoutWorkload(cfg, rate=2.0, duration_s=4.0, seed=3, max_context_len=4096),
                        Scale(max_output_tokens=4))
    n = workload_size(wl)["requests"]
    assert n >= 4
    hints_before = cluster.coord.get("/status")[1]["num_live_hints"]
    renderer = Renderer(AutoTokenizer.from_pretrained(model_path("tiny")), salt=11)
    expected = {}
    for _, s in wl.session_starts:
        for t in s.turns:
            expected.setdefault(t.prompt_len, 0)
    results = asyncio.run(replay(wl, renderer, ReplayConfig(url=router, hints_url=router + "/kvrep/hints",
                                                            api_key=ACME)))
    assert len(results) == n and all(r.error is None for r in results), [r.error for r in results]
    assert {r.prompt_tokens for r in results} <= set(expected)  # the renderer's lengths are the workers' lengths
    assert all(r.ttft_s <= r.e2e_s and r.output_tokens == 4 for r in results)
    trunk_len = min(expected)
    branches = [r for r in results if r.prompt_tokens == trunk_len + 32]
    assert branches and max(r.cached_tokens for r in branches) >= floor_page(trunk_len)
    assert cluster.coord.get("/status")[1]["num_live_hints"] > hints_before
