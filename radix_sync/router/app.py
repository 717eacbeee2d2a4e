"""The router's HTTP app (aiohttp): SGLang's native and OpenAI endpoints, the router's own, and `serve`.

Each handler is the HTTP edge of one call on the `Router` (`radix_sync.router.service`): the tenant from the API
key (401 if unknown), the JSON body (413 over `max_body_bytes`, 400 if bad), the bounds (`limits`: token ids
outside the vocabulary 400, prompts, batches and chats over their caps 413), the prompt's token ids (`tokenize`;
text is tokenized in a thread pool, off the event loop), then the router decides and forwards. The admin routes
need the router's tokens (`auth`); `/health` is open and says only ok or not. Run by `kvrep router`
(`radix_sync.cli`), or in-process with `build_app` (tests, `scripts/bench_router.py`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Optional

import aiohttp
from aiohttp import web

from radix_sync import kv_hints
from radix_sync.fastjson import loads as _loads
from radix_sync.router.auth import READ, WRITE, RouterSecrets, admin_level, admin_middleware, refuse
from radix_sync.router.config import RouterConfig
from radix_sync.router.limits import TooLarge, check_request
from radix_sync.router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radix_sync.router.proxy import NoWorker
from radix_sync.router.service import MAX_DECISIONS_KEPT, Router
from radix_sync.router.tenants import Tenant, TenantTable, Unauthorized, apply_namespace
from radix_sync.router.tokenize import BadRequest, PromptTokenizer, needs_tokenizing

log = logging.getLogger("kvrep.router")

ROUTER_KEY = web.AppKey("router", Router)


def _router(request: web.Request) -> Router:
    return request.app[ROUTER_KEY]


def _tenant(request: web.Request) -> Tenant:
    r = _router(request)
    try:
        return r.tenants.resolve(request.headers.get("Authorization"), request.headers.get("x-api-key"))
    except Unauthorized as exc:
        r.metrics.unauthorized.inc()
        raise web.HTTPUnauthorized(text=json.dumps({"error": str(exc)}), content_type="application/json") from None


async def _json_body(request: web.Request) -> dict:
    try:
        body = _loads(await request.read())
    except ValueError:  # json.JSONDecodeError and orjson.JSONDecodeError are ValueErrors
        raise web.HTTPBadRequest(text=json.dumps({"error": "body is not JSON"}), content_type="application/json")
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}),
                                 content_type="application/json")
    return body


class _PayloadTooLarge(web.HTTPClientError):
    """413 with our own message (aiohttp's `HTTPRequestEntityTooLarge` writes its own)."""

    status_code = 413


def _error(cls, message: str) -> web.HTTPException:
    return cls(text=json.dumps({"error": message}), content_type="application/json")


async def _prompt_ids(r: Router, endpoint: str, body: dict) -> list[int]:
    """Returns: the prompt's token ids, once the whole body is within bounds (400/413 otherwise)."""
    try:
        check_request(endpoint, body, r.bounds())
        tok = r.tokenizer
        if tok is None:
            ids = body.get("input_ids") if endpoint == "generate" else body.get("prompt")
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                ids = ids[0]
            return ids if isinstance(ids, list) and ids and isinstance(ids[0], int) else []  # else: by load only
        if not needs_tokenizing(endpoint, body):
            return tok.prompt_ids(endpoint, body)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(r.tokenize_pool, tok.prompt_ids, endpoint, body)
        except BadRequest:
            raise
        except Exception as exc:  # noqa: BLE001 - a chat template that cannot render this body: the client's error
            log.info("could not tokenize a %s prompt: %s: %s", endpoint, type(exc).__name__, exc)
            raise BadRequest(f"could not tokenize the prompt: {type(exc).__name__}: {exc}"[:500]) from None
        if len(ids) > r.cfg.max_prompt_tokens:
            raise TooLarge(f"the prompt is {len(ids)} tokens, the limit is {r.cfg.max_prompt_tokens}")
        return ids
    except TooLarge as exc:
        r.metrics.refused.labels("too_large").inc()
        raise _error(_PayloadTooLarge, str(exc)) from None
    except BadRequest as exc:
        r.metrics.refused.labels("bad_request").inc()
        raise _error(web.HTTPBadRequest, str(exc)) from None


def _num_prompts(endpoint: str, body: dict) -> int:
    """Prompts in a request as SGLang counts them for `kv_hints` (a batch: one per prompt)."""
    if endpoint == "chat":
        return 1
    for key in (("text", "input_ids") if endpoint == "generate" else ("prompt",)):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], (list, str)):
            return len(value)
    return 1


def _kv_hints(r: Router, request: web.Request, endpoint: str, body: dict) -> list[dict]:
    """The kvrep actions of the body's `kv_hints` envelope (`radix_sync.kv_hints`), or 400 if it is malformed."""
    if body.get("kv_hints") is None:
        return []
    try:
        return kv_hints.parse(body["kv_hints"], _num_prompts(endpoint, body))
    except kv_hints.KvHintsError as exc:
        r.metrics.refused.labels("bad_request").inc()
        raise _error(web.HTTPBadRequest, str(exc)) from None


def _send_kv_hints(r: Router, request: web.Request, tenant: Tenant, hints: list[dict], ids: list[int]) -> str:
    """Sends the envelope's actions to the coordinator in the background (the request does not wait for them),
    as `/kvrep/hints` would: allowed for a tenant's own key (tenants configured) or the router's write token,
    within the tenant's hint rate, on the request's own prompt in the tenant's namespace.

    Returns:
        what happened, for the `x-kvrep-kv-hints` response header.
    """
    if not r.tenants.required and admin_level(r.secrets.admin, request.headers.get("Authorization")) != WRITE:
        r.metrics.kv_hints.labels("unauthorized").inc(len(hints))
        return "ignored: hints need a tenant's API key or the router's write token"
    if r.link is None:
        r.metrics.kv_hints.labels("unreachable").inc(len(hints))
        return "ignored: no coordinator configured"
    if not ids:
        r.metrics.kv_hints.labels("refused").inc(len(hints))
        return "ignored: no token ids for the prompt (text needs a tokenizer)"
    now = time.monotonic()
    sent = []
    for hint in hints:
        if r.hint_buckets.take(tenant.name, now) is not None:
            r.metrics.kv_hints.labels("rate_limited").inc()
            continue
        sent.append({**hint, "input_ids": ids, "cache_salt": tenant.namespace})
    if sent:
        task = asyncio.get_running_loop().create_task(_post_hints(r, sent))
        _HINT_TASKS.add(task)
        task.add_done_callback(_HINT_TASKS.discard)
    return f"{len(sent)} of {len(hints)} sent" + ("" if len(sent) == len(hints) else " (hint rate limit)")


_HINT_TASKS: set = set()
"""The background sends of `_send_kv_hints` (a reference each, so none is collected before it ends)."""


HINT_RETRY_S = 5.0
"""How long a hint waits out the link's backoff (the coordinator slow or restarting) before it counts as lost: a
hint says what comes in the next seconds, so one that arrives later still helps; one older than this would not."""


async def _post_hint(r: Router, hint: dict) -> tuple[int, dict]:
    """Sends one hint; while the coordinator is unreachable (503: the link backing off after a timeout), waits for
    the backoff to end and sends it again, for at most `HINT_RETRY_S`."""
    deadline = time.monotonic() + HINT_RETRY_S
    while True:
        status, answer = await r.link.hint(hint)
        wait_s = r.link.backoff_left_s()
        if status != 503 or time.monotonic() + wait_s > deadline:
            return status, answer
        await asyncio.sleep(max(wait_s, 0.05))


async def _post_hints(r: Router, hints: list[dict]) -> None:
    for hint in hints:
        status, answer = await _post_hint(r, hint)
        outcome = "sent" if status == 200 else "unreachable" if status == 503 else "refused"
        r.metrics.kv_hints.labels(outcome).inc()
        if status != 200:
            log.info("kv_hints action %s not recorded: %s %s", hint["kind"], status, answer.get("error"))


def _proxy_handler(endpoint: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        r = _router(request)
        tenant = _tenant(request)
        body = await _json_body(request)
        t0 = time.perf_counter()
        ids = await _prompt_ids(r, endpoint, body)
        hints = _kv_hints(r, request, endpoint, body)
        hinted = _send_kv_hints(r, request, tenant, hints, ids) if hints else None
        try:
            decision, hashes, hash_page_size = await r.decide(ids, tenant.namespace)
            decision_s = time.perf_counter() - t0
            r.metrics.decision_seconds.observe(decision_s)
            resp = await r.forward(request, request.path, apply_namespace(body, tenant), decision, endpoint, ids,
                                   hashes, tenant, hash_page_size)
            if not resp.prepared:  # streams have sent their headers already
                resp.headers["x-kvrep-decision-us"] = str(int(decision_s * 1e6))
                if hinted is not None:
                    resp.headers["x-kvrep-kv-hints"] = hinted
            return resp
        except NoWorker as exc:
            r.metrics.no_worker.inc()
            return web.json_response({"error": str(exc)}, status=503)
        except asyncio.TimeoutError:
            return web.json_response({"error": "worker timed out"}, status=504)
        except aiohttp.ClientError as exc:  # the worker failed after it started answering: no failover
            log.warning("worker failed mid-answer: %s: %s", type(exc).__name__, exc)
            return web.json_response({"error": f"upstream worker failed mid-answer: {type(exc).__name__}"},
                                     status=502)
    return handler


def _passthrough(method: str, path: str):
    async def handler(request: web.Request) -> web.Response:
        _tenant(request)
        try:
            return await _router(request).any_worker(request, method, path)
        except NoWorker as exc:
            return web.json_response({"error": str(exc)}, status=503)
    return handler


async def _flush_cache(request: web.Request) -> web.Response:
    # an admin write (the middleware checked the write token): never a tenant's action
    return await _router(request).fan_out(request, "/flush_cache")


async def _health(request: web.Request) -> web.Response:
    r = _router(request)
    await r.refresh_workers()
    ok = bool(r.pool.known)
    return web.json_response({"ok": ok}, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=_router(request).metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def _status(request: web.Request) -> web.Response:
    """`GET /kvrep/status[?decisions=N]`: N of the last routing decisions (default 256, at most the 4,096 kept)."""
    raw = request.query.get("decisions", "256")
    if not raw.isdigit() or int(raw) > MAX_DECISIONS_KEPT:
        raise _error(web.HTTPBadRequest, f"decisions must be an integer in 0..{MAX_DECISIONS_KEPT}")
    return web.json_response(_router(request).status(int(raw)))


def _hint_tenant(r: Router, request: web.Request, body: dict) -> Tenant:
    """Who a hint is for: with the router's write token, the tenant named by the body's `tenant` (required when
    tenants are configured); with a tenant's API key (tenants configured), that tenant. 401/403/400 otherwise."""
    level = admin_level(r.secrets.admin, request.headers.get("Authorization"))
    if level == READ:
        r.metrics.refused.labels("admin_auth").inc()
        raise refuse(403, "hints need the router's write token or a tenant's API key")
    if level == WRITE:
        name = body.get("tenant")
        if name is None and r.tenants.required:
            raise _error(web.HTTPBadRequest, "a hint sent with the write token names its 'tenant'")
        tenant = r.tenants.by_name("default" if name is None else name) if name is None or isinstance(name, str) \
            else None
        if tenant is None:
            raise _error(web.HTTPBadRequest, f"unknown tenant {name!r}")
        return tenant
    if r.tenants.required:
        return _tenant(request)
    r.metrics.refused.labels("admin_auth").inc()
    raise refuse(401, "hints need the router's write token (Authorization: Bearer <token>)")


async def _hints(request: web.Request) -> web.Response:
    r = _router(request)
    body = await _json_body(request)
    tenant = _hint_tenant(r, request, body)
    wait_s = r.hint_buckets.take(tenant.name, time.monotonic())
    if wait_s is not None:
        r.metrics.refused.labels("rate_limited").inc()
        return web.json_response({"error": f"hint rate limit of tenant {tenant.name!r} "
                                           f"({r.cfg.hints_per_s:g}/s, burst {r.cfg.hints_burst})"},
                                 status=429, headers={"Retry-After": str(max(1, math.ceil(wait_s)))})
    if r.link is None:
        return web.json_response({"error": "no coordinator configured"}, status=503)
    endpoint = "chat" if "messages" in body else "generate"
    ids = await _prompt_ids(r, endpoint, body)
    if not ids:
        return web.json_response({"error": "hint needs input_ids, text or messages (text needs a tokenizer)"},
                                 status=400)
    hint = {k: body[k] for k in ("kind", "k", "ttl_s", "delay_s") if k in body}
    hint.update(input_ids=ids, cache_salt=tenant.namespace)
    status, answer = await r.link.hint(hint)
    return web.json_response(answer, status=status)


def build_app(cfg: RouterConfig, tokenizer: Optional[PromptTokenizer] = None,
              tenants: Optional[TenantTable] = None, secrets: Optional[RouterSecrets] = None) -> web.Application:
    """Returns: the aiohttp application (its router is `app[ROUTER_KEY]`)."""
    router = Router(cfg, tokenizer, tenants, secrets)
    refused = router.metrics.refused.labels("admin_auth")
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[admin_middleware(router.secrets.admin, refused.inc)])
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    for path, endpoint in (("/generate", "generate"), ("/v1/completions", "completions"),
                           ("/v1/chat/completions", "chat")):
        app.router.add_post(path, _proxy_handler(endpoint))
    for path in ("/v1/models", "/model_info", "/server_info", "/get_model_info", "/get_server_info"):
        app.router.add_get(path, _passthrough("GET", path))
    app.router.add_route("*", "/flush_cache", _flush_cache)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/kvrep/status", _status)
    app.router.add_post("/kvrep/hints", _hints)
    return app


async def serve(cfg: RouterConfig, tokenizer: Optional[PromptTokenizer] = None,
                secrets: Optional[RouterSecrets] = None) -> None:
    """Runs the router until SIGTERM or SIGINT, then lets in-flight requests finish (`shutdown_timeout_s`)."""
    import signal

    app = build_app(cfg, tokenizer, secrets=secrets)
    runner = web.AppRunner(app, shutdown_timeout=cfg.shutdown_timeout_s, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"kvrep router: listening on http://{cfg.host}:{port}  (admin tokens: "
          f"{app[ROUTER_KEY].secrets.admin_path})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: waiting up to %gs for in-flight requests", cfg.shutdown_timeout_s)
    await runner.cleanup()
