"""The router's credentials: its admin tokens (checked by an aiohttp middleware), the tenant secret, the workers'
API key and the coordinator's token.

Admin routes (`ADMIN_ROUTES`) take `Authorization: Bearer <token>` from the router's `router-tokens.json`
(`radix_sync.keys`): the read token for `/kvrep/status` and `/metrics`, the write token for `/flush_cache`
(the write token also allows reads). No token or a wrong one: 401; the read token on a write route: 403. A
tenant's API key is never an admin token: no tenant can flush a cache or list namespaces and decisions.
`/kvrep/hints` checks its caller itself (`Router.hint_tenant`): the write token, or a tenant's own key.

`load_secrets` reads the files a `RouterConfig` names and creates the missing ones (admin tokens; the tenant
secret when a tenants file is used) in `state_dir`, 0600, logging their paths. Called by `kvrep router` and
`radix_sync.router.service.Router`.
"""
from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aiohttp import web

from radix_sync import secret_files as keys
from radix_sync.secret_files import AdminTokens
from radix_sync.router.config import RouterConfig

log = logging.getLogger("kvrep.router")

READ, WRITE = "read", "write"
ADMIN_ROUTES = {"/flush_cache": WRITE, "/kvrep/status": READ, "/metrics": READ}
"""Route (as registered) -> the token it needs."""


@dataclass(frozen=True)
class RouterSecrets:
    admin: AdminTokens
    admin_path: str
    tenant_secret: Optional[bytes] = None
    """None when no tenants file is used (everyone is the default namespace)."""
    worker_api_key: Optional[str] = None
    coordinator_token: Optional[str] = None


def load_secrets(cfg: RouterConfig) -> RouterSecrets:
    """Reads (or creates) every credential of `cfg`.

    Raises:
        ValueError: a file is malformed or unreadable.
    """
    state = Path(cfg.state_dir).expanduser()
    admin_path = Path(cfg.admin_tokens_path or state / "router-tokens.json")
    admin, created = keys.ensure_tokens(admin_path)
    if created:
        log.warning("router admin tokens created in %s (0600): send 'Authorization: Bearer <read|write>' to "
                    "/kvrep/status, /metrics, /flush_cache, /kvrep/hints", admin_path)
    secret = None
    if cfg.tenants_path:
        secret_path = Path(cfg.tenant_secret_path or state / "tenant-secret")
        secret, created = keys.ensure_secret(secret_path)
        if created:
            log.warning("tenant secret created in %s (0600): give every router of this cluster the same file "
                        "(--tenant-secret), or their namespaces differ", secret_path)
    api_key = keys.read_api_key(cfg.worker_api_key_path) if cfg.worker_api_key_path else None
    token = keys.read_tokens(cfg.coordinator_tokens_path).write if cfg.coordinator_tokens_path else None
    return RouterSecrets(admin, str(admin_path), secret, api_key, token)


def bearer(authorization: Optional[str]) -> str:
    """Returns: the token of an `Authorization: Bearer <token>` header ("" when absent or another scheme)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def admin_level(tokens: AdminTokens, authorization: Optional[str]) -> Optional[str]:
    """Returns: WRITE, READ or None (no admin token), compared in constant time."""
    token = bearer(authorization).encode()
    if not token:
        return None
    if hmac.compare_digest(token, tokens.write.encode()):
        return WRITE
    if hmac.compare_digest(token, tokens.read.encode()):
        return READ
    return None


def refuse(status: int, message: str) -> web.HTTPException:
    cls = {401: web.HTTPUnauthorized, 403: web.HTTPForbidden}[status]
    headers = {"WWW-Authenticate": 'Bearer realm="kvrep-router"'} if status == 401 else None
    return cls(text=json.dumps({"error": message}), content_type="application/json", headers=headers)


def require(tokens: AdminTokens, authorization: Optional[str], need: str) -> None:
    """Raises: 401 without a valid admin token, 403 when `need` is WRITE and the token is the read one."""
    level = admin_level(tokens, authorization)
    if level is None:
        raise refuse(401, "this route needs the router's admin token (Authorization: Bearer <token>)")
    if need == WRITE and level != WRITE:
        raise refuse(403, "this route needs the router's write token")


def admin_middleware(tokens: AdminTokens, on_refused=lambda: None):
    """Returns: the aiohttp middleware guarding `ADMIN_ROUTES` (matched by the route's registered path, so no
    spelling of the URL skips it)."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        resource = request.match_info.route.resource
        need = ADMIN_ROUTES.get(getattr(resource, "canonical", None)) if resource is not None else None
        if need is not None:
            try:
                require(tokens, request.headers.get("Authorization"), need)
            except web.HTTPException:
                on_refused()
                raise
        return await handler(request)
    return middleware
