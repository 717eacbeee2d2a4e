"""Bearer tokens on the admin HTTP surfaces (the coordinator's admin API; the router's admin routes use the same
tokens): the aiohttp middleware that checks every request, and the header a client sends.

The token file (`admin-tokens.json` / `router-tokens.json`, JSON `{"read": "<hex>", "write": "<hex>"}`, mode 0600)
is read, created and validated by `radix_sync.secret_files`. The read token is enough for GET routes; every other method
needs the write token, which also allows reads. Routes named open (`/health`) need nothing. Requests carry
`Authorization: Bearer <token>`; no token or a wrong one is 401, a read token on a write route is 403. Tokens are
compared with `hmac.compare_digest`.

Who uses it: `radix_sync.coordinator.admin` (server side), `radix_sync.router.coordinator_link` and
`kvrep_dev.cluster` (client side: `header`).
"""
from __future__ import annotations

from typing import Collection

from aiohttp import web

from radix_sync.secret_files import AdminTokens

READ, WRITE = "read", "write"


def header(token: str) -> dict[str, str]:
    """The request header that presents `token` (empty for no token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def _presented(request: web.Request) -> str:
    value = request.headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def bearer_middleware(tokens: AdminTokens, open_paths: Collection[str] = ("/health",),
                      read_methods: Collection[str] = ("GET", "HEAD")):
    """An aiohttp middleware: `open_paths` pass; `read_methods` need the read (or write) token; the rest the write
    token. Refusals are JSON `{"error": ...}` with 401 (no or wrong token, and `WWW-Authenticate: Bearer`) or 403."""

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        level = tokens.level(_presented(request))
        if not level:
            return web.json_response({"error": "authentication required: Authorization: Bearer <token>"},
                                     status=401, headers={"WWW-Authenticate": 'Bearer realm="kvrep"'})
        if level != WRITE and request.method not in read_methods:
            return web.json_response({"error": f"{request.method} {request.path} needs the write token"},
                                     status=403)
        return await handler(request)

    return auth
