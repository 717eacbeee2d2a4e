"""A cluster's keys and secrets in one directory: `kvrep keys --out DIR --workers N --routers M` writes it,
`load_dir(DIR)` reads it back; plus the CurveZMQ pieces every ZeroMQ plane uses (coordinator <-> workers, worker
-> worker) and the rule that a plane leaving loopback needs keys.

    DIR/                           (0700; every file 0600)
      coordinator.key_secret, coordinator.key     CurveZMQ pair of the coordinator (`zmq.auth` certificate format)
      worker-<i>.key_secret, worker-<i>.key       each worker's pair; metadata `worker_id = <id>`
      router-<j>.key_secret, router-<j>.key       each router's pair
      allow/worker-<i>.key                        the public certificates the ZMQ planes accept (workers only:
                                                  no ZMQ plane serves a router); each names its worker_id
      admin-tokens.json                           {"read": hex, "write": hex}: the coordinator's admin API
      router-tokens.json                          the same shape, for the router's admin routes
      tenant-secret                               32 random bytes, hex: the HMAC key of tenant namespaces
      worker-api-key                              hex: SGLang's --api-key, sent by the router on every request

Who uses it: `radix_sync.cli` (`kvrep keys`, `kvrep coordinator --keys`), `radix_sync.coordinator.server`,
`sglang_kvrep.agent.io_side` and `sglang_kvrep.dataplane.zmq_transport` (`--kvrep-keys`), the router (tokens and
secrets). Imports zmq only where a socket or a key pair is made, so the router reads its secrets without it.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from radix_sync import secret_files

log = logging.getLogger("kvrep.keys")

ZAP_DOMAIN = b"kvrep"
"""The ZAP domain every kvrep CURVE server socket sets (one authenticator per ZMQ context serves it)."""
_METADATA_LINE = re.compile(r'^\s+([A-Za-z0-9_-]+)\s*=\s*"?([^"]*)"?\s*$')
_WORKER_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")
"""What a worker id in a certificate may be (it goes into a ZPL line and a ZAP User-Id)."""


class KeysError(ValueError):
    """A key directory or certificate that is missing, malformed or inconsistent (the message names the file)."""


@dataclass(frozen=True)
class KeyPair:
    """One CurveZMQ certificate: z85 public key, z85 secret key (None in a public certificate), metadata."""

    name: str
    public: bytes
    secret: Optional[bytes]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def worker_id(self) -> Optional[str]:
        return self.metadata.get("worker_id")


Tokens = secret_files.AdminTokens
"""Bearer tokens of an admin surface (`radix_sync.secret_files.AdminTokens`)."""


@dataclass(frozen=True)
class KeyDir:
    """What `load_dir` found; a piece that is absent is None (or empty)."""

    path: Path
    coordinator: Optional[KeyPair]
    """With its secret on the coordinator's host; public only elsewhere."""
    workers: dict[str, KeyPair]
    """`worker-<i>` -> pair (only the pairs present here: a worker host needs only its own secret)."""
    routers: dict[str, KeyPair]
    allow: Optional[dict[bytes, str]]
    """z85 public key -> worker id, from `allow/` (None: no allow-list here)."""
    admin_tokens: Optional[Tokens]
    router_tokens: Optional[Tokens]
    tenant_secret: Optional[bytes]
    """The 32-byte HMAC key (the file holds it hex-encoded)."""
    worker_api_key: Optional[str]
    """The hex string itself: the value of `Authorization: Bearer` and of SGLang's `--api-key`."""

    def pair(self, name: str) -> KeyPair:
        """The pair `name` (`coordinator`, `worker-0`, `router-0`) with its secret.

        Raises:
            KeysError: absent here, or only its public half is.
        """
        pair = self.coordinator if name == "coordinator" else self.workers.get(name) or self.routers.get(name)
        if pair is None or pair.secret is None:
            raise KeysError(f"{self.path}: no secret key {name}.key_secret (made by `kvrep keys`)")
        return pair

    def allow_list(self) -> dict[bytes, str]:
        if not self.allow:
            raise KeysError(f"{self.path}/allow: no worker certificates (made by `kvrep keys`)")
        return self.allow

    def public_key_of(self, worker_id: str) -> Optional[bytes]:
        """The allow-listed public key of `worker_id` (what a source expects of a target), or None."""
        for key, wid in (self.allow or {}).items():
            if wid == worker_id:
                return key
        return None


# ------------------------------------------------------------------------------------------------- writing
def create_dir(out: str | os.PathLike, num_workers: int, num_routers: int = 1,
               worker_ids: Optional[list[str]] = None) -> KeyDir:
    """Write a new key directory (the layout above). `worker_ids` default to `worker-<i>`.

    Raises:
        KeysError: a file of the layout exists already (keys are never overwritten), a bad count or worker id.
    """
    from zmq.auth import create_certificates

    if num_workers < 1 or num_routers < 0:
        raise KeysError(f"need --workers >= 1 and --routers >= 0, got {num_workers} and {num_routers}")
    ids = list(worker_ids) if worker_ids else [f"worker-{i}" for i in range(num_workers)]
    if len(ids) != num_workers or len(set(ids)) != len(ids):
        raise KeysError(f"need {num_workers} distinct worker ids, got {ids}")
    for wid in ids:
        if not _WORKER_ID.match(wid):
            raise KeysError(f"bad worker id {wid!r} (letters, digits and ._:@/- only, at most 128)")
    root = Path(out)
    names = ["coordinator", *(f"worker-{i}" for i in range(num_workers)), *(f"router-{j}" for j in range(num_routers))]
    planned = [root / f"{n}{ext}" for n in names for ext in (".key", ".key_secret")]
    planned += [root / "allow", root / "admin-tokens.json", root / "router-tokens.json", root / "tenant-secret",
                root / "worker-api-key"]
    existing = [str(p) for p in planned if p.exists()]
    if existing:
        more = f" and {len(existing) - 3} more" if len(existing) > 3 else ""
        raise KeysError(f"refusing to overwrite existing keys: {', '.join(existing[:3])}{more} (choose a new --out)")
    old_umask = os.umask(0o077)
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        (root / "allow").mkdir(mode=0o700)
        create_certificates(root, "coordinator")
        for i, wid in enumerate(ids):
            name = f"worker-{i}"
            public, secret = create_certificates(root, name, metadata={"worker_id": wid})
            pub = _read_cert(Path(secret), name).public
            # NOTE: pyzmq writes metadata into the secret certificate only; the public ones, which other hosts
            # and the allow-list read, must name the worker too.
            _write_public_cert(Path(public), pub, {"worker_id": wid})
            _write_public_cert(root / "allow" / f"{name}.key", pub, {"worker_id": wid})
        for j in range(num_routers):
            create_certificates(root, f"router-{j}", metadata={"router_id": f"router-{j}"})
        create_tokens_file(root / "admin-tokens.json")
        create_tokens_file(root / "router-tokens.json")
        create_secret_file(root / "tenant-secret")
        create_secret_file(root / "worker-api-key")
        for path in root.rglob("*"):
            os.chmod(path, 0o700 if path.is_dir() else 0o600)
    finally:
        os.umask(old_umask)
    return load_dir(root)


create_tokens_file = secret_files.create_tokens_file
create_secret_file = secret_files.create_secret_file


def _write_public_cert(path: Path, public: bytes, metadata: dict[str, str]) -> None:
    """A public certificate in `zmq.auth`'s format (readable by `zmq.auth.load_certificate`), with metadata."""
    lines = ["#   ZeroMQ CURVE Public Certificate (kvrep keys)", "", "metadata"]
    lines += [f'    {k} = "{v}"' for k, v in metadata.items()]
    lines += ["curve", f'    public-key = "{public.decode()}"', ""]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------- reading
def load_dir(path: str | os.PathLike) -> KeyDir:
    """Read a key directory; missing pieces are None (a worker host holds only its own secret, say).

    Raises:
        KeysError: not a directory, a malformed file, or two allow-listed keys naming one worker.
    """
    root = Path(path)
    if not root.is_dir():
        raise KeysError(f"{root}: no such key directory (make one with `kvrep keys --out {root} --workers N`)")
    coordinator = _pair(root, "coordinator")
    workers, routers = {}, {}
    for cert in sorted(root.glob("*.key")):
        name = cert.stem
        if name.startswith("worker-"):
            workers[name] = _pair(root, name)
        elif name.startswith("router-"):
            routers[name] = _pair(root, name)
    for secret in sorted(root.glob("*.key_secret")):  # a host given only its secret certificate
        name = secret.name[:-len(".key_secret")]
        if name.startswith("worker-") and name not in workers:
            workers[name] = _pair(root, name)
        elif name.startswith("router-") and name not in routers:
            routers[name] = _pair(root, name)
    return KeyDir(path=root, coordinator=coordinator, workers=workers, routers=routers,
                  allow=_allow(root / "allow"), admin_tokens=_tokens(root / "admin-tokens.json"),
                  router_tokens=_tokens(root / "router-tokens.json"),
                  tenant_secret=_hex_file(root / "tenant-secret", as_bytes=True),
                  worker_api_key=_hex_file(root / "worker-api-key", as_bytes=False))


def load_tokens(path: str | os.PathLike) -> Tokens:
    """Raises: KeysError naming the file when it is absent or not `{"read": str, "write": str}`."""
    tokens = _tokens(Path(path))
    if tokens is None:
        raise KeysError(f"{path}: no such tokens file")
    return tokens


def _pair(root: Path, name: str) -> Optional[KeyPair]:
    secret, public = root / f"{name}.key_secret", root / f"{name}.key"
    if secret.exists():
        _warn_if_readable(secret)
        pair = _read_cert(secret, name)
        if pair.secret is None:
            raise KeysError(f"{secret}: no secret-key in it")
        if public.exists():  # the public half may carry metadata the secret one lacks
            pub = _read_cert(public, name)
            if pub.public != pair.public:
                raise KeysError(f"{public} and {secret} hold different public keys")
            pair = KeyPair(name, pair.public, pair.secret, {**pub.metadata, **pair.metadata})
        return pair
    return _read_cert(public, name) if public.exists() else None


def _read_cert(path: Path, name: str) -> KeyPair:
    from zmq.auth import load_certificate

    try:
        public, secret = load_certificate(path)
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise KeysError(f"{path}: not a CurveZMQ certificate ({exc})") from None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise KeysError(f"{path}: keys must be 40 z85 characters")
    metadata, section = {}, ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            section = line.strip()
        elif section == "metadata":
            m = _METADATA_LINE.match(line)
            if m:
                metadata[m.group(1)] = m.group(2)
    return KeyPair(name, public, secret, metadata)


def _allow(folder: Path) -> Optional[dict[bytes, str]]:
    if not folder.is_dir():
        return None
    allow: dict[bytes, str] = {}
    owner: dict[str, Path] = {}
    for cert in sorted(folder.glob("*.key")):
        pair = _read_cert(cert, cert.stem)
        wid = pair.worker_id
        if not wid or not _WORKER_ID.match(wid):
            raise KeysError(f"{cert}: an allow-listed certificate must name its worker (metadata worker_id)")
        if wid in owner:
            raise KeysError(f"{cert} and {owner[wid]} both name worker {wid!r}: one key per worker")
        owner[wid] = cert
        allow[pair.public] = wid
    return allow


def _tokens(path: Path) -> Optional[Tokens]:
    if not path.exists():
        return None
    try:
        return secret_files.read_tokens(path)
    except ValueError as exc:
        raise KeysError(str(exc)) from None


def _hex_file(path: Path, *, as_bytes: bool):
    if not path.exists():
        return None
    try:
        raw = secret_files.read_secret(path)
    except ValueError as exc:
        raise KeysError(str(exc)) from None
    return raw if as_bytes else path.read_text().strip()


_warn_if_readable = secret_files.warn_if_readable


# ------------------------------------------------------------------------------------------ CurveZMQ sockets
def start_authenticator(ctx, allow: dict[bytes, str]):
    """Start a ZAP handler on `ctx` that admits only the allow-listed public keys and gives each connection the
    User-Id of its key's worker (read it back with `peer_id(frame)`). Call before any CURVE server socket of `ctx`
    binds; `.stop()` it when the sockets are closed.

    Returns:
        the running `zmq.auth.thread.ThreadAuthenticator`.
    """
    from zmq.auth.thread import ThreadAuthenticator

    known = dict(allow)

    class _Allowed:
        def callback(self, domain: str, z85_key: bytes) -> bool:
            return z85_key in known

    class _KeyAuthenticator(ThreadAuthenticator):
        def curve_user_id(self, client_public_key: bytes) -> str:
            from zmq.utils import z85

            return known[z85.encode(client_public_key)]

    auth = _KeyAuthenticator(ctx, log=logging.getLogger("kvrep.zap"))
    auth.start()
    # NOTE: pyzmq matches the socket's ZAP domain exactly ("*" serves only sockets that set none)
    auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=_Allowed())
    return auth


def curve_server(sock, pair: KeyPair) -> None:
    """Make `sock` (before it binds) a CURVE server with `pair`: every peer must present an allowed key."""
    import zmq

    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


def curve_client(sock, pair: KeyPair, server_public: bytes) -> None:
    """Make `sock` (before it connects) a CURVE client of the server whose public key is `server_public`: the
    handshake fails unless the peer holds that key's secret."""
    import zmq

    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


def peer_id(frame) -> str:
    """The ZAP User-Id of the connection a received `zmq.Frame` came on ("" without CURVE)."""
    try:
        return frame.get("User-Id") or ""
    except Exception:  # no such property: a NULL-mechanism connection
        return ""


# ------------------------------------------------------------------------------------------- the loopback rule
def is_loopback_endpoint(endpoint: str) -> bool:
    """True for `ipc://`, `inproc://` and `tcp://` endpoints whose host is a loopback address (or a name that
    resolves only to loopback); False for `*`, 0.0.0.0, any other address, or a name that does not resolve."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    rest = endpoint.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return is_loopback_host(host.strip("[]"))


def is_loopback_host(host: str) -> bool:
    if host in ("", "*"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def insecure_error(what: str, address: str, flag_keys: str, flag_insecure: str) -> str:
    """The message a process refuses to start with when a plane would leave loopback without keys."""
    return (f"{what} {address} is not a loopback address, and without keys anyone who reaches it could act as a "
            f"worker (and read KV and prompts). Create keys with `kvrep keys --out DIR --workers N` and pass "
            f"{flag_keys} DIR, or pass {flag_insecure} to run unauthenticated and unencrypted anyway")


def warn_insecure(what: str, address: str) -> None:
    log.warning("!" * 100)
    log.warning("INSECURE: %s %s leaves loopback WITHOUT keys: no authentication, no encryption. Anyone who "
                "reaches it can act as a worker. Use `kvrep keys` for anything but a trusted network.", what, address)
    log.warning("!" * 100)
