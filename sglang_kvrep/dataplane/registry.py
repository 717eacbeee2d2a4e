"""Data-plane transports by name: `--kvrep-transport NAME` (checked by `KvrepConfig`) picks the implementation the
agent's I/O thread builds. "zmq" (`ZmqTransport`), "nixl" (`NixlTransport`, where NIXL is installed) and
"mooncake" (`MooncakeTransport`, where Mooncake Transfer Engine is installed) are registered here; another
implementation registers itself with `register_transport` before the agent starts."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import zmq

from sglang_kvrep.dataplane.transport import Admit, OnEvent, Transport, TransportFactory, TransportSettings
from sglang_kvrep.dataplane.zmq_transport import ZmqTransport

_TRANSPORTS: dict[str, TransportFactory] = {}
_MISSING: dict[str, Callable[[], Optional[str]]] = {}


def register_transport(name: str, factory: TransportFactory,
                       missing: Optional[Callable[[], Optional[str]]] = None) -> None:
    """Make `factory` selectable as `--kvrep-transport name`. Re-registering a name replaces it. `missing()`: why
    it cannot run on this host (a library not installed), None when it can; asked when the flag is checked."""
    _TRANSPORTS[name] = factory
    if missing is None:
        _MISSING.pop(name, None)
    else:
        _MISSING[name] = missing


def known_transports() -> tuple[str, ...]:
    return tuple(sorted(_TRANSPORTS))


def check_transport_name(name: str) -> None:
    """Raises:
        ValueError: `name` is not a registered transport (the message lists the known ones)."""
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown transport {name!r} (known: {', '.join(known_transports())})")
    why = _MISSING[name]() if name in _MISSING else None
    if why:
        raise ValueError(f"transport {name!r} cannot run here: {why}")


def make_transport(name: str, config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                   poller: zmq.Poller, arena: Any = None) -> Transport:
    """Build the transport registered as `name`; it registers its sockets with `poller`. `arena`: pinned host
    memory to receive into first (a GPU worker's), for a transport that can (`use_arena`); the others ignore it.

    Raises:
        ValueError: unknown name.
    """
    check_transport_name(name)
    transport = _TRANSPORTS[name](config, admit, on_event, ctx, poller)
    if arena is not None and hasattr(transport, "use_arena"):
        transport.use_arena(arena)
    return transport


def _lazy(module: str, cls: str, missing: str) -> tuple[TransportFactory, Callable[[], Optional[str]]]:
    """A transport whose module is imported only when it is chosen or checked (its engine's libraries load only
    when it is built): (factory, why it cannot run here)."""
    def factory(config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                poller: zmq.Poller) -> Transport:
        return getattr(importlib.import_module(module), cls)(config, admit, on_event, ctx, poller)

    def why() -> Optional[str]:
        return getattr(importlib.import_module(module), missing)()
    return factory, why


register_transport(ZmqTransport.name, ZmqTransport)
register_transport("nixl", *_lazy("sglang_kvrep.dataplane.nixl_transport", "NixlTransport", "nixl_missing"))
register_transport("mooncake", *_lazy("sglang_kvrep.dataplane.mooncake_transport", "MooncakeTransport",
                                      "mooncake_missing"))
