"""Fetches the shared libraries `requirements-native.txt` names (Debian packages), checks each package's SHA-256
and unpacks its `*.so*` files, flat, into one folder: what scripts/env.sh runs once per base environment, so that
Mooncake Transfer Engine's CPU wheel imports on a host without RDMA software (`--kvrep-transport mooncake`).

    python -m kvrep_dev.native_libs requirements-native.txt DEST

A `.deb` is an `ar` archive whose `data.tar.*` member holds the files; read here with the standard library only
(no `dpkg`, no root, no system change). Fails (exit 1) on a download error or a checksum mismatch, leaving DEST
without a partial file.
"""
from __future__ import annotations

import hashlib
import io
import os
import platform
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

MAX_DEB_BYTES = 64 << 20


def read_list(path: Path) -> list[tuple[str, str]]:
    """Returns: (url, sha256) per non-comment line."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            url, sha = line.split()
            out.append((url, sha.lower()))
    return out


def ar_members(data: bytes) -> dict[str, bytes]:
    """The members of an `ar` archive (a `.deb`), by name."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        pos += 60
        out[name] = data[pos:pos + size]
        pos += size + (size & 1)
    return out


def shared_objects(deb: bytes) -> list[tuple[str, bytes | str]]:
    """(file name, contents or symlink target name) of every `*.so*` file in a `.deb`'s data."""
    members = ar_members(deb)
    data = [n for n in members if n.startswith("data.tar")]
    if len(data) != 1:
        raise ValueError(f"a .deb with {len(data)} data.tar members ({', '.join(sorted(members))})")
    [name] = data
    out: list[tuple[str, bytes | str]] = []
    with tarfile.open(fileobj=io.BytesIO(members[name]), mode="r:*") as tar:
        for m in tar.getmembers():
            base = os.path.basename(m.name)
            if ".so" not in base or m.isdir():
                continue
            if m.issym():
                out.append((base, os.path.basename(m.linkname)))
            elif m.isfile():
                out.append((base, tar.extractfile(m).read()))
    return out


def fetch(url: str, sha256: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        data = r.read(MAX_DEB_BYTES + 1)
    if len(data) > MAX_DEB_BYTES:
        raise ValueError(f"{url}: larger than {MAX_DEB_BYTES} bytes")
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ValueError(f"{url}: sha256 {got}, expected {sha256}")
    return data


def install(listing: Path, dest: Path) -> list[str]:
    """Fetch, check and unpack every package of `listing` into `dest`. Returns: the file names written."""
    files: list[tuple[str, bytes | str]] = []
    for url, sha in read_list(listing):
        files.extend(shared_objects(fetch(url, sha)))
    dest.mkdir(parents=True, exist_ok=True)
    for name, body in files:  # (a symlink after the files it may name: the order of the packages' listings)
        target = dest / name
        if target.is_symlink() or target.exists():
            target.unlink()
        if isinstance(body, str):
            target.symlink_to(body)
            continue
        fd, tmp = tempfile.mkstemp(dir=dest)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    return [name for name, _ in files]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if sys.platform != "linux" or platform.machine() != "x86_64":
        print(f"[env] native libraries: none for {sys.platform}/{platform.machine()} (Debian amd64 only); "
              "--kvrep-transport mooncake needs the host's own rdma-core and libnl")
        return 0
    try:
        names = install(Path(argv[0]), Path(argv[1]))
    except Exception as exc:
        print(f"[env] native libraries: {exc}", file=sys.stderr)
        return 1
    print(f"[env] native libraries for Mooncake: {len(names)} files in {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
