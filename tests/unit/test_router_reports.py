"""What the router reports to the coordinator: how an answer ended, and arrivals and finishes in order."""
import asyncio
import json

import aiohttp
from aiohttp import web

from radix_sync.router.coordinator_link import CoordinatorLink, LinkConfig
from radix_sync.router.proxy import finish_reason
from tests.util import serve_app


def test_finish_reason_from_sglang_openai_and_streamed_answers():
    sglang = {"text": "hi", "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 8},
                                          "prompt_tokens": 3}}
    assert finish_reason(json.dumps(sglang).encode()) == "length"
    stop = {"meta_info": {"finish_reason": {"matched": 2, "type": "stop"}}}  # key order does not matter
    assert finish_reason(json.dumps(stop).encode()) == "stop"
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": [{"id": "c"}]},
                         "finish_reason": "tool_calls"}]}
    assert finish_reason(json.dumps(chat).encode()) == "tool_use"
    # a stream: every chunk but the last says null; the last one wins
    chunks = [{"choices": [{"delta": {"content": "a"}, "finish_reason": None}]},
              {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
    sse = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    assert finish_reason(sse) == "stop"
    assert finish_reason(b'data: {"meta_info": {"finish_reason": null}}\n\n') is None
    assert finish_reason(b'{"error": "bad"}') is None and finish_reason(b"") is None


def test_arrivals_and_finishes_go_in_one_batch_numbered_in_report_order():
    bodies = []
    status = [200]

    async def arrivals(request):
        bodies.append(await request.json())
        return web.json_response({"recorded": 1}, status=status[0])

    async def main():
        app = web.Application()
        app.router.add_post("/arrivals", arrivals)
        async with serve_app(app) as url, aiohttp.ClientSession() as session:
            link = CoordinatorLink(LinkConfig(url=url, timeout_s=5.0), session)
            link.report_arrival({"input_ids": [1, 2]})
            link.report_finish({"input_ids": [1, 2], "stop": "length"})
            link.report_arrival({"input_ids": [3]})
            await link.flush_arrivals()
            await link.flush_arrivals()  # nothing queued: no call
            status[0] = 400  # a refused batch is dropped and counted, not retried forever
            link.report_finish({"input_ids": [4]})
            await link.flush_arrivals()
            return link

    link = asyncio.run(main())
    assert len(bodies) == 2
    first = bodies[0]
    assert [a["seq"] for a in first["arrivals"]] == [1, 3] and [f["seq"] for f in first["finishes"]] == [2]
    assert first["finishes"][0]["stop"] == "length"
    assert (link.num_arrivals_sent, link.num_finishes_sent, link.num_finishes_dropped) == (2, 1, 1)
