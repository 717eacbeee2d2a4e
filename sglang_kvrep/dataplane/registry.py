"""Data-plane transports by name: `--kvrep-transport NAME` (checked by `KvrepConfig`) picks the implementation the
agent's I/O thread builds. "zmq" (`ZmqTransport`) is registered here; another implementation registers itself
with `register_transport` before the agent starts."""
from __future__ import annotations

import zmq

from sglang_kvrep.dataplane.transport import Admit, OnEvent, Transport, TransportFactory, TransportSettings
from sglang_kvrep.dataplane.zmq_transport import ZmqTransport

_TRANSPORTS: dict[str, TransportFactory] = {}


def register_transport(name: str, factory: TransportFactory) -> None:
    """Make `factory` selectable as `--kvrep-transport name`. Re-registering a name replaces it."""
    _TRANSPORTS[name] = factory


def known_transports() -> tuple[str, ...]:
    return tuple(sorted(_TRANSPORTS))


def check_transport_name(name: str) -> None:
    """Raises:
        ValueError: `name` is not a registered transport (the message lists the known ones)."""
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown transport {name!r} (known: {', '.join(known_transports())})")


def make_transport(name: str, config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                   poller: zmq.Poller) -> Transport:
    """Build the transport registered as `name`; it registers its sockets with `poller`.

    Raises:
        ValueError: unknown name.
    """
    check_transport_name(name)
    return _TRANSPORTS[name](config, admit, on_event, ctx, poller)


register_transport(ZmqTransport.name, ZmqTransport)
