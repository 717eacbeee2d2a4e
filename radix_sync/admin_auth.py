"""Bearer tokens for the admin HTTP surfaces (the coordinator's admin API; the router's admin routes use the same
file shape): a token file, its creation when absent, and the aiohttp middleware that checks every request.

The token file is JSON `{"read": "<hex>", "write": "<hex>"}` (the key directory's `admin-tokens.json` /
`router-tokens.json`, `radix_sync.keys`), mode 0600. The read token is enough for GET routes; every other method
needs the write token, which also allows reads. Routes named open (`/health`) need nothing. Requests carry
`Authorization: Bearer <token>`; no token or a wrong one is 401, a read token on a write route is 403. Tokens are
compared with `hmac.compare_digest`.

Who uses it: `radix_sync.coordinator.admin` (server side), `radix_sync.router.coordinator_link` and
`kvrep_dev.cluster` (client side: `header`).
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from aiohttp import web

log = logging.getLogger("kvrep.auth")

READ, WRITE = "read", "write"


@dataclass(frozen=True)
class AdminTokens:
    read: str
    """Allows the GET routes."""
    write: str
    """Allows every route."""

    def __post_init__(self) -> None:
        for name in (READ, WRITE):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) < 16 or not value.isascii() or not value.isprintable():
                raise ValueError(f"the {name} token must be a printable ASCII string of >= 16 characters")
        if hmac.compare_digest(self.read, self.write):
            raise ValueError("the read and write tokens must differ")

    @classmethod
    def generate(cls) -> "AdminTokens":
        return cls(read=secrets.token_hex(32), write=secrets.token_hex(32))

    def level(self, presented: str) -> str:
        """`write`, `read`, or "" for a token that is neither."""
        ok_write = hmac.compare_digest(presented.encode(), self.write.encode())
        ok_read = hmac.compare_digest(presented.encode(), self.read.encode())
        return WRITE if ok_write else READ if ok_read else ""


def load_tokens(path: str | os.PathLike) -> AdminTokens:
    """Reads a token file. Raises ValueError (naming the file) when it is unreadable or not of the shape above;
    warns when it is readable by others than its owner."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        tokens = AdminTokens(read=data[READ], write=data[WRITE])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"admin token file {path}: {exc}") from None
    if os.name == "posix" and path.stat().st_mode & 0o077:
        log.warning("admin token file %s is readable by others than its owner (chmod 600 it)", path)
    return tokens


def ensure_tokens(path: str | os.PathLike) -> tuple[AdminTokens, bool]:
    """The tokens of `path`, created (fresh random tokens, mode 0600, its folder 0700 when made) when absent.

    Returns:
        (the tokens, whether the file was created now).
    """
    path = Path(path)
    if path.exists():
        return load_tokens(path), False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tokens = AdminTokens.generate()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile: use theirs
        return load_tokens(path), False
    with os.fdopen(fd, "w") as f:
        json.dump({READ: tokens.read, WRITE: tokens.write}, f)
    return tokens, True


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
