"""Which address a worker gives others: its name, its HTTP URL and its data endpoint must be reachable from the
coordinator, the router and the other workers. A server bound to a wildcard (`--host 0.0.0.0` or `::`) is
reachable at the address of the interface that routes to the coordinator, unless `--kvrep-advertise-host` says
otherwise; the data plane binds what the server binds and advertises the reachable address.

Pure functions (one UDP `connect`, which sends nothing, to ask the kernel's routing table), called by
`sglang_kvrep.config.from_namespace` in the launcher and by the agent's I/O side for its data endpoint.
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Optional
from urllib.parse import urlsplit

WILDCARDS = ("0.0.0.0", "::", "", "*", "[::]")


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def _coordinator_host_port(coordinator: str) -> Optional[tuple[str, int]]:
    """(host, port) of a `tcp://host:port` endpoint; None for ipc:// and inproc:// (same machine)."""
    if not coordinator.startswith("tcp://"):
        return None
    parts = urlsplit(coordinator)
    try:
        port = parts.port or 0
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname else None


def routable_host(coordinator: str) -> str:
    """The local address of the interface the kernel routes `coordinator` through (IPv4 or IPv6): what the
    coordinator and its peers reach this machine at. A coordinator on loopback, on ipc:// or unresolvable gives
    `127.0.0.1` (then everything is on this machine, or nothing reaches it anyway)."""
    target = _coordinator_host_port(coordinator)
    if target is None:
        return "127.0.0.1"
    host, port = target
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
    except (socket.gaierror, IndexError, UnicodeError):
        return "127.0.0.1"
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: no packet is sent; the kernel picks the source address of the route
            local = s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    return "127.0.0.1" if ipaddress.ip_address(local.split("%")[0]).is_unspecified else local


def advertised_host(bind_host: str, advertise_host: str, coordinator: str) -> str:
    """The host a worker bound to `bind_host` names itself by: `advertise_host` when given, else `bind_host`
    unless it is a wildcard, else the address that routes to the coordinator."""
    if advertise_host:
        return advertise_host
    if not is_wildcard(bind_host):
        return bind_host
    return routable_host(coordinator)


def host_in_url(host: str) -> str:
    """`host` as written in a URL or a ZMQ endpoint (IPv6 literals in brackets)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def advertised_endpoint(bound_endpoint: str, host: str, port: int = 0) -> str:
    """The data endpoint peers connect to: `bound_endpoint`'s (`tcp://h:p`) with `host` instead of its host when
    given, and `port` instead of its port when > 0 (a port forwarded to this one)."""
    if not bound_endpoint.startswith("tcp://"):
        return bound_endpoint
    rest = bound_endpoint[len("tcp://"):]
    bound_host, _, bound_port = rest.rpartition(":")
    return f"tcp://{host_in_url(host) if host else bound_host}:{port if port > 0 else bound_port}"
