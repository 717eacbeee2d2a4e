"""`MooncakeTransport` (`--kvrep-transport mooncake`): the payload moves by Mooncake Transfer Engine (PyPI
`mooncake-transfer-engine`; RDMA between hosts where the host has RDMA devices, TCP otherwise), the engine SGLang's
PD disaggregation uses by default (`--disaggregation-transfer-backend mooncake`). Everything but the engine is
`WrittenTransport`'s (`sglang_kvrep.dataplane.written`: ZMQ control, the target's registered staging, checksums
over the written bytes, quarantine of a failed transfer's staging).

Mooncake's part: each worker runs one engine in peer-to-peer mode (`initialize(data host, "P2PHANDSHAKE",
protocol, "")`, no metadata server); its session name is `host:rpc port`. The target's `TransferReady` carries its
session name (no metadata: the engines exchange segment descriptors in their own handshake) and the source accepts
it only on the host of the data endpoint it connected to. A chunk's WRITE is one `transfer_submit_write` per layer
(`batch_transfer_async_write` + `transfer_check_status` would see only a batch's first request: 0.3.13's binding
reads task 0); it is DONE when every one reports 1. A target's engine refuses a write outside its registered
memory (its staging buffers).

What the host must give: the package (the CPU wheel `mooncake-transfer-engine-non-cuda` is pinned for the tests;
`mooncake-transfer-engine` is the CUDA 12 one) and libibverbs, libnl-3 and libnl-route-3, which a host without RDMA
software lacks: `scripts/env.sh` unpacks Debian's next to the package (`requirements-native.txt`) and they are
loaded from there only when the host has none (the host's own come first: its RDMA providers go with them).

What the fabric must give: Mooncake's engine listens on every interface whatever the data host (0.3.13: its RPC
and TCP ports bind 0.0.0.0; `MC_TCP_BIND_ADDRESS` does not change that), and its writes and reads of registered
memory are not authenticated by the workers' keys. So a worker on `--kvrep-transport mooncake` must sit on a
trusted fabric (or behind a firewall that keeps other hosts off those ports), as SGLang's own Mooncake KV transfer
requires (docs/security.md); the default transport, ZeroMQ, has no such port.
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import zmq

from radix_sync import protocol as p
from sglang_kvrep.dataplane.staging import Outgoing
from sglang_kvrep.dataplane.transport import Admit, OnEvent, TransportSettings
from sglang_kvrep.address import is_wildcard, routable_host
from sglang_kvrep.dataplane.written import DONE, ERR, LOST, PROC, Write, WrittenTransport

log = logging.getLogger("kvrep.agent")

NATIVE_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
"""What the engine links against beyond the wheel, in load order (libnl-route needs libnl-3)."""
NATIVE_DIR_ENV = "KVREP_NATIVE_LIB_DIR"
_loaded: list = []
"""The libraries loaded from our folder (kept referenced for the life of the process)."""


def native_dirs() -> list[Path]:
    """Where our copies of `NATIVE_LIBS` may be: `$KVREP_NATIVE_LIB_DIR`, then `kvrep_native_libs` next to the
    `mooncake` package (scripts/env.sh puts them there)."""
    out = [Path(os.environ[NATIVE_DIR_ENV])] if os.environ.get(NATIVE_DIR_ENV) else []
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        out.append(Path(list(spec.submodule_search_locations)[0]).parent / "kvrep_native_libs")
    return out


def _preload() -> list[str]:
    """Load each of `NATIVE_LIBS` the host cannot give from our folder: the dynamic loader then finds it by its
    soname when the engine's module asks for it (no `LD_LIBRARY_PATH` needed, which a running process cannot
    change). Returns: the ones found nowhere."""
    missing = []
    for soname in NATIVE_LIBS:
        try:
            ctypes.CDLL(soname)  # the host's own (an RDMA host's rdma-core, with its providers)
            continue
        except OSError:
            pass
        for d in native_dirs():
            if (d / soname).exists():
                try:
                    _loaded.append(ctypes.CDLL(str(d / soname)))
                except OSError as exc:  # (e.g. a host C library older than the one it was built for)
                    missing.append(f"{soname} ({exc})")
                break
        else:
            missing.append(soname)
    return missing


def mooncake_missing() -> Optional[str]:
    """Returns: why `--kvrep-transport mooncake` cannot run here (None: the package is installed). Cheap: loads
    nothing."""
    if importlib.util.find_spec("mooncake") is None:
        return ("Mooncake Transfer Engine is not installed (pip install mooncake-transfer-engine-non-cuda, or "
                "mooncake-transfer-engine next to CUDA 12)")
    return None


def load_mooncake() -> Any:
    """Returns: the `mooncake.engine` module (`TransferEngine`).

    Raises:
        ImportError: not installed, or a library it links against is missing; the message says which.
    """
    why = mooncake_missing()
    if why:
        raise ImportError(f"--kvrep-transport mooncake: {why}")
    missing = _preload()
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        hint = (f" ({', '.join(missing)}: not loadable from the host or from {', '.join(map(str, native_dirs()))}; "
                "scripts/env.sh installs them, requirements-native.txt)") if missing else ""
        raise ImportError(f"--kvrep-transport mooncake: mooncake.engine cannot be imported: {exc}{hint}") from exc


def host_memory_only() -> bool:
    """Whether the installed engine is the CPU build (it cannot read device memory)."""
    try:
        return importlib.metadata.distribution("mooncake-transfer-engine-non-cuda") is not None
    except importlib.metadata.PackageNotFoundError:
        return False


def rdma_devices() -> list[str]:
    """The host's RDMA devices (`/sys/class/infiniband`), if any."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def session_host(config: TransportSettings) -> str:
    """The host peers reach this worker's engine at: what the worker advertises for its data endpoint
    (`IoSide.data_endpoint`: `--kvrep-advertise-host`, else the data host, else, for a wildcard, the address that
    routes to the coordinator), without IPv6 brackets."""
    host = getattr(config, "advertise_host", "") or config.data_host
    if is_wildcard(host):
        host = routable_host(getattr(config, "coordinator", ""))
    return host.strip("[]")


class _Writes:
    """One chunk's WRITEs (one per layer), each a batch of one request; what each ended with, once it did."""

    __slots__ = ("ids", "ends", "short", "timed_out")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.ends: list[int] = []
        """Per id: 0 in flight (or timed out), 1 done, -1 failed: asked no more once 1 or -1 (the binding frees a
        batch that completed or failed; one that timed out it keeps, and may still move its bytes)."""
        self.short = ""
        """Why not every layer's WRITE was posted ("" when every one was)."""
        self.timed_out = False


class MooncakeTransport(WrittenTransport):
    """ZMQ control, Mooncake Transfer Engine payload (see the module docstring)."""

    name = "mooncake"
    accepts = ("zmq", "mooncake")

    def __init__(self, config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                 poller: zmq.Poller, clock: Callable[[], float] = time.monotonic,
                 protocol: Optional[str] = None) -> None:
        self.protocol = protocol or ("rdma" if rdma_devices() else "tcp")
        super().__init__(config, admit, on_event, ctx, poller, clock)

    # ------------------------------------------------------------------------------------------ the engine
    def _load_engine(self) -> None:
        self._api = load_mooncake()
        self._host_only = host_memory_only()

    def _open_engine(self, config: TransportSettings) -> None:
        host = session_host(config)
        self.engine = self._api.TransferEngine()
        ret = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, "")
        if ret != 0:
            raise RuntimeError(f"--kvrep-transport mooncake: TransferEngine.initialize({host!r}, "
                               f"P2PHANDSHAKE, {self.protocol!r}) returned {ret}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        log.info("kvrep: mooncake: engine %s (%s)", self.session, self.protocol)

    def _close_engine(self) -> None:
        self.engine = None  # (the binding has no close: the engine stops when it is collected)

    def _engine_register(self, buf: torch.Tensor) -> Any:
        if self._host_only and buf.device.type != "cpu":
            raise ValueError(f"the CPU build of Mooncake cannot read {buf.device} memory")
        addr = buf.data_ptr()
        ret = self.engine.register_memory(addr, buf.numel() * buf.element_size())
        if ret != 0:
            raise RuntimeError(f"register_memory returned {ret}")
        return addr

    def _engine_deregister(self, registration: Any) -> None:
        ret = self.engine.unregister_memory(registration)
        if ret != 0:
            log.warning("kvrep: mooncake: unregister_memory(%#x) returned %d", registration, ret)

    def _engine_peer(self) -> tuple[str, bytes]:
        return self.session, b""

    def _accept_peer(self, msg: p.TransferReady, out: Outgoing) -> Optional[str]:
        host, _, port = msg.agent_name.rpartition(":")
        own = out.endpoint.split("://", 1)[-1].rpartition(":")[0].strip("[]")
        if not (port.isdigit() and 0 < int(port) < 65536) or host != own or msg.agent_metadata:
            # (the source writes where the target says: only into an engine on the host it connected to)
            return f"target's session {msg.agent_name!r} is not an engine on its own host {own!r}"
        return None

    def _engine_write(self, ready: p.TransferReady, pieces: list[tuple[int, int, int]], buffer: torch.Tensor) -> Any:
        writes = _Writes()
        for src, dst, n in pieces:
            try:
                bid = self.engine.transfer_submit_write(ready.agent_name, src, dst, n)
            except Exception as exc:  # (those posted before it are watched to their end all the same)
                bid, writes.short = 0, f"transfer_submit_write raised {exc!r}"
            if bid <= 0:
                writes.short = writes.short or f"transfer_submit_write returned {bid}"
                break
            writes.ids.append(bid)
            writes.ends.append(0)
        if not writes.ids:
            raise RuntimeError(writes.short)
        return writes

    def _engine_state(self, write: Write) -> str:
        writes: _Writes = write.handle
        busy = False
        for i, bid in enumerate(writes.ids):
            if writes.ends[i] == 0:
                end = self.engine.transfer_check_status(bid)
                if end == -2:  # timed out: the transfer fails, the memory stays the engine's until it ends
                    writes.timed_out, end = True, 0
                writes.ends[i] = end
                busy = busy or end == 0
        if busy:
            return LOST if writes.timed_out else PROC
        return ERR if writes.short or writes.timed_out or any(end < 0 for end in writes.ends) else DONE
