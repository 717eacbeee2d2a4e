"""The secret files of a cluster: admin tokens, the tenant secret, the workers' API key. Reading them, and
creating the missing ones (0600, never overwriting: `O_EXCL`), saying whether they did so the caller can log the
path. The key directory as a whole (CurveZMQ certificates, allow-list, `kvrep keys`, `load_dir`) is
`radix_sync.keys`, which writes these files in the same formats:

    admin-tokens.json    {"read": "<hex>", "write": "<hex>"}: the coordinator's admin API
    router-tokens.json   the same shape, for the router's admin routes
    tenant-secret        32 random bytes, hex: the HMAC key of tenant namespaces
    worker-api-key       hex: SGLang's `--api-key`, set by the router on every forwarded call

Torch-free and zmq-free; used by the router (`radix_sync.router.auth`) and the dev harness.
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

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
            if not isinstance(value, str) or len(value) < 2 * MIN_SECRET_BYTES:
                raise ValueError(f"admin token {name!r} must be a string of >= {2 * MIN_SECRET_BYTES} characters")
        if self.read == self.write:
            raise ValueError("the read and write admin tokens must differ")


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
    """Reads an `admin-tokens.json` / `router-tokens.json` file.

    Raises:
        ValueError: unreadable, not the `{"read", "write"}` shape, or tokens too short.
    """
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


def ensure_tokens(path: str | Path) -> tuple[AdminTokens, bool]:
    """Returns: the tokens in `path`, creating the file (0600) with fresh ones when absent; and whether it did."""
    path = Path(path)
    if not path.exists():
        tokens = new_tokens()
        try:
            write_private(path, json.dumps({"read": tokens.read, "write": tokens.write}) + "\n")
            return tokens, True
        except FileExistsError:
            pass  # another process created it meanwhile: use theirs
    return read_tokens(path), False


def read_secret(path: str | Path) -> bytes:
    """Reads a hex secret file (`tenant-secret`, `worker-api-key`).

    Raises:
        ValueError: unreadable, not hex, or shorter than `MIN_SECRET_BYTES`.
    """
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
