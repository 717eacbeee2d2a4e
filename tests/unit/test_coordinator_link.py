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
