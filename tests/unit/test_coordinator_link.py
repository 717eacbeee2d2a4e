"""The router's link to the coordinator: lookups beyond the in-flight bound are shed, not a reason to back off."""
import asyncio

import aiohttp
from aiohttp import web

from radix_sync.router.coordinator_link import CoordinatorLink, LinkConfig
from tests.util import serve_app


def test_lookups_beyond_the_bound_are_shed_and_the_coordinator_stays_reachable():
    release = asyncio.Event()
    seen = []

    async def lookup(request):
        seen.append(await request.json())
        await release.wait()
        return web.json_response({"matched": {"w1": 32}})

    async def main():
        app = web.Application()
        app.router.add_post("/directory/lookup", lookup)
        async with serve_app(app) as url, aiohttp.ClientSession() as session:
            link = CoordinatorLink(LinkConfig(url=url, timeout_s=5.0, max_inflight_lookups=2), session)
            calls = [asyncio.ensure_future(link.lookup([1] * 32, "", ([7, 8], 16))) for _ in range(5)]
            while len(seen) < 2:
                await asyncio.sleep(0.01)
            release.set()
            out = await asyncio.gather(*calls)
            again = await link.lookup([1] * 32, "t")
            return out, link, again

    out, link, again = asyncio.run(main())
    assert out.count({"w1": 32}) == 2 and out.count(None) == 3
    assert link.num_lookups_shed == 3 and link.reachable and link.may_call()
    assert again == {"w1": 32}
    assert seen[0] == {"page_hashes": [7, 8], "page_size": 16} and seen[-1] == {"input_ids": [1] * 32,
                                                                                 "cache_salt": "t"}


def test_answers_are_decoded_with_the_api_structs_and_a_misfit_is_a_failed_call():
    from radix_sync import api

    worker = {"id": "w1", "url": "http://w1", "data_endpoint": "tcp://w1:1", "fingerprint": "f",
              "fingerprint_fields": {}, "page_size": 16, "pool_capacity_tokens": 100, "replica_budget_tokens": 25,
              "load": {"num_running_reqs": 1, "num_waiting_reqs": 2, "num_waiting_tokens": 3, "available_tokens": 4,
                       "evictable_tokens": 5, "replica_tokens": 6, "demoted_chains": 0,
                       "demoted_evicted_tokens": 0, "demotions_taken_back": 0}, "plain": False}
    rep = api.to_builtins(api.ReplicationInfo(id="r1", source="w1", target="w2", namespace="t", num_tokens=32,
                                              ttl_s=5.0, origin="admin", state="running", error=None,
                                              num_bytes=0))
    answers = {"/workers": [worker], "/replications": [rep, {**rep, "id": "r2", "state": "done"}]}
    hints = []

    asked = []

    async def get(request):
        asked.append(request.path_qs)
        return web.json_response(answers[request.path])

    async def hint(request):
        hints.append(await request.json())
        return web.json_response({"recorded": 1, "kind": "fanout", "prefix_len": 16})

    async def main():
        app = web.Application()
        app.router.add_get("/workers", get)
        app.router.add_get("/replications", get)
        app.router.add_post("/hints", hint)
        async with serve_app(app) as url, aiohttp.ClientSession() as session:
            link = CoordinatorLink(LinkConfig(url=url, timeout_s=5.0), session)
            state = await link.cluster_state(force=True)
            # a hint that does not fit the API is refused here, and not sent
            refused = await link.hint({"kind": "fanout", "input_ids": [1], "k": "eight"})
            sent = await link.hint({"kind": "fanout", "input_ids": list(range(16)), "k": 8, "cache_salt": ""})
            # a malformed report is dropped and counted, not queued
            link.report_arrival({"input_ids": [1, -1]})
            answers["/workers"] = [{"id": "w1"}]  # an answer that does not fit: a failed call
            broken = await link.cluster_state(force=True)
            return link, state, refused, sent, broken

    link, state, refused, sent, broken = asyncio.run(main())
    assert state.workers == (worker,)
    assert [(c.source, c.target, c.namespace, c.num_tokens) for c in state.copies] == [("w1", "w2", "t", 32)]
    assert asked[:2] == ["/workers", "/replications?state=pending,running"]  # not the whole history
    assert refused[0] == 400 and "at `$.k`" in refused[1]["error"]
    assert sent == (200, {"recorded": 1, "kind": "fanout", "prefix_len": 16})
    assert hints == [{"kind": "fanout", "input_ids": list(range(16)), "cache_salt": "", "k": 8}]
    assert link.num_arrivals_dropped == 1 and link._arrivals == []
    assert broken is None and not link.reachable and "missing required field `url`" in link.last_error


def test_a_hint_that_meets_a_backoff_is_sent_again_when_the_backoff_ends():
    """A coordinator that timed out once (the link backing off) still gets the hint: the send waits out the backoff
    and tries again, instead of dropping it."""
    from types import SimpleNamespace

    from radix_sync.router.app import _post_hint

    calls = []

    async def hint(request):
        calls.append(await request.json())
        if len(calls) == 1:
            await asyncio.sleep(1.0)  # past the link's timeout: the link backs off
        return web.json_response({"recorded": 1, "kind": "fanout", "prefix_len": 16})

    async def main():
        app = web.Application()
        app.router.add_post("/hints", hint)
        async with serve_app(app) as url, aiohttp.ClientSession() as session:
            link = CoordinatorLink(LinkConfig(url=url, timeout_s=0.2, backoff_min_s=0.3), session)
            out = await _post_hint(SimpleNamespace(link=link), {"kind": "fanout", "input_ids": list(range(16)),
                                                                "k": 8, "cache_salt": ""})
            return out, link

    (status, answer), link = asyncio.run(main())
    assert status == 200 and answer["recorded"] == 1
    assert len(calls) == 2 and calls[0] == calls[1] and link.reachable
