"""The secret files of a cluster: admin tokens, the tenant secret, the workers' API key. Reading them, and
creating the missing ones (0600, never overwriting: `O_EXCL`), saying whether they did so the caller can log the
path. The one module that knows these files' formats: the key directory (`radix_sync.keys`: CurveZMQ certificates,
allow-list, `kvrep keys`, `load_dir`), the admin bearer middleware (`radix_sync.admin_auth`), the router and the
dev harness all read and write them through it:

    admin-tokens.json    {"read": "<hex>", "write": "<hex>"}: the coordinator's admin API
    router-tokens.json   the same shape, for the router's admin routes
    tenant-secret        32 random bytes, hex: the HMAC key of tenant namespaces
    worker-api-key       hex: SGLang's `--api-key`, set by the router on every forwarded call

Torch-free and zmq-free; used by the router (`radix_sync.router.auth`) and the dev harness.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvrep.keys")

TOKEN_BYTES = 32
"""Random bytes in each admin token, API key and tenant secret (hex-encoded in the files: 64 characters)."""
MIN_SECRET_BYTES = 16
"""A tenant secret or API key shorter than this is refused (it could be guessed)."""


@dataclass(frozen=True)
class AdminTokens:
    """The bearer tokens of one admin surface: `read` for lookups, status and metrics; `write` for every call that
    changes something (it also allows reads)."""

    read: str
    write: str

    def __post_init__(self) -> None:
        for name in ("read", "write"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) < 2 * MIN_SECRET_BYTES or not value.isascii() \
                    or not value.isprintable():
                raise ValueError(f"admin token {name!r} must be a printable ASCII string of >= "
                                 f"{2 * MIN_SECRET_BYTES} characters")
        if hmac.compare_digest(self.read, self.write):
            raise ValueError("the read and write admin tokens must differ")

    def level(self, presented: str) -> str:
        """`"write"`, `"read"`, or "" for a token that is neither (compared in constant time)."""
        ok_write = hmac.compare_digest(presented.encode(), self.write.encode())
        ok_read = hmac.compare_digest(presented.encode(), self.read.encode())
        return "write" if ok_write else "read" if ok_read else ""


def warn_if_readable(path: str | Path) -> None:
    """Logs a warning when `path` is readable by others than its owner (a secret should be 0600)."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by other users (mode %o): chmod 600 it", path, stat.S_IMODE(mode))


def write_private(path: str | Path, text: str) -> None:
    """Creates `path` with `text`, mode 0600 from the start (its folder 0700 if created here).

    Raises:
        FileExistsError: `path` exists (nothing is overwritten).
    """
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_tokens(path: str | Path) -> AdminTokens:
    """Reads an `admin-tokens.json` / `router-tokens.json` file (warning when others can read it).

    Raises:
        ValueError: unreadable, not the `{"read", "write"}` shape, or tokens too short.
    """
    warn_if_readable(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokens file {path}: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"read", "write"}:
        raise ValueError(f"tokens file {path}: expected {{\"read\": \"<hex>\", \"write\": \"<hex>\"}}")
    try:
        return AdminTokens(data["read"], data["write"])
    except ValueError as exc:
        raise ValueError(f"tokens file {path}: {exc}") from None


def new_tokens() -> AdminTokens:
    return AdminTokens(secrets.token_hex(TOKEN_BYTES), secrets.token_hex(TOKEN_BYTES))


def create_tokens_file(path: str | Path) -> AdminTokens:
    """Writes two fresh tokens to a new 0600 file and returns them.

    Raises:
        FileExistsError: `path` exists (nothing is overwritten).
    """
    tokens = new_tokens()
    write_private(path, json.dumps({"read": tokens.read, "write": tokens.write}) + "\n")
    return tokens


def create_secret_file(path: str | Path) -> str:
    """Writes `TOKEN_BYTES` fresh random bytes, hex, to a new 0600 file and returns the hex.

    Raises:
        FileExistsError: `path` exists (nothing is overwritten).
    """
    value = secrets.token_hex(TOKEN_BYTES)
    write_private(path, value + "\n")
    return value


def ensure_tokens(path: str | Path) -> tuple[AdminTokens, bool]:
    """Returns: the tokens in `path`, creating the file (0600) with fresh ones when absent; and whether it did."""
    path = Path(path)
    if not path.exists():
        try:
            return create_tokens_file(path), True
        except FileExistsError:
            pass  # another process created it meanwhile: use theirs
    return read_tokens(path), False


def read_secret(path: str | Path) -> bytes:
    """Reads a hex secret file (`tenant-secret`, `worker-api-key`), warning when others can read it.

    Raises:
        ValueError: unreadable, not hex, or shorter than `MIN_SECRET_BYTES`.
    """
    warn_if_readable(path)
    try:
        text = Path(path).read_text().strip()
        raw = bytes.fromhex(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"secret file {path}: {exc}") from None
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"secret file {path}: {len(raw)} bytes, need >= {MIN_SECRET_BYTES}")
    return raw


def ensure_secret(path: str | Path) -> tuple[bytes, bool]:
    """Returns: the secret in `path`, creating it (0600, `TOKEN_BYTES` random bytes) when absent; and whether it
    did."""
    path = Path(path)
    if not path.exists():
        try:
            write_private(path, secrets.token_hex(TOKEN_BYTES) + "\n")
            return read_secret(path), True
        except FileExistsError:
            pass
    return read_secret(path), False


def read_api_key(path: str | Path) -> str:
    """Reads a `worker-api-key` file: the key as SGLang's `--api-key` takes it (the file's hex text)."""
    read_secret(path)  # validates
    return Path(path).read_text().strip()
