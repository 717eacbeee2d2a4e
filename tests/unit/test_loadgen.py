"""The live load generator: scaling a simulator workload, rendering pages to text, replaying it over HTTP."""
import asyncio
import math

import pytest
from aiohttp import web

from kvrep_dev.loadgen import Renderer, ReplayConfig, Result, Scale, replay, scale_workload, summarize, workload_size
from radix_sync.sim.generators import FanoutWorkload, GeneratorConfig
from radix_sync.sim.workload import Session, SimRequest, TurnSpec, Workload
from tests.util import serve_app


class WordTokenizer:
    """One token per space-prefixed word (what the renderer relies on), like a byte-level BPE on whole words."""

    def __init__(self, words):
        self.vocab = {"\u0120" + w: i for i, w in enumerate(words)}

    def get_vocab(self):
        return dict(self.vocab)

    def encode(self, text, add_special_tokens=False):
        return [self.vocab["\u0120" + w] for w in text.split(" ") if w]


WORDS = [f"{a}{b}{c}" for a in "abcdefgh" for b in "ijklmnop" for c in "qrstu"]


def fanout(page_len=64, k=3, rate=0.5, duration=20.0):
    cfg = GeneratorConfig(page_len=page_len, fanout_k=k, fanout_prefix_min_len=1024, fanout_branch_len=128,
                          fanout_output_len=200, fanout_delay_s=0.5)
    return FanoutWorkload(cfg, rate, duration, seed=1, max_context_len=100000)


def test_scale_keeps_page_identity_and_caps_lengths():
    wl = fanout()
    before = [(t.prompt_len, list(t.pages), t.output_len) for _, s in wl.session_starts for t in s.turns]
    small = scale_workload(wl, Scale(token_factor=0.25, max_prompt_tokens=100000, max_output_tokens=8,
                                     think_factor=0.5, max_think_s=5.0))
    assert small.page_len == 16 and wl.page_len == 64
    after = [(t.prompt_len, t.pages, t.output_len) for _, s in small.session_starts for t in s.turns]
    assert [(p, list(pg), o) for p, pg, o in before] == [(t.prompt_len, t.pages, t.output_len)
                                                         for _, s in wl.session_starts for t in s.turns]
    for (p0, pages0, _), (p1, pages1, o1) in zip(before, after):
        assert pages1 == pages0  # same page ids: the same sharing
        assert p1 == len(pages0) * 16 + round((p0 - len(pages0) * 64) * 0.25)
        assert o1 == 8
    assert small.delay_s == pytest.approx(0.25)
    assert workload_size(small)["requests"] == workload_size(wl)["requests"] > 0


def test_scale_cuts_long_prompts_to_their_leading_pages():
    wl = Workload()
    wl.page_len = 4
    req = SimRequest(0, 42, 300, list(range(10)), arrival_s=1.0)
    wl.open_requests.append(req)
    wl.session_starts.append((0.0, Session([TurnSpec(42, 5, list(range(10)), "tool_use", 50.0)], 0, "c")))
    small = scale_workload(wl, Scale(token_factor=0.5, max_prompt_tokens=9, max_output_tokens=16, think_factor=0.1,
                                     max_think_s=2.0))
    r = small.open_requests[0]
    assert small.page_len == 2 and r.pages == [0, 1, 2, 3] and r.prompt_len == 8 + 1 - 0  # 4 pages + 1 tail, cut at 9
    assert r.output_len == 16
    t = small.session_starts[0][1].turns[0]
    assert t.think_s == 2.0 and t.output_len == 5
    with pytest.raises(ValueError):
        Scale(token_factor=0)


def test_renderer_shares_exactly_the_shared_pages():
    tok = WordTokenizer(WORDS)
    r = Renderer(tok, salt=3)
    a = SimRequest(1, 3 * 8 + 5, 4, [10, 11, 12])
    b = SimRequest(2, 4 * 8, 4, [10, 11, 13, 14])
    ta, tb = tok.encode(r.prompt(a, 8)), tok.encode(r.prompt(b, 8))
    assert len(ta) == 29 and len(tb) == 32
    common = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert common >= 16 and ta[:16] == tb[:16]
    assert ta[16:24] != tb[16:24]
    # another salt: same shape, other text (a benchmark arm must not hit the previous arm's cache)
    other = Renderer(tok, salt=4)
    assert tok.encode(other.prompt(a, 8))[:8] != ta[:8]
    assert len(tok.encode(other.prompt(a, 8))) == 29


def test_renderer_refuses_a_tokenizer_without_one_token_words():
    class Bad(WordTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [0] * (2 * len(text.split()))

    with pytest.raises(ValueError, match="one-token words"):
        Renderer(Bad(WORDS))
    with pytest.raises(ValueError):
        Renderer(WordTokenizer(["ab", "cd"]))


def test_summarize_statistics_and_errors():
    rs = [Result(i, "x", float(i), prompt_tokens=100, cached_tokens=50, output_tokens=5, ttft_s=t, e2e_s=t + 0.4)
          for i, t in enumerate([0.1, 0.2, 0.3, 0.4])]
    rs.append(Result(9, "x", 9.0, error="HTTP 500"))
    s = summarize(rs)
    assert s["requests"] == 5 and s["errors"] == 1
    assert s["ttft_s"]["mean"] == pytest.approx(0.25) and s["ttft_s"]["p50"] == pytest.approx(0.25)
    assert s["ttft_s"]["p99"] == pytest.approx(0.397)
    assert s["tpot_s"]["mean"] == pytest.approx(0.1)
    assert s["cached_token_ratio"] == pytest.approx(0.5)
    assert math.isnan(summarize([])["ttft_s"]["mean"])


def test_replay_sends_sessions_closed_loop_with_hints_then_all_branches():
    """A real HTTP server (aiohttp) records what arrives and when."""
    from kvrep_dev.stub_worker import build_stub

    tok = WordTokenizer(WORDS)
    seen, hints, ids = [], [], []
    stub = build_stub("s", delay_s=0.01)
    gen = next(r.handler for r in stub.router.routes() if r.resource.canonical == "/generate")

    async def generate(request):
        body = await request.json()
        seen.append((asyncio.get_running_loop().time(), len(body["text"].split())))
        ids.append(request.headers.get("X-Request-Id"))
        return await gen(request)

    async def hint(request):
        hints.append(await request.json())
        return web.json_response({"recorded": 1})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/kvrep/hints", hint)
    wl = scale_workload(fanout(k=3, rate=2.0, duration=3.0), Scale(token_factor=0.125, max_output_tokens=3,
                                                                    think_factor=0.2))
    n = workload_size(wl)["requests"]
    assert n >= 4

    async def main():
        async with serve_app(app) as url:
            return await replay(wl, Renderer(tok, 0), ReplayConfig(url=url, hints_url=url + "/kvrep/hints",
                                                                   request_id_prefix="c3-"))

    results = asyncio.run(main())
    assert len(results) == n == len(seen)
    assert all(r.error is None and r.ttft_s <= r.e2e_s and r.output_tokens == 3 for r in results)
    assert sorted(ids) == sorted(r.request_id for r in results) == sorted(f"c3-{r.rid}" for r in results)
    trees = n // 4
    assert len(hints) == trees and all(h["kind"] == "fanout" and h["k"] == 3 for h in hints)
    # the first tree: its trunk arrives first; its 3 branches (16 more tokens each) after the trunk's answer
    # (>= 3 tokens x 10 ms) plus the scaled fan-out delay (0.5 s x 0.2)
    t0, trunk_words = seen[0]
    branches = [t for t, words in seen if words == trunk_words + 16]
    assert len(branches) == 3 and min(branches) >= t0 + 0.03 + 0.1


def test_an_arm_at_n_front_doors_and_the_client_spreading_requests_over_them():
    import pytest

    from kvrep_dev.bench import MAX_FRONTS, split_arm
    from kvrep_dev.loadgen import ReplayConfig, _front

    assert split_arm("shadow") == ("shadow", 1) and split_arm("smg-ca@4") == ("smg-ca", 4)
    for bad in ("nope@2", "shadow@0", f"shadow@{MAX_FRONTS + 1}", "shadow@x"):
        with pytest.raises(ValueError):
            split_arm(bad)
    cfg = ReplayConfig(url="http://a", more_urls=("http://b", "http://c"))
    assert [_front(cfg, rid) for rid in range(5)] == ["http://a", "http://b", "http://c", "http://a", "http://b"]
    assert _front(ReplayConfig(url="http://a"), 7) == "http://a"


def test_a_cell_keeps_only_its_own_requests_decisions():
    from kvrep_dev.bench import cell_decisions

    class FakeRouter:
        asked = None

        def status(self, n):
            self.asked = n
            return {"last_decisions": [{"request_id": "3-1"}, {"request_id": "4-1"}, {}, {"request_id": "4-12"},
                                       {"request_id": "14-1"}]}

    router = FakeRouter()
    assert cell_decisions(router, "4-") == [{"request_id": "4-1"}, {"request_id": "4-12"}] and router.asked == 4096
