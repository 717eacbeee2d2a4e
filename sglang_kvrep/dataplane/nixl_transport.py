"""`NixlTransport` (`--kvrep-transport nixl`): the payload moves by NIXL (NVIDIA's inference transfer library,
PyPI `nixl`; the UCX backend: RDMA between hosts where the fabric has it, shared memory or TCP otherwise), the
way SGLang's own PD disaggregation moves KV with `--disaggregation-transfer-backend nixl`. Everything but the
engine is `WrittenTransport`'s (`sglang_kvrep.dataplane.written`: ZMQ control, the target's registered staging,
checksums over the written bytes, quarantine of a failed transfer's staging).

NIXL's part: the target's `TransferReady` carries its agent name and `get_agent_metadata()` (with its registered
memory); the source adds that metadata once per change (`add_remote_agent`) and WRITEs each chunk with
`initialize_xfer("WRITE", local descriptors, remote descriptors, agent)`; a WRITE is DONE when
`check_xfer_state` says so. No progress thread (it spins a core when idle): the I/O loop drives UCX while a
transfer is under way.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import time
import uuid
from typing import Any, Callable, Optional

import torch
import zmq

from radix_sync import protocol as p
from sglang_kvrep.dataplane.staging import Outgoing
from sglang_kvrep.dataplane.transport import Admit, OnEvent, TransportSettings
from sglang_kvrep.dataplane.written import ERR, Write, WrittenTransport

log = logging.getLogger("kvrep.agent")

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
"""Where NIXL's Python API lives: `nixl` (the meta package, which picks the wheel of the CUDA it finds) or one of
its per-CUDA wheels installed alone (`nixl-cu13` is the one pinned here: torch of sglang 0.5.23 is built for
CUDA 13)."""


def nixl_missing() -> Optional[str]:
    """Returns: why `--kvrep-transport nixl` cannot run here (None: NIXL is installed). Cheap: imports nothing."""
    for name in _MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return None
    return "NIXL is not installed (pip install nixl, or nixl-cu13 next to a CUDA 13 torch)"


def load_nixl() -> Any:
    """Returns: NIXL's `_api` module (`nixl_agent`, `nixl_agent_config`).

    Raises:
        ImportError: NIXL is not installed (or none of its wheels loads here); the message says which failed.
    """
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("--kvrep-transport nixl: NIXL cannot be imported (" + "; ".join(errors) + ")")


def _mem_kind(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


class NixlTransport(WrittenTransport):
    """ZMQ control, NIXL payload (see the module docstring)."""

    name = "nixl"
    accepts = ("zmq", "nixl")

    def __init__(self, config: TransportSettings, admit: Admit, on_event: OnEvent, ctx: zmq.Context,
                 poller: zmq.Poller, clock: Callable[[], float] = time.monotonic, backend: str = "UCX") -> None:
        self._backend = backend
        self.remote: dict[str, bytes] = {}
        """Peer agent name -> the metadata last added for it."""
        super().__init__(config, admit, on_event, ctx, poller, clock)

    # ------------------------------------------------------------------------------------------ the engine
    def _load_engine(self) -> None:
        self._api = load_nixl()

    def _open_engine(self, config: TransportSettings) -> None:
        self.agent_name = f"kvrep-{uuid.uuid4().hex}"
        # no progress thread: NIXL's spins a core even when idle (measured: 0.75 CPU-s per s), which a serving
        # worker cannot give away; `_engine_progress` drives UCX while a transfer is under way instead
        self.agent = self._api.nixl_agent(
            self.agent_name, self._api.nixl_agent_config(enable_prog_thread=False, backends=[self._backend]))

    def _engine_register(self, buf: torch.Tensor) -> Any:
        return self.agent.register_memory(buf)

    def _engine_deregister(self, registration: Any) -> None:
        self.agent.deregister_memory(registration)

    def _engine_peer(self) -> tuple[str, bytes]:
        return self.agent_name, self.agent.get_agent_metadata()

    def _accept_peer(self, msg: p.TransferReady, out: Outgoing) -> Optional[str]:
        if self.remote.get(msg.agent_name) == msg.agent_metadata:
            return None
        # (loading it again updates it in place: a buffer the target registered since becomes writable, and WRITEs
        # in flight to that agent are left alone)
        try:
            name = self.agent.add_remote_agent(msg.agent_metadata)
        except Exception as exc:
            return f"target's agent metadata refused: {exc}"
        name = name.decode() if isinstance(name, bytes) else name
        if name != msg.agent_name:
            return f"target says agent {msg.agent_name!r}, its metadata is {name!r}'s"
        self.remote[msg.agent_name] = msg.agent_metadata
        return None

    def _engine_write(self, ready: p.TransferReady, pieces: list[tuple[int, int, int]], buffer: torch.Tensor) -> Any:
        kind, dev = _mem_kind(buffer)
        local = self.agent.get_xfer_descs([(src, n, dev) for src, _, n in pieces], kind)
        remote = self.agent.get_xfer_descs([(dst, n, 0) for _, dst, n in pieces], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, ready.agent_name)
        try:
            if self.agent.transfer(handle) == ERR:
                raise RuntimeError("transfer refused to start")
        except Exception:
            self.agent.release_xfer_handle(handle)
            raise
        return handle

    def _engine_state(self, write: Write) -> str:
        return self.agent.check_xfer_state(write.handle)

    def _engine_release(self, write: Write) -> None:
        self.agent.release_xfer_handle(write.handle)

    def _engine_progress(self, receiving: bool) -> None:
        if receiving:
            self.agent.get_new_notifs()  # drives UCX's progress (its TCP transport needs the target's)
