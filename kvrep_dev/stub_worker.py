"""A stub SGLang worker (aiohttp) for the router's component tests and `scripts/bench_router.py`: no model.

It answers `/generate`, `/v1/completions` and `/v1/chat/completions` (streaming or not) in SGLang's shapes, with
`num_tokens` fake output tokens `delay_s` apart, and says in every answer who served it and which `cache_salt` it
received (`meta_info.served_by`, `meta_info.cache_salt`; OpenAI answers carry the same under `sglext`); a streamed
answer's first output waits the body's `stub_hold_s` (at most 30 s: a long prefill, its headers already sent). Also
`/v1/models`, `/model_info`, `/server_info`, `/flush_cache`, `/health`. Run: `python -m kvrep_dev.stub_worker
--port P --name A`.

Like SGLang: with `--api-key KEY` every route but `/health` answers 401 without `Authorization: Bearer KEY`, and
`/server_info` quotes the key (its server args and launch command); with `--vocab-size N` a prompt holding a token
id >= N kills the process (what one out-of-vocabulary id does to an SGLang 0.5.23 CPU worker).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Optional

from aiohttp import web


def _meta(name: str, body: dict, n: int) -> dict:
    prompt = body.get("input_ids") or body.get("prompt") or body.get("text") or body.get("messages") or []
    return {"id": "stub", "served_by": name, "cache_salt": body.get("cache_salt"), "extra_key": body.get("extra_key"),
            "kv_hints": body.get("kv_hints"), "prompt_tokens": len(prompt), "completion_tokens": n, "cached_tokens": 0, "finish_reason": {"type": "length"}}


def _out_of_vocab(body: dict, vocab_size: int) -> bool:
    ids = body.get("input_ids") if body.get("input_ids") is not None else body.get("prompt")
    if not isinstance(ids, list):
        return False
    rows = ids if ids and isinstance(ids[0], list) else [ids]
    return any(isinstance(t, int) and not 0 <= t < vocab_size for row in rows if isinstance(row, list) for t in row)


def build_stub(name: str, num_tokens: int = 4, delay_s: float = 0.0, api_key: Optional[str] = None,
               vocab_size: Optional[int] = None, drop_reused: bool = False) -> web.Application:
    """Returns: the stub app; `app["stats"]` counts requests per path. With `drop_reused`, a generation request on a
    connection that already had one is read and the connection closed without an answer (`stats["dropped"]`): what
    a client sees when it reuses a pooled connection the server is closing as idle."""
    stats: dict[str, int] = {}
    answered: set = set()  # the peer address of each connection that had a generation request

    @web.middleware
    async def check_key(request: web.Request, handler):
        if api_key and request.path not in ("/health", "/stub/stats") \
                and request.headers.get("Authorization") != f"Bearer {api_key}":
            stats["unauthorized"] = stats.get("unauthorized", 0) + 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def gen(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        if drop_reused and peer in answered:
            answered.discard(peer)
            stats["dropped"] = stats.get("dropped", 0) + 1
            request.transport.close()
            return web.Response(status=500)  # never reaches the client: the connection is closed
        answered.add(peer)
        stats[request.path] = stats.get(request.path, 0) + 1
        if vocab_size is not None and _out_of_vocab(body, vocab_size):
            print(f"stub worker {name}: IndexError: token id out of the vocabulary ({vocab_size}); exiting",
                  flush=True)
            os._exit(1)
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or body.get("max_tokens") or num_tokens)
        meta = _meta(name, body, n)
        oai = request.path.startswith("/v1/")
        if not body.get("stream"):
            if delay_s:
                await asyncio.sleep(delay_s * n)
            text = "x" * n
            if oai:
                key = "message" if "chat" in request.path else "text"
                choice = {"index": 0, key: {"role": "assistant", "content": text} if key == "message" else text,
                          "finish_reason": "length"}
                return web.json_response({"id": "stub", "object": "completion", "model": "stub", "choices": [choice],
                                          "usage": {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": n},
                                          "sglext": meta})
            return web.json_response({"text": text, "output_ids": [7] * n, "meta_info": meta})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        hold_s = min(30.0, max(0.0, float(body.get("stub_hold_s") or 0.0)))
        if hold_s:  # (a long prefill: the answer has started, its first output has not come)
            await asyncio.sleep(hold_s)
        for i in range(n):
            if delay_s:
                await asyncio.sleep(delay_s)
            if oai:
                delta = {"delta": {"content": "x"}} if "chat" in request.path else {"text": "x"}
                chunk = {"id": "stub", "choices": [{"index": 0, **delta, "finish_reason": None}], "sglext": meta}
            else:
                chunk = {"text": "x" * (i + 1), "output_ids": [7] * (i + 1), "meta_info": {**meta, "seq": i}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stub-model", "tokenizer_path": "stub-model", "served_by": name,
                                  "page_size": 16, "api_key": api_key,
                                  "launch_command": f"stub --api-key {api_key}" if api_key else "stub"})

    async def flush(request: web.Request) -> web.Response:
        stats["/flush_cache"] = stats.get("/flush_cache", 0) + 1
        return web.Response(text="Cache flushed.\n")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application(middlewares=[check_key])
    app["stats"] = stats
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, gen)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/model_info", info)
    app.router.add_get("/server_info", info)
    app.router.add_route("*", "/flush_cache", flush)
    app.router.add_get("/health", health)
    app.router.add_get("/stub/stats", get_stats)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="stub")
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--delay-s", type=float, default=0.0, help="seconds per output token")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (as SGLang's --api-key)")
    ap.add_argument("--vocab-size", type=int, default=None, help="exit on a token id >= this (as SGLang on CPU)")
    ap.add_argument("--drop-reused", action="store_true",
                    help="close a connection, unanswered, at its second generation request (a stale keep-alive)")
    args = ap.parse_args()
    print(f"stub worker {args.name} on {args.port} at {time.time():.0f}", flush=True)
    web.run_app(build_stub(args.name, args.num_tokens, args.delay_s, args.api_key, args.vocab_size,
                           args.drop_reused), host=args.host,
                port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
